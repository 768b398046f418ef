"""Cross-section checks of ``policy.lora`` against the model and the layers (part of ``rules.validate``).

The adapter rank is never split over tensor-parallel ranks (``models.lora``: a column-parallel base splits
``B``'s output rows, a row-parallel one ``A``'s input columns, both already divisible by TP), so no rank is
refused for a TP size; what is refused is a target the model lacks (a dense MLP's layer on a
mixture-of-experts model, an expert's on a dense one), a rank past the model's width, and the Transformer
Engine's fused norm + linear layers and grouped-GEMM experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megagrpo.config.errors import require

if TYPE_CHECKING:
    from megagrpo.config.schema import Config

_FUSED_WITH_NORM = ("linear_qkv", "linear_fc1")


def check_lora(cfg: Config, shape: Any, where: str) -> None:
    """``policy.lora`` against a model shape (``model.tiny`` or an HF config.json, named by ``where``)."""
    lora = cfg.policy.lora
    check_lora_sync(cfg, shape, where)
    if not lora.enabled:
        return
    moe = bool(getattr(shape, "num_experts", 0))
    mlp = [t for t in lora.targets if t in ("linear_fc1", "linear_fc2")]
    require(
        not (moe and mlp),
        ("policy.lora.target_modules", f"{where}.num_experts"),
        f"{', '.join(mlp)}: this mixture-of-experts model's MLP layers are experts (its shared expert is "
        f"not adapted): target {', '.join('experts.' + t for t in mlp)}",
    )
    experts = [t for t in lora.targets if t.startswith("experts.")]
    require(
        moe or not experts,
        ("policy.lora.target_modules", f"{where}.num_experts"),
        f"{', '.join(experts)}: this model is dense (no routed experts): target "
        f"{', '.join(t.removeprefix('experts.') for t in experts)}",
    )
    require(
        lora.rank <= shape.hidden_size,
        ("policy.lora.rank", f"{where}.hidden_size"),
        f"rank {lora.rank} exceeds the model's hidden_size {shape.hidden_size}",
    )
    impl = cfg.resolved.transformer_impl if cfg.resolution is not None else cfg.parallel.transformer_impl
    require(
        not (impl == "transformer_engine" and experts),
        ("policy.lora.target_modules", "parallel.transformer_impl"),
        f"{', '.join(experts)}: Transformer Engine's grouped-GEMM experts (TEGroupedMLP) carry no "
        "adapters; set parallel.transformer_impl torch or local (SequentialMLP experts)",
    )
    fused = [t for t in lora.targets if t in _FUSED_WITH_NORM]
    require(
        not (impl == "transformer_engine" and fused),
        ("policy.lora.target_modules", "parallel.transformer_impl"),
        f"{', '.join(fused)}: Transformer Engine fuses these layers with the norm before them, whose "
        "output an adapter needs; set parallel.transformer_impl torch or local",
    )


def check_lora_sync(cfg: Config, shape: Any, where: str) -> None:
    """``generation.lora_sync: adapter`` (``generation.vllm_lora``) against what it needs: adapters to send,
    engines that keep the base between syncs, and layers vLLM's LoRA support adapts here."""
    gen = cfg.generation
    if gen.lora_sync != "adapter":
        return
    require(
        cfg.policy.lora.enabled,
        ("generation.lora_sync", "policy.lora.rank"),
        "adapter sync sends LoRA adapters, and policy.lora.rank is 0 (no adapters): set a rank, or "
        "generation.lora_sync merged",
    )
    require(
        gen.placement != "colocated",
        ("generation.lora_sync", "generation.placement"),
        "colocated engines discard their weights when they sleep, so the base would travel with every "
        "sync: adapter sync would save nothing; use generation.lora_sync merged",
    )
    require(
        gen.sync_mode == "full",
        ("generation.lora_sync", "generation.sync_mode"),
        "the base goes once and the adapters whole (they are small): delta sync has nothing to save; "
        "set generation.sync_mode full",
    )
    require(
        not getattr(shape, "num_experts", 0),
        ("generation.lora_sync", f"{where}.num_experts"),
        "adapter sync into vLLM's LoRA support is not built for mixture-of-experts models; use "
        "generation.lora_sync merged",
    )
    require(
        cfg.policy.lora.rank <= 512,
        ("generation.lora_sync", "policy.lora.rank"),
        f"rank {cfg.policy.lora.rank} exceeds vLLM's largest max_lora_rank 512",
    )
