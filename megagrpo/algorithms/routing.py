"""Rollout routing replay: the engine's expert choices laid out for the trainer's forwards, and the
metrics that say how far the trainer's own routers are from them.

The engine returns, per completion, the top-k experts of every MoE layer for each position it forwarded
(``Completion.routed_experts``: prompt + response - 1 rows; the last sampled token is never forwarded).
:func:`routing_rows` lays them out per input position of a :class:`~megagrpo.types.TrainBatch`
(``TrainBatch.routing``); :func:`micro_batch_routing` turns a micro-batch's positions into the rows
Megatron's routers see (one ``[tokens, k]`` index tensor per MoE layer of this pipeline stage), which
``engine.forward_backward`` hands to Megatron's router replay.

Row order. Megatron's router flattens its ``[s, b, h]`` input to ``[s * b, E]``: row ``s_i * b + b_i``.
A packed (THD) micro-batch has ``b = 1`` and its sequences end to end, so its rows are its tokens in
order; a padded ``[b, s]`` one is transposed first. Positions no engine routed (the last token of a
sequence, padding) get experts ``0 .. k - 1``: valid, distinct, and feeding no logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from megagrpo.types import TrainBatch

ROUTING_SAMPLE = 32
"""Sequences of a step on which rollout routing replay's agreement is measured (one extra forward)."""


def routing_sample(batch: TrainBatch, data_parallel_size: int) -> TrainBatch:
    """The first ``ROUTING_SAMPLE`` sequences of the step (at least one per data-parallel rank)."""
    return batch.select(range(min(batch.size, max(ROUTING_SAMPLE, data_parallel_size))))


def filler(layers: int, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """[layers, topk] experts 0 .. k - 1: what positions no engine routed are given."""
    return torch.arange(topk, dtype=dtype).expand(layers, topk)


def routing_rows(
    per_sequence: Sequence[np.ndarray | None], width: int, *, unrouted: Sequence[int] = ()
) -> torch.Tensor:
    """[B, width, layers, topk] from each sequence's engine routing ``[rows, layers, topk]`` (rows =
    its forwarded positions, from 0), in uint8 when every sequence's is, else int16. A position past
    a sequence's rows repeats its last routed row when it is the sequence's last token, else gets
    :func:`filler`. ``unrouted``: sequences no engine forwarded (an episode whose environment failed
    to open it), all filler."""
    missing = [row for row, routed in enumerate(per_sequence) if routed is None and row not in unrouted]
    if missing:
        raise ValueError(
            f"sequences {missing[:8]} have no routed experts (grpo.routing_replay needs them all)"
        )
    routed_shape = next((np.shape(r) for r in per_sequence if r is not None), (0, 0, 0))
    empty = np.zeros((0, *routed_shape[1:]), dtype=np.uint8)
    arrays = [empty if routed is None else np.asarray(routed) for routed in per_sequence]
    layers, topk = arrays[0].shape[1:] if arrays else (0, 0)
    dtype = torch.uint8 if all(a.dtype == np.uint8 for a in arrays) else torch.int16
    out = filler(layers, topk, dtype).expand(len(arrays), width, layers, topk).clone()
    for row, routed in enumerate(arrays):
        if routed.ndim != 3 or routed.shape[1:] != (layers, topk):
            want = f"[rows, {layers}, {topk}]"
            raise ValueError(f"sequence {row}: routed experts of shape {list(routed.shape)}, expected {want}")
        got = torch.from_numpy(routed.astype(np.int16 if dtype == torch.int16 else np.uint8))
        n = min(got.shape[0], width)
        out[row, :n] = got[:n]
        if 0 < n < width:
            out[row, n] = got[n - 1]
    return out


def micro_batch_routing(
    routing: torch.Tensor,
    lengths: torch.Tensor,
    *,
    packed_tokens: int | None,
    layers: range,
    width: int | None = None,
    positions: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The router rows of one micro-batch: per MoE layer in ``layers`` (this stage's), a LongTensor
    ``[tokens, k]`` in the router's row order.

    ``routing``: the micro-batch's ``[b, s, L, k]``. ``packed_tokens``: a packed micro-batch's token
    count (its sequences end to end, then padding to a multiple), None for a padded ``[b, s]`` one, whose
    rows are ``width`` long (rounded up for sequence or context parallelism; the positions past
    ``routing``'s get :func:`filler`) and of which this rank holds ``positions`` (context parallelism's
    two chunks, ``policy.packing.context_parallel_positions``), else all.
    """
    b, s, total_layers, k = routing.shape
    if packed_tokens is None:
        if width is not None and width > s:
            extra = filler(total_layers, k, routing.dtype).expand(b, width - s, total_layers, k)
            routing = torch.cat([routing, extra], dim=1)
        if positions is not None:
            routing = routing[:, positions]
        rows = routing.transpose(0, 1).reshape(-1, total_layers, k)
    else:
        parts = [routing[i, : int(lengths[i])] for i in range(b)]
        pad = packed_tokens - sum(p.shape[0] for p in parts)
        parts.append(filler(total_layers, k, routing.dtype).expand(pad, total_layers, k))
        rows = torch.cat(parts)
    return [rows[:, layer].long().contiguous() for layer in layers]


def engine_routed_rows(
    lengths: torch.Tensor, *, packed_tokens: int | None, width: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """[rows] bool, in the router's row order of a micro-batch (as :func:`micro_batch_routing`): the
    positions the engine forwarded itself (each sequence's tokens but its last). ``positions``: a padded
    micro-batch's positions held by this rank (context parallelism), else 0 .. width - 1."""
    if packed_tokens is None:
        b = lengths.shape[0]
        held = torch.arange(width) if positions is None else positions
        return (held[:, None] < lengths[None, :] - 1).reshape(held.shape[0] * b)
    mask = torch.zeros(packed_tokens, dtype=torch.bool)
    start = 0
    for n in lengths.tolist():
        mask[start : start + n - 1] = True
        start += n
    return mask


def routing_agreement(trainer: Sequence[torch.Tensor], engine: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(token-layer pairs whose top-k sets are equal, pairs compared): the trainer's own routing (per
    layer ``[tokens, k]``, recorded without replay) against the engine's for the same tokens. The
    trainer's rows may be on its device, the engine's are on the host."""
    same = total = 0
    for mine, theirs in zip(trainer, engine, strict=True):
        a, _ = mine.sort(dim=1)
        b, _ = theirs.to(a.device, a.dtype).sort(dim=1)
        same += int((a == b).all(dim=1).sum())
        total += a.shape[0]
    return same, total


def expert_load_max(per_sequence: Sequence[np.ndarray]) -> float:
    """The largest share of routed choices any expert of any MoE layer took: 1 / (number of experts) when
    every layer is perfectly balanced, 1 / top-k when some layer sends every token to one expert."""
    if not per_sequence:
        return float("nan")
    rows = np.concatenate([np.asarray(r) for r in per_sequence])  # [tokens, layers, k]
    worst = 0.0
    for layer in range(rows.shape[1]):
        counts = np.bincount(rows[:, layer].ravel().astype(np.int64))
        worst = max(worst, float(counts.max()) / max(1, int(counts.sum())))
    return worst
