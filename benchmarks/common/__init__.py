"""What the benchmarks share, each written once.

- ``record``: the one measurement record (``Measurement``), the options every benchmark takes
  (``--repeat``, ``--out``, ``--quick``), its results file and their generic Markdown;
- ``timing``: the interleaved timer (A, B, ... then ..., B, A: drift on a shared machine hits all
  alike) and what it samples besides wall time (CPU time, other jobs' load);
- ``machine``: the machine and commit measured; ``/proc`` readings (CPU time, RSS, PSS, memory);
- ``megatron``: the bare Megatron step every "against bare Megatron" figure compares with;
- ``models``: random Qwen2-shaped HF checkpoints, built once under ``results/tmp/``;
- ``configs``: megagrpo run configs from ``{"section.key": value}`` overrides;
- ``runs``: whole ``megagrpo train`` runs (warm-ups and runs a suite makes once) and their metrics;
- ``memory``: activation memory (peak bytes autograd holds for backward) on any device.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
TMP = RESULTS / "tmp"
"""Scratch data (source models, outputs, results of runs outside a suite), git-ignored."""
MB = 10**6
GB = 10**9


def importable_by_workers() -> None:
    """Let the processes this one starts from now on (Ray's workers: they unpickle this folder's
    actor classes by module) import ``benchmarks``: the repository first on their PYTHONPATH."""
    import os

    paths = [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
