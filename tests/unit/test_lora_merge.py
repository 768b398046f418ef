"""``models.lora.merged`` (what the weight sync and the merged export send) and ``disabled`` (the KL
reference) on one rank of a tiny GPT stage: the merged weights compute what base + adapters compute, the
base's bytes come back exactly, and with the adapters off the model is the base bit for bit."""

from __future__ import annotations

import pytest
import torch

from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.unit


def _merge_and_disable(rank: int, world_size: int) -> dict:
    from megagrpo.models.builder import build_stage
    from megagrpo.models.layout import stage_param_names
    from megagrpo.models.lora import LoraSpec, adapters, attach, disabled, merged
    from megagrpo.models.shape import GPTShape
    from megagrpo.parallel import ParallelSizes, destroy_parallel, init_parallel

    shape = GPTShape(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    ctx = init_parallel(ParallelSizes(), backend="gloo")
    try:
        model = build_stage(ctx, shape, torch.float32, initialize=True).eval()
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(12).expand(2, -1)
        mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).triu(1)

        def logits():
            with torch.no_grad():
                return model(tokens, positions, mask).clone()

        base = logits()
        attach(model, LoraSpec(rank=4, alpha=8.0), stage_param_names(model, ctx, shape.num_layers))
        zero_b = logits()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, _, adapter in adapters(model):
                adapter.weight_b.copy_(torch.randn(adapter.weight_b.shape, generator=gen) * 0.1)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        adapted = logits()
        with merged(model):
            from_merged = logits()
            changed = [n for n, p in model.named_parameters() if not torch.equal(p, weights[n])]
        restored = all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
        with disabled(model):
            off = logits()
        return {
            "base": base,
            "zero_b": zero_b,
            "adapted": adapted,
            "merged": from_merged,
            "changed": changed,
            "restored": restored,
            "off": off,
            "after": logits(),
        }
    finally:
        destroy_parallel()


def test_merged_weights_compute_the_adapted_model_and_the_base_comes_back():
    (res,) = run_local_ranks(_merge_and_disable, 1)
    assert torch.equal(res["zero_b"], res["base"])  # B = 0: the base, bit for bit
    assert (res["adapted"] - res["base"]).abs().max() > 1e-3
    torch.testing.assert_close(res["merged"], res["adapted"], atol=1e-5, rtol=1e-5)
    # inside merged(): exactly the adapted linear weights changed (2 layers x qkv, proj, fc1, fc2)
    assert len(res["changed"]) == 8 and all(
        n.endswith(".weight") and ".lora." not in n for n in res["changed"]
    )
    assert res["restored"]  # the base's exact bytes after it
    assert torch.equal(res["off"], res["base"])  # adapters off: the base, bit for bit
    assert torch.equal(res["after"], res["adapted"])  # and on again
