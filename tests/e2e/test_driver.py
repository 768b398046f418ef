"""The GRPO driver end to end on the tiny default (TP=2 Megatron over gloo, a vLLM CPU engine)."""

from __future__ import annotations

import json
import math
import time

import pytest
from _grpo_runs import assert_same_steps, metrics, reuse_warmup, run_overrides

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e


def test_resume_past_a_damaged_checkpoint_repeats_the_uninterrupted_run_until_ctrl_c(undisturbed, tmp_path):
    """A run that ended after step 2 is continued by ``megagrpo train --resume`` for many more steps, the
    first model shard of its latest checkpoint truncated meanwhile: the resume falls back to step_1 and
    repeats the uninterrupted run's steps from there on; Ctrl-C in its terminal (SIGINT to the whole
    foreground process group: driver, Ray, actors) then finishes the step running, saves it and shuts
    down."""
    import os
    import signal
    import subprocess
    import sys

    from megagrpo.trainers.grpo import train

    want = undisturbed.metrics
    assert sorted(want) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert want[step]["sync/probe_error"] <= 1.001
        assert want[step]["train/ratio_min"] > 0
    assert math.isfinite(want[0]["val/accuracy"]) and math.isfinite(want[4]["val/accuracy"])
    assert (undisturbed.root / "runs" / "reference" / "curves.png").is_file()
    # A checkpoint every step, the last 2 kept (checkpoint.save_every=1, keep_last=2).
    assert sorted(p.name for p in undisturbed.ckpt.iterdir()) == ["step_3", "step_4"]

    # The same run stopped after step 2.
    root, ckpt = undisturbed.root, tmp_path / "ckpt_b"
    reuse_warmup(root, "stopped")
    train(load_config(None, run_overrides(root, "stopped", ckpt, steps=2)))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]

    # Its latest checkpoint's first model shard truncated.
    shard = ckpt / "step_2" / "megatron" / "__0_0.distcp"
    full = shard.stat().st_size
    with shard.open("r+b") as fh:
        fh.truncate(100)

    # Resumed for 500 steps, without checkpoints of its own (checkpoint.save_every=0): Ctrl-C once step 4
    # is logged.
    resumed = [*run_overrides(root, "stopped", ckpt, steps=500), "checkpoint.save_every=0"]
    log = tmp_path / "resumed.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megagrpo.cli", "train", *resumed, "--resume"],
            start_new_session=True,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    run_dir = root / "runs" / "stopped"
    deadline = time.monotonic() + 600
    while 4 not in _logged(run_dir):
        assert proc.poll() is None, log.read_text()
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"step 4 not logged in 600 s:\n{log.read_text()}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=300)
    out = log.read_text()
    assert proc.returncode == 130, out
    assert f"step_2/megatron/__0_0.distcp: size 100 bytes, manifest.json says {full}" in out
    assert "falling back to step_1, the newest checkpoint that verifies" in out
    assert f"resume: continuing after step 1 from {ckpt / 'step_1'}" in out
    assert "continue with --resume" in out
    got = metrics(run_dir)
    stopped = max(got)
    assert sorted(got) == list(range(stopped + 1))  # resumed metrics continue the same file
    assert 4 <= stopped < 500
    assert_same_steps(got, want, (2, 3, 4))
    # The damaged checkpoint set aside; the step the Ctrl-C found running saved (save_every=0: only the
    # interrupt saves), beside step_1 (checkpoint.keep_last=2).
    saved = {p.name for p in ckpt.iterdir()}
    assert saved == {"step_1", "step_2.corrupt", f"step_{stopped}"}, (saved, out)


def _logged(run_dir) -> dict:
    """The metrics logged so far (none while a line is half-written)."""
    try:
        return metrics(run_dir)
    except json.JSONDecodeError:
        return {}


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
