"""How Megatron lays one logical tensor out over tensor- and pipeline-parallel ranks.

Pure functions, shared by the converters, weight sync and the equivalence tests:

- Pipeline: each stage numbers its transformer layers from 0; the global index adds the stage's
  layer offset.
- Tensor: a TP-parallel parameter carries Megatron's ``partition_dim``; its full tensor is the
  concatenation of the rank shards along that dim, except for the gated MLP's ``linear_fc1``,
  whose rank shard is ``[gate_r; up_r]`` (each half split separately), so that the SwiGLU pairing
  stays local to a rank.
- Coverage: which rules of the HF map a stage holds (:func:`stage_rules`), and :func:`check_stage`,
  which the load, the export and the weight sync run before moving any weight.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import torch

from megagrpo.models.mapping import LEGACY_GROUPED_RE, Rule, canonical_name, hf_tensor_shapes, megatron_numel
from megagrpo.models.shape import GPTShape, padded_vocab_size

if TYPE_CHECKING:
    from megagrpo.parallel import ParallelContext

ADAPTER_MODULE = "lora"
"""The child module a LoRA adapter is of the linear layer it adapts (``megagrpo.models.lora``)."""
_ADAPTER_PARAMS = (f".{ADAPTER_MODULE}.weight_a", f".{ADAPTER_MODULE}.weight_b")


def is_adapter_param(name: str) -> bool:
    """A LoRA adapter's parameter (``<linear>.lora.weight_a`` / ``weight_b``), not a base one."""
    return name.endswith(_ADAPTER_PARAMS)


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

    Weight sync and the converters address a stage's parameters by these names. LoRA adapters are not
    the model's weights (``models.lora``): they are left out."""
    return stage_global_names(
        [name for name, _ in model.named_parameters() if not is_adapter_param(name)], ctx, num_layers
    )


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


# ---------------------------------------------------------------------------------------- coverage
# Whether the HF map covers a model stage exactly, checked before any weight moves (load, export,
# weight sync). A pipeline stage must hold one parameter for each rule of its layers (and the
# embedding on the first stage, the final norm and output layer on the last; a routed expert's rules on
# the expert-parallel rank that holds that expert), each with the element count of its tensor-parallel
# shard. A parameter without a rule would be left unfilled at load and skipped by export and weight
# sync; a rule without a parameter is an HF tensor that nothing reads. Either is an error naming the
# tensors, raised on the rank that finds it, before step 0.

_STAGE_LAYER = re.compile(r"\blayers\.(\d+)\.")
_STAGE_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_SHOWN = 8


class CoverageError(ValueError):
    """A parameter, HF tensor or engine parameter that a load, an export or a weight sync would miss."""


def listing(names: list[str], what: str) -> str:
    """``what``: the first few of ``names``, and how many in all."""
    shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    return f"{len(names)} {what}: {shown}"


def stage_rules(rules: list[Rule], shape: GPTShape, ctx: ParallelContext) -> dict[str, Rule]:
    """The rules (by canonical global Megatron name) whose parameter this rank's stage holds."""
    per_stage = shape.num_layers // ctx.sizes.pp
    first_layer = layer_offset(shape.num_layers, ctx.sizes.pp, ctx.pp_rank)
    per_rank = shape.num_experts // ctx.sizes.ep if shape.is_moe else 0
    first_expert = ctx.ep_rank * per_rank
    out = {}
    for rule in rules:
        name = rule.megatron
        layer = _STAGE_LAYER.search(name)
        if layer is not None:
            if not first_layer <= int(layer.group(1)) < first_layer + per_stage:
                continue
            expert = _STAGE_EXPERT.search(name)
            if expert is not None and not first_expert <= int(expert.group(1)) < first_expert + per_rank:
                continue
        elif name.startswith("embedding."):
            if not ctx.is_first_stage:
                continue
        elif name == "output_layer.weight":
            # Tied: the first stage's embedding is the output layer; a later last stage keeps a copy.
            if not ctx.is_last_stage or (shape.tie_word_embeddings and ctx.is_first_stage):
                continue
        elif not ctx.is_last_stage:  # the final norm
            continue
        out[name] = rule
    return out


def shard_numel(rule: Rule, hf_shapes: dict[str, tuple[int, ...]], split: int, padded_vocab: int) -> int:
    """Elements of one rank's shard of ``rule``'s parameter, split ``split`` ways along its TP dim."""
    full = megatron_numel(rule, hf_shapes, padded_vocab)
    return full // split if tp_partition_dim(rule.megatron) >= 0 else full


def check_stage(
    params: dict[str, int], names: dict[str, str], rules: list[Rule], shape: GPTShape, ctx: ParallelContext
) -> None:
    """Raise :class:`CoverageError` unless this stage's parameters and the map's rules for it match one to
    one, with the element counts of their shards.

    ``params``: {local parameter name: numel}, as ``named_parameters()`` gives them; ``names``: their
    canonical global names (``layout.stage_param_names``)."""
    expected = stage_rules(rules, shape, ctx)
    held = {names[local]: local for local in params}
    legacy = sorted(local for local in params if LEGACY_GROUPED_RE.search(local))
    if legacy:
        raise CoverageError(
            f"rank {ctx.rank}: Megatron's legacy GroupedMLP experts are not supported (the map knows "
            f"SequentialMLP's and Transformer Engine's grouped experts): {listing(legacy, 'parameters')}"
        )
    problems = []
    unmapped = sorted(held[g] for g in held if g not in expected)
    if unmapped:
        problems.append(listing(unmapped, "parameters the HF map has no rule for on this stage"))
    missing = sorted(set(expected) - set(held))
    if missing:
        unread = sorted(n for g in missing for n in expected[g].hf)
        problems.append(
            listing(missing, "rules of this stage with no parameter")
            + f" ({listing(unread, 'HF tensors nothing reads')})"
        )
    padded = padded_vocab_size(shape.vocab_size, ctx.sizes.tp)
    hf_shapes = hf_tensor_shapes(shape)
    wrong = []
    for global_name, local in sorted(held.items()):
        rule = expected.get(global_name)
        if rule is None:
            continue
        split = ctx.sizes.expert_tp if is_expert(global_name) else ctx.sizes.tp
        want = shard_numel(rule, hf_shapes, split, padded)
        if params[local] != want:
            wrong.append(f"{local} has {params[local]} elements, the map's shard {want}")
    if wrong:
        problems.append(listing(wrong, "parameters of the wrong size"))
    if problems:
        raise CoverageError(
            f"rank {ctx.rank} (pipeline stage {ctx.pp_rank}, expert-parallel rank {ctx.ep_rank}): the model "
            f"and the HF map disagree: {'; '.join(problems)}"
        )


def param_numels(model) -> dict[str, int]:
    """{name: numel} of a module's parameters, LoRA adapters left out (what :func:`check_stage` compares)."""
    return {name: math.prod(p.shape) for name, p in model.named_parameters() if not is_adapter_param(name)}
