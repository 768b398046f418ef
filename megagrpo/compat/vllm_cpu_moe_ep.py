"""vLLM's CPU mixture-of-experts kernel given local expert ids under vLLM's expert parallelism.

Verified with vllm 0.32.0 (CPU build). With ``enable_expert_parallel`` an engine rank holds ``E / EP``
experts (``w13_weight`` / ``w2_weight`` stacked ``[E / EP, ...]``) and its MoE layer passes the router's
global top-k ids with an ``expert_map`` (global id -> local index, -1 for another rank's expert) to the
experts' ``apply``. ``CPUUnquantizedExperts.apply`` ignores the map and hands the global ids to
``cpu_fused_moe``, which then indexes past the rank's stacked experts: a segmentation fault in
``csrc/cpu/cpu_fused_moe.cpp`` at the first forward of real tokens (measured: TP 2 with expert
parallelism, a tiny Qwen3-MoE).

:func:`install` (run in each engine worker, through ``collective_rpc``) wraps ``apply``: with a map,
the ids become local indices and a top-k slot routed to another rank's expert gets weight 0 (its id
set to local expert 0, which it then adds nothing to). Each rank's output is then its own experts'
share, which vLLM's MoE layer sums over the expert-parallel group as it does on GPU. Without a map
(no expert parallelism) ``apply`` runs as before. With the fix an EP 2 engine decodes transformers'
greedy tokens (``tests/e2e/test_vllm_moe.py``).

:func:`local_experts` reports each MoE layer's experts on this rank, so that the engine can check
vLLM placed them as the weight sync assumes (contiguous ranges, ``expert_placement_strategy``
linear).

GPU: not affected (only ``CPUUnquantizedExperts`` is wrapped); vLLM's GPU kernels take the map
themselves.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["install", "local_experts"]


def install(worker=None) -> bool:
    """Wrap ``CPUUnquantizedExperts.apply`` in this process (once); False where this vLLM has none.
    ``worker``: the vLLM worker when called through ``collective_rpc`` (unused)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return False
    original = CPUUnquantizedExperts.apply
    if getattr(original, "_megagrpo_local_ids", False):
        return True
    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        expert_map = bound.arguments["expert_map"]
        if expert_map is not None:
            ids = bound.arguments["topk_ids"]
            local = expert_map[ids.long()]
            weights = bound.arguments["topk_weights"]
            bound.arguments["topk_weights"] = weights * (local >= 0).to(weights.dtype)
            bound.arguments["topk_ids"] = local.clamp_min(0).to(ids.dtype)
        return original(*bound.args, **bound.kwargs)

    apply._megagrpo_local_ids = True
    CPUUnquantizedExperts.apply = apply
    return True


def local_experts(worker) -> list[list[int]]:
    """Per MoE layer of the worker's model, the global ids of the experts this rank holds, in local
    order (every expert where the layer has no ``expert_map``)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    out = []
    for module in worker.model_runner.model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        expert_map = module.expert_map
        if expert_map is None:
            out.append(list(range(module.global_num_experts)))
            continue
        real = expert_map.tolist()[: module.global_num_experts]
        pairs = sorted((int(local), g) for g, local in enumerate(real) if local >= 0)
        out.append([g for _, g in pairs])
    return out
