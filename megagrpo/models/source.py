"""Which model a run trains: architecture, shape, dtype and where its initial weights come from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.config import Config
from megagrpo.models.builder import GPTShape
from megagrpo.models.registry import ARCHITECTURES, Architecture, load_hf_config, shape_from_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunModel:
    arch: Architecture
    shape: GPTShape
    dtype: torch.dtype
    hf_dir: Path | None
    """HF directory (config + tokenizer; also the weights unless megatron_ckpt is set)."""
    megatron_ckpt: Path | None
    """A megagrpo checkpoint (hf_to_megatron output) to load the weights from."""


def run_model(cfg: Config) -> RunModel:
    """Resolve ``cfg.model`` into the model to build (reads config.json, no weights)."""
    m = cfg.model
    dtype = DTYPES[m.dtype]
    if m.tiny is not None:
        t = m.tiny
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
            qkv_bias=t.qkv_bias,
            tie_word_embeddings=t.tie_word_embeddings,
        )
        return RunModel(ARCHITECTURES[m.arch], shape, dtype, None, None)
    hf_dir = Path(m.hf_dir)
    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), str(hf_dir / "config.json"))
    ckpt = Path(m.megatron_ckpt) if m.megatron_ckpt else None
    return RunModel(arch, shape, dtype, hf_dir, ckpt)
