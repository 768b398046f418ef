"""Fixed SFT and DPO workloads on the tiny HF model of ``policy_cases`` (dist tests and the benchmark)."""

from __future__ import annotations

import torch
from policy_cases import LARGE_BUDGET, policy_config

from megagrpo.data.supervised import Example, Pair
from megagrpo.types import SequenceBatch


def _tokens(gen: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 300, (n,), generator=gen).tolist())


def sft_batch(seed: int = 0, size: int = 8) -> SequenceBatch:
    """Two-turn conversations: prompt, answer (trained), follow-up, answer (trained)."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(size):
        parts = [int(torch.randint(2, 6, (1,), generator=gen)) for _ in range(4)]
        ids, mask = [], []
        for i, n in enumerate(parts):
            ids += _tokens(gen, n)
            mask += [i % 2 == 1] * n
        examples.append(Example(tuple(ids), tuple(mask)))
    return SequenceBatch.from_examples(examples)


def dpo_batch(seed: int = 0, pairs: int = 6) -> SequenceBatch:
    """Pairs sharing a prompt, responses of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pairs):
        prompt = _tokens(gen, int(torch.randint(3, 8, (1,), generator=gen)))
        responses = [_tokens(gen, int(torch.randint(2, 12, (1,), generator=gen))) for _ in range(2)]
        chosen, rejected = (Example(prompt + r, (False,) * len(prompt) + (True,) * len(r)) for r in responses)
        out.append(Pair(chosen, rejected))
    return SequenceBatch.from_pairs(out)


def supervised_config(hf_dir: str, *, budget=LARGE_BUDGET, extra=(), **layout):
    return policy_config(
        hf_dir,
        budget=budget,
        extra=("sft.num_steps=4", "dpo.num_steps=4", "dpo.beta=0.5", "dpo.label_smoothing=0.1", *extra),
        **layout,
    )
