"""How Megatron lays one logical tensor out over tensor- and pipeline-parallel ranks.

Pure functions, shared by the converters, weight sync and the equivalence tests:

- Pipeline: each stage numbers its transformer layers from 0; the global index adds the stage's
  layer offset.
- Tensor: a TP-parallel parameter carries Megatron's ``partition_dim``; its full tensor is the
  concatenation of the rank shards along that dim, except for the gated MLP's ``linear_fc1``,
  whose rank shard is ``[gate_r; up_r]`` (each half split separately), so that the SwiGLU pairing
  stays local to a rank.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from megagrpo.models.mapping import canonical_name

if TYPE_CHECKING:
    from megagrpo.parallel import ParallelContext

_LAYER_RE = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")


def layer_offset(num_layers: int, pp_size: int, pp_rank: int) -> int:
    """Global index of a stage's first layer (layers split evenly across stages)."""
    if num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline parallel size {pp_size}")
    return pp_rank * (num_layers // pp_size)


def shift_layer_index(name: str, delta: int) -> str:
    """``decoder.layers.3.x`` -> ``decoder.layers.{3 + delta}.x``; names without a layer index unchanged."""
    match = _LAYER_RE.match(name)
    if match is None:
        return name
    return f"{match.group(1)}{int(match.group(2)) + delta}{match.group(3)}"


def stage_param_names(model: torch.nn.Module, ctx: ParallelContext, num_layers: int) -> dict[str, str]:
    """This stage's parameter names -> canonical global names: the layer index offset by the stage's,
    a routed expert's local index on this expert-parallel rank turned into its global one.

    Weight sync and the converters address a stage's parameters by these names."""
    return stage_global_names([name for name, _ in model.named_parameters()], ctx, num_layers)


def stage_global_names(local_names: list[str], ctx: ParallelContext, num_layers: int) -> dict[str, str]:
    """:func:`stage_param_names` of a stage whose parameters are named ``local_names`` (as any of
    Megatron's layer specs name them, ``mapping.canonical_name``)."""
    offset = layer_offset(num_layers, ctx.sizes.pp, ctx.pp_rank)
    names = [canonical_name(name) for name in local_names]
    local_experts = 1 + max((int(m.group(2)) for m in map(_EXPERT_RE.match, names) if m), default=-1)
    return {
        name: expert_global_name(
            shift_layer_index(canonical, offset), ep_rank=ctx.ep_rank, num_local_experts=local_experts
        )
        for name, canonical in zip(local_names, names, strict=True)
    }


_GATED_FC1_RE = re.compile(
    r"\bmlp\.(?:shared_experts\.|experts\.local_experts\.\d+\.)?linear_fc1\.(?:weight|bias)$"
)
_EXPERT_RE = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


def is_gated_fc1(name: str) -> bool:
    """A SwiGLU ``linear_fc1`` ([gate; up] rows): the dense MLP's, a routed or the shared expert's."""
    return _GATED_FC1_RE.search(name) is not None


def is_expert(name: str) -> bool:
    """A routed expert's parameter (split over expert-parallel ranks, not replicated over them)."""
    return _EXPERT_RE.match(name) is not None


def expert_global_name(name: str, *, ep_rank: int, num_local_experts: int) -> str:
    """``...experts.local_experts.i...`` of an expert-parallel rank -> the expert's global index
    (``ep_rank * num_local_experts + i``, as Megatron assigns them); other names unchanged."""
    match = _EXPERT_RE.match(name)
    if match is None or ep_rank == 0:
        return name
    return f"{match.group(1)}{ep_rank * num_local_experts + int(match.group(2))}{match.group(3)}"


def tensor_split(ctx: ParallelContext, global_name: str) -> tuple[int, int]:
    """(this rank's index, number of slices) of the tensor-parallel split of parameter ``global_name``:
    a routed expert's is the expert tensor-parallel one, every other parameter's the tensor-parallel one."""
    if is_expert(global_name):
        return ctx.etp_rank, ctx.sizes.expert_tp
    return ctx.tp_rank, ctx.sizes.tp


def tp_shard(full: torch.Tensor, *, partition_dim: int, tp_rank: int, tp_size: int, gated: bool = False):
    """This rank's slice of ``full`` (a view; ``partition_dim`` -1 means replicated)."""
    if partition_dim < 0 or tp_size == 1:
        return full
    if gated:
        gate, up = full.chunk(2, dim=partition_dim)
        return torch.cat(
            [gate.chunk(tp_size, dim=partition_dim)[tp_rank], up.chunk(tp_size, dim=partition_dim)[tp_rank]],
            dim=partition_dim,
        )
    if full.shape[partition_dim] % tp_size:
        raise ValueError(
            f"dim {partition_dim} of a tensor of shape {tuple(full.shape)} is not divisible by TP={tp_size}"
        )
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def tp_merge(shards: list[torch.Tensor], *, partition_dim: int, gated: bool = False) -> torch.Tensor:
    """Inverse of :func:`tp_shard` given every rank's shard in rank order."""
    if partition_dim < 0 or len(shards) == 1:
        return shards[0]
    if gated:
        halves = [s.chunk(2, dim=partition_dim) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=partition_dim)
        up = torch.cat([h[1] for h in halves], dim=partition_dim)
        return torch.cat([gate, up], dim=partition_dim)
    return torch.cat(shards, dim=partition_dim)


# Column-parallel layers split their output rows (dim 0), row-parallel ones their input columns
# (dim 1); everything else (norms, the row-parallel biases we do not use) is replicated. Megatron
# also tags parameters with ``partition_dim``, but only when it initialises them itself.
_COLUMN_PARALLEL = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "linear_fc1.bias",
    "word_embeddings.weight",
    "output_layer.weight",
)
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def tp_partition_dim(name: str) -> int:
    """The dim a Megatron parameter is split along under TP, or -1 when every rank holds all of it."""
    if name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return -1
