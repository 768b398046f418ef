"""Standalone broadcast groups between trainer senders and vLLM workers (gloo on CPU, NCCL on GPU).

These groups live outside both jobs' default process groups: trainer rank ``s`` (the sender of
pipeline stage ``s``) hosts a TCPStore and is rank 0 of group ``s``; every vLLM worker joins every
group. Each group has its own timeout, so a dead peer turns into an exception, not a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megagrpo.compat.torch_store import bound_tcp_store


@dataclass(frozen=True)
class GroupAddress:
    """Where one broadcast group meets (the sender's TCPStore); sent to the sender and every engine."""

    address: str
    port: int
    world_size: int
    """1 sender + every receiving vLLM worker."""


class BroadcastGroup:
    def __init__(
        self, addr: GroupAddress, rank: int, *, backend: str, timeout_s: float, device: torch.device
    ):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.device, self.timeout_s = rank, device, timeout_s
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
        """Start a broadcast from ``root``; returns the work handle (``.wait()`` it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        self.pg = None
        self.store = None
