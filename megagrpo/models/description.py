"""What model a job builds: architecture, shape, dtype, and where its config and initial weights are.

One description serves every consumer: the policy and the warm-up build from it
(:func:`describe_model`, from a run config), the converters and ``megagrpo export`` read it back
from a checkpoint (``megagrpo.ckpt.megatron.read_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megagrpo.models.registry import (
    ARCHITECTURES,
    Architecture,
    load_hf_config,
    shape_from_hf_config,
)
from megagrpo.models.shape import DTYPES, GPTShape

if TYPE_CHECKING:
    from megagrpo.config import Config


@dataclass(frozen=True)
class ModelDescription:
    arch: Architecture
    shape: GPTShape
    dtype: torch.dtype
    hf_dir: Path | None
    """config.json and tokenizer files (also the weights unless ``megatron_ckpt`` is set); None for
    a tiny model built in-process."""
    megatron_ckpt: Path | None
    """A megagrpo checkpoint (``hf_to_megatron`` output, a run's ``step_N/``) holding the weights."""


def describe_model(cfg: Config) -> ModelDescription:
    """Resolve ``cfg.model`` into the model to build (reads config.json, no weights)."""
    m = cfg.model
    dtype = DTYPES[m.dtype]
    if m.tiny is not None:
        t, arch = m.tiny, ARCHITECTURES[m.arch]
        shape = GPTShape(
            num_layers=t.num_layers,
            hidden_size=t.hidden_size,
            ffn_hidden_size=t.ffn_hidden_size,
            num_attention_heads=t.num_attention_heads,
            num_query_groups=t.num_query_groups,
            vocab_size=t.vocab_size,
            max_position_embeddings=t.max_position_embeddings,
            rope_theta=t.rope_theta,
            norm_epsilon=t.norm_epsilon,
            qkv_bias=t.qkv_bias if not arch.moe else arch.qkv_bias,
            qk_layernorm=arch.qk_layernorm,
            tie_word_embeddings=t.tie_word_embeddings,
            **(_tiny_moe(t) if arch.moe else {}),
        )
        return ModelDescription(arch, shape, dtype, None, None)
    hf_dir = Path(m.hf_dir)
    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), str(hf_dir / "config.json"))
    ckpt = Path(m.megatron_ckpt) if m.megatron_ckpt else None
    return ModelDescription(arch, shape, dtype, hf_dir, ckpt)


def _tiny_moe(t) -> dict:
    """GPTShape's mixture-of-experts fields from ``model.tiny``."""
    return dict(
        num_experts=t.num_experts,
        moe_ffn_hidden_size=t.moe_ffn_hidden_size,
        moe_router_topk=t.moe_router_topk,
        moe_norm_topk_prob=t.moe_norm_topk_prob,
        moe_shared_expert_ffn_hidden_size=t.moe_shared_expert_ffn_hidden_size,
    )
