"""Trainer side of weight sync: each pipeline stage streams its own layers to vLLM, in two ways.

Within a stage, the ranks of data-parallel replica 0 (and CP rank 0) take part; under expert
parallelism, so do the first ranks holding each other share of the experts (Megatron's expert
data-parallel rank 0), which send their own experts only: no rank gathers another's experts. The path is
:func:`megagrpo.weight_sync.shards.choose_path`'s:

- **shard-wise**: every TP rank turns its own Megatron shards into HF layout (QKV de-interleaved per
  query group, fc1 -> gate/up, vocabulary rows trimmed: ``shards.local_hf_tensors``, no gather) and
  sends each engine TP rank the blocks of vLLM's per-rank parameters it holds
  (``shards.rank_pieces``), one broadcast group per (trainer rank, engine rank) link;
- **gathered**: each parameter is gathered over the TP group when HF layout needs the whole tensor,
  turned into HF tensors by the converter's map, and TP rank 0 of the stage broadcasts them to every
  vLLM worker, which cuts out its shard.

Either way tensors are packed into fixed-size buckets; packing bucket k+1 overlaps the broadcast of
bucket k (two buffers, on CPU kept from one sync to the next). No rank ever holds more than one
parameter gathered plus two buckets; no rank funnels another stage's weights. An engine on the
sender's own device (colocated) takes the link's buckets from two shared slots instead
(``weight_sync.ipc``), which are then also the buffers the link broadcasts from.

:class:`WeightSyncEndpoints` is what the controller (``sync.WeightSync``) calls on every trainer
rank; the policy worker inherits it, so the controller names these methods without importing the
policy.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megagrpo.compat.torch_store import listening_socket
from megagrpo.models.layout import (
    check_stage,
    is_expert,
    is_gated_fc1,
    param_numels,
    stage_param_names,
    tensor_split,
    tp_merge,
    tp_partition_dim,
)
from megagrpo.models.mapping import hf_tensor_shapes, to_hf
from megagrpo.parallel.local import node_ip
from megagrpo.weight_sync.adapters import stage_adapters, tensors_digest
from megagrpo.weight_sync.buckets import Bucket, SentBuckets, Slot, checksum, dtype_name, pack, plan_buckets
from megagrpo.weight_sync.coverage import check_sender_plan, sender_shares, sent_ranges
from megagrpo.weight_sync.delta import FULL, SentCopies, slot_digests
from megagrpo.weight_sync.ipc import IpcSender
from megagrpo.weight_sync.shards import SyncPath, choose_path, local_hf_tensors, piece_tensor, rank_pieces
from megagrpo.weight_sync.transport import BroadcastGroup, GroupAddress, Link, LinkKey

if TYPE_CHECKING:
    from megagrpo.generation.engine import EngineLayout
    from megagrpo.models.description import ModelDescription
    from megagrpo.parallel import ParallelContext
    from megagrpo.types import TrainBatch


class WeightSender:
    def __init__(self, ctx, module: torch.nn.Module, model_info):
        self.ctx, self.module, self.info = ctx, module, model_info
        self.path: SyncPath | None = None
        self.engine_tp = 1
        self.layout: EngineLayout | None = None  # the engines' (given with the offer)
        self.groups: dict[int, BroadcastGroup] = {}  # plan source (link index) -> its group
        self.ipc: dict[int, IpcSender] = {}  # plan source -> the handoff to the engine on this device
        self.sources: list[int] = []  # the plan sources (links) this rank sends
        self._mine: dict[LinkKey, Link] = {}  # this rank's links, as offered
        # Each offered link's store sockets (broadcast, handoff), listening from the offer, where their
        # ports are handed out, until ``open`` gives them to the stores: a port only found free then
        # could be taken meanwhile by any process, if only as an outgoing connection's source port.
        self._listening: dict[LinkKey, tuple[socket.socket, socket.socket]] = {}
        self._keys: list[LinkKey] = []  # every link of the sync, in plan-source order
        self._buffers: list[torch.Tensor] | None = None  # the packing buffers (senders only)
        self.copies: SentCopies | None = None  # delta mode: the bytes last sent (weight_sync.delta)
        names = stage_param_names(module, ctx, model_info.shape.num_layers)
        params = dict(module.named_parameters())
        # Every parameter has its rule and its shard's size, before anything is planned.
        check_stage(
            param_numels(module), names, model_info.arch.rules(model_info.shape), model_info.shape, ctx
        )
        self.covered = (len(names), 0)  # (parameters checked, HF tensor shares the plan covers)
        by_global = {g: params[local] for local, g in names.items()}
        self.sends_dense = ctx.dp_rank == 0 and ctx.cp_rank == 0
        self.sends_experts = ctx.expert_dp_rank == 0 and ctx.cp_rank == 0
        # Rule order: embedding, layers in order, final norm, output layer. With ETP < TP a rank of
        # DP replica 0 may hold a replica of experts another rank sends, and the other way round.
        self.rules = [
            r
            for r in model_info.arch.rules(model_info.shape)
            if r.export
            and r.megatron in by_global
            and (self.sends_experts if is_expert(r.megatron) else self.sends_dense)
        ]
        # Each rule's tensor-parallel split on this rank: (rank, size); a routed expert's is ETP's.
        self.splits = [tensor_split(ctx, r.megatron) for r in self.rules]
        self.params = [by_global[r.megatron] for r in self.rules]
        # A link's sender within its stage: this rank's share of the experts, then its TP rank.
        self.slot = ctx.ep_rank * ctx.sizes.tp + ctx.tp_rank

    @property
    def takes_part(self) -> bool:
        """Ranks of DP replica 0 (and CP rank 0) send or gather, and under expert parallelism those
        holding the other shares of the experts; the others sit the sync out."""
        return self.sends_dense or self.sends_experts

    @property
    def shard_wise(self) -> bool:
        return self.path is not None and self.path.kind == "shard"

    def choose(self, engine_tp: int, requested: str, engine_ep: bool, layout: EngineLayout) -> SyncPath:
        sizes, shape = self.ctx.sizes, self.info.shape
        return choose_path(
            shape,
            sizes.tp,
            engine_tp,
            requested,
            layout=layout,
            expert_tp=sizes.expert_tp,
            engine_ep=engine_ep,
        )

    # ----------------------------------------------------------------------------------- planning

    def _link_pieces(self, engine_rank: int) -> Iterator[tuple[int, int, object]]:
        """(rule index, HF tensor index, piece) this rank sends engine rank ``engine_rank``, in rule order."""
        shape = self.info.shape
        for k, (rule, (r, t)) in enumerate(zip(self.rules, self.splits, strict=True)):
            for i, name in enumerate(rule.hf):
                for piece in rank_pieces(
                    name, shape, t, r, self.engine_tp, self.path.engine_ep, layout=self.layout
                ):
                    if piece.engine_rank == engine_rank:
                        yield k, i, piece

    def offer(
        self, path: SyncPath, engine_tp: int, bucket_bytes: int, layout: EngineLayout
    ) -> tuple[Link, ...]:
        """This rank's links with their buckets (``source`` set by the controller) into engines of
        ``layout``: shard-wise, one per engine rank it sends to; gathered, one on TP rank 0 of the stage
        (and on expert-TP rank 0 of each share of the experts); none elsewhere."""
        self.path, self.engine_tp, self.layout = path, engine_tp, layout
        if not self.takes_part:
            return ()
        stage, dtype = self.ctx.pp_rank, self.info.dtype
        if self.shard_wise:
            pieces = {j: [p for _, _, p in self._link_pieces(j)] for j in range(engine_tp)}
            self._check_plan([p for mine in pieces.values() for p in mine], [])
            links = []
            for j, mine in pieces.items():
                if not mine:
                    continue
                slots = [
                    Slot(p.param, dtype_name(dtype), p.shape, 0, into=(p.dim, p.dst_start), pad=p.pad)
                    for p in mine
                ]
                links.append(self._link((stage, self.slot, j), plan_buckets(slots, bucket_bytes, -1)))
            return tuple(links)
        shapes = hf_tensor_shapes(self.info.shape)
        tensors = [
            (name, dtype, shapes[name])
            for rule, (r, _) in zip(self.rules, self.splits, strict=True)
            if r == 0
            for name in rule.hf
        ]
        self._check_plan(None, [name for name, _, _ in tensors])
        if not tensors:
            return ()
        return (self._link((stage, self.slot, -1), plan_buckets(tensors, bucket_bytes, -1)),)

    def _check_plan(self, pieces, whole: list[str]) -> None:
        """What this rank offers covers its share of every HF tensor it sends (``weight_sync.coverage``)."""
        shape = self.info.shape
        expected = sender_shares(
            self.rules, self.splits, shape, self.engine_tp, self.shard_wise, layout=self.layout
        )
        shares = check_sender_plan(self.ctx.rank, expected, sent_ranges(pieces, whole, shape))
        self.covered = (self.covered[0], shares)

    def _link(self, key: LinkKey, buckets: list[Bucket]) -> Link:
        host = node_ip()
        store, handoff = listening_socket(host), listening_socket(host)
        for unused in self._release(key):  # an earlier offer's, never opened
            if unused is not None:
                unused.close()
        self._listening[key] = (store, handoff)
        port, ipc_port = store.getsockname()[1], handoff.getsockname()[1]
        link = Link(key, host, port, tuple(buckets), rank=self.ctx.rank, ipc_port=ipc_port)
        self._mine[key] = link
        return link

    def _release(self, key: LinkKey) -> tuple[socket.socket | None, socket.socket | None]:
        """The link's listening sockets, no longer held here (None, None once given to the stores: a
        link opened again binds its ports anew)."""
        return self._listening.pop(key, (None, None))

    def open(
        self,
        groups: Sequence[GroupAddress],
        keys: Sequence[LinkKey],
        *,
        backend: str,
        timeout_s: float,
        delta_max_fraction: float | None = None,
    ):
        """Become rank 0 of each of this rank's groups and the sender of its handoffs, in plan order
        (blocks until every receiver joined). ``delta_max_fraction``: delta mode (``weight_sync.delta``),
        starting with no bytes known to the engines; None: full mode."""
        self.close()
        self.copies = None if delta_max_fraction is None else SentCopies(delta_max_fraction)
        self._keys = list(keys)
        for index, key in enumerate(keys):
            if key not in self._mine:
                continue
            self.sources.append(index)
            addr = groups[index]
            store, handoff = self._release(key)
            if addr.world_size > 1:
                engines = ",".join(map(str, addr.engines))
                name = f"weight sync link {key} (trainer rank {self.ctx.rank} -> engine(s) {engines})"
                self.groups[index] = BroadcastGroup(
                    addr,
                    0,
                    backend=backend,
                    timeout_s=timeout_s,
                    device=self.ctx.device,
                    name=name,
                    listening=store,
                )
            elif store is not None:
                store.close()
            if addr.ipc is not None:
                slot_bytes = max(b.nbytes for b in self._mine[key].buckets)
                name = f"weight sync link {key} (trainer rank {self.ctx.rank}) -> engine {addr.ipc.engine}"
                self.ipc[index] = IpcSender(
                    addr.ipc,
                    slot_bytes,
                    device=self.ctx.device,
                    timeout_s=timeout_s,
                    name=name,
                    listening=handoff,
                )
            elif handoff is not None:
                handoff.close()
        if self.ipc and len(self.sources) > 1:
            raise RuntimeError(
                "weight sync: a rank hands buckets to the engine on its device on one link only, "
                f"rank {self.ctx.rank} has {len(self.sources)}"
            )

    # ------------------------------------------------------------------------------------ sending

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Gathered path: HF (name, tensor) of this stage in plan order; a TP collective on every
        participating rank (a routed expert's over its expert-TP group), tensors on the group's first
        rank only."""
        for rule, param, (rank, size) in zip(self.rules, self.params, self.splits, strict=True):
            full = param.detach()
            dim = tp_partition_dim(rule.megatron)
            if dim >= 0 and size > 1:
                shards = [torch.empty_like(full) for _ in range(size)]
                group = self.ctx.pgs.expt_tp if is_expert(rule.megatron) else self.ctx.pgs.tp
                dist.all_gather(shards, full.contiguous(), group=group)
                full = tp_merge(shards, partition_dim=dim, gated=is_gated_fc1(rule.megatron))
            if rank == 0:
                yield from zip(rule.hf, to_hf(rule, full, self.info.shape), strict=True)

    def shard_tensors(self, engine_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Shard-wise: (vLLM parameter, block) this rank sends engine rank ``engine_rank``, in plan
        order; views into this rank's own parameters, no communication."""
        shape = self.info.shape
        cached: tuple[int, list[torch.Tensor]] | None = None
        for k, i, piece in self._link_pieces(engine_rank):
            if cached is None or cached[0] != k:
                r, t = self.splits[k]
                cached = (k, local_hf_tensors(self.rules[k], self.params[k].detach(), shape, t, r))
            yield piece.param, piece_tensor(cached[1][i], piece)

    def send(self, plan: Sequence[Bucket], *, with_checksums: bool = False) -> SentBuckets | None:
        """Broadcast this rank's buckets of ``plan``; senders report them, the other ranks return None."""
        if not self.takes_part:
            return None
        if self.shard_wise:
            streams = {index: self.shard_tensors(self._keys[index][2]) for index in self.sources}
            return self._broadcast(plan, streams, with_checksums)
        stream = self.hf_tensors()
        if not self.sources:
            for _ in stream:  # TP peers: take part in the gathers only
                pass
            return None
        try:
            return self._broadcast(plan, dict.fromkeys(self.sources, stream), with_checksums)
        except Exception:
            # A receiver died mid-sync: still take part in the rest of the TP gathers, so that the
            # TP peers, which cannot know, are not left waiting in one.
            with contextlib.suppress(Exception):
                for _ in stream:
                    pass
            raise

    def _broadcast(self, plan: Sequence[Bucket], streams: dict, with_checksums: bool) -> SentBuckets:
        """Pack the buckets of ``plan`` this rank sends, tensors from ``streams`` (by plan source), and
        broadcast them on its groups / hand them to the engine on its device; two buckets in flight. In
        delta mode each goes as its header and its encoding against the bytes last sent
        (``weight_sync.delta``)."""
        if not self.sources:
            raise RuntimeError("weight sync: send() before open()")
        mine = [(i, b) for i, b in enumerate(plan) if b.source in self.sources]
        ipc = next(iter(self.ipc.values()), None)  # at most one link: then the slots are the buffers
        delta = self.copies is not None
        # Full mode packs into the handoff's slots where there are some; delta mode packs apart and puts
        # the encoding into the slots, or (no handoff) into two buffers more.
        count = (0 if ipc is not None else 2) if not delta else (2 if ipc is not None else 4)
        buffers = self._packing_buffers(mine, count)
        in_flight, digests, encoded = [None, None], [], []  # per buffer: (group, works, plan index, header)

        def done(flight) -> None:
            if flight is not None:
                group, works, index, _ = flight
                for work in works:
                    group.wait(work, f"the broadcast of bucket {index}")

        try:
            for n, (index, bucket) in enumerate(mine):
                slot = n % 2
                done(in_flight[slot])  # this buffer's previous broadcast must be done before reuse
                # A slot is free once its previous bucket's broadcast is done and the engine took it.
                buffer = ipc.slot(n) if ipc is not None and not delta else buffers[slot]
                buf = pack(bucket, self._next_tensors(bucket, streams), buffer)
                if with_checksums:
                    digests.append((index, slot_digests(bucket, buf) if delta else checksum(buf)))
                header, sent = None, None
                if delta:
                    wire = ipc.slot(n) if ipc is not None else buffers[2 + slot]
                    sent = self.copies.encode(index, bucket, buf, wire)
                    encoded.append((index, sent.count, sent.nbytes, sent.words, sent.changed))
                    if sent.count == FULL and ipc is None:
                        wire = buf
                    elif sent.count == FULL:
                        wire[: buf.numel()].copy_(buf)
                    buf, header = wire[: sent.nbytes], sent.header(self.ctx.device)
                if ipc is not None:
                    ipc.post(n, index, None if sent is None else (sent.count, sent.nbytes))
                group = self.groups.get(bucket.source)
                if group is None:
                    in_flight[slot] = None
                    continue
                works = [] if header is None else [group.broadcast(header, root=0)]
                if buf.numel():  # an unchanged bucket's delta is its header alone
                    works.append(group.broadcast(buf, root=0))
                in_flight[slot] = (group, works, index, header)
            for flight in in_flight:
                done(flight)
            if ipc is not None:
                ipc.finish()
        except BaseException:
            if delta:  # which receivers got which bucket is not known: the next sync goes whole
                self.copies.clear()
            raise
        for stream in streams.values():
            leftover = next(stream, None)
            if leftover is not None:
                raise RuntimeError(f"weight sync plan is missing {leftover[0]}")
        return SentBuckets(tuple(digests) if with_checksums else None, tuple(encoded))

    def _packing_buffers(self, mine: list[tuple[int, Bucket]], count: int) -> list[torch.Tensor]:
        """``count`` buffers as large as this rank's largest bucket."""
        if not count:
            return []
        size = max((b.nbytes for _, b in mine), default=0)
        if self._buffers is None or len(self._buffers) != count or self._buffers[0].numel() < size:
            device = self.ctx.device
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
        buffers = [b[:size] for b in self._buffers]
        if self.ctx.device.type != "cpu":
            # On CPU they are kept (fresh multi-MB buffers cost a page fault per 4 KiB on every
            # sync); a GPU's caching allocator reuses the memory, which colocated engines may need.
            self._buffers = None
        return buffers

    @staticmethod
    def _next_tensors(bucket: Bucket, streams: dict) -> list[torch.Tensor]:
        """The tensors of ``bucket``'s slots, from its link's stream."""
        tensors = []
        for expected in bucket.slots:
            name, tensor = next(streams[bucket.source])
            if name != expected.name:
                raise RuntimeError(f"weight sync plan expected {expected.name}, the model produced {name}")
            tensors.append(tensor)
        return tensors

    def close(self) -> None:
        self._buffers = self.copies = None
        for channel in [*self.groups.values(), *self.ipc.values()]:
            channel.close()
        self.groups, self.ipc, self.sources = {}, {}, []


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

    def weight_sync_path(
        self, engine_tp: int, requested: str, engine_ep: bool, layout: EngineLayout
    ) -> SyncPath:
        """The path for this model and these TP sizes into engines of ``layout`` (``shards.choose_path``,
        from this rank's shape)."""
        return self._sender().choose(engine_tp, requested, engine_ep, layout)

    def weight_sync_offer(
        self, path: SyncPath, engine_tp: int, bucket_bytes: int, layout: EngineLayout
    ) -> tuple[Link, ...]:
        """This rank's links (where each group will listen, and its buckets of <= ``bucket_bytes``) into
        engines of ``layout``."""
        return self._sender().offer(path, engine_tp, bucket_bytes, layout)

    def weight_sync_covered(self) -> tuple[int, int]:
        """(parameters of this rank checked against the HF map, HF tensor shares its offer was checked to
        send whole): the coverage checks passed (they raise otherwise)."""
        return self._sender().covered

    def weight_sync_shape(self):
        """The model's shape (``GPTShape``): the controller checks the engines' side of the plan with it."""
        return self._sender().info.shape

    def open_weight_sync(
        self,
        groups: Sequence[GroupAddress],
        keys: Sequence[LinkKey],
        backend: str,
        timeout_s: float,
        delta_max_fraction: float | None = None,
    ) -> None:
        """Host this rank's broadcast groups (``groups[i]`` is link ``keys[i]``); ``delta_max_fraction``:
        delta mode (``generation.sync_delta_max_fraction``), None: full."""
        self._sender().open(
            groups, keys, backend=backend, timeout_s=timeout_s, delta_max_fraction=delta_max_fraction
        )

    def send_weights(self, plan: Sequence[Bucket], with_checksums: bool = False) -> SentBuckets | None:
        """Collective: every rank calls it; senders broadcast, TP peers of the gathered path help gather."""
        return self._sender().send(plan, with_checksums=with_checksums)

    def send_adapters(self) -> tuple[dict, str] | None:
        """``generation.lora_sync: adapter``: (this stage's LoRA adapters whole in PEFT's names, their
        digest) from the stage's first rank, None from the others (``weight_sync.adapters``; collective
        over each stage's TP group)."""
        tensors = stage_adapters(*self.weight_source())
        return None if tensors is None else (tensors, tensors_digest(tensors))

    def forget_sent_weights(self) -> None:
        """Delta mode: drop the bytes last sent, so that the next sync sends every bucket whole (the
        controller calls it after a sync that failed, a digest mismatch included)."""
        if self.sender is not None and self.sender.copies is not None:
            self.sender.copies.clear()

    def close_weight_sync(self) -> None:
        if self.sender is not None:
            self.sender.close()
