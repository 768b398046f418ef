"""The bare Megatron step, the bound of every trainer benchmark (train, sft_dpo, moe, the step's
bound), and the model shapes and rank options those benchmarks share.

``bare_step(engine, micro)`` is Megatron's forward+backward schedule over a worker's own
micro-batches with Megatron's ``vocab_parallel_cross_entropy`` summed over the trained tokens, then
the optimizer step: what a plain Megatron step costs on the same model, buffers and tokens, with no
megagrpo loss, metrics or batch handling. On a mixture-of-experts model it is the same model too (the
worker's engine: its TransformerConfig, MoE layers and expert-parallel groups); under expert
parallelism its schedule pads the EP ranks to equal micro-batch counts as the worker's does, which
the all-to-all needs of any Megatron step.
"""

from __future__ import annotations

import argparse

PRESETS = {
    "tiny": dict(  # make demo's model (tiny_cpu.yaml)
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
        vocab_size=512,
    ),
    "cpu": dict(
        num_layers=4, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=2,
        vocab_size=32000,
    ),
    "qwen2-1.5b": dict(
        num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2,
        vocab_size=151936,
    ),
    "smoke": dict(  # qwen2-1.5b's code path at toy size: the GPU suite's --quick
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        vocab_size=1000,
    ),
    "tiny_moe": dict(  # make moe-demo's Qwen3-MoE (tiny_moe.yaml): 8 experts of width 64, top-2
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
        vocab_size=512, num_experts=8, moe_ffn_hidden_size=64, moe_router_topk=2,
    ),
    "moe": dict(  # a Qwen3-MoE whose experts are ~70% of its weights: 16 experts of width 128, top-2
        num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=4,
        vocab_size=8192, num_experts=16, moe_ffn_hidden_size=128, moe_router_topk=2,
    ),
    "qwen3-30b-a3b-4l": dict(  # 4 layers of Qwen3-30B-A3B (128 experts of width 768, top-8; 16 heads of
        # 128 for its 32 of 128 over hidden 2048): ~3B parameters, one GPU at EP 1 (the gpu suite's moe)
        num_layers=4, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=4,
        vocab_size=151936, num_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
    ),
}  # fmt: skip
"""Model shapes (Megatron's names) of the trainer benchmarks; those with ``num_experts`` are Qwen3-MoE
models (``model.arch`` qwen3_moe: no QKV bias, QK norm, top-k probabilities renormalised)."""


def cross_entropy_loss(logits, micro: dict):
    """Megatron's vocab-parallel cross-entropy summed over a micro-batch's trained tokens.

    ``micro`` is one of a worker's ``micro_batches``: padded [b, s] rows, or one packed row whose
    per-position values ``packed.unpack`` lays out as [n, S - 1]."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    sub = micro["sub"]
    # Position t predicts token t + 1 of its sequence (targets past a sequence's end are dummies).
    loss_BS = vocab_parallel_cross_entropy(logits, micro["targets"].to(logits.device))  # [b, s] fp32
    packed = micro.get("packed")
    width = sub.input_ids.shape[1] - 1
    loss_NT = packed.unpack(loss_BS) if packed is not None else loss_BS[:, :width]  # [n, S - 1]
    mask_NT = sub.response_mask().to(logits.device)
    loss = torch.where(mask_NT, loss_NT, torch.zeros_like(loss_NT)).sum()
    return loss, mask_NT.sum().to(torch.int), {}


def bare_step(engine, micro: list[dict]):
    """One plain Megatron training step of ``engine`` on ``micro`` (a worker's micro-batches)."""
    from megagrpo.policy.engine import forward_backward, optimizer_step

    forward_backward(engine, micro, cross_entropy_loss)
    return optimizer_step(engine)


def device_sync(device):
    """A callable that waits for ``device`` (a CUDA synchronize; nothing on CPU), for the timer."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def add_model_args(
    p: argparse.ArgumentParser, *, tp: list[int] | None, seq: int, budget: int, seqs=False, preset="cpu"
) -> None:
    """The model, layout and rank options of a trainer benchmark (``shape_of`` applies ``--shape``);
    ``seqs``: ``--seq`` takes several lengths (one run each); ``tp`` None: no ``--tp`` (TP 1)."""
    p.add_argument("--preset", choices=sorted(PRESETS), default=preset, help="model shape")
    p.add_argument("--shape", action="append", default=[], metavar="KEY=INT", help="override a preset key")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    if tp is not None:
        p.add_argument("--tp", type=int, nargs="+", default=tp, help="one run (of TP ranks) per value")
    if seqs:
        p.add_argument("--seq", type=int, nargs="+", default=[seq], help="longest sequence; a run each")
    else:
        p.add_argument("--seq", type=int, default=seq, help="longest sequence")
    p.add_argument("--min-len-frac", type=float, default=0.5, help="shortest sequence / --seq")
    p.add_argument("--budget", type=int, default=budget, help="policy.micro_batch_max_tokens")
    p.add_argument("--chunk", type=int, default=1024, help="policy.logprob_chunk_size")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: CPUs / ranks)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run of ranks")


def shape_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int]:
    """The preset's shape with the ``--shape`` overrides (a bad one is a usage error naming it)."""
    shape = dict(PRESETS[args.preset])
    for item in args.shape:
        key, _, value = item.partition("=")
        if key not in shape or not value.isdigit():
            p.error(f"--shape {item}: want KEY=INT with KEY one of {', '.join(shape)}")
        shape[key] = int(value)
    return shape


def rank_threads(args: argparse.Namespace, ranks: int) -> int:
    """``--threads``, else on CPU the usable cores shared among the ranks; 0 (torch's) on GPU."""
    import os

    import torch

    if args.threads or torch.cuda.is_available():
        return args.threads
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def model_overrides(args: argparse.Namespace, shape: dict, tp: int) -> dict[str, object]:
    """The config keys every trainer benchmark sets: shape, sequence, dtype, layout, budget (a shape
    with experts: a Qwen3-MoE)."""
    moe = {"model.arch": "qwen3_moe", "model.tiny.qkv_bias": False} if shape.get("num_experts") else {}
    return {
        **moe,
        **{f"model.tiny.{k}": v for k, v in shape.items()},
        "model.tiny.tie_word_embeddings": True,
        "model.tiny.max_position_embeddings": args.seq,
        "model.seq_length": args.seq,
        "model.dtype": args.dtype,
        "parallel.tensor_model_parallel_size": tp,
        "parallel.backend": args.backend,
        "policy.micro_batch_max_tokens": args.budget,
        "policy.logprob_chunk_size": args.chunk,
    }
