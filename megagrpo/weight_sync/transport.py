"""Standalone broadcast groups between trainer senders and vLLM workers (gloo on CPU, NCCL on GPU).

These groups live outside both jobs' default process groups: the sending trainer rank hosts a
TCPStore and is rank 0 of its group. On the gathered path there is one group per pipeline stage and
every vLLM worker joins every group; on the shard-wise path one group per link (stage, trainer TP
rank, engine TP rank: ``weight_sync.shards``), joined by that engine rank's worker of every engine.

No call of a sync blocks past the sync's timeout (``generation.sync_timeout_s``), so that the Ray
actor making it, a synchronous one, is free for the next call (the groups re-formed with an engine's
replacement) instead of queueing it behind a stuck one. The actors stay synchronous on purpose (no
threaded actor or concurrency group for control calls): a trainer rank's calls are Megatron
collectives that must run one at a time and in order, and re-forming groups beside a broadcast still
holding the device and its communicator would race with it. So each wait ends by itself:

- **Connecting.** A group connects when it is made, on both sides, under the timeout: its store, its
  process group and its communicator. NCCL would otherwise make the communicator inside the first
  broadcast, blocking, before any wait of ours starts, and forever if a peer never joins (an engine
  that died before its first receive): it is connected eagerly (``eager_connect_single_device``) on a
  helper thread the caller waits for with a deadline. Past it the caller raises and returns; the
  helper thread is left behind, since a blocking NCCL init cannot be aborted (gloo's ends by itself at
  its own, doubled, timeout).
- **Broadcasting.** Posting a broadcast on a connected group does not block; every wait on one polls
  ``Work.is_completed`` (which for NCCL queries the CUDA event: ``Work.wait`` alone only orders the
  stream, so a hung NCCL broadcast would never be seen) up to the timeout; past it the group is aborted
  (``ProcessGroup.abort``: ``ncclCommAbort`` on NCCL, so no kernel stays queued).

Either way the error names the link, the group rank, the trainer rank and the engines. NCCL's own
watchdog timeout is set to twice the sync's, as the backstop that would otherwise kill the process;
gloo's group timeout likewise.

An engine on the sender's own device (colocated placement) is not in the link's group: it receives
the link's buckets through shared slots (``weight_sync.ipc``), and the group holds the others.
"""

from __future__ import annotations

import datetime
import socket
import threading
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
    """One link's group as one of its members sees it: rank 0 is the sender, the others receive.

    Made connected, within ``timeout_s`` (see the module docstring), or a ``TimeoutError`` naming the
    group and this member's rank in it.
    """

    def __init__(
        self,
        addr: GroupAddress,
        rank: int,
        *,
        backend: str,
        timeout_s: float,
        device: torch.device | str,
        name: str = "weight sync group",
        listening: socket.socket | None = None,
    ):
        """``listening``: rank 0's store socket, listening at ``addr.port`` since the port was offered
        (``compat.torch_store.listening_socket``); None: the port is bound now."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight sync backend must be gloo or nccl, got {backend!r}")
        self.rank, self.timeout_s, self.name = rank, timeout_s, name
        self.device = _indexed(torch.device(device))
        self.store = self.pg = None
        self._listening = listening
        self._connect(addr, backend)

    # ----------------------------------------------------------------------------------- connecting

    def _connect(self, addr: GroupAddress, backend: str) -> None:
        """Make and connect the group on a helper thread, waiting for it up to the timeout: the
        blocking parts run inside torch and the backend, out of reach of any poll of ours."""
        outcome: list[BaseException | None] = []

        def connect() -> None:
            try:
                self._open(addr, backend)
                outcome.append(None)
            except BaseException as err:  # re-raised by the caller
                outcome.append(err)

        thread = threading.Thread(target=connect, name=f"connect {self.name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            # Nothing to abort yet: a blocking NCCL init is not in the group's communicators, and an
            # abort could wait on it. The thread keeps the half-made group; this member is free.
            raise TimeoutError(
                f"{self.name}: connecting did not finish within {self.timeout_s:.0f}s "
                f"(generation.sync_timeout_s) at group rank {self.rank} of {addr.world_size}: "
                "a member did not join; the connection was given up"
            )
        if outcome[0] is not None:
            raise outcome[0]

    def _open(self, addr: GroupAddress, backend: str) -> None:
        """Blocking: the rendezvous store, the process group, and its communicator connected."""
        # The backend's own timeout is the backstop; our deadlines give up first, with a message.
        timeout = datetime.timedelta(seconds=2 * self.timeout_s)
        # The sender's store listens on its advertised address only (127.0.0.1 on a local run).
        listening, self._listening = self._listening, None
        self.store = bound_tcp_store(
            addr.address,
            addr.port,
            addr.world_size,
            is_master=self.rank == 0,
            timeout=timeout,
            listening=listening,
        )
        pg = self._make_group(backend, addr.world_size, timeout)
        # NCCL makes its communicator inside the first collective, unless told to now; gloo has
        # connected in its constructor (a no-op there).
        pg.eager_connect_single_device(self.device)
        self.pg = pg

    def _make_group(self, backend: str, world_size: int, timeout: datetime.timedelta):
        """The process group of ``backend``, as torch makes it (NCCL: not yet connected)."""
        if backend == "gloo":
            return dist.ProcessGroupGloo(self.store, self.rank, world_size, timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(self.store, self.rank, world_size, opts)

    # --------------------------------------------------------------------------------- broadcasting

    def broadcast(self, tensor: torch.Tensor, root: int = 0):
        """Start a broadcast from ``root``; returns the work handle (:meth:`wait` for it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = datetime.timedelta(seconds=2 * self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def wait(self, work, what: str) -> None:
        """Block until ``work`` is done (its error raised, if it failed); past the timeout, abort the
        group and raise ``TimeoutError`` naming it, this member's rank in it and ``what``."""
        deadline, pause = time.monotonic() + self.timeout_s, 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(
                    f"{self.name}: {what} did not finish within {self.timeout_s:.0f}s "
                    f"(generation.sync_timeout_s) at group rank {self.rank}; the group was aborted"
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


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: NCCL keys its communicators by it (``cuda`` alone would be -1)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
