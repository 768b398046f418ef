"""Data that crosses actor boundaries, with the shape of every tensor spelled out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD_ID = 0


@dataclass(frozen=True)
class TrainBatch:
    """B sequences (prompt + response token ids) and per-position data for the policy.

    Position ``t`` of every ``[B, S - 1]`` tensor refers to predicting ``input_ids[:, t + 1]``
    from ``input_ids[:, : t + 1]``; only response positions (``response_mask``) carry meaning.
    """

    input_ids: torch.Tensor
    """[B, S] int64, right-padded with PAD_ID."""
    lengths: torch.Tensor
    """[B] int64: prompt + response tokens of each sequence."""
    prompt_lengths: torch.Tensor
    """[B] int64: prompt tokens of each sequence (>= 1)."""
    advantages: torch.Tensor | None = None
    """[B] float32: one advantage per sequence (GRPO)."""
    old_logprobs: torch.Tensor | None = None
    """[B, S - 1] float32: trainer logprobs before this step's updates (PPO ratio denominator)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, S - 1] float32: reference-policy logprobs (KL penalty)."""
    gen_logprobs: torch.Tensor | None = None
    """[B, S - 1] float32: the generator's sampling logprobs (importance correction, metrics)."""

    def __post_init__(self) -> None:
        batch, seq = self.input_ids.shape
        if self.lengths.shape != (batch,) or self.prompt_lengths.shape != (batch,):
            raise ValueError(
                f"lengths/prompt_lengths must be [{batch}] for input_ids of shape [{batch}, {seq}]"
            )
        if batch and (int(self.lengths.max()) > seq or bool((self.prompt_lengths < 1).any())):
            raise ValueError("every sequence needs 1 <= prompt_length and length <= input_ids.shape[1]")
        for name in ("old_logprobs", "ref_logprobs", "gen_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != (batch, seq - 1):
                raise ValueError(f"{name} must be [{batch}, {seq - 1}], got {list(value.shape)}")
        if self.advantages is not None and self.advantages.shape != (batch,):
            raise ValueError(f"advantages must be [{batch}], got {list(self.advantages.shape)}")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def response_mask(self) -> torch.Tensor:
        """[B, S - 1] bool: positions whose target is a response token."""
        pos = torch.arange(self.input_ids.shape[1] - 1)
        return (pos >= self.prompt_lengths[:, None] - 1) & (pos < self.lengths[:, None] - 1)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The sub-batch of ``indices``, trimmed to its own longest sequence."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        seq = int(self.lengths[idx].max()) if len(idx) else 1

        def take(t: torch.Tensor | None, width: int | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[idx]
            return t[:, :width] if width is not None else t

        return TrainBatch(
            input_ids=take(self.input_ids, seq),
            lengths=self.lengths[idx],
            prompt_lengths=self.prompt_lengths[idx],
            advantages=take(self.advantages, None),
            old_logprobs=take(self.old_logprobs, seq - 1),
            ref_logprobs=take(self.ref_logprobs, seq - 1),
            gen_logprobs=take(self.gen_logprobs, seq - 1),
        )

    def replace(self, **fields) -> TrainBatch:
        return dataclasses.replace(self, **fields)

    @staticmethod
    def from_sequences(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> TrainBatch:
        lengths = [len(s) for s in sequences]
        ids = torch.full((len(sequences), max(lengths)), PAD_ID, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        return TrainBatch(
            input_ids=ids,
            lengths=torch.as_tensor(lengths, dtype=torch.long),
            prompt_lengths=torch.as_tensor(list(prompt_lengths), dtype=torch.long),
        )


def balanced_shards(lengths: Sequence[int], num_shards: int) -> list[list[int]]:
    """Split sequence indices into ``num_shards`` groups of near-equal token counts (deterministic).

    Longest first onto the least-loaded shard; each shard keeps ascending index order.
    """
    loads = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(num_shards), key=lambda s: (loads[s], len(shards[s]), s))
        shards[target].append(i)
        loads[target] += lengths[i]
    return [sorted(s) for s in shards]
