"""Weight-sync groups on gloo that connect the way NCCL's do: in the first broadcast, not when made.

``ProcessGroupNCCL`` makes its communicator inside the first collective, blocking, with no deadline of
its own, unless ``eager_connect_single_device`` makes it first. ``DeferredGloo`` is a gloo group made
the same way; ``DeferredBroadcastGroup`` is the production ``BroadcastGroup`` with it in place of
torch's process group, so that on CPU the transport's own code (what it calls, when, under which
deadline) runs as it would on NCCL. ``defer_group_creation()`` puts it in place of ``BroadcastGroup``
wherever the process makes weight-sync groups (a trainer rank, a vLLM worker).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from megagrpo.weight_sync.transport import BroadcastGroup

# A blocking NCCL init has no timeout: an hour stands for none.
NO_DEADLINE = datetime.timedelta(hours=1)


class DeferredGloo:
    """A gloo group connected by ``eager_connect_single_device`` or, failing that, inside its first
    broadcast (blocking until every member has joined)."""

    def __init__(self, store, rank: int, size: int):
        self.store, self.rank, self.size = store, rank, size
        self.inner: dist.ProcessGroupGloo | None = None
        self.connected_by: str | None = None
        """What connected it: "eager" (made so), "broadcast" (connected lazily), None (not yet)."""

    def eager_connect_single_device(self, device) -> None:
        self._connect("eager")

    def broadcast(self, tensors, opts):
        self._connect("broadcast")
        return self.inner.broadcast(tensors, opts)

    def abort(self) -> None:
        if self.inner is not None:
            self.inner.abort()

    def _connect(self, by: str) -> None:
        if self.inner is None:
            self.store.set_timeout(NO_DEADLINE)  # the rendezvous waits on the store
            self.inner = dist.ProcessGroupGloo(self.store, self.rank, self.size, NO_DEADLINE)
            self.connected_by = by


class DeferredBroadcastGroup(BroadcastGroup):
    def _make_group(self, backend: str, world_size: int, timeout: datetime.timedelta):
        assert backend == "gloo", backend
        return DeferredGloo(self.store, self.rank, world_size)


def defer_group_creation() -> None:
    """This process's weight-sync groups (trainer and vLLM sides) are ``DeferredBroadcastGroup``s."""
    from megagrpo.weight_sync import trainer, vllm_engine

    trainer.BroadcastGroup = vllm_engine.BroadcastGroup = DeferredBroadcastGroup


def connected_by(groups) -> list[str | None]:
    """What connected each of ``groups`` (``BroadcastGroup``s), in order."""
    return [getattr(group.pg, "connected_by", None) for group in groups]
