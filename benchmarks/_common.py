"""What every benchmark records about the machine and the code it measured."""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
