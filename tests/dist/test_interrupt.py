"""Ctrl-C in the trainer-only jobs, as a terminal sends it (SIGINT to the whole foreground process group:
the ``megagrpo`` process and every rank it spawned): the step running finishes, a checkpoint of it is
saved, the command exits with 130 saying how to continue, and ``--resume`` continues from there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megagrpo.ckpt import manifest

pytestmark = pytest.mark.dist

MEGAGRPO = [sys.executable, "-m", "megagrpo.cli"]


def _overrides(root: Path, steps: int) -> list[str]:
    return [
        f"logging.dir={root}",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.log_every=1",
        "sft.batch_size=8",
        f"sft.num_steps={steps}",
        "sft.val_every=0",
        "sft.num_val_examples=8",
        "policy.lr_schedule=constant",
        f"checkpoint.dir={root / 'ckpt'}",
        "checkpoint.save_every=0",
        "checkpoint.export_hf_at_end=false",
    ]


def _logged_steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def _wait_for(condition, what: str, proc: subprocess.Popen, deadline_s: float = 600.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` if the process ends or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"megagrpo exited with {proc.returncode} before {what}:\n{out[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within {deadline_s:.0f}s")
        time.sleep(0.2)


def test_ctrl_c_finishes_the_step_checkpoints_and_resume_continues(tmp_path):
    run_dir, steps = tmp_path / "runs" / "tiny-sft", 400
    proc = subprocess.Popen(
        [*MEGAGRPO, "sft", "--config", "tiny_sft", *_overrides(tmp_path / "runs", steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, which the test signals as a terminal would
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: max(_logged_steps(metrics), default=0) >= 2, "step 2 logged", proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, out[-3000:]
    stopped = max(_logged_steps(metrics))
    assert 2 <= stopped < steps
    ckpt = tmp_path / "runs" / "ckpt" / f"step_{stopped}"
    assert f"interrupted after step {stopped}: saved {ckpt}; continue with --resume" in out
    assert "Ctrl-C: finishing this step" in out
    manifest.verify(ckpt)
    assert json.loads((ckpt / "driver_state.json").read_text())["step"] == stopped

    resumed = subprocess.run(
        [*MEGAGRPO, "sft", "--config", "tiny_sft", "--resume", *_overrides(tmp_path / "runs", stopped + 2)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resume: continuing after step {stopped} from {ckpt}" in resumed.stdout
    assert _logged_steps(metrics)[-2:] == [stopped + 1, stopped + 2]
