"""The shape of a decoder-only model: what Megatron needs to build it, independent of HF and weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPTShape:
    """The HF-independent shape of a decoder-only model (what Megatron needs to build it)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    """The tokenizer's vocabulary (HF ``vocab_size``); Megatron's embedding is padded beyond it."""
    max_position_embeddings: int
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-6
    qkv_bias: bool = True
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    kv_channels: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads."""
    rope_scaling_factor: float | None = None
    """Llama 3.x RoPE scaling factor (low/high frequency factors 1/4, original context 8192)."""
    num_experts: int = 0
    """Routed experts of every MLP (a mixture-of-experts model); 0: dense MLPs of ffn_hidden_size."""
    moe_ffn_hidden_size: int | None = None
    """Width of one expert's MLP (HF ``moe_intermediate_size``)."""
    moe_router_topk: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_norm_topk_prob: bool = True
    """The top-k routing probabilities are renormalised to sum to 1 (HF ``norm_topk_prob``); else they
    are the softmax over all experts."""
    moe_shared_expert_ffn_hidden_size: int | None = None
    """Width of the shared expert every token also goes through, scaled by a sigmoid gate (Qwen2-MoE's
    ``shared_expert_intermediate_size``); None: no shared expert."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """Rows of Megatron's embedding/output layer: the vocabulary rounded up to a multiple of 128.

    The padding deliberately does not depend on TP (Megatron-LM pads to 128 x TP), so one
    checkpoint loads at every TP that divides the padded size (every power of two up to 128).
    """
    padded = -(-vocab_size // VOCAB_DIVISIBLE_BY) * VOCAB_DIVISIBLE_BY
    if padded % tp:
        raise ValueError(f"padded vocabulary {padded} (from {vocab_size}) is not divisible by TP={tp}")
    return padded


# Model dtypes by the names configs, checkpoints' megagrpo.json and HF's ``torch_dtype`` use.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
