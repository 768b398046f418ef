"""The GRPO driver end to end on the tiny default (TP=2 Megatron over gloo, a vLLM CPU engine)."""

from __future__ import annotations

import json
import math

import pytest
from _grpo_runs import assert_same_steps, metrics, reuse_warmup, run_overrides

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e


def test_resume_reproduces_the_uninterrupted_run(undisturbed, tmp_path):
    from megagrpo.trainers.grpo import train

    want = undisturbed.metrics
    assert sorted(want) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert want[step]["sync/probe_error"] <= 1.001
        assert want[step]["train/ratio_min"] > 0
    assert math.isfinite(want[0]["val/accuracy"]) and math.isfinite(want[4]["val/accuracy"])
    assert (undisturbed.root / "runs" / "reference" / "curves.png").is_file()

    # The same run stopped after step 2, then resumed from its step-2 checkpoint.
    root, ckpt = undisturbed.root, tmp_path / "ckpt_b"
    reuse_warmup(root, "stopped")
    train(load_config(None, run_overrides(root, "stopped", ckpt, steps=2)))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]
    resumed = [*run_overrides(root, "stopped", ckpt, steps=4), "checkpoint.resume=true"]
    run_dir = train(load_config(None, resumed))
    got = metrics(run_dir)
    assert sorted(got) == [0, 1, 2, 3, 4]  # resumed metrics continue the same file
    assert_same_steps(got, want, (3, 4))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3", "step_4"]


def test_config_errors_stop_before_any_actor(tmp_path):
    import ray

    from megagrpo.data.errors import DataError
    from megagrpo.trainers.grpo import train

    cfg = load_config(
        None,
        [
            f"logging.dir={tmp_path}",
            f"checkpoint.dir={tmp_path / 'checkpoints'}",  # not the demo's, which `make demo` fills
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
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stdout.read()
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"fewer than 2 steps logged in 600 s:\n{proc.communicate()[0]}")
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    saved = sorted(p.name for p in ckpt_dir.iterdir())
    assert saved == [f"step_{logged[-1]}"], (saved, logged, out)
    assert "continue with --resume" in out
