"""What every benchmark records about the machine and the code it measured, and what it samples of
the processes it runs: CPU time (its own and the machine's, whose difference is what other jobs of a
shared machine took) and memory. Linux ``/proc`` only."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
import time
from pathlib import Path

from . import REPO

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def machine_info(*packages: str) -> dict:
    """Date, host, CPUs, memory, load, Python, the git commit, the versions of ``packages`` (import
    names, e.g. "torch", "megatron.core", "vllm") and, when torch sees one, the CUDA device."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    except OSError:
        commit = ""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln), platform.processor()
        ),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "loadavg_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "git_commit": commit.strip() or None,
    }
    for name in packages:  # a package the machine lacks (vLLM on the lent GPU) is recorded as None
        try:
            info[name.replace(".", "_")] = getattr(importlib.import_module(name), "__version__", None)
        except ModuleNotFoundError:
            info[name.replace(".", "_")] = None
    if "torch" in packages:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all CPUs), from /proc/stat."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS  # all but idle and iowait


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


class Contention:
    """Over a ``with`` block: ``ours_cpu_s``, the CPU seconds of ``pids``, and ``other_cpus``, the
    CPUs every other process kept busy on average (the machine's busy time minus ours)."""

    def __init__(self, pids: list[int]):
        self.pids = sorted(set(pids))

    def __enter__(self):
        self.t0, self.m0, self.o0 = time.perf_counter(), machine_busy_s(), process_cpu_s(self.pids)
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        self.ours_cpu_s = process_cpu_s(self.pids) - self.o0
        self.other_cpus = max(0.0, (machine_busy_s() - self.m0 - self.ours_cpu_s) / wall)
        return False


def proc_status(pid: int | str = "self", keys: tuple[str, ...] = ("VmRSS",)) -> dict[str, int]:
    """``keys`` of /proc/<pid>/status (VmRSS, VmHWM, ...) in bytes; {} once the process has exited."""
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
    """Proportional set size of one process in bytes (0 once it has exited); reading it walks the
    page tables: ~34 ms for a 3 GB process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return next((int(line.split()[1]) * 1024 for line in fh if line.startswith("Pss:")), 0)
    except OSError:
        return 0
