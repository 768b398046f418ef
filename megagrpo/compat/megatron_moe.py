"""Megatron-Core's mixture-of-experts layers without Transformer Engine and on CPU.

Verified with megatron-core 0.16.1; both patches leave GPU runs with Transformer Engine untouched.

- **The router's gating GEMM.** ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not
  None``, a module global bound only when Transformer Engine imports: without it the first router forward
  raises NameError. Bound to None here, the router takes Megatron's own torch matmul path. Nothing to
  restore: where TE imported, the global exists and is left alone; elsewhere None is what every reader
  of it takes to mean "no TE".
- **The all-to-all dispatcher's split sizes on CPU** (expert parallelism over gloo).
  ``MoEAlltoAllTokenDispatcher`` turns its per-rank split sizes into numpy arrays with
  ``maybe_move_tensor_to_cpu(t, as_numpy=True)``, which converts only CUDA tensors: on CPU they stay
  tensors, and ``torch.distributed.all_to_all_single`` rejects tensors as split sizes (TypeError:
  incompatible function arguments). The dispatcher's name for the function is wrapped so that a CPU
  tensor asked for as numpy becomes one; CUDA tensors go to Megatron's function as before.
"""

from __future__ import annotations

__all__ = ["install"]


def install() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "megagrpo_cpu_numpy", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and tensor is not None and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.megagrpo_cpu_numpy = True
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
