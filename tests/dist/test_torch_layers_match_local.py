"""The ``torch`` layers (SDPA attention, torch RMSNorm) compute what Megatron's local layers compute.

Same layout, same weights, same micro-batches: logits, loss and every gradient (after Megatron's
finalize: DP, TP and sequence-parallel reductions) agree within fp32 rounding at TP=1 (x DP 2),
TP=2, TP=2 with sequence parallelism (torch layers only: the local ones refuse it) and PP=2; the
recompute modes leave the torch layers' gradients unchanged; parameter names and checkpoint keys
are the local spec's.
"""

from __future__ import annotations

import pytest
import torch

from megagrpo.models.shape import GPTShape
from megagrpo.parallel import ParallelSizes, destroy_parallel, init_parallel
from megagrpo.parallel.local import run_local_ranks
from megagrpo.policy.engine import OptimizerSettings, build_engine, forward_backward

pytestmark = pytest.mark.dist

# 4 query heads over 2 KV groups (GQA), QK norm (Qwen3) and QKV bias (Qwen2): every module swapped.
SHAPE = GPTShape(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=300,
    max_position_embeddings=64,
    qk_layernorm=True,
)
SEQ = 24
REL = 1e-5


def _micro_batches(n: int, batch: int = 2) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, SHAPE.vocab_size, (batch, SEQ + 1), generator=gen)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "position_ids": torch.arange(SEQ).expand(batch, -1),
                "labels": tokens[:, 1:],
            }
        )
    return out


def _step(engine, micro: list[dict]) -> dict:
    """One forward/backward: the logits and loss of the last stage, every parameter's reduced gradient."""
    from megatron.core import tensor_parallel

    logits = []

    def loss_fn(output, batch):
        logits.append(output.detach().clone())
        losses = tensor_parallel.vocab_parallel_cross_entropy(output.float(), batch["labels"])  # [b, s]
        return losses.sum(), torch.tensor(losses.numel(), dtype=torch.int), {"loss": losses.sum().detach()}

    outs = forward_backward(engine, micro, loss_fn)
    grads = {name: p.main_grad.detach().clone() for name, p in engine.module.named_parameters()}
    return {"logits": logits, "loss": sum(float(o["loss"]) for o in outs), "grads": grads}


def _compare(rank: int, world_size: int) -> dict:
    layouts = {
        "tp1": (ParallelSizes(tp=1), False, 1),
        "tp2": (ParallelSizes(tp=2), False, 1),
        "tp2-sp": (ParallelSizes(tp=2), True, 1),
        "pp2": (ParallelSizes(pp=2), False, 2),
    }
    opt = OptimizerSettings()
    results = {}
    for name, (sizes, sequence_parallel, num_micro) in layouts.items():
        ctx = init_parallel(sizes, seed=1234)
        try:
            micro = _micro_batches(num_micro)
            local = build_engine(ctx, SHAPE, opt, transformer_impl="local")
            weights = {k: p.detach().clone() for k, p in local.module.named_parameters()}
            got = {"local": _step(local, micro)}
            variants = {"torch": "none"}
            if name == "tp2":
                variants.update({"torch-recompute-attn": "core_attention", "torch-recompute-full": "full"})
            for variant, recompute in variants.items():
                engine = build_engine(
                    ctx,
                    SHAPE,
                    opt,
                    transformer_impl="torch",
                    sequence_parallel=sequence_parallel,
                    recompute=recompute,
                    recompute_num_layers=2,
                )
                if name == "tp1" and variant == "torch":
                    results["names"] = {
                        "local": (
                            [(k, tuple(p.shape)) for k, p in local.module.named_parameters()],
                            sorted(local.module.sharded_state_dict()),
                        ),
                        "torch": (
                            [(k, tuple(p.shape)) for k, p in engine.module.named_parameters()],
                            sorted(engine.module.sharded_state_dict()),
                        ),
                    }
                with torch.no_grad():
                    for k, p in engine.module.named_parameters():
                        p.copy_(weights[k])
                got[variant] = _step(engine, micro)
                got[variant]["recompute"] = engine.config.recompute_granularity
            results[name] = got
        finally:
            destroy_parallel(keep_world=True)
    return results


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def compared() -> list[dict]:
    return run_local_ranks(_compare, 2, timeout_s=600)


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2-sp", "pp2"])
def test_torch_layers_match_local(compared, layout):
    for res in compared:
        want, got = res[layout]["local"], res[layout]["torch"]
        assert len(got["logits"]) == len(want["logits"])  # the last pipeline stage only has logits
        for g, w in zip(got["logits"], want["logits"], strict=True):
            assert _rel(g, w) <= REL
        if want["logits"]:
            assert abs(got["loss"] - want["loss"]) <= REL * abs(want["loss"])
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            assert grad.abs().max() > 0, name  # every parameter got a gradient to compare
            assert _rel(got["grads"][name], grad) <= REL, name
    assert any(res[layout]["local"]["logits"] for res in compared)


def test_recompute_modes_leave_the_gradients_unchanged(compared):
    for res in compared:
        base = res["tp2"]["torch"]
        for variant, granularity in (("torch-recompute-attn", "selective"), ("torch-recompute-full", "full")):
            got = res["tp2"][variant]
            assert got["recompute"] == granularity  # the mode reached Megatron
            assert abs(got["loss"] - base["loss"]) <= REL * abs(base["loss"])
            for name, grad in base["grads"].items():
                assert _rel(got["grads"][name], grad) <= REL, (variant, name)


def test_parameter_names_and_checkpoint_keys_are_the_local_spec(compared):
    names = compared[0]["names"]
    assert names["torch"] == names["local"]
