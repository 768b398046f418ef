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
- **Uneven gathers over TP on gloo** (experts split over TP and EP together). With TP > 1 the dispatcher
  gathers each TP rank's share of the tokens it received, whose counts differ, with
  ``mappings._gather_along_first_dim(..., output_split_sizes)`` (``all_gather`` into a list of unequal
  tensors) and scatters their gradients back with ``_reduce_scatter_along_first_dim(...,
  input_split_sizes)`` (``reduce_scatter`` of unequal tensors). Gloo refuses both ("invalid tensor size").
  On a gloo group those two cases are done here with even collectives: the gather pads every share to the
  largest and trims, the reduce-scatter all-reduces the whole and keeps the rank's rows. Even splits and
  NCCL groups go to Megatron's functions.
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
    _even_collectives_on_gloo()


def _even_collectives_on_gloo() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def on_gloo(group) -> bool:
        return group is not None and group.size() > 1 and dist.get_backend(group) == "gloo"

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or not on_gloo(group):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        shares = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(shares, padded, group=group)
        return torch.cat([share[:n] for share, n in zip(shares, output_split_sizes, strict=True)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or not on_gloo(group):
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.split(list(input_split_sizes))[group.rank()].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
