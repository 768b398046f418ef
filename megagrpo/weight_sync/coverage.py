"""Whether a weight-sync plan moves every parameter: checked when the sync is set up, before step 0.

Trainer side (:func:`check_sender_plan`, on every rank): the stage's parameters match the HF map one
to one with their shards' element counts (``models.layout.check_stage``), and what the rank offers
covers its share of every HF tensor it is the sender of: shard-wise, the union of its pieces' source
ranges along the split dim is the whole share (``[0, share)``; a replicated tensor is whole on the
rank that sends it to some engine rank, the others leave it to that TP peer); gathered, TP rank 0 of
the stage (of each expert share) sends every HF tensor whole. Deliberately not sent: a data-parallel
replica's parameters (DP rank 0 sends them), the tied output layer (the embedding is sent).

Engine side (:func:`check_engine_plan`, on the controller, per vLLM worker): the elements of every
parameter of the engine's model, in model format (``vllm_engine.model_param_shapes``), are what the
plan's buckets for that worker carry, plus the vocabulary padding rows zeroed after a ``pad`` block; the
tied ``lm_head`` is derived from the embedding. A block for a parameter the worker does not have is
an error too.

Either finding is a :class:`~megagrpo.models.layout.CoverageError` naming the tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megagrpo.models.layout import CoverageError, listing
from megagrpo.models.mapping import Rule, hf_tensor_shapes
from megagrpo.models.shape import GPTShape
from megagrpo.weight_sync.buckets import Bucket
from megagrpo.weight_sync.shards import Piece, SyncPath, rank_pieces

if TYPE_CHECKING:
    from megagrpo.generation.engine import EngineLayout


@dataclass(frozen=True)
class Sent:
    """A range of one HF tensor, along the dim its share is split on, that a trainer rank sends."""

    hf: str
    start: int
    length: int


def sender_shares(
    rules: Sequence[Rule],
    splits: Sequence[tuple[int, int]],
    shape: GPTShape,
    engine_tp: int,
    shard_wise: bool,
    *,
    layout: EngineLayout,
) -> dict[str, int]:
    """{HF tensor: extent along its split dim} this rank must send whole, ``[0, extent)``, for the rules
    it sends (each with its (TP rank, TP size)) to engines of ``layout``; a tensor it leaves to a TP peer
    is not listed."""
    full = hf_tensor_shapes(shape)
    out = {}
    for rule, (r, t) in zip(rules, splits, strict=True):
        for name in rule.hf:
            if not shard_wise:
                if r == 0:  # gathered: the group's first rank sends whole tensors
                    out[name] = full[name][0]
                continue
            if layout.placement(name).dim < 0:
                # Whole on every engine rank j, sent by trainer rank j * t // e.
                if any(j * t // engine_tp == r for j in range(engine_tp)):
                    out[name] = full[name][0]
                continue
            # One engine rank: the trainer rank's whole share.
            own = rank_pieces(name, shape, t, r, 1, layout=layout)
            if own:
                out[name] = own[0].length
    return out


def uncovered(expected: dict[str, int], sent: Iterable[Sent]) -> list[str]:
    """The HF tensors of ``expected`` whose ``[0, extent)`` the ``sent`` ranges leave a gap in, each with
    the first element missing; and ranges of tensors not expected or past the extent."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for s in sent:
        ranges.setdefault(s.hf, []).append((s.start, s.start + s.length))
    out = []
    for name, extent in sorted(expected.items()):
        end = 0
        for lo, hi in sorted(ranges.get(name, ())):
            if lo > end:
                break
            end = max(end, hi)
        if end < extent:
            out.append(f"{name} (from element {end} of {extent} along its split dim)")
    out += [f"{name} (not this rank's to send)" for name in sorted(set(ranges) - set(expected))]
    out += [
        f"{name} (past its extent {expected[name]})"
        for name in sorted(set(ranges) & set(expected))
        if max(hi for _, hi in ranges[name]) > expected[name]
    ]
    return out


def sent_ranges(pieces: Iterable[Piece] | None, whole: Iterable[str], shape: GPTShape) -> list[Sent]:
    """What a rank's offer sends: shard-wise, its pieces' source ranges; gathered, ``whole`` tensors."""
    if pieces is not None:
        return [Sent(p.hf, p.src_start, p.length) for p in pieces]
    full = hf_tensor_shapes(shape)
    return [Sent(name, 0, full[name][0]) for name in whole]


def check_sender_plan(rank: int, expected: dict[str, int], sent: Iterable[Sent]) -> int:
    """Raise unless ``sent`` covers ``expected`` exactly (:func:`uncovered`); returns how many HF tensors
    (or shares of them) the rank sends."""
    gaps = uncovered(expected, sent)
    if gaps:
        raise CoverageError(
            f"weight sync: trainer rank {rank}'s plan does not send what it holds: "
            f"{listing(gaps, 'HF tensors')}; the engines would keep stale values there"
        )
    return len(expected)


@dataclass(frozen=True)
class Block:
    """Elements a vLLM worker receives for one of its parameters."""

    param: str
    numel: int
    dim: int = 0
    end: int = 0
    """Where the block ends along ``dim`` in the parameter (``pad``: the rows after it are zeroed)."""
    pad: bool = False


def worker_blocks(
    plan: Sequence[Bucket],
    keys: Sequence[tuple],
    path: SyncPath,
    shape: GPTShape,
    engine_tp: int,
    worker: int,
    *,
    layout: EngineLayout,
) -> list[Block]:
    """What the plan's buckets carry into engine TP rank ``worker``'s parameters (of ``layout``)."""
    out = []
    for bucket in plan:
        if path.kind == "shard":
            if keys[bucket.source][2] != worker:
                continue
            for slot in bucket.slots:
                dim, start = slot.into
                length = slot.shape[dim] if slot.shape else 1
                out.append(Block(slot.name, math.prod(slot.shape), dim, start + length, slot.pad))
            continue
        for slot in bucket.slots:  # gathered: whole HF tensors; the engine's loaders cut out its part
            for p in rank_pieces(slot.name, shape, 1, 0, engine_tp, path.engine_ep, layout=layout):
                if p.engine_rank == worker:
                    out.append(Block(p.param, math.prod(p.shape), p.dim, p.dst_start + p.length, p.pad))
    return out


def check_engine_plan(
    blocks: Sequence[Block], params: dict[str, tuple[int, ...]], *, tied: bool, where: str
) -> int:
    """Raise unless ``blocks`` fill every parameter of ``params`` (a vLLM worker's, model format) with
    its element count exactly; returns how many parameters were checked."""
    got: dict[str, int] = {}
    for b in blocks:
        got[b.param] = got.get(b.param, 0) + b.numel
        shape = params.get(b.param)
        if b.pad and shape is not None and b.end < shape[b.dim]:
            row = math.prod(shape) // shape[b.dim]
            got[b.param] += (shape[b.dim] - b.end) * row  # zeroed vocabulary padding
    problems = []
    unknown = sorted(set(got) - set(params))
    if unknown:
        problems.append(listing(unknown, "tensors it has no parameter for"))
    derived = {"lm_head.weight"} if tied else set()
    missing = sorted(n for n in params if n not in got and n not in derived)
    if missing:
        problems.append(listing(missing, "parameters nothing is sent to"))
    wrong = [
        f"{n} receives {got[n]} of {math.prod(params[n])} elements"
        for n in sorted(set(got) & set(params))
        if got[n] != math.prod(params[n])
    ]
    if wrong:
        problems.append(listing(wrong, "parameters not filled exactly"))
    if problems:
        raise CoverageError(f"weight sync plan does not cover {where}'s model: {'; '.join(problems)}")
    return len(params)
