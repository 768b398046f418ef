"""What the benchmarks of this folder share (each is written once here).

- ``models``: random Qwen2-shaped HF checkpoints (sizes, a cache that survives while the shape
  holds, writers through safetensors or transformers);
- ``configs``: megagrpo run configs for a benchmark, from ``{"section.key": value}`` overrides;
- ``sampling``: the machine and the code measured, and /proc readings: CPU time of processes and of
  the whole machine (contention from other jobs), RSS/PSS, available memory;
- ``tables``: Markdown table rows and the results files (``<name>.json`` + ``<name>.md``);
- ``memory``: activation memory on any device (peak bytes autograd saves for backward).

The benchmarks are scripts run from the repository (``python benchmarks/<name>.py``), so this
folder is on ``sys.path`` and they import ``common.<module>``. Importing ``common`` puts the
repository root first on ``sys.path``: the benchmarks run the checkout's megagrpo without installing
it.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
TMP = RESULTS / "tmp"
"""Scratch data (source models, outputs), git-ignored."""
MB = 10**6
GB = 10**9

sys.path.insert(0, str(REPO))
