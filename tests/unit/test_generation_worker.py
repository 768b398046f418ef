"""What the vLLM engine actor sets up before vLLM starts (vLLM itself is not started here)."""

import pytest

from megagrpo.config import load_config
from megagrpo.generation.worker import vllm_env

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
