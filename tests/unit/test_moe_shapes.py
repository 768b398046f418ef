"""Mixture-of-experts config.json parsing, the expert rules of the HF <-> Megatron map, the gated fc1 of
routed and shared experts, local -> global expert names, and the layout rules for experts."""

from __future__ import annotations

import pytest

from megagrpo.config import ConfigError, load_config
from megagrpo.config.rules import check_shape
from megagrpo.models.builder import build_gpt_model, check_router_replay, transformer_config
from megagrpo.models.layout import expert_global_name, is_gated_fc1, tp_partition_dim
from megagrpo.models.mapping import decoder_rules, hf_tensor_shapes
from megagrpo.models.registry import UnsupportedModelError, hf_config_for, shape_from_hf_config
from megagrpo.models.shape import DTYPES

pytestmark = pytest.mark.unit

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
}
QWEN3_MOE = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 32, "num_experts": 8}
QWEN3_MOE |= {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
QWEN2_MOE = {**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}


def test_moe_configs_parse_with_transformers_defaults():
    arch, shape = shape_from_hf_config(QWEN3_MOE)
    assert arch.name == "qwen3_moe" and shape.qk_layernorm and not shape.qkv_bias
    assert (shape.num_experts, shape.moe_router_topk, shape.moe_ffn_hidden_size) == (8, 2, 32)
    assert shape.moe_norm_topk_prob and shape.moe_shared_expert_ffn_hidden_size is None
    arch, shape = shape_from_hf_config(QWEN2_MOE)
    assert arch.name == "qwen2_moe" and shape.qkv_bias and not shape.moe_norm_topk_prob
    assert shape.moe_shared_expert_ffn_hidden_size == 48
    # transformers 5 writes Qwen3-MoE's count as num_local_experts.
    renamed = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert shape_from_hf_config(renamed)[1].num_experts == 8
    again = shape_from_hf_config(hf_config_for(arch, shape, DTYPES["float32"]))[1]
    assert again == shape


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ],
)
def test_moe_options_we_would_build_differently_are_refused(change, key):
    with pytest.raises(UnsupportedModelError, match=key):
        shape_from_hf_config({**QWEN3_MOE, **change})


def test_expert_rules_and_shapes_cover_every_tensor():
    _, shape = shape_from_hf_config(QWEN2_MOE)
    rules = decoder_rules(shape)
    hf = {name for rule in rules if rule.export for name in rule.hf}
    assert hf == set(hf_tensor_shapes(shape))
    by_name = {rule.megatron: rule for rule in rules}
    fc1 = by_name["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.transform == "gated" and fc1.hf[0] == "model.layers.1.mlp.experts.3.gate_proj.weight"
    gate = by_name["decoder.layers.0.mlp.shared_experts.gate_weight"]
    assert gate.hf == ("model.layers.0.mlp.shared_expert_gate.weight",)
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in by_name


def test_expert_layout_names():
    assert is_gated_fc1("decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight")
    assert is_gated_fc1("decoder.layers.0.mlp.shared_experts.linear_fc1.weight")
    assert is_gated_fc1("decoder.layers.0.mlp.linear_fc1.weight")
    assert not is_gated_fc1("decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight")
    assert tp_partition_dim("decoder.layers.0.mlp.router.weight") == -1
    assert tp_partition_dim("decoder.layers.0.mlp.shared_experts.gate_weight") == -1
    name = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    assert expert_global_name(name, ep_rank=1, num_local_experts=4) == name.replace(".2.", ".6.")
    assert expert_global_name(name, ep_rank=0, num_local_experts=4) == name
    assert expert_global_name("decoder.layers.1.mlp.router.weight", ep_rank=1, num_local_experts=4).endswith(
        "layers.1.mlp.router.weight"
    )


def test_layout_rules_for_experts_name_their_keys():
    _, shape = shape_from_hf_config(QWEN3_MOE)
    ok = load_config(None, ["parallel.tensor_model_parallel_size=1", "parallel.transformer_impl=local"])
    check_shape(ok, shape, "config.json")
    with pytest.raises(ConfigError, match="need sequence_parallel true"):
        check_shape(load_config(None, ["parallel.transformer_impl=local"]), shape, "config.json")
    tp2 = ["parallel.transformer_impl=torch", "parallel.sequence_parallel=true"]
    check_shape(load_config(None, tp2), shape, "config.json")
    tiny_moe = ["model.arch=qwen3_moe", "model.tiny.num_experts=8"]
    # Experts whole on each rank while attention is split over TP 2 (Megatron's parallel folding).
    folded = load_config(None, [*tiny_moe, *tp2, "parallel.expert_tensor_parallel_size=1"])
    assert folded.parallel.expert_tensor_parallel_size == 1
    tp1 = ["parallel.tensor_model_parallel_size=1", "parallel.transformer_impl=local"]
    with pytest.raises(
        ConfigError, match="expert_tensor_parallel_size 2 must divide tensor_model_parallel_size 1"
    ):
        load_config(
            None, [*tiny_moe, *tp1, "parallel.data_parallel_size=2", "parallel.expert_tensor_parallel_size=2"]
        )
    with pytest.raises(ConfigError, match="must divide the expert width moe_ffn_hidden_size") as err:
        load_config(None, [*tiny_moe, *tp2, "model.tiny.moe_ffn_hidden_size=33"])
    assert "model.tiny.moe_ffn_hidden_size" in str(err.value)


def _moe_cfg(tmp_path, *overrides):
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    base = ["model.tiny=null", f"model.hf_dir={tmp_path}", "parallel.tensor_model_parallel_size=1"]
    return load_config(None, [*base, "parallel.transformer_impl=local", *overrides])


def test_an_hf_moe_model_is_described_and_its_layout_checked_at_load(tmp_path):
    from megagrpo.models.description import describe_model

    cfg = _moe_cfg(tmp_path, "parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2")
    assert describe_model(cfg).shape.num_experts == 8
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size 3 must divide num_experts 8"):
        _moe_cfg(tmp_path, "parallel.data_parallel_size=3", "parallel.expert_model_parallel_size=3")
    with pytest.raises(ConfigError, match=r"must divide the ranks of a pipeline stage"):
        _moe_cfg(tmp_path, "parallel.expert_model_parallel_size=2")


def test_expert_options_on_a_dense_model_are_refused_naming_the_key():
    for override in (
        "grpo.routing_replay=rollout",
        "policy.freeze_router=true",
        "policy.moe_aux_loss_coeff=0.01",
    ):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=rf"{key}.*is for mixture-of-experts models"):
            load_config(None, [override])


def test_a_tiny_moe_model_needs_a_moe_arch():
    from megagrpo.models.description import describe_model

    moe = ["model.arch=qwen3_moe", "model.tiny.num_experts=4", "parallel.tensor_model_parallel_size=1"]
    shape = describe_model(load_config(None, [*moe, "parallel.transformer_impl=local"])).shape
    assert (shape.num_experts, shape.qk_layernorm, shape.qkv_bias) == (4, True, False)
    with pytest.raises(ConfigError, match="needs arch qwen3_moe or qwen2_moe"):
        load_config(None, ["model.tiny.num_experts=4"])
    with pytest.raises(ConfigError, match=r"needs tiny\.num_experts > 0"):
        load_config(None, ["model.arch=qwen3_moe"])


def test_vllms_expert_parallelism_is_refused_where_it_cannot_split_the_experts():
    tiny_moe = ["model.arch=qwen3_moe", "model.tiny.num_experts=8", "parallel.transformer_impl=local"]
    tp1 = [*tiny_moe, "parallel.tensor_model_parallel_size=1", "generation.engine_expert_parallel=true"]
    ok = load_config(None, [*tp1, "generation.engine_tensor_parallel_size=2"])
    assert ok.generation.engine_expert_parallel
    for engine_tp, experts in ((1, 8), (4, 6)):
        with pytest.raises(ConfigError, match=r"generation\.engine_expert_parallel") as err:
            load_config(
                None,
                [
                    *tp1,
                    f"generation.engine_tensor_parallel_size={engine_tp}",
                    f"model.tiny.num_experts={experts}",
                ],
            )
        assert "must be > 1 and divide num_experts" in str(err.value)
    with pytest.raises(ConfigError, match=r"engine_expert_parallel=True is for mixture-of-experts"):
        load_config(None, ["parallel.transformer_impl=local", "generation.engine_expert_parallel=true"])


def test_router_replay_never_runs_with_megatrons_fused_router():
    # Megatron-Core 0.16.1's topk_routing_with_score_function returns the fused top-k before it applies
    # the router's replay: a replaying config keeps the fused router off, and one with both is refused.
    _, shape = shape_from_hf_config(QWEN3_MOE)
    config = transformer_config(shape, on_cpu=True, routing_replay=True)
    assert config.moe_enable_routing_replay and not config.moe_router_fusion
    config.moe_router_fusion = True
    with pytest.raises(ValueError, match=r"moe_router_fusion .* with grpo.routing_replay 'rollout'"):
        check_router_replay(config)
    with pytest.raises(ValueError, match="moe_router_fusion"):
        build_gpt_model(shape, config, pgs=None)
    config.moe_enable_routing_replay = False
    check_router_replay(config)  # the fused router alone is Megatron's business
