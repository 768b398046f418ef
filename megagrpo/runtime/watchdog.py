"""A local Ray that does not outlive the driver that started it.

``ray.init()`` without an address starts a Ray of its own: GCS, raylet, agents, worker processes.
When the driver is killed (SIGKILL, the OOM killer), the GCS and raylet go with it, but Ray's
agents (``DashboardAgent``, ``RuntimeEnvAgent``) live on, and so may processes that workers forked
(Megatron's checkpoint writers). So every local start:

- writes ``megagrpo_driver.json`` (the driver's pid and start time) into its Ray session directory;
- starts a watchdog (``python -m megagrpo.runtime.watchdog SESSION_DIR PID``, in a session of its own so
  that a signal to the driver's process group does not reach it) that waits for the driver to end
  and then stops every process of that Ray session still running;
- sweeps (``sweep_orphans``) the sessions of earlier drivers that are gone, should their watchdog
  have been killed too.

A process belongs to a session when its command line names the session directory or it holds a
file there open: Ray's processes log into it, and what they fork inherits those files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megagrpo.ckpt.durable import atomic_write

MARKER = "megagrpo_driver.json"
_POLL_S = 0.5
_SCAN_EVERY = 10  # polls between full scans for the session's processes (watchdog of a live driver)


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces


def alive(pid: int, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (not a reused pid, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and start_time(pid) == started


def session_processes(session_dir: str | Path) -> list[int]:
    """Pids of the processes of a Ray session (see the module docstring), this one excepted."""
    prefix = os.fspath(session_dir).rstrip("/") + "/"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if prefix in cmdline or _holds_file_under(entry.path, prefix):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to inspect
            continue
    return found


def _holds_file_under(proc_dir: str, prefix: str) -> bool:
    for fd in os.scandir(os.path.join(proc_dir, "fd")):
        try:
            if os.readlink(fd.path).startswith(prefix):
                return True
        except OSError:
            continue
    return False


def stop_processes(pids: list[int], grace_s: float = 3.0) -> list[int]:
    """SIGTERM ``pids``, then SIGKILL those still running after ``grace_s``; returns those signalled."""
    started = {pid: start_time(pid) for pid in pids}
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            signalled.append(pid)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p, started[p]) for p in signalled):
        time.sleep(0.1)
    for pid in signalled:
        if alive(pid, started[pid]):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return signalled


def claim(session_dir: Path) -> subprocess.Popen:
    """Mark ``session_dir`` as started by this driver and start its watchdog (returned)."""
    pid = os.getpid()
    atomic_write(session_dir / MARKER, json.dumps({"pid": pid, "start_time": start_time(pid)}) + "\n")
    return subprocess.Popen(
        [sys.executable, "-m", "megagrpo.runtime.watchdog", str(session_dir), str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def release(session_dir: Path, watchdog: subprocess.Popen | None) -> None:
    """After a clean ``ray.shutdown``: the session needs no watching any more."""
    (session_dir / MARKER).unlink(missing_ok=True)
    if watchdog is not None and watchdog.poll() is None:
        watchdog.terminate()
        watchdog.wait(timeout=10)


def sweep_orphans(temp_root: Path) -> list[str]:
    """Stop what is left of local Rays under ``temp_root`` whose megagrpo driver is gone; returns
    the sessions swept."""
    swept = []
    for marker in sorted(temp_root.glob(f"session_*/{MARKER}")):
        try:
            owner = json.loads(marker.read_text())
            gone = not alive(int(owner["pid"]), owner.get("start_time"))
        except (OSError, ValueError, KeyError, TypeError):
            gone = True  # a marker we cannot read is as good as an owner that is gone
        if gone:
            stop_processes(session_processes(marker.parent))
            marker.unlink(missing_ok=True)
            swept.append(marker.parent.name)
    return swept


def watch(session_dir: Path, driver_pid: int) -> None:
    """The watchdog: wait for the driver to end, then stop the session's remaining processes. Ends
    by itself once the session has no process left (the driver shut Ray down)."""
    started = start_time(driver_pid)
    polls = 0
    while alive(driver_pid, started):
        time.sleep(_POLL_S)
        polls += 1
        if polls % _SCAN_EVERY == 0 and not session_processes(session_dir):
            return
    stop_processes(session_processes(session_dir))
    (session_dir / MARKER).unlink(missing_ok=True)


if __name__ == "__main__":
    watch(Path(sys.argv[1]), int(sys.argv[2]))
