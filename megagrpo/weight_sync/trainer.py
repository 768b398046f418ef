"""Trainer side of weight sync: each pipeline stage streams its own layers, in HF layout, to vLLM.

Within a stage, the ranks of data-parallel replica 0 take part: each parameter is gathered over
the TP group only when HF layout needs the whole tensor (TP-split weights), turned into HF tensors
by the converter's map (QKV de-interleave, fc1 -> gate/up, vocabulary trimmed), and TP rank 0 of
the stage packs them into fixed-size buckets and broadcasts them on its own group. Packing bucket
k+1 overlaps the broadcast of bucket k (two buffers, on CPU kept from one sync to the next). No
rank ever holds more than one parameter gathered plus two buckets; no rank funnels another stage's
weights.

:class:`WeightSyncEndpoints` is what the controller (``sync.WeightSync``) calls on every trainer
rank; the policy worker inherits it, so the controller names these methods without importing the
policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megagrpo.models.layout import is_gated_fc1, stage_param_names, tp_merge, tp_partition_dim
from megagrpo.models.mapping import hf_tensor_shapes, to_hf
from megagrpo.parallel.local import free_port, node_ip
from megagrpo.weight_sync.buckets import Bucket, SentBuckets, checksum, pack, plan_buckets
from megagrpo.weight_sync.transport import BroadcastGroup, GroupAddress

if TYPE_CHECKING:
    from megagrpo.models.description import ModelDescription
    from megagrpo.parallel import ParallelContext
    from megagrpo.types import TrainBatch


class WeightSender:
    def __init__(self, ctx, module: torch.nn.Module, model_info):
        self.ctx, self.module, self.info = ctx, module, model_info
        self.group: BroadcastGroup | None = None
        self._buffers: list[torch.Tensor] | None = None  # the two packing buffers (sender only)
        names = stage_param_names(module, ctx, model_info.shape.num_layers)
        params = dict(module.named_parameters())
        by_global = {g: params[local] for local, g in names.items()}
        # Rule order: embedding, layers in order, final norm, output layer.
        self.rules = [
            r for r in model_info.arch.rules(model_info.shape) if r.export and r.megatron in by_global
        ]
        self.params = [by_global[r.megatron] for r in self.rules]

    @property
    def takes_part(self) -> bool:
        """Ranks of DP replica 0 (and CP rank 0) gather; the others sit the sync out."""
        return self.ctx.dp_rank == 0 and self.ctx.cp_rank == 0

    @property
    def is_sender(self) -> bool:
        return self.takes_part and self.ctx.tp_rank == 0

    def plan(self, bucket_bytes: int) -> tuple[Bucket, ...] | None:
        """This stage's buckets, in broadcast order (sender ranks only)."""
        if not self.is_sender:
            return None
        shapes = hf_tensor_shapes(self.info.shape)
        dtype = self.info.dtype
        tensors = [(name, dtype, shapes[name]) for rule in self.rules for name in rule.hf]
        return tuple(plan_buckets(tensors, bucket_bytes, source=self.ctx.pp_rank))

    def open(self, groups: Sequence[GroupAddress], *, backend: str, timeout_s: float) -> None:
        """Senders become rank 0 of their stage's group (blocks until every vLLM worker joined)."""
        if self.is_sender:
            addr = groups[self.ctx.pp_rank]
            self.group = BroadcastGroup(addr, 0, backend=backend, timeout_s=timeout_s, device=self.ctx.device)

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF (name, tensor) of this stage in plan order; a TP collective on every participating rank."""
        tp = self.ctx.sizes.tp
        for rule, param in zip(self.rules, self.params, strict=True):
            full = param.detach()
            dim = tp_partition_dim(rule.megatron)
            if dim >= 0 and tp > 1:
                shards = [torch.empty_like(full) for _ in range(tp)]
                dist.all_gather(shards, full.contiguous(), group=self.ctx.pgs.tp)
                full = tp_merge(shards, partition_dim=dim, gated=is_gated_fc1(rule.megatron))
            if self.is_sender:
                yield from zip(rule.hf, to_hf(rule, full, self.info.shape), strict=True)

    def send(self, plan: Sequence[Bucket], *, with_checksums: bool = False) -> SentBuckets | None:
        """Broadcast this stage's buckets of ``plan``; senders report them, the other ranks return None."""
        if not self.takes_part:
            return None
        mine = [b for b in plan if b.source == self.ctx.pp_rank]
        stream = self.hf_tensors()
        if not self.is_sender:
            for _ in stream:  # TP peers: take part in the gathers only
                pass
            return None
        if self.group is None:
            raise RuntimeError("weight sync: send() before open()")
        size = max((b.nbytes for b in mine), default=0)
        if self._buffers is None or self._buffers[0].numel() < size:
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.ctx.device) for _ in range(2)]
        buffers = [b[:size] for b in self._buffers]
        if self.ctx.device.type != "cpu":
            # On CPU they are kept (fresh multi-MB buffers cost a page fault per 4 KiB on every
            # sync); a GPU's caching allocator reuses the memory, which colocated engines may need.
            self._buffers = None
        in_flight, digests = [None, None], []
        try:
            for i, bucket in enumerate(mine):
                slot = i % 2
                if in_flight[slot] is not None:
                    in_flight[slot].wait()  # this buffer's previous broadcast must be done before reuse
                tensors = []
                for expected in bucket.slots:
                    name, tensor = next(stream)
                    if name != expected.name:
                        raise RuntimeError(
                            f"weight sync plan expected {expected.name}, the model produced {name}"
                        )
                    tensors.append(tensor)
                buf = pack(bucket, tensors, buffers[slot])
                if with_checksums:
                    digests.append(checksum(buf))
                in_flight[slot] = self.group.broadcast(buf, root=0)
            for work in in_flight:
                if work is not None:
                    work.wait()
        except Exception:
            # A receiver died mid-sync: still take part in the rest of the TP gathers, so that the
            # TP peers, which cannot know, are not left waiting in one.
            with contextlib.suppress(Exception):
                for _ in stream:
                    pass
            raise
        leftover = next(stream, None)
        if leftover is not None:
            raise RuntimeError(f"weight sync plan is missing {leftover[0]}")
        return SentBuckets(self.ctx.pp_rank, tuple(digests) if with_checksums else None)

    def close(self) -> None:
        self._buffers = None
        if self.group is not None:
            self.group.close()
            self.group = None


class WeightSyncEndpoints:
    """The methods ``sync.WeightSync`` calls on every rank of the trainer job (all collective).

    A trainer worker inherits them and provides ``weight_source`` (what its sender reads) and
    ``logprobs`` (how the probe is scored on the trainer side).
    """

    sender: WeightSender | None = None

    def weight_source(self) -> tuple[ParallelContext, torch.nn.Module, ModelDescription]:
        """(parallel context, this rank's model stage, model description) the sender reads."""
        raise NotImplementedError

    def logprobs(self, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        """[B, S - 1] fp32 logprobs of every next token under the current weights, on every rank."""
        raise NotImplementedError

    def _sender(self) -> WeightSender:
        if self.sender is None:
            self.sender = WeightSender(*self.weight_source())
        return self.sender

    def weight_sync_address(self) -> tuple[str, int] | None:
        """(host, free port) on this stage's sender rank, where its broadcast group will listen."""
        return (node_ip(), free_port()) if self._sender().is_sender else None

    def weight_sync_plan(self, bucket_bytes: int) -> tuple[Bucket, ...] | None:
        """This stage's buckets of at most ``bucket_bytes`` (on its sender rank; None elsewhere)."""
        return self._sender().plan(bucket_bytes)

    def open_weight_sync(self, groups: Sequence[GroupAddress], backend: str, timeout_s: float) -> None:
        """Join the broadcast groups, one per stage (``groups[stage]``); senders host theirs."""
        self._sender().open(groups, backend=backend, timeout_s=timeout_s)

    def send_weights(self, plan: Sequence[Bucket], with_checksums: bool = False) -> SentBuckets | None:
        """Collective: every rank calls it; stage senders broadcast, TP peers help gather."""
        return self._sender().send(plan, with_checksums=with_checksums)

    def close_weight_sync(self) -> None:
        if self.sender is not None:
            self.sender.close()
