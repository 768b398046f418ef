"""Completions from the trainer's own model: greedy or sampled decoding with full forwards.

For short answers of small models (the synthetic task's accuracy, the pairs the DPO demo samples from its
initial policy), where starting a vLLM engine would cost more than the decoding. Logits stay vocab-parallel
until the last position's are gathered over TP; the last pipeline stage picks each step's tokens and
broadcasts them to every stage, so all ranks return the same completions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megagrpo.policy.engine import TrainEngine, forward_backward
from megagrpo.types import PAD_ID


def complete(
    engine: TrainEngine,
    prompts: list[list[int]],
    max_new: int,
    *,
    vocab_size: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """``max_new`` tokens after each prompt (no early stop: callers cut at EOS). ``temperature`` 0 is
    greedy; above 0, tokens are drawn from softmax(logits / temperature) with a generator seeded by
    ``seed`` (the same on every rank)."""
    ctx = engine.ctx
    lengths = [len(p) for p in prompts]
    seq_len = max(lengths) + max_new
    tokens = torch.full((len(prompts), seq_len), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = torch.tensor(ids)
    lengths_t = torch.tensor(lengths)
    rows = torch.arange(len(prompts))
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    out: list[list[int]] = [[] for _ in prompts]
    for module in engine.model:
        module.eval()
    try:
        for _ in range(max_new):
            picked = {}

            def pick_next(logits: torch.Tensor, batch: dict, picked=picked, lengths_t=lengths_t):
                last = logits[rows, lengths_t - 1].float()  # [b, vocab / tp]
                if ctx.sizes.tp > 1:
                    parts = [torch.empty_like(last) for _ in range(ctx.sizes.tp)]
                    dist.all_gather(parts, last.contiguous(), group=ctx.pgs.tp)
                    last = torch.cat(parts, dim=-1)
                last = last[:, :vocab_size].cpu()  # Megatron's padding rows are no tokens
                if generator is None:
                    picked["next"] = last.argmax(dim=-1)
                else:
                    probs = torch.softmax(last / temperature, dim=-1)
                    picked["next"] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                return torch.zeros(()), torch.tensor(1, dtype=torch.int), {}

            batch = {"tokens": tokens, "position_ids": torch.arange(seq_len).expand(len(prompts), -1)}
            with torch.no_grad():
                forward_backward(engine, [batch], pick_next, forward_only=True)
            nxt = picked.get("next", torch.zeros(len(prompts), dtype=torch.long))
            if ctx.sizes.pp > 1:
                last_stage = dist.get_global_rank(ctx.pgs.pp, ctx.sizes.pp - 1)
                nxt = nxt.to(ctx.device)
                dist.broadcast(nxt, src=last_stage, group=ctx.pgs.pp)
                nxt = nxt.cpu()
            tokens[rows, lengths_t] = nxt
            lengths_t = lengths_t + 1
            for row, tok in enumerate(nxt.tolist()):
                out[row].append(tok)
    finally:
        for module in engine.model:
            module.train()
    return out
