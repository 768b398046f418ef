"""Architecture registry: an HF ``config.json`` -> the Megatron shape and the HF<->Megatron name map.

Supported: Qwen2 / Qwen2.5 (incl. DeepSeek-R1-Distill-Qwen), Llama 3 / 3.1 / 3.2, Qwen3, and the
mixture-of-experts Qwen3-MoE (top-k softmax routing, QK norm) and Qwen2-MoE (plus a shared expert with a
sigmoid gate), every layer's MLP a mixture of experts. Anything
this code would build differently from the HF reference (another rope scaling, sliding windows,
biases where the architecture has none, another activation) is refused with an error naming the
config key, never silently approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megagrpo.models.mapping import Rule, decoder_rules
from megagrpo.models.shape import DTYPE_NAMES, GPTShape


class UnsupportedModelError(ValueError):
    """The HF config asks for an architecture or option megagrpo does not implement."""


@dataclass(frozen=True)
class Architecture:
    name: str
    """Registry key ("qwen2", "llama", "qwen3")."""
    hf_classes: tuple[str, ...]
    """``architectures`` entries of config.json that select it."""
    qkv_bias: bool
    qk_layernorm: bool
    moe: bool = False
    """Mixture-of-experts MLPs (routed experts; Qwen2-MoE also a gated shared expert)."""

    def rules(self, shape: GPTShape) -> list[Rule]:
        """The declarative HF<->Megatron map for a model of this shape."""
        return decoder_rules(shape)


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture(name="qwen2", hf_classes=("Qwen2ForCausalLM",), qkv_bias=True, qk_layernorm=False),
        Architecture(name="llama", hf_classes=("LlamaForCausalLM",), qkv_bias=False, qk_layernorm=False),
        Architecture(name="qwen3", hf_classes=("Qwen3ForCausalLM",), qkv_bias=False, qk_layernorm=True),
        Architecture(
            name="qwen3_moe", hf_classes=("Qwen3MoeForCausalLM",), qkv_bias=False, qk_layernorm=True, moe=True
        ),
        Architecture(
            name="qwen2_moe", hf_classes=("Qwen2MoeForCausalLM",), qkv_bias=True, qk_layernorm=False, moe=True
        ),
    )
}

# Megatron's llama3 rope scaling has these three fixed; only the factor is a parameter.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _fail(where: str, key: str, message: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {key}: {message}")


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, float | None]:
    """(theta, llama3 factor or None) from either transformers-5 ``rope_parameters`` or the older keys."""
    params = cfg.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling, key = (
            (params, "rope_parameters") if params.get("rope_type", "default") != "default" else (None, "")
        )
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling, key = cfg.get("rope_scaling"), "rope_scaling"
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise _fail(where, f"{key}.rope_type", f"{kind!r} is not supported (supported: default, llama3)")
    for name, want in _LLAMA3_FIXED.items():
        if float(scaling.get(name, want)) != want:
            raise _fail(
                where,
                f"{key}.{name}",
                f"{scaling.get(name)} is not supported; Megatron's llama3 rope uses {want}",
            )
    return float(theta), float(scaling["factor"])


def architecture_of(cfg: dict[str, Any], where: str = "config.json") -> Architecture:
    classes = cfg.get("architectures") or []
    for arch in ARCHITECTURES.values():
        if any(c in arch.hf_classes for c in classes):
            return arch
    supported = sorted(c for a in ARCHITECTURES.values() for c in a.hf_classes)
    raise _fail(where, "architectures", f"{classes} is not supported (supported: {', '.join(supported)})")


def shape_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> tuple[Architecture, GPTShape]:
    """Validate an HF config dict and return its architecture and Megatron shape."""
    arch = architecture_of(cfg, where)
    required = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
    )
    missing = [k for k in required if k not in cfg]
    if missing:
        raise _fail(where, missing[0], f"required key missing (also missing: {missing[1:]})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _fail(where, "hidden_act", f"{cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("use_sliding_window"):
        raise _fail(where, "use_sliding_window", "sliding-window attention is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise _fail(where, "layer_types", "only full_attention layers are supported")
    if arch.name == "llama" and cfg.get("attention_bias"):
        raise _fail(where, "attention_bias", "Llama with attention bias is not supported")
    if arch.name in ("qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        raise _fail(where, "attention_bias", "Qwen3 with attention bias is not supported")
    if cfg.get("mlp_bias"):
        raise _fail(where, "mlp_bias", "MLP biases are not supported")
    theta, factor = _rope(cfg, where)
    moe = _moe_shape(cfg, arch, where) if arch.moe else {}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    shape = GPTShape(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_theta=theta,
        norm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        kv_channels=head_dim if head_dim * heads != cfg["hidden_size"] else None,
        rope_scaling_factor=factor,
        **moe,
    )
    return arch, shape


def _moe_shape(cfg: dict[str, Any], arch: Architecture, where: str) -> dict[str, Any]:
    """GPTShape's mixture-of-experts fields from a Qwen3-MoE / Qwen2-MoE config (every layer MoE)."""
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; checkpoints say num_experts.
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    for name in (key, "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(cfg.get(name), int) or cfg[name] < 1:
            raise _fail(where, name, f"a positive integer is required, got {cfg.get(name)!r}")
    if cfg["num_experts_per_tok"] > cfg[key]:
        raise _fail(
            where, "num_experts_per_tok", f"{cfg['num_experts_per_tok']} is more than {key} {cfg[key]}"
        )
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise _fail(where, "decoder_sparse_step", "only 1 is supported (every layer a mixture of experts)")
    if cfg.get("mlp_only_layers"):
        raise _fail(where, "mlp_only_layers", "dense layers between MoE layers are not supported")
    shared = cfg.get("shared_expert_intermediate_size") or None
    if shared is not None and arch.name != "qwen2_moe":
        raise _fail(where, "shared_expert_intermediate_size", f"{arch.name} has no shared expert")
    return {
        "num_experts": cfg[key],
        "moe_ffn_hidden_size": cfg["moe_intermediate_size"],
        "moe_router_topk": cfg["num_experts_per_tok"],
        # transformers' defaults: Qwen3-MoE renormalises the top-k probabilities, Qwen2-MoE does not.
        "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", arch.name == "qwen3_moe")),
        "moe_shared_expert_ffn_hidden_size": shared,
    }


def load_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the HF directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err


def hf_config_for(arch: Architecture, shape: GPTShape, dtype: torch.dtype) -> dict[str, Any]:
    """An HF config.json for a model built from ``shape`` (so vLLM and transformers can load it)."""
    config = {
        "architectures": list(arch.hf_classes),
        "model_type": arch.name,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if shape.rope_scaling_factor is not None:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": shape.rope_scaling_factor, **_LLAMA3_FIXED}
    if shape.is_moe:
        config |= {
            "num_experts": shape.num_experts,
            "num_experts_per_tok": shape.moe_router_topk,
            "moe_intermediate_size": shape.moe_ffn_hidden_size,
            "norm_topk_prob": shape.moe_norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        if arch.name == "qwen2_moe":
            config["shared_expert_intermediate_size"] = shape.moe_shared_expert_ffn_hidden_size or 0
    return config
