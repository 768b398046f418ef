"""``megagrpo plan``: rules against a shape read from config.json; memory that fits, or the overflow named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hf_models import R1_DISTILL_QWEN_1_5B as QWEN_1_5B

from megagrpo.cli import main
from megagrpo.config import ConfigError, load_config
from megagrpo.parallel import backends
from megagrpo.plan import GIB, make_plan, read_shape

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


LLAMA_3_70B = {  # Meta-Llama-3-70B's config.json, the fields the shape reads
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

LLAMA_70B_ON_1024 = [  # 128 nodes x 8 GPUs: 512 trainer ranks (TP 8 x PP 4 x DP 16) + 64 engines x TP 8
    "model.tiny=null",
    "model.dtype=bfloat16",
    "model.seq_length=8192",
    "parallel.tensor_model_parallel_size=8",
    "parallel.pipeline_model_parallel_size=4",
    "parallel.data_parallel_size=16",
    "parallel.sequence_parallel=true",
    "parallel.use_distributed_optimizer=true",
    "parallel.backend=nccl",
    "parallel.transformer_impl=transformer_engine",
    "policy.micro_batch_max_tokens=8192",
    "policy.mini_batch_size=512",
    "generation.num_engines=64",
    "generation.engine_tensor_parallel_size=8",
    "generation.placement=disaggregated",
    "generation.gpu_memory_utilization=0.9",
    "generation.max_new_tokens=7168",
    "grpo.num_prompts_per_step=64",
    "grpo.num_generations=8",
    "cluster.num_nodes=128",
    "cluster.gpus_per_node=8",
]


def hf_dir(tmp_path: Path, config: dict, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def plan_of(overrides, path=None, **kw):
    cfg = load_config(path, overrides)
    shape, where = read_shape(cfg, None)
    return make_plan(cfg, shape, where, **kw)


def errors_of(overrides, path=None, **kw) -> str:
    """The load error, or the plan's errors, as one string."""
    try:
        return "\n".join(plan_of(overrides, path, **kw).errors)
    except ConfigError as err:
        return str(err)


def test_deepscaler_8k_on_one_node_of_8_gpus_fits(tmp_path, monkeypatch):
    model = hf_dir(tmp_path, QWEN_1_5B)
    path = REPO / "configs" / "deepscaler" / "8k.yaml"
    plan = plan_of([f"model.hf_dir={model}"], path, gpu_memory_gib=80, transformer_engine=True)
    assert plan.errors == []
    assert plan.world_size == 8 and plan.gpus == 8
    assert 0 < max(r.total for r in plan.ranks) < 80 * GIB
    # the distributed optimizer divides the Adam states over DP 4
    r = plan.ranks[0]
    assert r.optimizer == pytest.approx(r.optimizer_without_distributed / 4, abs=1)
    e = plan.engine_worker_bytes
    assert e["weights"] + e["kv_cache"] < e["claimed"]
    # transformer_impl auto on machines without Transformer Engine: the torch layers, which take SP
    no_te = plan_of([f"model.hf_dir={model}"], path, gpu_memory_gib=80, transformer_engine=False)
    assert no_te.transformer_impl == "torch" and no_te.errors == []
    # and where PyTorch has no torch layers either: Megatron's local ones, which refuse it
    monkeypatch.setattr(backends, "torch_layers_available", lambda: False)
    local = errors_of([f"model.hf_dir={model}"], path, gpu_memory_gib=80, transformer_engine=False)
    assert "parallel.sequence_parallel" in local and "parallel.transformer_impl" in local


def test_llama_3_70b_on_128_nodes_of_8_gpus_fits(tmp_path):
    model = hf_dir(tmp_path, LLAMA_3_70B)
    plan = plan_of([*LLAMA_70B_ON_1024, f"model.hf_dir={model}"], gpu_memory_gib=80)
    assert plan.errors == []
    assert plan.gpus == 1024 and plan.world_size == 512
    assert 68e9 < plan.params < 72e9
    assert [r.stage for r in plan.ranks] == [0, 1, 2, 3]
    assert all(0 < r.total < 80 * GIB for r in plan.ranks)
    # TP 8 trainer, TP 8 engines, 8 KV heads: shard-wise, every TP rank of each stage sends its shard
    assert plan.sync["path"] == "shard" and plan.sync["senders"] == 32 and plan.sync["receivers"] == 512
    assert plan.sync["est_seconds"] > 0
    gathered = plan_of(
        [*LLAMA_70B_ON_1024, f"model.hf_dir={model}", "generation.weight_sync_path=gathered"],
        gpu_memory_gib=80,
    ).sync
    assert gathered["path"] == "gathered" and gathered["senders"] == 4
    # gathered: every worker receives the whole bf16 model; shard-wise an eighth of it (plus the norms)
    assert 2 * 68e9 < gathered["bytes_per_worker"] == gathered["total_bytes"] < 2 * 72e9
    assert (
        gathered["bytes_per_worker"] / 8 <= plan.sync["bytes_per_worker"] < gathered["bytes_per_worker"] / 7.9
    )
    assert plan.sync["total_bytes"] >= gathered["total_bytes"]
    assert plan.sync["est_seconds"] < gathered["est_seconds"] / 4
    # Delta sync: each sender keeps what it sends, each worker what it receives, in host memory.
    assert plan.sync["sync_mode"] == "full" and plan.sync["host_bytes_per_sender"] == 0
    delta = plan_of(
        [*LLAMA_70B_ON_1024, f"model.hf_dir={model}", "generation.sync_mode=delta"], gpu_memory_gib=80
    ).sync
    assert delta["host_bytes_per_sender"] == plan.sync["bytes_per_sender"] > 0
    assert delta["host_bytes_per_worker"] == plan.sync["bytes_per_worker"]


def test_an_infeasible_layout_names_the_stage_and_the_overflow(tmp_path):
    model = hf_dir(tmp_path, LLAMA_3_70B)
    overrides = [*LLAMA_70B_ON_1024, f"model.hf_dir={model}", "parallel.pipeline_model_parallel_size=1"]
    overrides += ["parallel.data_parallel_size=64", "parallel.use_distributed_optimizer=false"]
    plan = plan_of(overrides, gpu_memory_gib=80)
    (err,) = plan.errors
    over = (plan.ranks[0].total - 80 * GIB) / GIB
    assert err.startswith(f"trainer ranks of pipeline stage 0 need {plan.ranks[0].total / GIB:.1f} GiB, ")
    assert f"{over:.1f} GiB more than the 80 GiB per GPU" in err


SHAPE_BREAKERS = [  # (overrides, config.json changes, keys the error names)
    (
        ["parallel.tensor_model_parallel_size=8", "parallel.data_parallel_size=1"],
        {},
        ["parallel.tensor_model_parallel_size", "config.json.num_attention_heads"],
    ),
    (
        ["parallel.tensor_model_parallel_size=4", "parallel.data_parallel_size=1"],
        {},
        ["parallel.tensor_model_parallel_size", "config.json.num_query_groups"],
    ),
    (
        ["parallel.pipeline_model_parallel_size=3"],
        {},
        ["parallel.pipeline_model_parallel_size", "config.json.num_layers"],
    ),
    (
        ["generation.engine_tensor_parallel_size=8"],
        {},
        ["generation.engine_tensor_parallel_size", "config.json.num_attention_heads"],
    ),
    ([], {"max_position_embeddings": 4096}, ["model.seq_length", "config.json.max_position_embeddings"]),
    (
        ["parallel.sequence_parallel=true", "parallel.transformer_impl=local"],
        {},
        ["sequence_parallel", "transformer_impl"],
    ),
    (
        ["parallel.context_parallel_size=2", "parallel.transformer_impl=local"],
        {},
        ["context_parallel_size", "transformer_impl"],
    ),
    (
        [
            "parallel.context_parallel_size=2",
            "parallel.transformer_impl=transformer_engine",
            "grpo.loss_agg=sequence",
        ],
        {},
        ["parallel.context_parallel_size", "grpo.loss_agg"],
    ),
    (
        ["generation.num_engines=5", "grpo.num_prompts_per_step=8"],
        {},
        ["grpo.num_prompts_per_step", "generation.num_engines"],
    ),
    (["policy.mini_batch_size=48"], {}, ["policy.mini_batch_size", "grpo.num_prompts_per_step"]),
    (
        ["policy.mini_batch_size=2", "parallel.data_parallel_size=4"],
        {},
        ["policy.mini_batch_size", "parallel.data_parallel_size"],
    ),
    (["generation.max_new_tokens=8192"], {}, ["generation.max_new_tokens", "model.seq_length"]),
    (
        ["generation.num_engines=8", "grpo.num_prompts_per_step=8", "cluster.num_nodes=1"],
        {},
        ["parallel.data_parallel_size", "generation.num_engines", "cluster.gpus_per_node"],
    ),
]

BASE_1_5B = [  # a valid 8-GPU layout for the 1.5B shape, on local layers (no Transformer Engine needed)
    "model.tiny=null",
    "model.dtype=bfloat16",
    "model.seq_length=8192",
    "parallel.tensor_model_parallel_size=2",
    "parallel.data_parallel_size=2",
    "parallel.transformer_impl=local",
    "parallel.backend=nccl",
    "policy.micro_batch_max_tokens=8192",
    "policy.mini_batch_size=16",
    "policy.recompute=core_attention",
    "generation.num_engines=4",
    "generation.max_new_tokens=4096",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations=8",
    "cluster.gpus_per_node=8",
    "cluster.num_nodes=16",
]


def test_the_base_layout_passes(tmp_path):
    model = hf_dir(tmp_path, QWEN_1_5B)
    assert errors_of([*BASE_1_5B, f"model.hf_dir={model}"], gpu_memory_gib=141) == ""


@pytest.mark.parametrize(("overrides", "changes", "keys"), SHAPE_BREAKERS)
def test_each_rule_names_its_keys(tmp_path, overrides, changes, keys):
    model = hf_dir(tmp_path, {**QWEN_1_5B, **changes})
    err = errors_of([*BASE_1_5B, f"model.hf_dir={model}", *overrides], gpu_memory_gib=141)
    assert err, "the rule did not fire"
    for key in keys:
        assert key in err


def test_cli_reads_hf_config_and_prints_json(tmp_path, capsys):
    path = hf_dir(tmp_path, LLAMA_3_70B) / "config.json"
    args = ["plan", "--hf-config", str(path), "--json", *LLAMA_70B_ON_1024, "model.hf_dir=/nonexistent"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpus"] == 1024 and plan["errors"] == []
    assert len(plan["ranks"]) == 4 and all(r["total"] < 80 * GIB for r in plan["ranks"])
    assert (
        main([*args[:-1], "parallel.pipeline_model_parallel_size=3", "parallel.data_parallel_size=16"]) == 1
    )


@pytest.mark.parametrize("stage", ["8k", "16k", "24k"])
def test_recipe_stages_chain_and_fit_one_node_of_8_gpus(tmp_path, stage, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_1_5B))
    argv = ["plan", "--config", f"deepscaler/{stage}", "--hf-config", str(tmp_path / "config.json")]
    assert main([*argv, "--transformer-engine", "yes", "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "plan OK" in out and "8 ranks" in out
    # Colocated: every phase of a run fits one 80 GB GPU, and the plan says which one is the peak.
    phases = "start .*, resume .*, step0_sync .*, wake .*, sync .*, generation .*, train .*, save .*"
    line = " ".join(out.split())  # rich wraps the line at 120 columns
    said = re.search(
        rf"colocated, per GPU \(policy.offload all\): {phases}; peak (\S+)G in the (\w+) phase", line
    )
    assert said is not None, out
    # The engine starting beside the built trainer (vLLM claims gpu_memory_utilization of the GPU).
    assert (said.group(1), said.group(2)) == ({"8k": "56.4", "16k": "72.4", "24k": "72.4"}[stage], "start")
    cfg = load_config(f"deepscaler/{stage}")
    previous = {"8k": None, "16k": "runs/deepscaler-8k", "24k": "runs/deepscaler-16k"}[stage]
    assert cfg.model.init_from == previous
    assert (cfg.eval.num_samples, cfg.eval.temperature, cfg.eval.top_p) == (16, 0.6, 0.95)


@pytest.mark.parametrize(
    ("offload", "kept_at_sync", "kept_at_generation", "saved", "peak_phase"),
    # By hand, GiB: weights 1, grads 2, optimizer 3, activations + logits 10. Kept by the trainer in the
    # sync (and wake) phases: none all 6, optimizer weights + grads 3, all weights 1; in generation the
    # same, "all" borrowing its weights for the probe; saved from: weights + optimizer twice, + grads
    # unless they were parked.
    [
        ("none", 6, 6, 1 + 6 + 2, "generation"),
        ("optimizer", 3, 3, 1 + 6 + 2, "start"),
        ("all", 1, 1, 1 + 6, "start"),
    ],
)
def test_colocated_phases_by_hand(offload, kept_at_sync, kept_at_generation, saved, peak_phase):
    from megagrpo.plan import COLOCATED_PHASES, GIB, RankMemory, colocated_phases

    cfg = load_config("deepscaler/8k", [f"policy.offload={offload}"])
    assert cfg.generation.sync_bucket_mb == 512
    rank = RankMemory(0, 0, 1 * GIB, 2 * GIB, 3 * GIB, 3 * GIB, 9 * GIB, 1 * GIB)
    # The engine: a claim of 48, weights of 4, its largest tensor a quarter; 2 bucket slots of 0.5 in
    # every phase, 2 receive buffers of 0.5 and the reloaded layer (twice its largest tensor) during a
    # sync; 2 process contexts of 0.5.
    engine = {"claimed": 48 * GIB, "weights": 4 * GIB, "largest_tensor": GIB // 4}
    phases = colocated_phases(cfg, [rank], engine)
    want = {
        "start": 1 + 2 + 3 + 48 + 1,
        "resume": 1 + 2 + 3 + 3 + 1 + 1,
        "step0_sync": kept_at_sync + 4 + 1 + 0.5 + 1 + 1,
        "wake": kept_at_sync + 4 + 1 + 1,
        "sync": kept_at_sync + 4 + 1 + 0.5 + 1 + 1,
        "generation": kept_at_generation + 48 + 1 + 1,
        "train": 1 + 2 + 3 + 10 + 1 + 1,
        "save": saved + 1 + 1,
    }
    assert {phase: phases[phase] / GIB for phase in COLOCATED_PHASES} == want
    assert phases["peak_phase"] == peak_phase and phases["peak"] == max(want.values()) * GIB
