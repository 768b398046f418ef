"""What runs a job's processes: this process's Ray (``ray_session``, with the ``watchdog`` that keeps a
local Ray from outliving its driver), the rank groups a trainer calls its Megatron ranks through
(``groups``: Ray actors or SPMD processes, one ``RankCalls`` surface), the vLLM engines and the pool
that replaces a failed one (``engines``), and the faults that stop a run (``faults``).

The names below are importable from here; they load with their module on first use, so that
``python -m megagrpo.runtime.watchdog`` imports neither Ray nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "faults": ("FAULT_EXIT", "EngineFailure", "RankFailure", "RunFault"),
    "ray_session": ("local_session_dir", "shutdown_ray", "start_ray"),
    "groups": ("LocalGroup", "RankCalls", "RankGroup", "end_rank", "method_name", "run_ranks"),
    "engines": (
        "EnginePool",
        "RestartBudget",
        "SyncLayout",
        "SyncOutcome",
        "launch_engines",
        "placement_summary",
        "start_engines",
        "wait_for_engines",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [  # the names of _EXPORTS (checked by tests/unit/test_runtime_groups.py)
    "FAULT_EXIT",
    "EngineFailure",
    "EnginePool",
    "LocalGroup",
    "RankCalls",
    "RankFailure",
    "RankGroup",
    "RestartBudget",
    "RunFault",
    "SyncLayout",
    "SyncOutcome",
    "end_rank",
    "launch_engines",
    "local_session_dir",
    "method_name",
    "placement_summary",
    "run_ranks",
    "shutdown_ray",
    "start_engines",
    "start_ray",
    "wait_for_engines",
]

if TYPE_CHECKING:
    from megagrpo.runtime.engines import (
        EnginePool,
        RestartBudget,
        SyncLayout,
        SyncOutcome,
        launch_engines,
        placement_summary,
        start_engines,
        wait_for_engines,
    )
    from megagrpo.runtime.faults import FAULT_EXIT, EngineFailure, RankFailure, RunFault
    from megagrpo.runtime.groups import LocalGroup, RankCalls, RankGroup, end_rank, method_name, run_ranks
    from megagrpo.runtime.ray_session import local_session_dir, shutdown_ray, start_ray


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
