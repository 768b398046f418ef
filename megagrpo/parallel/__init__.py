"""Process groups and device handling for the Megatron trainer (see groups.py and cpu.py)."""

from megagrpo.parallel.groups import (
    ParallelContext,
    ParallelSizes,
    destroy_parallel,
    init_parallel,
    resolve_backend,
)

__all__ = ["ParallelContext", "ParallelSizes", "destroy_parallel", "init_parallel", "resolve_backend"]
