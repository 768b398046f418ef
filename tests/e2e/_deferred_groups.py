"""Ray actors whose weight-sync groups connect as NCCL's do (``tests/lazy_groups.py``): a policy worker
and a vLLM engine that make ``DeferredBroadcastGroup``s once told to (the engine that replaces another
from the start), and say what connected each of their groups.
"""

from __future__ import annotations

import sys

import ray.cloudpickle
from _damaging_engine import DamagingGenerationWorker
from lazy_groups import connected_by, defer_group_creation

from megagrpo.policy.worker import PolicyWorker

# Ray's workers cannot import this test module by name: ship its classes and functions by value
# (``_damaging_engine`` ships ``lazy_groups`` likewise).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DeferringPolicyWorker(PolicyWorker):
    def defer_group_creation(self) -> None:
        defer_group_creation()

    def group_connections(self) -> list[str | None]:
        """What connected each of this rank's weight-sync groups (``DeferredGloo.connected_by``)."""
        return connected_by(self.sender.groups.values() if self.sender else ())


class DeferringGenerationWorker(DamagingGenerationWorker):
    """Makes deferred groups from its first ``init_weight_sync`` on (a replacement engine)."""

    def init_weight_sync(self, groups, **kwargs) -> None:
        self.defer_group_creation()
        super().init_weight_sync(groups, **kwargs)
