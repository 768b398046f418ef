"""A PEFT LoRA adapter merged into its HF base (``megagrpo eval --model <adapter dir>``): the merged weights,
the base found or given, and each bad adapter refused by an error naming its file and key, nothing written.
(That merging ``megagrpo export --peft``'s adapter gives ``megagrpo export``'s merged bytes is
``tests/dist/test_lora.py``'s.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.peft_merge import merge_peft

pytestmark = pytest.mark.unit

RANK, ALPHA = 2, 8.0
P = "base_model.model.model.layers.0"


def _base(root: Path) -> Path:
    base = root / "base"
    base.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(6, 4, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 5, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(4),
    }
    save_file(tensors, str(base / "model.safetensors"))
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return base


def _adapter(root: Path, base: Path | str | None, tensors=None, **config) -> Path:
    adapter = root / "adapter"
    adapter.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    tensors = tensors or {
        f"{P}.self_attn.q_proj.lora_A.weight": torch.randn(RANK, 4, generator=gen),
        f"{P}.self_attn.q_proj.lora_B.weight": torch.randn(6, RANK, generator=gen),
        f"{P}.mlp.down_proj.lora_A.weight": torch.randn(RANK, 5, generator=gen),
        f"{P}.mlp.down_proj.lora_B.weight": torch.randn(4, RANK, generator=gen),
    }
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "base_model_name_or_path": None if base is None else str(base),
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": ["q_proj", "down_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (adapter / "adapter_config.json").write_text(json.dumps(settings | config))
    return adapter


def test_the_adapted_weights_are_the_base_plus_the_scaled_update(tmp_path):
    base = _base(tmp_path)
    adapter = _adapter(tmp_path, base)
    out = merge_peft(adapter, tmp_path / "merged")
    merged, weights, lora = (
        load_file(str(d / n))
        for d, n in (
            (out, "model.safetensors"),
            (base, "model.safetensors"),
            (adapter, "adapter_model.safetensors"),
        )
    )
    assert merged.keys() == weights.keys() and (out / "config.json").is_file()
    for module in ("self_attn.q_proj", "mlp.down_proj"):
        name = f"model.layers.0.{module}.weight"
        a, b = lora[f"{P}.{module}.lora_A.weight"], lora[f"{P}.{module}.lora_B.weight"]
        want = (weights[name].float() + (b @ a) * (ALPHA / RANK)).to(weights[name].dtype)
        assert merged[name].dtype == weights[name].dtype and torch.equal(merged[name], want)
        assert not torch.equal(merged[name], weights[name])
    assert torch.equal(merged["model.norm.weight"], weights["model.norm.weight"])  # not adapted


def test_the_base_can_be_named_when_the_adapter_does_not_name_one_found_here(tmp_path):
    base = _base(tmp_path)
    with pytest.raises(CheckpointError, match=r"base_model_name_or_path.*--base"):
        merge_peft(_adapter(tmp_path, None), tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"base_model_name_or_path 'elsewhere/qwen'.*--base"):
        merge_peft(_adapter(tmp_path, "elsewhere/qwen"), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert (
        merge_peft(_adapter(tmp_path, "elsewhere/qwen"), tmp_path / "c", base=base) / "config.json"
    ).is_file()


def _bad_tensors(kind: str) -> dict[str, torch.Tensor]:
    a, b = torch.zeros(RANK, 4), torch.zeros(6, RANK)
    q = f"{P}.self_attn.q_proj"
    if kind == "rank":  # rank 3 factors, config r = 2
        return {f"{q}.lora_A.weight": torch.zeros(3, 4), f"{q}.lora_B.weight": torch.zeros(6, 3)}
    if kind == "shape":  # B of the wrong out features
        return {f"{q}.lora_A.weight": a, f"{q}.lora_B.weight": torch.zeros(5, RANK)}
    if kind == "unknown":
        return {f"{P}.self_attn.z_proj.lora_A.weight": a, f"{P}.self_attn.z_proj.lora_B.weight": b}
    if kind == "unpaired":
        return {f"{q}.lora_A.weight": a}
    return {f"{q}.lora_magnitude_vector": a}  # not a LoRA factor


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("rank", r"self_attn\.q_proj\.lora_A\.weight has shape \[3, 4\]; rank r=2"),
        ("shape", r"q_proj\.lora_B\.weight has shape \[5, 2\].*need \[6, 2\]"),
        (
            "unknown",
            r"z_proj\.lora_A\.weight adapts model\.layers\.0\.self_attn\.z_proj\.weight, which the base",
        ),
        ("unpaired", r"q_proj\.lora_B\.weight is missing"),
        ("other", r"lora_magnitude_vector is not a LoRA factor"),
    ],
)
def test_a_bad_adapter_tensor_is_named(tmp_path, kind, named):
    adapter = _adapter(tmp_path, _base(tmp_path), _bad_tensors(kind))
    with pytest.raises(CheckpointError, match=named) as info:
        merge_peft(adapter, tmp_path / "out")
    assert "adapter_model.safetensors" in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r must be"),
    ],
)
def test_adapter_settings_the_merge_does_not_implement_are_named(tmp_path, config, named):
    adapter = _adapter(tmp_path, _base(tmp_path), **config)
    with pytest.raises(CheckpointError, match=named) as info:
        merge_peft(adapter, tmp_path / "out")
    assert "adapter_config.json" in str(info.value)
    assert not (tmp_path / "out").exists()
