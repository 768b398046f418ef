"""Atomic step checkpoints: a write killed half-way leaves the previous checkpoint as the latest."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megagrpo.ckpt import run as ckpt

pytestmark = pytest.mark.unit


def _complete(root, step):
    tmp = ckpt.begin(root, step)
    (tmp / "payload.bin").write_bytes(b"x" * 100)
    return ckpt.commit(
        tmp, ckpt.DriverState.capture(step, data_position=step * 16), "run_name: t\n", keep_last=5
    )


def test_killed_write_leaves_previous_checkpoint_latest(tmp_path):
    root = tmp_path / "ckpts"
    previous = _complete(root, 2)
    writer = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from megagrpo.ckpt import run as ckpt
        tmp = ckpt.begin(Path({str(root)!r}), 4)
        with open(tmp / "weights.bin", "wb") as fh:
            while True:  # a long write, killed from outside
                fh.write(b"w" * 65536)
                fh.flush()
                time.sleep(0.01)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer])
    partial = root / ".step_4.tmp" / "weights.bin"
    deadline = time.monotonic() + 300  # generous: the writer imports torch first
    while not (partial.exists() and partial.stat().st_size > 0):  # killed half-way, not before the write
        assert proc.poll() is None, f"the writer exited ({proc.returncode}) before writing"
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the writer wrote nothing to {partial} in 300 s")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (root / ".step_4.tmp").exists()  # the half-written checkpoint is there...
    assert ckpt.latest(root) == previous  # ...and ignored
    assert ckpt.load_driver_state(previous).step == 2
    _complete(root, 4)  # the next save clears the leftover
    assert not (root / ".step_4.tmp").exists()
    assert ckpt.latest(root).name == "step_4"


def test_retention_keeps_newest(tmp_path):
    root = tmp_path / "c"
    for step in (1, 2, 3, 4):
        tmp = ckpt.begin(root, step)
        ckpt.commit(tmp, ckpt.DriverState.capture(step, 0), "", keep_last=2)
    assert [s for s, _ in ckpt.step_dirs(root)] == [3, 4]


def test_driver_state_round_trips_rng(tmp_path):
    import random

    import torch

    random.seed(3)
    torch.manual_seed(3)
    path = _complete(tmp_path / "r", 7)
    expected = (random.random(), torch.rand(2))
    random.seed(99)
    torch.manual_seed(99)
    state = ckpt.load_driver_state(path)
    state.restore_rng()
    assert state.step == 7 and state.data_position == 112
    got = (random.random(), torch.rand(2))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
