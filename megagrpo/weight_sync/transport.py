"""Standalone broadcast groups between trainer senders and vLLM workers (gloo on CPU, NCCL on GPU).

These groups live outside both jobs' default process groups: the sending trainer rank hosts a
TCPStore and is rank 0 of its group. On the gathered path there is one group per pipeline stage and
every vLLM worker joins every group; on the shard-wise path one group per link (stage, trainer TP
rank, engine TP rank: ``weight_sync.shards``), joined by that engine rank's worker of every engine.
Every wait on a broadcast blocks the host until the broadcast is done, polling ``Work.is_completed``
(which for NCCL queries the CUDA event: ``Work.wait`` alone only orders the stream, so a hung NCCL
broadcast would never be seen), up to the sync's timeout; past it the group is aborted
(``ProcessGroup.abort``: ``ncclCommAbort`` on NCCL, so no kernel stays queued) and the rank raises an
error naming the link, the trainer rank and the engines. NCCL's own watchdog timeout is set to twice
that, as the backstop that would otherwise kill the process; gloo's group timeout likewise.

An engine on the sender's own device (colocated placement) is not in the link's group: it receives
the link's buckets through shared slots (``weight_sync.ipc``), and the group holds the others.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megagrpo.compat.torch_store import bound_tcp_store
from megagrpo.weight_sync.buckets import Bucket
from megagrpo.weight_sync.ipc import IpcAddress

LinkKey = tuple[int, int, int]
"""(pipeline stage, sender within the stage: EP rank x TP + TP rank, engine TP rank or -1 for every
worker of every engine)."""


@dataclass(frozen=True)
class GroupAddress:
    """How one link reaches the engines: its broadcast group (where the sender's TCPStore meets, who
    joins) and, for an engine on the sender's device, its shared-slot handoff; sent to the sender
    and every engine."""

    address: str
    port: int
    world_size: int
    """1 sender + every vLLM worker that receives by broadcast (1: nobody; no group is formed)."""
    engine_rank: int | None = None
    """Shard-wise: the engine TP rank whose workers join (one per engine); None: every worker of every
    engine joins."""
    engines: tuple[int, ...] = ()
    """The engines (by index in the sync) that receive by broadcast, in rank order."""
    ipc: IpcAddress | None = None
    """The engine on the sender's device, which receives through shared slots instead; None: none."""
    sender: int = 0
    """The sending trainer rank (named in errors)."""

    def broadcast_rank(self, engine_index: int, worker_rank: int, workers: int) -> int | None:
        """The group rank of worker ``worker_rank`` (of ``workers``) of engine ``engine_index``; None
        when that worker is not in the group."""
        if self.world_size == 1 or engine_index not in self.engines:
            return None
        at = self.engines.index(engine_index)
        if self.engine_rank is None:  # gathered: every worker of every engine
            return 1 + at * workers + worker_rank
        return 1 + at if self.engine_rank == worker_rank else None

    def ipc_for(self, engine_index: int, worker_rank: int) -> IpcAddress | None:
        """The handoff worker ``worker_rank`` of engine ``engine_index`` receives this link by, if any."""
        if self.ipc is None or self.ipc.engine != engine_index:
            return None
        return self.ipc if self.engine_rank in (None, worker_rank) else None


@dataclass(frozen=True)
class Link:
    """A sending trainer rank's broadcast group, as the rank offers it when the sync is set up."""

    key: LinkKey
    """Which stage and ranks it connects; the controller numbers the links in key order."""
    address: str
    """Where the sender's store will listen."""
    port: int
    buckets: tuple[Bucket, ...]
    """Its buckets in send order (``source`` not yet set: the controller sets it to the link's number)."""
    rank: int = 0
    """The sender's global trainer rank (colocated placement: engine ``rank`` shares its device)."""
    ipc_port: int = 0
    """Where the sender's store for a shared-slot handoff would listen."""


_ABORTED: list = []  # aborted process groups, never destroyed (one per failed sync at most)


class BroadcastGroup:
    def __init__(
        self,
        addr: GroupAddress,
        rank: int,
        *,
        backend: str,
        timeout_s: float,
        device: torch.device,
        name: str = "weight sync group",
    ):
        # The backend's own timeout is the backstop; ``wait`` gives up first, with a message.
        timeout = datetime.timedelta(seconds=2 * timeout_s)
        self.rank, self.device, self.timeout_s, self.name = rank, device, timeout_s, name
        # The sender's store listens on its advertised address only (127.0.0.1 on a local run).
        self.store = bound_tcp_store(
            addr.address, addr.port, addr.world_size, is_master=rank == 0, timeout=timeout
        )
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, addr.world_size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, addr.world_size, opts)
        else:
            raise ValueError(f"weight sync backend must be gloo or nccl, got {backend!r}")

    def broadcast(self, tensor: torch.Tensor, root: int = 0):
        """Start a broadcast from ``root``; returns the work handle (:meth:`wait` for it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = datetime.timedelta(seconds=2 * self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def wait(self, work, what: str) -> None:
        """Block until ``work`` is done (its error raised, if it failed); past the timeout, abort the
        group and raise ``TimeoutError`` naming it and ``what``."""
        deadline, pause = time.monotonic() + self.timeout_s, 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(
                    f"{self.name}: {what} did not finish within {self.timeout_s:.0f}s "
                    "(generation.sync_timeout_s); the group was aborted"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        work.wait()

    def abort(self) -> None:
        if self.pg is not None:
            try:
                self.pg.abort()
            finally:
                # Destroying a process group joins its worker threads, which a stuck collective holds
                # until the backend's own (doubled) timeout: kept, so the rank is free now.
                _ABORTED.append(self.pg)
                self.pg = None

    def close(self) -> None:
        self.pg = None
        self.store = None
