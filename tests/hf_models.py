"""Tiny random HF checkpoints built with transformers' own classes (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,  # not a multiple of 128: the Megatron side pads, export trims
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


TINY_QWEN2_CONFIG = {  # a tiny Qwen2 config.json: what the shape readers need of a model directory
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}

R1_DISTILL_QWEN_1_5B = {  # DeepSeek-R1-Distill-Qwen-1.5B's config.json, the fields plan's shape reads
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    tie = overrides.pop("tie_word_embeddings", None)
    tiny = {**TINY, **overrides}

    if arch == "qwen2":
        return Qwen2Config(**tiny, rope_theta=1e6, tie_word_embeddings=bool(tie))
    if arch == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        return LlamaConfig(
            **{**tiny, "max_position_embeddings": 16384},
            rope_theta=500000.0,
            rope_scaling=scaling,
            tie_word_embeddings=True,
        )
    if arch == "qwen3":
        # head_dim * heads != hidden, as in the real Qwen3 models.
        return Qwen3Config(**tiny, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        moe = {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        }
        return Qwen3MoeConfig(**tiny, **moe, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        moe = {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
        }
        return Qwen2MoeConfig(
            **tiny, **moe, shared_expert_intermediate_size=48, rope_theta=1e6, tie_word_embeddings=bool(tie)
        )
    raise ValueError(arch)


ARCHS = ("qwen2", "llama", "qwen3")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
"""Mixture-of-experts models: 8 experts, top-2 (Qwen3-MoE renormalising the top-k probabilities;
Qwen2-MoE not, with a gated shared expert)."""


def make_tiny_hf(
    arch: str, out: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> Path:
    """Save a random tiny model of ``arch`` to ``out`` with non-trivial norms and biases.

    ``overrides`` change config fields, e.g. ``hidden_size=128`` for vLLM's CPU attention,
    which needs a head size of at least 32.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, **overrides), dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Defaults are ones (norms) and zeros (biases): a swapped or dropped tensor would go unseen.
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


def make_tiny_teacher(out: Path, *, num_layers: int = 3, seed: int = 7, tokenizer=None) -> Path:
    """A random qwen2 teacher for the tiny config's student (``configs/tiny_cpu.yaml``: its vocabulary and
    head size, one layer more), saved with the student's built-in character tokenizer (or ``tokenizer``)."""
    from megagrpo.data.tokenizer import char_tokenizer, save_tokenizer

    make_tiny_hf(
        "qwen2",
        out,
        seed=seed,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    save_tokenizer(tokenizer if tokenizer is not None else char_tokenizer(), out)
    return out


def transformers_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """transformers' greedy continuation of ``prompt`` by ``model`` (fp32, eval), ``new_tokens`` long (no
    stop at EOS, as vLLM's ``ignore_eos``), and its closest call: the smallest top-1 minus top-2 logit
    along the way (a comparison through a near-tie would test rounding, not weights)."""
    with torch.no_grad():
        # eos_token_id=None: no early stop and no EOS masking (min_new_tokens would change the argmax).
        gen = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2_S2 = torch.cat(gen.logits).float().topk(2, dim=-1).values  # [steps, 2]
    return gen.sequences[0, len(prompt) :].tolist(), float((top2_S2[:, 0] - top2_S2[:, 1]).min())


def router_topk(model, tokens: list[int]) -> tuple[torch.Tensor, float]:
    """The experts each of ``tokens`` is routed to by an MoE ``model`` (fp32, eval): [len(tokens), MoE
    layers, k], each row's top-k of its router's softmax; and the smallest gap between a row's k-th and
    (k + 1)-th probability (a near-tie would make the choice rounding's)."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        router_logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    probs_LTE = torch.stack([logits.float().softmax(-1) for logits in router_logits])  # [layers, T, E]
    top = probs_LTE.topk(k + 1, dim=-1)
    gap = float((top.values[..., k - 1] - top.values[..., k]).min())
    return top.indices[..., :k].transpose(0, 1), gap
