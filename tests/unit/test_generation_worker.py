"""What the vLLM engine actor sets up before vLLM starts (vLLM itself is not started here)."""

import pytest

from megagrpo.config import load_config
from megagrpo.generation.vllm import engine_cpu_threads, scheduler_args, vllm_env

pytestmark = pytest.mark.unit


def test_cpu_kvcache_space_is_set_only_when_configured():
    assert vllm_env(load_config(None))["VLLM_CPU_KVCACHE_SPACE"] == "1"
    env = vllm_env(load_config(None, ["generation.cpu_kvcache_space_gib=null"]))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # vLLM's own default, not the string "None"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_torch_compile_is_off_only_for_eager_cpu_engines():
    assert vllm_env(load_config(None))["TORCH_COMPILE_DISABLE"] == "1"  # the demo: CPU, eager
    assert "TORCH_COMPILE_DISABLE" not in vllm_env(load_config(None, ["generation.enforce_eager=false"]))
    assert "TORCH_COMPILE_DISABLE" not in vllm_env(load_config(None, ["cluster.gpus_per_node=4"]))


def test_threads_are_left_unbound_only_for_multi_worker_engines():
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(load_config(None))
    env = vllm_env(load_config(None, ["generation.engine_tensor_parallel_size=2"]))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.parametrize(
    ("overrides", "cores", "want"),
    [
        ([], 2, 2),  # the sequential loop on one node: the engine takes the node's cores in turn
        (["generation.num_engines=2"], 4, 2),  # shared among the node's engines
        (["generation.num_engines=4"], 2, 1),  # at least one
        (["grpo.max_staleness=1"], 2, 1),  # generating while the trainer trains: its reserved CPUs
        (["cluster.num_nodes=2"], 8, 1),  # engines on several nodes: its reserved CPUs
        (["cluster.cpu_threads=3"], 2, 3),  # as configured
        (["generation.engine_tensor_parallel_size=2"], 2, None),  # vLLM's own worker processes
        (["cluster.gpus_per_node=4"], 2, None),  # GPUs: left as they are
    ],
)
def test_engine_cpu_threads(overrides, cores, want):
    cfg = load_config(None, ["generation.num_engines=1", *overrides])
    assert engine_cpu_threads(cfg, cores) == want


@pytest.mark.parametrize(
    ("overrides", "seqs", "budget"),
    [
        ([], 512, 4096),  # the demo's 64 x 8 rollouts decode in one wave, not two of vLLM's 256
        (["generation.num_engines=2"], 256, 4096),  # 256 per engine: vLLM's CPU default stays
        (
            [
                "generation.engine_tensor_parallel_size=2",
                "grpo.num_prompts_per_step=16",
                "policy.mini_batch_size=128",
            ],
            512,
            4096,
        ),
        (["grpo.num_prompts_per_step=1024"], 8192, 8192),  # the token budget holds a decode step
        (
            ["generation.num_engines=3", "grpo.num_prompts_per_step=100", "policy.mini_batch_size=100"],
            267,
            4096,
        ),  # 800 / 3, rounded up
        (["generation.max_num_seqs=64"], 64, 4096),  # as configured
        (
            [
                "model.seq_length=8192",
                "model.tiny.max_position_embeddings=8192",
                "policy.micro_batch_max_tokens=8192",
                "generation.max_num_seqs=64",
            ],
            64,
            8192,
        ),  # one whole prompt fits
    ],
)
def test_cpu_scheduler_holds_one_step_per_engine(overrides, seqs, budget):
    args = scheduler_args(load_config(None, ["grpo.num_generations=8", *overrides]))
    assert args == {"enable_chunked_prefill": False, "max_num_seqs": seqs, "max_num_batched_tokens": budget}
