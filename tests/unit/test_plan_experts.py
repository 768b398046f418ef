"""``megagrpo plan`` for mixture-of-experts models: Qwen3-30B-A3B on 4 nodes of 8 x 80 GB against a hand
computation, Qwen1.5-MoE-A2.7B's shared expert counted, and the expert rules naming their keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megagrpo.cli import main
from megagrpo.config import ConfigError, load_config
from megagrpo.plan import GIB, make_plan, read_shape

pytestmark = pytest.mark.unit

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json, the fields the shape reads
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,  # unused: every layer's MLP is a mixture of experts
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

QWEN1_5_MOE_A2_7B = {  # Qwen/Qwen1.5-MoE-A2.7B's config.json (Qwen2-MoE: a shared expert), the fields read
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "norm_topk_prob": False,
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

ON_4_NODES = [  # 4 nodes x 8 GPUs: 16 trainer ranks (DP 16, EP 8) + 4 engines x TP 4
    "model.tiny=null",
    "model.dtype=bfloat16",
    "model.seq_length=8192",
    "parallel.tensor_model_parallel_size=1",
    "parallel.pipeline_model_parallel_size=1",
    "parallel.data_parallel_size=16",
    "parallel.expert_model_parallel_size=8",
    "parallel.use_distributed_optimizer=true",
    "parallel.backend=nccl",
    "parallel.transformer_impl=transformer_engine",
    "policy.micro_batch_max_tokens=8192",
    "policy.mini_batch_size=128",
    "policy.logprob_chunk_size=1024",
    "policy.recompute=full",
    "generation.num_engines=4",
    "generation.engine_tensor_parallel_size=4",
    "generation.placement=disaggregated",
    "generation.gpu_memory_utilization=0.9",
    "generation.max_new_tokens=7168",
    "grpo.num_prompts_per_step=64",
    "grpo.num_generations=8",
    "cluster.num_nodes=4",
    "cluster.gpus_per_node=8",
]


def hf_dir(tmp_path: Path, config: dict) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def plan_of(overrides):
    cfg = load_config(None, overrides)
    shape, where = read_shape(cfg, None)
    return make_plan(cfg, shape, where, gpu_memory_gib=80)


def test_qwen3_30b_a3b_on_4_nodes_of_8_gpus_by_hand(tmp_path):
    """By hand, h = 2048, 48 layers, 128 experts of f = 768, top-8, vocabulary 151936 (a multiple of 128:
    no padding), bf16 (2 bytes), Adam with fp32 master weights 12 bytes per parameter, fp32 grads 4.

    Parameters. Per layer: attention q 32 x 128 x 2048 = 8388608, k and v 4 x 128 x 2048 = 1048576 each,
    o 8388608: 18874368; q/k norms 2 x 128 = 256; the two norms 2 x 2048 = 4096; router 128 x 2048 =
    262144: 19140864 non-expert. One expert 3 x 2048 x 768 = 4718592 (fc1 [1536, 2048], fc2 [2048, 768]),
    128 of them 603979776. Embedding and the untied output layer 2 x 151936 x 2048 = 622329856, final
    norm 2048. Non-expert: 48 x 19140864 + 622329856 + 2048 = 1541093376. Total: 1541093376 +
    48 x 603979776 = 30532122624 (30.5B); active: 1541093376 + 48 x 8 x 4718592 = 3353032704 (3.3B).

    Trainer rank (TP 1, PP 1, DP 16, EP 8, ETP 1): 16 experts of each layer, 48 x 16 x 4718592 =
    3623878656 expert parameters, 5164972032 in all. Weights 2 x 5164972032 = 10329944064; grads
    4 x 5164972032 = 20659888128. Adam: the non-expert states over DP 16, 1541093376 x 12 / 16 =
    1155820032; the experts' over the expert data-parallel group, TP x DP x CP / (EP x ETP) = 16 / 8 = 2
    ranks, 3623878656 x 12 / 2 = 21743271936; 22899091968 in all (61979664384 without the distributed
    optimizer). Activations at 8192 tokens, full recompute of 1 layer, fused attention: every layer's
    input 48 x 2048 x 8192 x 2 = 1610612736, and one layer's: per token 3 h + q/k/v (32 + 8) x 128 +
    2 h = 15360 elements for attention and norms, the router's 2 x 128 and the 8 copies' 8 x (2 h + 3 f)
    = 51200, 66816 x 2 bytes x 8192 = 1094713344: 2705326080 (the routed part 51456 x 2 x 8192 =
    843055104). Logits 2 x 8192 x 151936 x 2 = 4978638848 and log-prob chunks 3 x 4 x 1024 x 151936 =
    1866989568. Total 63439878656 bytes, 59.1 GiB of 80.

    All-to-all, EP 8: a token's 8 copies send 8 x 2048 x 2 x 7/8 = 28672 bytes to other ranks each way:
    per layer and micro-batch forward (dispatch + combine) 2 x 8192 x 28672 = 469762048. A step: 512
    rollouts / DP 16 = 32 sequences of at most 8192 tokens, 262144 tokens trained (forward, backward,
    full recompute's forward: 6 passes), forward-only old log-probs of mini-batches 2-4 of 4 for 3/4 of
    them (2 passes): 48 layers x 28672 x (6 x 262144 + 2 x 196608) = 2705829396480 bytes.

    Engine worker (TP 4): attention, norms and embeddings split over 4, (1541093376 - 48 x 262144) / 4 =
    382127616, routers whole 12582912, every expert at 192 of 768: 48 x 128 x 3 x 2048 x 192 =
    7247757312; x 2 bytes = 15284935680 (with vLLM's expert parallelism 32 whole experts per worker: the
    same). KV cache: 2 x 48 x 4 x 128 x 2 / 4 = 24576 bytes a token, x 8192 x 128 sequences =
    25769803776, of 0.9 x 80 GiB = 77309411328 claimed.

    Weight sync, shard-wise (trainer TP 1, engine TP 4; each expert's 768 split 4 ways): per stage, the
    8 EP shares' senders (EP rank x TP 1 x PP 1 = 8); the first share's also sends the dense tensors.
    Its bytes: its weights, 10329944064, plus what goes whole to each of the 4 engine ranks, 3 copies
    more: the routers 48 x 262144 x 2 = 25165824 and the norms (48 x (4096 + 256) + 2048) x 2 = 421888,
    3 x 25587712 = 76763136: 10406707200. Each worker: its weights above, 15284935680, with the norms
    whole instead of a quarter, 3/4 x 421888 = 316416 more: 15285252096. With vLLM's expert parallelism
    (``generation.engine_expert_parallel``) each worker receives 32 whole experts instead of a quarter of
    128: the same bytes, on the same path.
    """
    model = hf_dir(tmp_path, QWEN3_30B_A3B)
    plan = plan_of([*ON_4_NODES, f"model.hf_dir={model}"])
    assert plan.errors == []
    assert (plan.params, plan.experts.active_params) == (30532122624, 3353032704)
    (rank,) = plan.ranks
    assert (rank.params, rank.weights, rank.grads) == (5164972032, 10329944064, 20659888128)
    assert (rank.optimizer, rank.optimizer_without_distributed) == (22899091968, 61979664384)
    assert (rank.activations, rank.logits) == (2705326080, 1866989568 + 4978638848)
    assert rank.total == 63439878656 < 80 * GIB
    x = plan.experts
    assert (x.ep, x.etp, x.expert_dp, x.local_experts) == (8, 1, 2, 16)
    (e,) = x.ranks
    assert (e.params, e.weights, e.grads) == (3623878656, 2 * 3623878656, 4 * 3623878656)
    assert (e.optimizer, e.activations) == (21743271936, 843055104)
    assert (e.all_to_all_layer_forward, e.all_to_all_step) == (469762048, 2705829396480)
    engine = plan.engine_worker_bytes
    assert (engine["weights"], engine["kv_cache"], engine["claimed"]) == (
        15284935680,
        25769803776,
        77309411328,
    )
    assert (x.engine_expert_ffn, x.engine_experts_ep, x.engine_weights_ep) == (192, 32, 15284935680)
    assert plan.sync["path"] == "shard" and plan.sync["senders"] == 8
    assert (plan.sync["bytes_per_sender"], plan.sync["bytes_per_worker"]) == (10406707200, 15285252096)
    ep = plan_of([*ON_4_NODES, f"model.hf_dir={model}", "generation.engine_expert_parallel=true"]).sync
    assert (ep["path"], ep["bytes_per_sender"], ep["bytes_per_worker"]) == ("shard", 10406707200, 15285252096)


def test_pipeline_stages_hold_half_the_experts_and_expert_dp_1_keeps_their_whole_states(tmp_path):
    """PP 2 x DP 8, EP 8: expert DP 8 / 8 = 1. Stage 0 holds the embedding and 24 layers' non-expert
    parameters, 311164928 + 24 x 19140864 = 770545664, stage 1 the output layer and final norm instead
    (+ 2048), and each 24 x 16 x 4718592 = 1811939328 expert parameters whose Adam states are whole:
    770545664 x 12 / 8 + 1811939328 x 12 = 1155818496 + 21743271936."""
    model = hf_dir(tmp_path, QWEN3_30B_A3B)
    layout = ["parallel.pipeline_model_parallel_size=2", "parallel.data_parallel_size=8"]
    plan = plan_of([*ON_4_NODES, *layout, f"model.hf_dir={model}"])
    assert plan.errors == [] and plan.experts.expert_dp == 1
    assert [r.params for r in plan.ranks] == [770545664 + 1811939328, 770547712 + 1811939328]
    assert [e.params for e in plan.experts.ranks] == [1811939328, 1811939328]
    assert plan.ranks[0].optimizer == 1155818496 + 21743271936


def test_frozen_routers_have_no_gradients_nor_adam_states(tmp_path):
    """policy.freeze_router: the 48 routers' 48 x 128 x 2048 = 12582912 parameters keep their weights but
    lose their fp32 gradients (4 bytes each) and their Adam states (12 bytes each, over DP 16)."""
    model = hf_dir(tmp_path, QWEN3_30B_A3B)
    (trained,) = plan_of([*ON_4_NODES, f"model.hf_dir={model}"]).ranks
    (frozen,) = plan_of([*ON_4_NODES, f"model.hf_dir={model}", "policy.freeze_router=true"]).ranks
    assert frozen.weights == trained.weights
    assert trained.grads - frozen.grads == 4 * 12582912
    assert trained.optimizer - frozen.optimizer == 12 * 12582912 // 16


def test_qwen2_moe_counts_the_shared_expert_and_its_gate(tmp_path):
    """Qwen1.5-MoE-A2.7B, "14.3B parameters, 2.7B activated". Per layer: attention 4 x 2048^2 + q/k/v
    biases 3 x 2048 = 16783360, norms 4096, router 60 x 2048 = 122880, shared expert 3 x 2048 x 5632 =
    34603008 and its gate 2048: 51515392; the 60 experts 60 x 3 x 2048 x 1408 = 519045120. With the
    embeddings 2 x 151936 x 2048 and the final norm: 24 x 570560512 + 622331904 = 14315784192 in all,
    24 x (51515392 + 4 x 8650752) + 622331904 = 2689173504 active."""
    model = hf_dir(tmp_path, QWEN1_5_MOE_A2_7B)
    overrides = [*ON_4_NODES, f"model.hf_dir={model}", "parallel.expert_model_parallel_size=4"]
    plan = plan_of(overrides)
    assert plan.errors == []
    assert (plan.params, plan.experts.active_params) == (14315784192, 2689173504)
    assert plan.experts.ranks[0].params == 24 * 15 * 3 * 2048 * 1408


EXPERT_RULES = [  # (overrides, config.json changes, keys the error names)
    (
        ["parallel.expert_model_parallel_size=16"],
        {"num_experts": 120},
        ["parallel.expert_model_parallel_size", "config.json.num_experts", "must divide num_experts 120"],
    ),
    (
        ["parallel.expert_model_parallel_size=32"],
        {},
        ["parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size", "(16)"],
    ),
    (
        ["parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=8"],
        {},
        ["parallel.tensor_model_parallel_size", "parallel.sequence_parallel"],
    ),
    (
        ["parallel.expert_tensor_parallel_size=2"],
        {},
        ["parallel.tensor_model_parallel_size", "parallel.expert_tensor_parallel_size"],
    ),
]


@pytest.mark.parametrize(("overrides", "changes", "keys"), EXPERT_RULES)
def test_each_expert_rule_names_its_keys(tmp_path, capsys, overrides, changes, keys):
    """At load (the config.json in model.hf_dir is read), and in the plan of a config.json given apart."""
    config = {**QWEN3_30B_A3B, **changes}
    model = hf_dir(tmp_path, config)
    with pytest.raises(ConfigError) as err:
        load_config(None, [*ON_4_NODES, f"model.hf_dir={model}", *overrides])
    assert all(key in str(err.value) for key in keys), str(err.value)
    argv = ["plan", "--hf-config", str(model / "config.json"), *ON_4_NODES, *overrides]
    assert main([*argv, "model.hf_dir=/nonexistent"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert all(key in out for key in keys), out


def test_the_plan_prints_the_experts(tmp_path, capsys):
    path = hf_dir(tmp_path, QWEN3_30B_A3B) / "config.json"
    argv = [
        "plan",
        "--hf-config",
        str(path),
        *ON_4_NODES,
        "model.hf_dir=/nonexistent",
        "--gpu-memory-gib",
        "80",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "30.53B parameters (3.35B active)" in out
    assert "EP 8 x ETP 1: 16 per rank, expert DP 2 (TP x DP x CP / EP x ETP)" in out
    assert "a2a/step, at most: forward, backward, full recompute, old log-probs" in out
    assert "expert parallel: 32 whole" in out and "plan OK" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["experts"]["ranks"][0]["all_to_all_step"] == 2705829396480
