"""A vLLM engine whose KV cache holds a few blocks only, so that concurrent requests outgrow it: vLLM then
preempts a request and later computes it again from its first token, and the routed experts of its
completion must be those of that last computation.

A Ray actor with the engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
``VLLMEngine`` runs it), capturing through ``megagrpo.generation.routing.HookedRouting``; vLLM's
preemption counter (``vllm:num_preemptions``) says whether a preemption happened.
"""

from __future__ import annotations

import os
import sys

import ray.cloudpickle

# Ray's workers cannot import this test module by name: ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PreemptingEngine:
    def __init__(self, model_dir: str, num_experts: int, kv_blocks: int):
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TORCH_COMPILE_DISABLE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        for name, value in env.items():
            os.environ.setdefault(name, value)
        from vllm import LLM

        from megagrpo.generation.routing import HookedRouting

        self.routing = HookedRouting(num_experts)
        self.llm = LLM(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=128,
            seed=0,
            block_size=32,  # vLLM's CPU attention wants multiples of 32
            num_gpu_blocks_override=kv_blocks,
            disable_log_stats=False,  # the preemption counter
            **self.routing.engine_args(),
        )
        self.routing.install(self.llm)

    def generate(self, prompts: list[list[int]], max_tokens: int):
        """(sampled tokens per prompt, their routed experts, preemptions vLLM counted)."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True, detokenize=False
        )
        self.routing.start(self.llm)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        routed = [per[0] for per in self.routing.collect(self.llm, outputs)]
        preemptions = sum(m.value for m in self.llm.get_metrics() if m.name == "vllm:num_preemptions")
        return [list(o.outputs[0].token_ids) for o in outputs], routed, preemptions
