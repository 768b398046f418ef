"""Grouping sequences into micro-batches under a token budget.

First-fit-decreasing: take sequences longest first and put each into the first micro-batch that still has
room. Long sequences placed first leave gaps that the short ones fill, which keeps both the number of
micro-batches (forward/backward passes) and, in the padded layout, the padding low: sequences of similar
length end up together, so a batch's padding to its longest member wastes little. The loss does not depend on
the grouping (see ``megagrpo.algorithms.grpo``), so any grouping is correct; this one is just cheap to run.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "PackedSequences",
    "context_parallel_positions",
    "pack_by_token_budget",
    "pack_sequences",
    "place_positions",
    "round_up",
]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int, *, padded: bool = True) -> list[list[int]]:
    """Indices into ``lengths`` grouped into micro-batches whose cost is at most ``max_tokens``.

    Cost: ``padded=True`` (right-padded [b, s] layout) ``len(batch) * max(length in batch)``; ``padded=False``
    (packed THD layout) ``sum(lengths in batch)``. Deterministic: ties are broken by index; each micro-batch
    lists its indices in ascending order, micro-batches come in the order they were opened (longest first).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for i, n in enumerate(lengths):
        if not 0 <= n <= max_tokens:
            raise ValueError(f"sequence {i} has length {n}, outside [0, max_tokens={max_tokens}]")

    batches: list[list[int]] = []
    costs: list[int] = []  # in the padded layout: the first (longest) length of each batch
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, batch in enumerate(batches):
            # Longest first: a padded batch's max is its first member, so adding i costs that max once more.
            new_cost = costs[b] * (len(batch) + 1) if padded else costs[b] + n
            if new_cost <= max_tokens:
                batch.append(i)
                if not padded:
                    costs[b] = new_cost
                break
        else:
            batches.append([i])
            costs.append(n)
    return [sorted(batch) for batch in batches]


@dataclass(frozen=True)
class PackedSequences:
    """A micro-batch's sequences laid end to end in one row (the THD layout of fused attention).

    Sequence ``i`` occupies ``[cu_seqlens[i], cu_seqlens[i + 1])``: its tokens, then padding up to
    the segment's length (attention is causal inside a segment, so trailing padding never reaches
    the real tokens). Positions restart at 0 in every segment.
    """

    tokens: torch.Tensor
    """[1, T] int64 token ids."""
    position_ids: torch.Tensor
    """[1, T] int64 position of each token inside its sequence."""
    targets: torch.Tensor
    """[1, T] int64 the next token inside the same sequence (a dummy 0 at each segment's end)."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 segment boundaries."""
    max_seqlen: int
    """Longest segment."""
    source: torch.Tensor
    """[n, S - 1] int64: for row i, position t, where its next-token prediction sits in the row."""
    valid: torch.Tensor
    """[n, S - 1] bool: t < lengths[i] - 1 (the rest of the padded [n, S - 1] layout is zero)."""

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """[1, T] or [T] per-position values -> [n, S - 1] padded layout (0 elsewhere), differentiable."""
        flat = flat.reshape(-1)
        zero = torch.zeros((), dtype=flat.dtype, device=flat.device)
        return torch.where(self.valid.to(flat.device), flat[self.source.to(flat.device)], zero)


def pack_sequences(
    input_ids: torch.Tensor, lengths: torch.Tensor, *, segment_multiple: int = 1, total_multiple: int = 1
) -> PackedSequences:
    """Pack the rows of right-padded ``input_ids`` [n, S] (real lengths ``lengths`` [n]) into one row.

    ``segment_multiple`` rounds every segment up (context parallelism splits each sequence in
    2 x CP chunks); ``total_multiple`` rounds the whole row up, the padding going to the last
    segment (sequence parallelism splits the row over TP ranks).
    """
    n, seq = input_ids.shape
    lens = [int(x) for x in lengths]
    if n == 0:
        raise ValueError("pack_sequences needs at least one sequence")
    if any(not 1 <= length <= seq for length in lens):
        raise ValueError(f"every length must be in [1, {seq}], got {lens}")
    segments = [round_up(length, segment_multiple) for length in lens]
    total = round_up(sum(segments), total_multiple)
    segments[-1] += total - sum(segments)
    starts = [0]
    for length in segments:
        starts.append(starts[-1] + length)

    tokens = torch.zeros(1, total, dtype=torch.long)
    position_ids = torch.empty(1, total, dtype=torch.long)
    targets = torch.zeros(1, total, dtype=torch.long)
    steps = torch.arange(seq - 1)
    source = torch.zeros(n, max(seq - 1, 0), dtype=torch.long)
    for i, (start, length, segment) in enumerate(zip(starts[:-1], lens, segments, strict=True)):
        row = input_ids[i, :length]
        tokens[0, start : start + length] = row
        targets[0, start : start + length - 1] = row[1:]
        position_ids[0, start : start + segment] = torch.arange(segment)
        source[i] = start + steps
    valid = steps[None, :] < (torch.tensor(lens)[:, None] - 1)
    source = torch.where(valid, source, torch.zeros_like(source))
    return PackedSequences(
        tokens=tokens,
        position_ids=position_ids,
        targets=targets,
        cu_seqlens=torch.tensor(starts, dtype=torch.int32),
        max_seqlen=max(segments),
        source=source,
        valid=valid,
    )


def context_parallel_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The positions of a ``seq_len`` row held by context-parallel rank ``cp_rank`` of ``cp``.

    Megatron's load-balanced split for causal attention: the row is cut into 2 x CP chunks and rank
    r holds chunks r and 2 x CP - 1 - r (an early, cheap chunk with a late, expensive one).
    """
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x context parallel size {cp}")
    chunk = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


def place_positions(values: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    """[b, n] values of the given row positions -> [b, length], zero elsewhere (differentiable)."""
    full = values.new_zeros(values.shape[0], length)
    return full.index_copy(1, positions.to(values.device), values)
