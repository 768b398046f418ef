"""Vocab-parallel logprobs over a real TP=2 gloo group equal the gathered log-softmax, with gradients."""

import pytest
import torch

from megagrpo.parallel.local import run_local_ranks
from megagrpo.policy.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.dist

PADDED = 64


def _case(vocab: int):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 9, PADDED, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (2, 9), generator=gen)
    weights = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    return logits, targets, weights


def _rank(rank: int, world_size: int, vocab: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        logits, targets, weights = _case(vocab)
        local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(
            local,
            targets,
            group=dist.group.WORLD,
            vocab_start=rank * PADDED // world_size,
            vocab_size=vocab,
            temperature=0.9,
            chunk_size=4,
            with_entropy=True,
        )
        (lp * weights).sum().backward()
        return {"lp": lp.detach(), "entropy": ent, "grad": local.grad}
    finally:
        dist.destroy_process_group()


# 20: rank 1's whole slice (ids 32..63) is padding, yet it must join every collective.
@pytest.mark.parametrize("vocab", [50, 20])
def test_tp2_equals_gathered_reference(vocab):
    results = run_local_ranks(_rank, 2, vocab, timeout_s=120)
    logits, targets, weights = _case(vocab)
    logits.requires_grad_()
    logp = torch.log_softmax(logits[..., :vocab] / 0.9, dim=-1)
    want = logp.gather(-1, targets[..., None]).squeeze(-1)
    (want * weights).sum().backward()
    want_entropy = -(logp.exp() * logp).sum(-1)
    for res in results:
        torch.testing.assert_close(res["lp"].double(), want.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["entropy"].double(), want_entropy.detach(), atol=1e-5, rtol=1e-5)
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    torch.testing.assert_close(grad, logits.grad, atol=1e-6, rtol=1e-6)
