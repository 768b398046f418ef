"""What every benchmark records about the machine and the code it measured, and what it samples of
the processes it runs: CPU time (its own and the machine's, whose difference is what other jobs of a
shared machine took), resident memory, available memory. Linux ``/proc`` only."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import resource
import subprocess
import time
from pathlib import Path

from . import REPO

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# ------------------------------------------------------------------------------ machine and code


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), platform.processor())


def machine_info(*packages: str) -> dict:
    """Date, host, CPUs, memory, load, Python, the git commit, the versions of ``packages`` (import
    names, e.g. "torch", "megatron.core", "vllm") and, when torch sees one, the CUDA device."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "loadavg_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }
    for name in packages:
        info[name.replace(".", "_")] = getattr(importlib.import_module(name), "__version__", None)
    if "torch" in packages:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


# ------------------------------------------------------------------------------------- CPU time


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all CPUs), from /proc/stat."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def process_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (processes that have exited count 0)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime
    return total


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (and theirs), from rusage."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def child_pids() -> list[int]:
    """This process's children (e.g. the Ray daemons it started)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == os.getpid():
                out.append(int(entry.name))
    return out


class Contention:
    """CPU seconds of ``pids``, and CPUs kept busy by every other process, over a ``with`` block.

    After the block: ``ours_cpu_s`` (CPU seconds of ``pids``), ``ours_cpus`` (per wall second),
    ``other_cpu_s`` (the machine's busy CPU seconds minus ours: what other jobs took) and
    ``other_cpus`` (that per wall second, at least 0).
    """

    def __init__(self, pids: list[int]):
        self.pids = sorted(set(pids))

    def __enter__(self):
        self.t0, self.m0 = time.perf_counter(), machine_busy_s()
        self.o0 = process_cpu_s(self.pids)
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        ours = process_cpu_s(self.pids) - self.o0
        self.ours_cpu_s = ours
        self.ours_cpus = ours / wall
        self.other_cpu_s = machine_busy_s() - self.m0 - ours
        self.other_cpus = max(0.0, self.other_cpu_s / wall)
        return False


def timed_call(fn, pids: list[int]):
    """``fn()``'s value, its wall seconds, and the ``Contention`` of ``pids`` around the call."""
    with Contention(pids) as contention:
        start = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - start
    return value, seconds, contention


# --------------------------------------------------------------------------------------- memory


def proc_status(pid: int | str = "self", keys: tuple[str, ...] = ("VmRSS",)) -> dict[str, int]:
    """``keys`` of /proc/<pid>/status (VmRSS, RssAnon, RssFile, VmHWM, ...) in bytes; {} once the
    process has exited."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return out


def proc_pss(pid: int) -> int:
    """Proportional set size of one process in bytes (0 once it has exited). Reading it walks the
    page tables: ~34 ms for a 3 GB process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def mem_available() -> int:
    """The kernel's estimate of memory available to new allocations, in bytes (0 if not reported)."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
