"""Shard-wise weight sync: which trainer TP rank sends which block of which engine parameter.

Pure functions of the model shape, the two TP sizes (``t`` trainer, ``e`` engine) and the engine's
layout (an ``EngineLayout``, ``megagrpo.generation.engine``: where each HF tensor goes among an engine
worker's parameters, and how it pads the vocabulary), shared by the trainer's senders, ``megagrpo plan``
and the tests. The layout of ``generation.engine: vllm`` is ``generation.vllm_layout``, described below.

:func:`choose_path` is the one place that picks the path. ``shard`` when ``t`` and ``e`` divide one
another and vLLM splits every tensor without replicating any of it (query groups divisible by ``e``:
with fewer KV heads than engine ranks vLLM copies KV heads onto several ranks; an expert's and the
shared expert's intermediate width divisible by both); otherwise, or when
``generation.weight_sync_path`` is ``gathered``, today's gathered path (all-gather over trainer TP,
TP rank 0 of each stage broadcasts whole HF tensors, every vLLM worker cuts out its shard).

The two layouts, per TP rank, of an HF tensor split along ``dim`` into equal parts (rows for the
column-parallel q/k/v, gate/up and vocabulary tensors; columns for the row-parallel o_proj and
down_proj; norms are whole on every rank):

- Megatron (trainer rank ``r`` of ``t``): part ``r`` of ``t``, inside its own parameter layout:
  ``linear_qkv`` interleaved per query group (``[q heads of group g, k_g, v_g]`` for the rank's
  groups), ``linear_fc1`` = ``[gate_r; up_r]``, the vocabulary padded to a multiple of 128
  (``models.shape.padded_vocab_size``) and split in ``padded / t`` rows.
- vLLM 0.32 (engine rank ``j`` of ``e``; its Qwen2 / Llama / Qwen3 models): part ``j`` of ``e``,
  placed as a block of a fused per-rank parameter: ``qkv_proj`` = ``[q_j; k_j; v_j]`` (heads, then
  KV heads, then KV heads: concatenated, not interleaved), ``gate_up_proj`` = ``[gate_j; up_j]``,
  ``embed_tokens`` / ``lm_head`` = rows ``[j P/e, (j + 1) P/e)`` of the vocabulary padded to a
  multiple of ``vllm_layout.VLLM_VOCAB_PADDING`` (``P``; rows past the real vocabulary are zero).

Mixture-of-experts models (vLLM's Qwen3-MoE / Qwen2-MoE): the router ``mlp.gate`` and Qwen2-MoE's
``mlp.shared_expert_gate`` are whole on every rank (vLLM's CPU build prepacks them, shape ``(0,)``
after load, but its layerwise reload gives every parameter back its logical shape before loading, so
they are sent whole like a norm); the shared expert is a dense MLP (``mlp.shared_expert.gate_up_proj``,
``down_proj``). The experts of a layer are stacked into two parameters of ``mlp.experts.routed_experts``:
``w13_weight`` ``[E, 2 f/e, h]`` (expert ``x``'s rows ``[gate_j; up_j]``) and ``w2_weight``
``[E, h, f/e]`` (``f`` = ``moe_ffn_hidden_size``): without vLLM's expert parallelism vLLM's TP splits
every expert's intermediate dim and keeps all ``E`` experts on every rank; with it
(``generation.engine_expert_parallel``) rank ``j`` holds experts ``j E/e .. (j+1) E/e - 1`` whole,
``[E/e, 2f, h]`` and ``[E/e, h, f]``, and each trainer rank's slice of an expert goes to that one rank.
A piece of expert ``x`` goes into ``param[x]`` (its local index); so that a piece keeps one
``(dim, start)``, the expert is folded into the start: ``dst_start = x * extent + offset``, ``extent``
being the per-expert parameter's size along ``dim`` (``2 f/e`` rows of ``w13``, ``f/e`` columns of
``w2``; ``2f`` and ``f`` under expert parallelism), which the engine unfolds (``vllm_engine.load_block``).

A trainer rank's share of an HF tensor (its Megatron shard turned into HF layout by
:func:`local_hf_tensors`: no gather) and an engine rank's share are intervals along ``dim``; every
non-empty intersection is a :class:`Piece`: a block the trainer rank sends and the engine rank
copies into its parameter at ``dst_start``. A whole (replicated) tensor goes to engine rank ``j``
from trainer rank ``j * t // e``. Each (trainer rank, engine rank) pair with pieces is a *link*:
one broadcast group per link and pipeline stage, holding that trainer rank and engine rank ``j`` of
every engine. So every vLLM worker receives exactly the bytes of its own shard (plus the norms).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from megagrpo.models.layout import is_expert
from megagrpo.models.mapping import Rule, hf_tensor_shapes, to_hf
from megagrpo.models.shape import GPTShape, padded_vocab_size

if TYPE_CHECKING:
    from megagrpo.generation.engine import EngineLayout

PathKind = Literal["shard", "gathered"]


@dataclass(frozen=True)
class SyncPath:
    """Which weight-sync path a layout takes, and why (logged when the sync is set up)."""

    kind: PathKind
    """``shard``: each trainer TP rank sends its own shards; ``gathered``: all-gather, a sender per stage."""
    reason: str
    """One sentence naming the sizes that decided it."""
    engine_ep: bool = False
    """The engines run their expert parallelism (``generation.engine_expert_parallel``): each engine
    rank holds whole experts, a contiguous range of them."""


def choose_path(
    shape: GPTShape,
    trainer_tp: int,
    engine_tp: int,
    requested: str = "auto",
    *,
    layout: EngineLayout,
    expert_tp: int | None = None,
    engine_ep: bool = False,
) -> SyncPath:
    """The weight-sync path for a model of ``shape`` with these TP sizes into engines of ``layout``
    (``requested``: ``auto`` or ``gathered``, the config's ``generation.weight_sync_path``; ``expert_tp``:
    the trainer's expert tensor-parallel size, by default ``trainer_tp``; ``engine_ep``: the engines hold
    whole experts)."""
    path = _choose_path(shape, trainer_tp, engine_tp, requested, expert_tp, engine_ep, layout)
    if engine_ep and path.kind == "shard":
        path = replace(
            path,
            reason=path.reason + f"; each {layout.name} worker receives its own experts whole (engine EP)",
        )
    return replace(path, engine_ep=engine_ep)


def _choose_path(
    shape: GPTShape,
    t: int,
    e: int,
    requested: str,
    expert_tp: int | None,
    engine_ep: bool,
    layout: EngineLayout,
):
    et = t if expert_tp is None else expert_tp
    heads, groups, ffn = shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size
    if requested == "gathered":
        return SyncPath("gathered", "generation.weight_sync_path is 'gathered'")
    if requested != "auto":
        raise ValueError(f"generation.weight_sync_path must be 'auto' or 'gathered', got {requested!r}")
    if t % e and e % t:
        return SyncPath(
            "gathered", f"trainer TP {t} and engine TP {e} do not divide one another: shards do not nest"
        )
    if groups % e:
        return SyncPath(
            "gathered",
            f"{groups} query groups do not split over engine TP {e}: "
            f"{layout.name} replicates KV heads across ranks",
        )
    if heads % e or ffn % e or shape.hidden_size % e:
        return SyncPath(
            "gathered",
            f"{heads} heads / FFN {ffn} / hidden {shape.hidden_size} do not split over engine TP {e}",
        )
    if shape.is_moe and not engine_ep and et % e and e % et:
        return SyncPath(
            "gathered",
            f"trainer expert TP {et} and engine TP {e} do not divide one another: expert shards do not nest",
        )
    for key, width, tt in (
        # Under the engine's expert parallelism a rank holds its experts whole: any trainer split nests.
        ("expert FFN", shape.moe_ffn_hidden_size if shape.is_moe and not engine_ep else None, et),
        ("shared expert FFN", shape.moe_shared_expert_ffn_hidden_size, t),
    ):
        if width is not None and (width % e or width % tt):
            return SyncPath(
                "gathered", f"{key} {width} does not split over trainer TP {tt} and engine TP {e}"
            )
    per_engine_rank = layout.padded_vocab(shape.vocab_size) // e
    if shape.vocab_size <= (e - 1) * per_engine_rank:
        return SyncPath(
            "gathered",
            f"vocabulary {shape.vocab_size} leaves engine rank {e - 1} without real rows at TP {e}",
        )
    return SyncPath(
        "shard",
        f"trainer TP {t} and engine TP {e} divide one another and {groups} query groups split over both: "
        "each trainer TP rank sends its own shards, no all-gather",
    )


# ---------------------------------------------------------------------------------- engine layout

_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Placement:
    """Where an HF tensor lives in an engine's per-rank parameters (``EngineLayout.placement``); fused
    blocks lie in block order, a stacked expert parameter holds expert ``x`` at ``[x]``."""

    param: str
    """The engine parameter (vLLM: ``...qkv_proj.weight`` for q/k/v, ``...gate_up_proj.weight`` for
    gate/up)."""
    dim: int
    """The dim TP splits (0 rows, 1 columns); -1: the whole tensor on every rank."""
    block: int
    """Index of this tensor's block in the fused per-rank parameter (q, k, v: 0, 1, 2; gate, up: 0, 1)."""
    expert: int = -1
    """The expert's index in the stacked expert parameter (``w13_weight``, ``w2_weight``); -1: not an
    expert's tensor."""


def _mlp_width(hf_name: str, placement: Placement, shape: GPTShape) -> int:
    """The intermediate width of the MLP a gate/up/down tensor belongs to."""
    if placement.expert >= 0:
        return shape.moe_ffn_hidden_size
    if ".shared_expert." in hf_name:
        return shape.moe_shared_expert_ffn_hidden_size
    return shape.ffn_hidden_size


def _block_offset(hf_name: str, placement: Placement, shape: GPTShape, engine_tp: int) -> int:
    """Start of the tensor's block along ``dim`` in an engine rank's fused parameter; for an expert, with
    the expert folded in (``expert x extent``, see the module's docstring)."""
    start = 0
    if placement.expert >= 0:
        extent = _mlp_width(hf_name, placement, shape) // engine_tp
        start = placement.expert * (2 * extent if placement.dim == 0 else extent)
    if placement.block == 0:
        return start
    if ".self_attn." in hf_name:  # k after q, v after q and k
        q_rows = shape.num_attention_heads * shape.head_dim // engine_tp
        kv_rows = shape.num_query_groups * shape.head_dim // engine_tp
        return q_rows + (placement.block - 1) * kv_rows
    return start + _mlp_width(hf_name, placement, shape) // engine_tp  # up after gate


def _share(length: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``parts`` equal parts of ``[0, length)``."""
    per = length // parts
    return index * per, (index + 1) * per


def _vocab_share(vocab: int, padded: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``parts`` of ``padded`` vocabulary rows, clipped to the ``vocab`` real ones."""
    per = padded // parts
    return index * per, min((index + 1) * per, vocab)


# ------------------------------------------------------------------------------------------ pieces


@functools.lru_cache(maxsize=8)
def _hf_shapes(shape: GPTShape) -> dict[str, tuple[int, ...]]:
    return hf_tensor_shapes(shape)


@dataclass(frozen=True)
class Piece:
    """A block of one HF tensor that a trainer TP rank sends to one engine TP rank."""

    hf: str
    """The HF tensor it is part of."""
    engine_rank: int
    """The engine TP rank that holds it (of every engine)."""
    param: str
    """The engine parameter it is copied into."""
    dim: int
    """The dim it is a block along (0 for a whole tensor)."""
    src_start: int
    """Start along ``dim`` in the trainer rank's share of the HF tensor (:func:`local_hf_tensors`)."""
    dst_start: int
    """Start along ``dim`` in the engine rank's parameter; in a stacked expert parameter, with the expert
    folded in: ``expert x (per-expert size along dim) + start in param[expert]``."""
    length: int
    """Its extent along ``dim``."""
    shape: tuple[int, ...]
    """The block's shape."""
    pad: bool = False
    """The engine rank's last real vocabulary rows: the parameter's rows after them are zeroed (padding)."""


def rank_pieces(
    hf_name: str,
    shape: GPTShape,
    trainer_tp: int,
    trainer_rank: int,
    engine_tp: int,
    engine_ep: bool = False,
    *,
    layout: EngineLayout,
) -> list[Piece]:
    """What trainer rank ``trainer_rank`` sends of HF tensor ``hf_name``, by engine rank of ``layout``
    (``engine_ep``: the engine's expert parallelism, see :func:`_whole_expert_piece`)."""
    t, r, e, V = trainer_tp, trainer_rank, engine_tp, shape.vocab_size
    full = _hf_shapes(shape)[hf_name]
    place = layout.placement(hf_name)
    if engine_ep and place.expert >= 0:
        return [_whole_expert_piece(hf_name, place, full, shape, t, r, e)]
    if place.dim < 0:
        return [Piece(hf_name, j, place.param, 0, 0, 0, full[0], full) for j in range(e) if j * t // e == r]
    dim, vocab = place.dim, hf_name in _VOCAB
    offset = _block_offset(hf_name, place, shape, e)
    if vocab:
        src_lo, src_hi = _vocab_share(V, padded_vocab_size(V, t), t, r)
    else:
        src_lo, src_hi = _share(full[dim], t, r)
    pieces = []
    for j in range(e):
        if vocab:
            dst_lo, dst_hi = _vocab_share(V, layout.padded_vocab(V), e, j)
        else:
            dst_lo, dst_hi = _share(full[dim], e, j)
        lo, hi = max(src_lo, dst_lo), min(src_hi, dst_hi)
        if lo >= hi:
            continue
        block = list(full)
        block[dim] = hi - lo
        pad = vocab and hi == dst_hi and hi - dst_lo < layout.padded_vocab(V) // e
        pieces.append(
            Piece(hf_name, j, place.param, dim, lo - src_lo, offset + lo - dst_lo, hi - lo, tuple(block), pad)
        )
    return pieces


def _whole_expert_piece(
    hf_name: str, place: Placement, full: tuple[int, ...], shape: GPTShape, t: int, r: int, e: int
) -> Piece:
    """Under the engine's expert parallelism engine rank ``j`` of ``e`` holds experts
    ``j E/e .. (j+1) E/e - 1`` whole (linear placement, checked by the engine at start) as
    ``w13_weight`` ``[E/e, 2f, h]`` and ``w2_weight`` ``[E/e, h, f]``: trainer rank ``r``'s slice of the
    expert goes to that one rank, at the expert's local index and the slice's own offset in the whole
    width."""
    per = shape.num_experts // e
    j, local = divmod(place.expert, per)
    width = shape.moe_ffn_hidden_size
    extent = 2 * width if place.dim == 0 else width
    offset = local * extent + (width if place.block == 1 else 0)
    lo, hi = _share(full[place.dim], t, r)
    block = list(full)
    block[place.dim] = hi - lo
    return Piece(hf_name, j, place.param, place.dim, 0, offset + lo, hi - lo, tuple(block))


def stage_links(
    rules: list[Rule],
    shape: GPTShape,
    trainer_tp: int,
    engine_tp: int,
    engine_ep: bool = False,
    *,
    layout: EngineLayout,
) -> list[tuple[int, int]]:
    """Every (trainer rank, engine rank) pair that has pieces of these rules (a pipeline stage's), sorted."""
    return sorted(
        {
            (r, p.engine_rank)
            for rule in rules
            for name in rule.hf
            for r in range(trainer_tp)
            for p in rank_pieces(name, shape, trainer_tp, r, engine_tp, engine_ep, layout=layout)
        }
    )


def local_hf_tensors(rule: Rule, local: torch.Tensor, shape: GPTShape, trainer_tp: int, trainer_rank: int):
    """This trainer rank's share of each HF tensor of ``rule`` (``rule.hf`` order), from its Megatron shard
    ``local`` of the rule's parameter: the inverse of the map's transform, applied to one shard."""
    t = trainer_tp
    if rule.transform == "copy":
        return [local]
    if rule.transform == "gated":
        return list(local.chunk(2, dim=0))
    if rule.transform == "qkv":
        # A rank's shard of linear_qkv is whole query groups: the same de-interleave with the rank's
        # heads and groups (the head width stays the model's).
        per_rank = replace(
            shape,
            num_attention_heads=shape.num_attention_heads // t,
            num_query_groups=shape.num_query_groups // t,
            kv_channels=shape.head_dim,
        )
        return to_hf(rule, local, per_rank)
    if rule.transform == "vocab":
        V = shape.vocab_size
        lo, hi = _vocab_share(V, padded_vocab_size(V, t), t, trainer_rank)
        return [local[: max(0, hi - lo)]]
    raise AssertionError(f"unknown transform {rule.transform}")


def piece_tensor(local_hf: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The block ``piece`` of the trainer rank's share ``local_hf`` of its HF tensor (a view)."""
    return local_hf.narrow(piece.dim, piece.src_start, piece.length)


def shard_bytes(
    shape: GPTShape,
    rules: list[Rule],
    trainer_tp: int,
    engine_tp: int,
    itemsize: int,
    *,
    layout: EngineLayout,
    expert_tp: int | None = None,
    engine_ep: bool = False,
):
    """(bytes each trainer rank sends, bytes each engine rank receives) for these rules, shard-wise; a
    routed expert's pieces come from its ``expert_tp`` ranks (default ``trainer_tp``, which it divides),
    counted against the trainer TP ranks of the same index, as the ranks holding both are numbered."""
    sent, received = [0] * max(trainer_tp, expert_tp or 1), [0] * engine_tp
    for rule in rules:
        t = trainer_tp if expert_tp is None or not is_expert(rule.megatron) else expert_tp
        for name in rule.hf:
            for r in range(t):
                for p in rank_pieces(name, shape, t, r, engine_tp, engine_ep, layout=layout):
                    n = itemsize
                    for d in p.shape:
                        n *= d
                    sent[r] += n
                    received[p.engine_rank] += n
    return sent, received
