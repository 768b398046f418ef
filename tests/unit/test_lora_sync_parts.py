"""``generation.lora_sync: adapter``'s pure parts: its config checks, each one error naming the keys; the
vLLM slot rank; the adapters' digest, whose parts join into the whole's and which names a changed
tensor; the PEFT fields the engines get."""

from __future__ import annotations

import pytest
import torch

from megagrpo.config import ConfigError, load_config
from megagrpo.generation.vllm_lora import engine_args, slot_rank
from megagrpo.weight_sync.adapters import tensors_digest
from megagrpo.weight_sync.sync import peft_config

pytestmark = pytest.mark.unit

ADAPTER = ("policy.lora.rank=8", "generation.lora_sync=adapter")
MOE = ("model.arch=qwen3_moe", "model.tiny.num_experts=4", "parallel.tensor_model_parallel_size=1")


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (("generation.lora_sync=adapter",), ("generation.lora_sync", "policy.lora.rank")),
        ((*ADAPTER, "generation.placement=colocated"), ("generation.lora_sync", "generation.placement")),
        ((*ADAPTER, "generation.sync_mode=delta"), ("generation.lora_sync", "generation.sync_mode")),
        (
            (*ADAPTER, "policy.lora.target_modules=linear_qkv", *MOE),
            ("generation.lora_sync", "model.tiny.num_experts"),
        ),
        (("generation.lora_sync=both",), ("generation.lora_sync",)),
    ],
)
def test_adapter_sync_settings_it_cannot_serve_name_their_keys(overrides, keys):
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    assert set(keys) <= set(info.value.keys), info.value


def test_engines_start_with_lora_only_for_adapter_sync():
    assert engine_args(load_config(None, ["policy.lora.rank=8"])) == {}
    args = engine_args(load_config(None, [*ADAPTER]))
    assert args == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1}
    assert [slot_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="513"):
        slot_rank(513)


def test_stage_digests_join_into_the_whole_and_name_a_changed_tensor():
    torch.manual_seed(0)
    tensors = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.randn(4, 8) for i in range(3)}
    tensors["base_model.model.layers.1.q_proj.lora_B.weight"] = torch.randn(8, 4).to(torch.bfloat16)
    names = sorted(tensors)
    first, second = {n: tensors[n] for n in names[:2]}, {n: tensors[n] for n in names[2:]}
    joined = sorted(tensors_digest(first).split(";") + tensors_digest(second).split(";"))
    assert ";".join(joined) == tensors_digest(tensors)
    changed = dict(tensors)
    changed[names[1]] = tensors[names[1]].clone()
    changed[names[1]][0, 0] += 1
    differing = set(tensors_digest(tensors).split(";")) ^ set(tensors_digest(changed).split(";"))
    assert {d.split(":")[0] for d in differing} == {names[1]}


def test_the_engines_peft_fields_name_each_adapted_projection():
    lora = load_config(None, ["policy.lora.rank=4", "policy.lora.alpha=8"]).policy.lora
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": None,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": None,
        "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight": None,
    }
    config = peft_config(lora, tensors)
    assert config == {"r": 4, "lora_alpha": 8.0, "target_modules": ["down_proj", "q_proj"], "bias": "none"}


def test_plan_counts_the_adapters_one_sync_sends():
    """The tiny model (hidden 128, 4 heads of 32 in 2 query groups, FFN 256, 2 layers) at rank 8, by hand:
    QKV 8 x (3 x 128 + 128 + 2 x 64), out 8 x (128 + 128), gate/up 8 x (2 x 128 + 2 x 256), down
    8 x (256 + 128)."""
    from megagrpo.models.description import describe_model
    from megagrpo.weight_sync.adapters import adapter_sync_bytes

    cfg = load_config(None, [*ADAPTER])
    shape = describe_model(cfg).shape
    per_layer = 8 * (3 * 128 + 128 + 128) + 8 * (128 + 128) + 8 * (2 * 128 + 512) + 8 * (256 + 128)
    assert adapter_sync_bytes(cfg, shape, 2) == 2 * per_layer * 2
    assert adapter_sync_bytes(load_config(None, ["policy.lora.rank=8"]), shape, 2) == 0
