"""What the vLLM engine actor sets up before vLLM starts (vLLM itself is not started here)."""

import pytest

from megagrpo.config import load_config
from megagrpo.generation.worker import engine_cpu_threads, vllm_env

pytestmark = pytest.mark.unit


def test_cpu_kvcache_space_is_set_only_when_configured():
    assert vllm_env(load_config(None))["VLLM_CPU_KVCACHE_SPACE"] == "1"
    env = vllm_env(load_config(None, ["generation.cpu_kvcache_space_gib=null"]))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # vLLM's own default, not the string "None"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


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
