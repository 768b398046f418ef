"""Fully asynchronous GRPO (``grpo.async_mode: partial``) on the real stack (tiny config: TP=2 Megatron over
gloo, two vLLM CPU engines whose streams are paced by ``_paced_engine``, so that every weight swap lands
in requests in flight):
- one run, its driver killed with SIGKILL once step 2's checkpoint is written, one of its engines killed
  mid-request before that; then resumed to step 4;
- every step trains on whole groups within the staleness bound, responses sampled by several policy
  versions among them, the probe passes after every swap;
- the killed engine costs no sample and no reward (its groups are generated again whole, counted) and is
  replaced; the resumed run continues the requests that were in flight at the checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _grpo_runs import metrics, reuse_warmup, run_overrides
from test_faults import _cmdline, _session_of, _wait_until

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
STEPS = 6
PARTIAL = [
    "grpo.async_mode=partial",
    "grpo.max_staleness=2",
    "generation.num_engines=2",
    "generation.ignore_eos=true",  # every response as long as the pacing needs
    "generation.max_new_tokens=48",
    "checkpoint.keep_last=4",
]


def test_partial_rollouts_survive_an_engine_and_the_driver_killed(undisturbed, tmp_path, capsys, monkeypatch):
    from _paced_engine import paced_spec

    from megagrpo.config import load_config
    from megagrpo.runtime.watchdog import session_processes
    from megagrpo.trainers.grpo import train

    root, ckpt = undisturbed.root, tmp_path / "ckpt"
    reuse_warmup(root, "partial")
    overrides = run_overrides(root, "partial", ckpt, steps=STEPS, extra=PARTIAL)
    run_dir = root / "runs" / "partial"

    # 1. A driver of its own (to kill -9): one engine killed mid-request once step 1 is logged, the driver
    #    once the checkpoint of a step after that is written.
    log_path = tmp_path / "run1.log"
    command = [sys.executable, str(HERE / "_paced_engine.py"), "train", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        session = _wait_until(lambda: _session_or_none(proc.pid), 300, "the driver's Ray session")
        killed_at = _kill_one_engine(session, run_dir)
        restarted = "restarted, weights re-synced and probed"
        _wait_until(lambda: restarted in log_path.read_text(), 300, "the engine's replacement")
        saved = killed_at + 1
        _wait_until(lambda: (ckpt / f"step_{saved}").is_dir(), 900, f"step_{saved} to be saved", poll_s=0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    first = log_path.read_text()
    assert "failed while generating" in first and "its groups are queued again" in first, first[-3000:]
    _wait_until(lambda: not session_processes(session), 60, f"the processes of {session.name} to end")
    stopped = max(metrics(run_dir))
    assert saved <= stopped < STEPS

    # 2. Resumed in this process from the latest checkpoint: its requests in flight are continued.
    from megagrpo.generation import engine

    monkeypatch.setitem(engine.ENGINES, "vllm", paced_spec())  # this test's runs only
    cfg = load_config(None, [*overrides, "checkpoint.resume=true"])
    capsys.readouterr()
    train(cfg)
    out = capsys.readouterr().out
    assert " partial request(s) to continue" in out, out[-3000:]
    continued = int(out.split(" partial request(s) to continue")[0].rsplit("with ", 1)[1])
    assert continued >= 1
    got = metrics(run_dir)
    assert set(range(1, STEPS + 1)) <= set(got)
    for step in range(1, STEPS + 1):
        row = got[step]
        assert 1.0 <= row["sync/probe_error"] <= 1.001, (step, row["sync/probe_error"])
        assert row["staleness/max"] <= 2 and row["reward/errors"] == 0, (step, row)
    # Tokens of one response sampled by several policy versions: weights swapped into running requests.
    assert sum(got[s]["async/mixed_version_frac"] for s in range(2, STEPS + 1)) > 0
    # The lost engine's groups went back to the queue whole, and its replacement took over.
    assert sum(got[s]["async/engine_failures"] for s in range(1, STEPS + 1)) == 1
    assert sum(got[s]["async/requeued_groups"] for s in range(1, STEPS + 1)) >= 1


def _session_or_none(pid: int):
    try:
        return _session_of(pid)
    except AssertionError:
        return None


def _kill_one_engine(session: Path, run_dir: Path) -> int:
    """Once step 1 is logged, SIGKILL an engine of ``session`` while it runs a slice of its stream; the
    last step logged then."""
    from megagrpo.runtime.watchdog import session_processes

    def step_1_logged():
        return (run_dir / "metrics.jsonl").is_file() and 1 in metrics(run_dir)

    _wait_until(step_1_logged, 900, "step 1 to be logged", poll_s=0.05)
    engines = [p for p in session_processes(session) if _cmdline(p).startswith("ray::PacedEngine")]
    assert len(engines) == 2, [_cmdline(p) for p in session_processes(session)]

    def advancing():
        return next((p for p in engines if _cmdline(p).startswith("ray::PacedEngine.advance")), None)

    pid = _wait_until(advancing, 120, "an engine in a slice of its stream", poll_s=0.001)
    os.kill(pid, signal.SIGKILL)
    return max(metrics(run_dir))
