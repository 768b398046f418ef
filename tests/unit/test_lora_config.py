"""``policy.lora``: its own fields and its checks against the model and the layers, each one error naming
the key; an adapter export of a checkpoint without adapters; the base reference a LoRA checkpoint keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megagrpo.ckpt import CheckpointError
from megagrpo.config import ConfigError, load_config

pytestmark = pytest.mark.unit

MOE = ("model.arch=qwen3_moe", "model.tiny.num_experts=4", "parallel.tensor_model_parallel_size=1")


def _error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return info.value


def test_lora_is_off_by_default_and_on_with_a_rank():
    assert not load_config(None).policy.lora.enabled
    assert not load_config(None, ["policy.lora.rank=null"]).policy.lora.enabled
    lora = load_config(
        None, ["policy.lora.rank=8", "policy.lora.target_modules=linear_qkv, linear_fc2"]
    ).policy.lora
    assert lora.enabled and lora.targets == ("linear_qkv", "linear_fc2")


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (("policy.lora.rank=-1",), ("policy.lora.rank",)),
        (("policy.lora.alpha=0",), ("policy.lora.alpha",)),
        (("policy.lora.dropout=1.0",), ("policy.lora.dropout",)),
        (("policy.lora.target_modules=q_proj",), ("policy.lora.target_modules",)),
        (("policy.lora.target_modules=linear_qkv,linear_qkv",), ("policy.lora.target_modules",)),
        # a target the architecture lacks: a mixture-of-experts model's MLPs are experts
        (("policy.lora.rank=8", *MOE), ("policy.lora.target_modules", "model.tiny.num_experts")),
        # and a dense model has no experts
        (
            ("policy.lora.rank=8", "policy.lora.target_modules=linear_qkv,experts.linear_fc1"),
            ("policy.lora.target_modules", "model.tiny.num_experts"),
        ),
        (("policy.lora.target_modules=experts.linear_fc3",), ("policy.lora.target_modules",)),
        # Transformer Engine's grouped-GEMM experts
        (
            (
                "policy.lora.rank=8",
                "policy.lora.target_modules=experts.linear_fc2",
                *MOE,
                "parallel.transformer_impl=transformer_engine",
            ),
            ("policy.lora.target_modules", "parallel.transformer_impl"),
        ),
        (("policy.lora.rank=512",), ("policy.lora.rank", "model.tiny.hidden_size")),
        (
            ("policy.lora.rank=8", "parallel.transformer_impl=transformer_engine"),
            ("policy.lora.target_modules", "parallel.transformer_impl"),
        ),
    ],
)
def test_bad_lora_settings_name_their_keys(overrides, keys):
    err = _error(*overrides)
    assert set(keys) <= set(err.keys), err


def test_attention_only_adapters_are_accepted_on_a_moe_model():
    cfg = load_config(None, ["policy.lora.rank=8", "policy.lora.target_modules=linear_qkv,linear_proj", *MOE])
    assert cfg.policy.lora.targets == ("linear_qkv", "linear_proj")


def test_expert_adapters_are_accepted_on_a_moe_model_and_named_on_a_dense_one():
    targets = "policy.lora.target_modules=linear_qkv,experts.linear_fc1,experts.linear_fc2"
    cfg = load_config(None, ["policy.lora.rank=8", targets, *MOE])
    assert cfg.policy.lora.targets == ("linear_qkv", "experts.linear_fc1", "experts.linear_fc2")
    err = _error("policy.lora.rank=8", "policy.lora.target_modules=linear_fc1", *MOE)
    assert "experts.linear_fc1" in str(err)  # the dense name on a MoE model points at the experts'
    err = _error("policy.lora.rank=8", targets)
    assert "experts.linear_fc1, experts.linear_fc2" in str(err) and "dense" in str(err)


def test_plan_counts_each_ranks_share_of_the_expert_adapters():
    from megagrpo.models.lora import adapter_params_per_rank
    from megagrpo.plan import read_shape

    cfg = load_config(None, list(MOE))
    shape, _ = read_shape(cfg, None)
    targets = ("experts.linear_fc1", "experts.linear_fc2")
    h, f, e, r = shape.hidden_size, shape.moe_ffn_hidden_size, shape.num_experts, 4
    whole = e * (r * h + 2 * f * r) + e * (r * f + h * r)
    assert adapter_params_per_rank(shape, targets, r, 1) == whole
    assert adapter_params_per_rank(shape, targets, r, 2, ep=2, etp=1) == whole // 2
    # split over expert TP: fc1's B rows, fc2's A columns
    assert adapter_params_per_rank(shape, targets, r, 2) == e * (r * h + f * r) + e * (r * f // 2 + h * r)


def test_an_adapter_export_of_a_checkpoint_without_adapters_names_the_key(tmp_path):
    from megagrpo.ckpt.lora_export import export_peft

    (tmp_path / "megatron").mkdir()
    with pytest.raises(CheckpointError, match=r"policy\.lora\.rank"):
        export_peft(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_base_reference_follows_the_base_files(tmp_path):
    from megagrpo.ckpt.lora import base_reference
    from megagrpo.models.description import describe_model

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({}))
    (hf / "model.safetensors").write_bytes(b"weights")
    cfg = load_config(None)
    info = describe_model(cfg)
    info = type(info)(info.arch, info.shape, info.dtype, Path(hf), None)
    first = base_reference(info, cfg.model, seed=0)
    assert first["source"] == "hf_dir" and first["path"] == str(hf)
    assert base_reference(info, cfg.model, seed=0) == first
    (hf / "model.safetensors").write_bytes(b"other weights")
    assert base_reference(info, cfg.model, seed=0)["digest"] != first["digest"]
    tiny = describe_model(cfg)
    assert base_reference(tiny, cfg.model, seed=0) != base_reference(tiny, cfg.model, seed=1)


def test_plan_counts_gradients_and_adam_states_of_the_adapters_only():
    from megagrpo.plan import make_plan, read_shape

    def first_rank(overrides):
        cfg = load_config(None, overrides)
        shape, where = read_shape(cfg, None)
        return make_plan(cfg, shape, where).ranks[0]

    full, lora = first_rank([]), first_rank(["policy.lora.rank=8"])
    assert lora.params > full.params  # the base and the adapters
    assert 0 < lora.grads < full.grads / 10 and 0 < lora.optimizer < full.optimizer / 10


@pytest.mark.parametrize(
    ("module", "target"),
    [
        ("decoder.layers.0.mlp.linear_fc1", "linear_fc1"),
        ("decoder.layers.1.self_attention.linear_qkv", "linear_qkv"),
        ("decoder.layers.0.mlp.experts.local_experts.7.linear_fc1", "experts.linear_fc1"),  # SequentialMLP
        ("decoder.layers.0.mlp.experts.linear_fc2", "experts.linear_fc2"),  # Transformer Engine's grouped
        ("decoder.layers.0.mlp.shared_experts.linear_fc1", None),  # the shared expert: not a target
        ("decoder.layers.0.mlp.router", None),
    ],
)
def test_each_linear_layer_is_named_by_one_target(module, target):
    from megagrpo.models.lora import target_of

    assert target_of(module) == target


def test_plan_counts_no_gradient_of_the_frozen_experts_only_their_adapters():
    from megagrpo.models.lora import adapter_params_per_rank
    from megagrpo.plan import make_plan, read_shape

    par = ["parallel.expert_model_parallel_size=2", "parallel.data_parallel_size=2"]
    targets = "policy.lora.target_modules=linear_qkv,experts.linear_fc1,experts.linear_fc2"
    cfg = load_config(None, [*MOE, *par, "policy.lora.rank=8", targets])
    shape, where = read_shape(cfg, None)
    plan = make_plan(cfg, shape, where)
    rank, experts = plan.ranks[0], plan.experts.ranks[0]
    per_layer = adapter_params_per_rank(shape, cfg.policy.lora.targets, 8, 1, ep=2, etp=1)
    assert rank.grads == shape.num_layers * per_layer * 4  # every adapter, and no base weight
    routed = adapter_params_per_rank(shape, ("experts.linear_fc1", "experts.linear_fc2"), 8, 1, ep=2, etp=1)
    assert experts.grads == shape.num_layers * routed * 4  # the experts' adapters, with the experts
