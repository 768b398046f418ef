"""vLLM's CPU mixture-of-experts layers re-processed after an in-place weight reload.

Verified with vllm 0.32.0 (CPU build). After loading, vLLM processes an MoE layer's expert weights once
(``UnquantizedFusedMoEMethod.process_weights_after_loading`` -> ``_setup_kernel``): on the CPU its
experts (``CPUUnquantizedExperts.process_weights_after_loading``) zero-pad each expert's intermediate
dim to a multiple of 32 and prepack ``w13_weight`` / ``w2_weight`` into the grouped GEMM's layout. A
layerwise reload (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``: how weight sync
loads new weights) restores the logical, unpacked shapes, loads, and runs the same processing again;
but ``_setup_kernel`` takes a second call, the kernel being set (``moe_kernel is not None``), for a
weight update and skips the experts' own step. The new weights then stay unpacked: silently wrong
outputs when nothing needed padding (the intermediate size per engine rank a multiple of 32, as
Qwen3-30B-A3B's 768), a size error when it did (``The size of tensor a (64) must match ... (32)``).

:func:`forget_cpu_moe_kernels`, before the reload starts, sets the kernel of each such layer back to
None, so that the reload takes the first load's path: pad, prepack, a new kernel from the processed
weights, which the reload then copies into the parameters' original storage as usual. A layer the
reload does not process (no weights of it arrived, so vLLM puts its old tensors back) would be left
without a kernel: :func:`restore_moe_kernels`, after the reload, gives those their old kernel back,
which matches the old tensors they keep. Nothing else is changed, so nothing else is restored.

GPU: not affected, and left alone (only layers whose experts are ``CPUUnquantizedExperts`` are
touched). Read, not run (no GPU here): on CUDA the unquantized backends are Triton (the default on
Hopper), FlashInfer CUTLASS and FlashInfer TRT-LLM (``oracle/unquantized.py``). Their weight
conversion (``convert_to_unquantized_kernel_format``: contiguous, the [w3; w1] swap, TRT-LLM's
padding and block layout) runs on every call of ``_setup_kernel``, weight update or not, and its
result is copied into the existing storage; their experts' ``process_weights_after_loading`` is
empty (Triton, TRT-LLM BF16) or touches NVFP4 scales only (FlashInfer CUTLASS). So the step a weight
update skips does nothing for them, and their kernels keep reading the same storage. ROCm's AITER
shuffles in the conversion too; MoonEP refuses in-place reloads outright.
"""

from __future__ import annotations

__all__ = ["forget_cpu_moe_kernels", "restore_moe_kernels"]


def _cpu_moe_methods(model):
    """The unquantized MoE methods of ``model`` whose experts run vLLM's CPU kernel (none where this
    vLLM has no such classes)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:
        return
    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        method = getattr(module.routed_experts, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and isinstance(experts, CPUUnquantizedExperts):
            yield method


def forget_cpu_moe_kernels(model) -> list[tuple[object, object]]:
    """Before a layerwise reload: drop the kernel of every MoE layer on vLLM's CPU experts, so the
    reload processes its new weights as a first load. Returns (method, kernel) per layer, for
    :func:`restore_moe_kernels`; [] for a dense model or on GPU."""
    dropped = []
    for method in _cpu_moe_methods(model):
        dropped.append((method, method.moe_kernel))
        method.moe_kernel = None
    return dropped


def restore_moe_kernels(dropped: list[tuple[object, object]]) -> int:
    """After the reload: the old kernel back on each layer the reload did not process (still None);
    returns how many."""
    restored = 0
    for method, kernel in dropped:
        if method.moe_kernel is None:
            method.moe_kernel = kernel
            restored += 1
    return restored
