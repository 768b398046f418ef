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
