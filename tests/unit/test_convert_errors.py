"""Bad converter inputs fail naming the file, tensor or key, before any rank starts, and leave nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import make_tiny_hf
from safetensors.torch import load_file, save_file

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.convert import hf_to_megatron, megatron_to_hf
from megagrpo.models.registry import UnsupportedModelError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_tiny_hf("qwen2", tmp_path_factory.mktemp("pristine") / "qwen2")


@pytest.fixture
def hf_dir(pristine, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(pristine, tmp_path / "src"))


def _rewrite(hf_dir: Path, edit) -> None:
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _convert_fails(hf_dir: Path, tmp_path: Path, exc, pattern: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(exc, match=pattern):
        hf_to_megatron(hf_dir, out, tp=1)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_missing_tensor(hf_dir, tmp_path):
    _rewrite(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _convert_fails(
        hf_dir, tmp_path, CheckpointError, r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"
    )


def test_extra_tensor(hf_dir, tmp_path):
    _rewrite(hf_dir, lambda t: t.__setitem__("model.layers.1.mystery.weight", torch.zeros(3)))
    _convert_fails(
        hf_dir,
        tmp_path,
        CheckpointError,
        r"unexpected tensor model\.layers\.1\.mystery\.weight in model\.safetensors",
    )


def test_shape_mismatch(hf_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    _rewrite(hf_dir, shrink)
    _convert_fails(
        hf_dir,
        tmp_path,
        CheckpointError,
        r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight "
        r"has shape \[16, 64\], config\.json implies \[32, 64\]",
    )


def test_mixed_dtypes(hf_dir, tmp_path):
    def half(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.bfloat16)

    _rewrite(hf_dir, half)
    _convert_fails(hf_dir, tmp_path, CheckpointError, r"mixed dtypes.*model\.norm\.weight is torch\.bfloat16")


def test_truncated_safetensors(hf_dir, tmp_path):
    path = hf_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    _convert_fails(hf_dir, tmp_path, CheckpointError, r"model\.safetensors: truncated safetensors file")


def test_index_pointing_to_missing_shard(hf_dir, tmp_path):
    names = list(load_file(hf_dir / "model.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _convert_fails(hf_dir, tmp_path, CheckpointError, r"refers to model-00001-of-00002\.safetensors")


def test_output_directory_exists(hf_dir, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="out: output directory already exists"):
        hf_to_megatron(hf_dir, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_unsupported_architecture(hf_dir, tmp_path):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    _convert_fails(
        hf_dir, tmp_path, UnsupportedModelError, r"config\.json: architectures: \['MistralForCausalLM'\]"
    )


def test_unsupported_rope_scaling(hf_dir, tmp_path):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    _convert_fails(
        hf_dir, tmp_path, UnsupportedModelError, r"rope_parameters\.rope_type: 'yarn' is not supported"
    )


def test_tp_not_dividing_heads(hf_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"--tp 3 must divide num_attention_heads 4"):
        hf_to_megatron(hf_dir, out, tp=3)
    assert not out.exists()


def test_export_of_something_else(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointError, match=r"ckpt: no megagrpo\.json"):
        megatron_to_hf(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
