"""Process groups and device handling for the Megatron trainer.

``groups.py``: ``init_parallel`` (torch.distributed + Megatron's groups, returned explicitly);
``backends.py``: the one resolver of ``"auto"`` backends and layer implementations (config loading uses
it without importing torch); ``local.py``: spawn N local ranks. Without CUDA, ``init_parallel`` runs
Megatron through ``megagrpo.compat.cuda_on_cpu`` (the CUDA -> CPU redirection).
The names below are imported on first use, so ``import megagrpo.parallel.backends`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megagrpo.parallel.backends import resolve_backend
    from megagrpo.parallel.groups import ParallelContext, ParallelSizes, destroy_parallel, init_parallel

__all__ = ["ParallelContext", "ParallelSizes", "destroy_parallel", "init_parallel", "resolve_backend"]

_HOMES = {
    "ParallelContext": "megagrpo.parallel.groups",
    "ParallelSizes": "megagrpo.parallel.groups",
    "destroy_parallel": "megagrpo.parallel.groups",
    "init_parallel": "megagrpo.parallel.groups",
    "resolve_backend": "megagrpo.parallel.backends",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
