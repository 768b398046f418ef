"""The GRPO driver end to end on the tiny default (TP=2 Megatron over gloo, a vLLM CPU engine)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e

# Same-run metrics that must repeat exactly after a resume (timings obviously do not).
_DETERMINISTIC = ("reward/mean", "response/length_mean", "train/loss", "train/grad_norm", "train/ratio_mean")


def _config(tmp_path: Path, ckpt_dir: str, steps: int):
    return load_config(
        None,
        [
            f"logging.dir={tmp_path / 'runs'}",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "logging.val_every=2",
            "data.num_val_prompts=16",
            "warmup.steps=60",
            "grpo.num_prompts_per_step=4",
            f"grpo.num_steps={steps}",
            "policy.mini_batch_size=16",
            f"checkpoint.dir={ckpt_dir}",
            "checkpoint.save_every=2",
            "checkpoint.keep_last=2",
            "checkpoint.export_hf_at_end=false",
        ],
    )


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    from megagrpo.driver import train

    straight = _config(tmp_path, str(tmp_path / "ckpt_a"), steps=4)
    run_dir = train(straight)
    want = _metrics(run_dir)
    assert sorted(want) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert want[step]["sync/probe_error"] <= 1.001
        assert want[step]["train/ratio_min"] > 0
    assert math.isfinite(want[0]["val/accuracy"]) and math.isfinite(want[4]["val/accuracy"])
    assert (run_dir / "curves.png").is_file()

    # The same run stopped after step 2, then resumed from its step-2 checkpoint.
    train(_config(tmp_path, str(tmp_path / "ckpt_b"), steps=2))
    assert sorted(p.name for p in (tmp_path / "ckpt_b").iterdir()) == ["step_2"]
    run_dir = train(_config(tmp_path, str(tmp_path / "ckpt_b"), steps=4), resume=True)
    got = _metrics(run_dir)
    assert sorted(got) == [0, 1, 2, 3, 4]  # resumed metrics continue the same file
    for step in (3, 4):
        for key in _DETERMINISTIC:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert sorted(p.name for p in (tmp_path / "ckpt_b").iterdir()) == ["step_2", "step_4"]


def test_config_errors_stop_before_any_actor(tmp_path):
    import ray

    from megagrpo.data.prompts import DataError
    from megagrpo.driver import train

    cfg = load_config(
        None,
        [
            f"logging.dir={tmp_path}",
            "model.tiny=null",
            f"model.hf_dir={tmp_path}",
            f"data.train_path={tmp_path / 'missing.jsonl'}",
        ],
    )
    with pytest.raises(DataError, match=r"missing\.jsonl: dataset file not found"):
        train(cfg)
    assert not ray.is_initialized()


def test_ctrl_c_finishes_the_step_saves_and_shuts_down(tmp_path):
    """Ctrl-C in a terminal reaches the whole foreground process group (driver, Ray, actors)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ckpt_dir = tmp_path / "ckpt"
    overrides = [
        f"logging.dir={tmp_path / 'runs'}",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.val_every=0",
        "warmup.steps=20",
        "grpo.num_prompts_per_step=4",
        "grpo.num_steps=500",
        "policy.mini_batch_size=16",
        f"checkpoint.dir={ckpt_dir}",
        "checkpoint.save_every=0",
        "checkpoint.export_hf_at_end=false",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "megagrpo.cli", "train", *overrides],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "runs" / "tiny-cpu" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    saved = sorted(p.name for p in ckpt_dir.iterdir())
    assert saved == [f"step_{logged[-1]}"], (saved, logged, out)
    assert "continue with --resume" in out
