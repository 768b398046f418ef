"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert) through the converters and
Megatron's MoE layers on CPU: HF -> Megatron -> HF bit-identical when converted with the experts split over
EP 2 ranks, with TP 2 (gated expert fc1 split per rank; or whole experts on each rank at ETP 1) or PP 2
(stages and layer offsets): each rank
reads and writes only its own experts, and Megatron's logits equal transformers' within 1e-4 (the router computed as transformers
computes it) at EP 1 and at EP 2 (tokens dispatched to the other rank's experts over gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import MOE_ARCHS, make_tiny_hf
from test_convert import megatron_logits

from megagrpo.ckpt.convert import hf_to_megatron, megatron_to_hf
from megagrpo.ckpt.hf_files import HFCheckpoint
from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {arch: make_tiny_hf(arch, root / arch, seed=10 + i) for i, arch in enumerate(MOE_ARCHS)}


@pytest.mark.parametrize(
    ("arch", "tp", "pp", "ep", "etp"),
    [
        ("qwen3_moe", 2, 1, 2, None),
        ("qwen2_moe", 1, 2, 2, None),
        # ETP 1 under TP 2 (Megatron's parallel folding): two ranks, each with half the experts whole.
        ("qwen3_moe", 2, 1, 2, 1),
        # ... and with EP 1: both TP ranks hold every expert whole; only the first writes them.
        ("qwen2_moe", 2, 1, 1, 1),
    ],
    ids=["qwen3_moe-tp2-ep2", "qwen2_moe-pp2-ep2", "qwen3_moe-tp2-ep2-etp1", "qwen2_moe-tp2-etp1"],
)
def test_moe_round_trip_is_bit_identical(arch, tp, pp, ep, etp, hf_dirs, tmp_path):
    ckpt = hf_to_megatron(hf_dirs[arch], tmp_path / "megatron", tp=tp, pp=pp, ep=ep, etp=etp)
    out = megatron_to_hf(ckpt, tmp_path / "hf")
    src, back = HFCheckpoint(hf_dirs[arch]), HFCheckpoint(out)
    assert set(back.tensors) == set(src.tensors)
    assert any(".mlp.experts.7.down_proj." in name for name in src.tensors)
    for name in src.tensors:
        a, b = src.read(name), back.read(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def _logits(rank: int, world_size: int, ckpt: str, tokens: torch.Tensor) -> torch.Tensor:
    return megatron_logits(ckpt, tokens, ep=world_size)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_megatron_logits_match_transformers(arch, hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(hf_dirs[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(tokens).logits
    ckpt = hf_to_megatron(hf_dirs[arch], tmp_path / "megatron", tp=1, pp=1)
    for ep in (1, 2):
        # EP 2: each rank holds half the experts, its tokens reach the other half by all-to-all.
        for got in run_local_ranks(_logits, ep, str(ckpt), tokens, timeout_s=300):
            diff = (got - want).abs().max().item()
            assert diff <= 1e-4, f"{arch} at EP {ep}: max |logits diff| {diff:.2e}"
