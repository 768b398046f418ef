"""Faults on the real stack (tiny config: TP=2 Megatron over gloo, one vLLM CPU engine, 4 steps).

Every faulty run is compared with the session's undisturbed run of the same config (fixed seeds,
``conftest.undisturbed``):
- an engine killed mid-generation is replaced and the run's metrics equal the undisturbed run's,
  while checkpoints that no longer fit a size-limited filesystem are skipped
  (``checkpoint.on_error: continue``) and every listening socket of the run is on loopback;
- kill -9 of the driver during a checkpoint write leaves the previous checkpoint the latest, and
  ``--resume`` removes the half-written one and reproduces the undisturbed run's next step; kill -9
  during training too; neither leaves a process of the killed run behind. (A resume past a truncated
  shard of the latest checkpoint: ``test_driver``.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _grpo_runs import assert_same_steps, metrics, reuse_warmup, run_overrides

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e

_LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _session_of(pid: int) -> Path:
    """The Ray session directory a megagrpo driver ``pid`` started (its marker names it, with the pid's
    start time: over a long test session an earlier driver may have had the same pid)."""
    from megagrpo.runtime.watchdog import MARKER, start_time

    started = start_time(pid)
    for marker in Path("/tmp/ray").glob(f"session_*/{MARKER}"):
        owner = json.loads(marker.read_text())
        if owner["pid"] == pid and owner.get("start_time") == started:
            return marker.parent.resolve()  # not the session_latest link
    raise AssertionError(f"no Ray session marked as started by pid {pid}")


def _wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _listening_addresses(pids) -> dict[str, int]:
    import psutil

    found = {}
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found[f"{conn.laddr.ip}:{conn.laddr.port}"] = pid
        except psutil.Error:
            continue
    return found


class EngineKiller(threading.Thread):
    """Once step ``after_step`` is logged: notes every listening socket of the run, then SIGKILLs the
    vLLM engine's process while it is inside a ``generate`` call."""

    def __init__(self, metrics: Path, after_step: int):
        super().__init__(daemon=True)
        self.metrics, self.after_step = metrics, after_step
        self.killed: int | None = None
        self.listening: dict[str, int] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # reported by the test
            self.error = err

    def _run(self) -> None:
        from megagrpo.runtime.ray_session import local_session_dir
        from megagrpo.runtime.watchdog import session_processes

        def logged() -> bool:
            return self.metrics.is_file() and self.after_step in metrics(self.metrics.parent)

        _wait_until(logged, 900, f"step {self.after_step} to be logged", poll_s=0.2)
        session = local_session_dir()
        pids = session_processes(session)
        self.listening = _listening_addresses([*pids, os.getpid()])
        engines = [p for p in pids if _cmdline(p).startswith("ray::VLLMEngine")]
        assert len(engines) == 1, [_cmdline(p) for p in pids]

        def generating() -> bool:
            return _cmdline(engines[0]).startswith("ray::VLLMEngine.generate")

        _wait_until(generating, 300, "the engine to be generating", poll_s=0.002)
        os.kill(engines[0], signal.SIGKILL)
        self.killed = engines[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture
def small_filesystem(tmp_path, undisturbed):
    """A tmpfs that holds one checkpoint of the run and half of another (root only); else a plain
    directory."""
    step = sorted(undisturbed.ckpt.glob("step_*"))[-1]
    size = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    mount = tmp_path / "small_fs"
    mount.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5) // 4096 * 4096}", "tmpfs", str(mount)],
            capture_output=True,
        ).returncode
        == 0
    )
    yield mount, mounted
    if mounted:
        subprocess.run(["umount", str(mount)], check=True)


def test_killed_engine_is_replaced_and_the_run_matches_an_undisturbed_one(
    undisturbed, small_filesystem, capsys
):
    from megagrpo.ckpt import run as ckpt_io
    from megagrpo.trainers.grpo import train

    root, want = undisturbed.root, undisturbed.metrics
    mount, mounted = small_filesystem
    reuse_warmup(root, "engine_killed")
    cfg = load_config(
        None, run_overrides(root, "engine_killed", mount / "ckpt", extra=["checkpoint.on_error=continue"])
    )
    killer = EngineKiller(root / "runs" / "engine_killed" / "metrics.jsonl", after_step=1)
    killer.start()
    run_dir = train(cfg)
    killer.join(timeout=10)
    assert killer.error is None, killer.error
    out = capsys.readouterr().out

    assert killer.killed is not None
    assert "vLLM engine 0 failed" in out and "vLLM engine 0 restarted, weights re-synced and probed" in out
    assert_same_steps(metrics(run_dir), want, (1, 2, 3, 4))
    # Every port the run listens on is on the loopback interface.
    outside = {addr: pid for addr, pid in killer.listening.items() if addr.rsplit(":", 1)[0] not in _LOOPBACK}
    assert killer.listening and not outside, (outside, [_cmdline(p) for p in outside.values()])
    if mounted:  # steps 2.. no longer fit: reported, skipped, the run went on; step_1 stays the latest
        # On failure, say what the run printed of its checkpoints and what the file system holds.
        saved = [line for line in out.splitlines() if "checkpoint" in line.lower()]
        usage = subprocess.run(["df", "-B1", str(mount)], capture_output=True, text=True).stdout
        held = sorted(str(p.relative_to(mount)) for p in mount.rglob("*") if p.is_file())
        why = (saved, usage, held[:40])
        assert "checkpoint step_2 could not be written" in out, why
        assert "No space left on device" in out, why
        assert "the latest checkpoint is still step_1; continuing without it" in out
        assert ckpt_io.latest(mount / "ckpt").name == "step_1"
        assert not list((mount / "ckpt").glob(".step_*.tmp"))
        ckpt_io.manifest.verify(mount / "ckpt" / "step_1")


def test_kill_9_during_checkpoint_write_and_training_then_resume(undisturbed, tmp_path):
    from megagrpo.ckpt import run as ckpt_io
    from megagrpo.runtime.watchdog import session_processes

    root, want = undisturbed.root, undisturbed.metrics
    ckpt = tmp_path / "ckpt"
    reuse_warmup(root, "killed")
    overrides = run_overrides(root, "killed", ckpt)
    command = [sys.executable, "-m", "megagrpo.cli", "train", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    # 1. kill -9 while step 2's checkpoint is being written.
    log1 = (tmp_path / "run1.log").open("w")
    proc = subprocess.Popen(command, stdout=log1, stderr=subprocess.STDOUT, env=env)
    _wait_until(lambda: (ckpt / ".step_2.tmp").is_dir(), 900, "the write of step_2", poll_s=0.005)
    session1 = _session_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ckpt / ".step_2.tmp").is_dir() and ckpt_io.latest(ckpt).name == "step_1"
    # The killed driver's Ray is stopped by its watchdog.
    _wait_until(lambda: not session_processes(session1), 60, f"the processes of {session1.name} to end")

    # 2. --resume, then kill -9 while it trains step 3.
    log2 = (tmp_path / "run2.log").open("w")
    proc = subprocess.Popen([*command, "--resume"], stdout=log2, stderr=subprocess.STDOUT, env=env)
    _wait_until(lambda: (ckpt / "step_2").is_dir(), 900, "step_2 to be saved", poll_s=0.005)
    session2 = _session_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = (tmp_path / "run2.log").read_text()
    assert "resume: removed .step_2.tmp, a checkpoint left half-written" in resumed
    assert "resume: continuing after step 1" in resumed
    # Step 1 as the first run logged it, step 2 as the resumed one did (before saving it): the undisturbed
    # run's.
    assert_same_steps(metrics(root / "runs" / "killed"), want, (1, 2))
    _wait_until(lambda: not session_processes(session2), 60, f"the processes of {session2.name} to end")
    for session in (session1, session2):
        assert session_processes(session) == []
