"""LoRA adapters around Megatron's tensor-parallel linear layers (``policy.lora``).

An adapter adds ``scale * B @ A @ x`` to a frozen linear layer's output (``scale = alpha / rank``), with
``A`` [rank, in] and ``B`` [out, rank], ``B`` zero at the start so that the adapted model starts as the
base bit for bit. Megatron-Core 0.16 has no LoRA of its own; the adapter is a child module ``lora`` of the
linear layer it adapts (parameters ``<linear>.lora.weight_a`` / ``weight_b``), added to the base's output by
a forward hook, so that the base's parameter names, checkpoint keys and HF map stay as they are.

Sharding follows the base layer, so that no rank ever holds or computes a whole adapted weight:

- column-parallel base (``linear_qkv``, ``linear_fc1``; output rows split over TP): ``A`` is replicated,
  ``B`` holds this rank's output rows (the same rows as the base shard: ``[gate_r; up_r]`` for a gated
  ``linear_fc1``, query groups for ``linear_qkv``). The low-rank activation ``h = A x`` is the same on every
  rank; its gradient is the sum of every rank's part (an all-reduce over TP in the backward); under
  sequence parallelism ``h`` is gathered over the sequence instead, and ``A``'s gradient, then partial, is
  summed over TP by Megatron's ``finalize_model_grads`` (the ``sequence_parallel`` parameter attribute).
- row-parallel base (``linear_proj``, ``linear_fc2``; input columns split): ``A`` holds this rank's input
  columns, ``h`` is the all-reduce of the ranks' partial products (a reduce-scatter over the sequence under
  sequence parallelism, as the base's own output), ``B`` is replicated.

A mixture-of-experts model's routed experts (``experts.linear_fc1`` / ``experts.linear_fc2``: each expert of
the local spec's ``SequentialMLP`` is an MLP of its own) get one adapter per expert, held with its expert
on its expert-parallel rank and split over the expert tensor-parallel group as the expert's weight is.
There Megatron's token dispatcher does the tensor-parallel communication, not the layer (its input is
every token of the expert's, its output a partial sum that the dispatcher reduces), so the adapter moves
no activation: the expert's rank shards compose as the base's do, and only the gradient of the
replicated factor (``A`` of ``linear_fc1``, ``B`` of ``linear_fc2``), partial on each rank, is summed over
the expert tensor-parallel group in the backward. The adapters are expert parameters for Megatron's DDP
and optimizer at every EP size (``allreduce = False``, as the expert's weight under expert parallelism:
their gradients are averaged over the expert data-parallel group). Transformer Engine's grouped-GEMM
experts (``TEGroupedMLP``, one layer for every local expert) are refused by name; the shared expert is no
target.

``A`` is initialised from a generator seeded by the parameter's global name (a routed expert's by its global
index), whole, and each rank keeps its slice: every layout starts from the same adapters. Transformer
Engine's layers are adapted by the same code (their ``tp_group``), except its fused norm + linear, whose
input is the un-normalised residual: refused by name. This path has never run on a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megagrpo.models.layout import ADAPTER_MODULE, is_expert, is_gated_fc1

# The targets (``policy.lora.target_modules``): Megatron's linear layers that can carry an adapter, a routed
# expert's as ``experts.<layer>``, and how the base splits over TP.
TARGET_KINDS = {
    "linear_qkv": "column",
    "linear_fc1": "column",
    "linear_proj": "row",
    "linear_fc2": "row",
    "experts.linear_fc1": "column",
    "experts.linear_fc2": "row",
}


@dataclass(frozen=True)
class LoraSpec:
    """What :func:`attach` builds (from ``policy.lora``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = tuple(TARGET_KINDS)
    seed: int = 0
    """Seeds ``A``'s initialisation (with each adapter's global name)."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one tensor-parallel linear layer (``base``), sharded as the module doc says."""

    def __init__(self, base: torch.nn.Module, kind: str, spec: LoraSpec, *, global_name: str, gated: bool):
        super().__init__()
        from megatron.core.tensor_parallel.layers import (
            set_defaults_if_not_set_tensor_model_parallel_attributes,
            set_tensor_model_parallel_attributes,
        )

        self.kind, self.scale, self.dropout = kind, spec.scale, spec.dropout
        self.group = _tp_group(base)  # a routed expert's: the expert tensor-parallel group
        self.expert = is_expert(global_name)
        # An expert's layer never communicates (the dispatcher does), sequence parallel or not.
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.expert
        self.enabled = True
        tp, tp_rank = self.group.size(), self.group.rank()
        weight = base.weight
        out_local, in_local = weight.shape
        in_full = in_local * tp if kind == "row" else in_local
        full_a = _initial_a(spec, global_name, in_full)
        if kind == "row":
            full_a = full_a.chunk(tp, dim=1)[tp_rank]
        self.weight_a = torch.nn.Parameter(full_a.to(weight.device, weight.dtype).contiguous())
        self.weight_b = torch.nn.Parameter(
            torch.zeros(out_local, spec.rank, dtype=weight.dtype, device=weight.device)
        )
        self.gated = gated  # B's rows are [gate_r; up_r] on this rank, as the base's
        sharded, replicated = (
            (self.weight_b, self.weight_a) if kind == "column" else (self.weight_a, self.weight_b)
        )
        set_tensor_model_parallel_attributes(
            sharded, is_parallel=True, dim=0 if kind == "column" else 1, stride=1
        )
        set_defaults_if_not_set_tensor_model_parallel_attributes(replicated)
        if self.expert:
            # The grad norm counts a factor without ``tensor_model_parallel`` on the (dense) TP rank 0
            # only; an expert's replicated factor is a copy within its expert TP group alone: count it
            # on that group's rank 0 (every rank at expert TP 1, where the ranks hold other experts).
            replicated.tensor_model_parallel = tp_rank == 0
        if self.sequence_parallel:
            # Its gradient holds this rank's part of the sequence: Megatron sums it over TP.
            replicated.sequence_parallel = True
        # An expert's adapter is an expert parameter (DDP's expert buffers, reduced over the expert
        # data-parallel group; the expert optimizer) at every EP size, EP 1 included (where that group is
        # the data-parallel one at ETP = TP): the optimizer's chained parts, and so its checkpoint's
        # keys, are then the same at every EP size, and the checkpoint reshards across them.
        self.weight_a.allreduce = self.weight_b.allreduce = not self.expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, self.dropout)
        if self.expert:
            return self._expert_forward(x)
        h = x @ self.weight_a.t()  # [s, b, rank]; column: whole, row: this rank's partial sum
        if self.kind == "column":
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=self.group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.group)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.group)
        return (h @ self.weight_b.t()) * self.scale

    def _expert_forward(self, x: torch.Tensor) -> torch.Tensor:
        """A routed expert's shard: ``B_r A x`` (column) or ``B A_r x_r`` (row), whose sum over the expert
        tensor-parallel ranks the dispatcher takes, as the base's; the replicated factor's gradient summed
        over those ranks (each holds the part of its own shard)."""
        group = self.group if self.group.size() > 1 else None
        h = _GradSummedLinear.apply(x, self.weight_a, group if self.kind == "column" else None)
        return _GradSummedLinear.apply(h, self.weight_b, group if self.kind == "row" else None) * self.scale

    def delta(self) -> torch.Tensor:
        """``scale * B @ A`` of this rank's shard of the base weight, in fp32 (no communication)."""
        return (self.weight_b.detach().float() @ self.weight_a.detach().float()) * self.scale


class _GradSummedLinear(torch.autograd.Function):
    """``x @ weight.t()`` whose weight gradient is summed over ``group`` (None: no sum) in the backward."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if ctx.group is not None:
            torch.distributed.all_reduce(grad_w, group=ctx.group)
        return grad @ weight, grad_w, None


def _tp_group(base: torch.nn.Module):
    group = getattr(base, "tp_group", None) or getattr(base, "_tp_group", None)
    if group is None:
        raise ValueError(f"{type(base).__name__} has no tensor-parallel group: cannot carry a LoRA adapter")
    return group


def _initial_a(spec: LoraSpec, global_name: str, in_features: int) -> torch.Tensor:
    """The whole ``A`` [rank, in] of one adapter: Kaiming-uniform (as PEFT's default), from a generator
    seeded by ``spec.seed`` and the global name, so that every layout draws the same values."""
    digest = hashlib.sha256(f"{spec.seed}:{global_name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)): bound = 1 / sqrt(fan_in)
    return (torch.rand(spec.rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1).mul(bound).float()


def _add_adapter(module, args, kwargs, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


def attach(model: torch.nn.Module, spec: LoraSpec, global_names: dict[str, str]) -> list[str]:
    """Freeze ``model``'s parameters and give each targeted linear layer an adapter; returns the adapted
    layers' names. ``global_names``: {local parameter name: canonical global name} of the stage
    (``layout.stage_param_names``), which seeds each ``A``."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        target = target_of(name)
        if target not in spec.target_modules:
            continue
        if "Grouped" in type(module).__name__:
            raise ValueError(
                f"policy.lora.target_modules: {name} is Transformer Engine's grouped-GEMM experts "
                f"({type(module).__name__}), which adapters do not support; set parallel.transformer_impl "
                "torch or local (SequentialMLP experts)"
            )
        if "LayerNorm" in type(module).__name__:
            raise ValueError(
                f"policy.lora: {name} is Transformer Engine's fused norm + linear ({type(module).__name__}), "
                "whose input is not normalised yet; set parallel.transformer_impl torch or local"
            )
        global_name = global_names[f"{name}.weight"]
        adapter = LoraAdapter(
            module, TARGET_KINDS[target], spec, global_name=global_name, gated=is_gated_fc1(global_name)
        )
        module.add_module(ADAPTER_MODULE, adapter)
        module.register_forward_hook(_add_adapter, with_kwargs=True)
        adapted.append(name)
    return adapted


def target_of(name: str) -> str | None:
    """The target (a key of ``TARGET_KINDS``) that names module ``name``: its leaf, ``experts.<leaf>`` for
    a routed expert's (``SequentialMLP``'s ``experts.local_experts.<i>.<leaf>``, or Transformer Engine's
    grouped ``experts.<leaf>``); None for the shared expert's layers and every other module."""
    parent, _, leaf = name.rpartition(".")
    if leaf not in TARGET_KINDS or ".shared_experts" in f".{parent}":
        return None
    if re.search(r"(^|\.)experts(\.local_experts\.\d+)?$", parent):
        return f"experts.{leaf}"
    return leaf


def adapters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, LoraAdapter]]:
    """(linear layer name, linear layer, its adapter) of every adapted layer of ``model``."""
    for name, module in model.named_modules():
        adapter = getattr(module, ADAPTER_MODULE, None)
        if isinstance(adapter, LoraAdapter):
            yield name, module, adapter


def has_adapters(model: torch.nn.Module) -> bool:
    return next(adapters(model), None) is not None


@contextlib.contextmanager
def disabled(model: torch.nn.Module):
    """Inside it, the model is its base: every adapter is skipped (the reference policy for KL)."""
    held = [a for _, _, a in adapters(model)]
    states = [a.enabled for a in held]
    for a in held:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(held, states, strict=True):
            a.enabled = state


@contextlib.contextmanager
def merged(model: torch.nn.Module):
    """Inside it, each adapted base weight holds ``W + scale * B @ A`` (rounded once, to its dtype) and the
    adapters are skipped: what the weight sync sends and a merged export writes. On exit the base weights
    get their exact bytes back (a copy in host memory, not a subtraction) and the adapters their state."""
    saved = []
    with torch.no_grad(), disabled(model):
        try:
            for _, module, adapter in adapters(model):
                weight = module.weight
                saved.append((weight, weight.detach().to("cpu", copy=True)))
                weight.copy_((weight.float() + adapter.delta()).to(weight.dtype))
            yield
        finally:
            for weight, original in saved:
                weight.copy_(original)


def adapter_state_dict(model: torch.nn.Module, global_names: dict[str, str], ctx) -> dict:
    """The adapters as Megatron ``ShardedTensor``s (a distributed checkpoint's state dict, reloadable at any
    TP/PP/DP/EP): keys ``<global linear name>.lora.weight_a|b`` (a routed expert's by its global index),
    TP-split as the module doc says (a gated ``linear_fc1``'s ``B`` as its gate and up halves, as Megatron
    stores the base weight); an expert's split over the expert tensor-parallel group and replicated over
    the expert data-parallel one."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = {}
    for name, _, adapter in adapters(model):
        linear = global_names[f"{name}.weight"].removesuffix(".weight")
        axis = {"weight_b": 0} if adapter.kind == "column" else {"weight_a": 1}
        tensors = {"weight_a": adapter.weight_a, "weight_b": adapter.weight_b}
        tp, dp = (ctx.pgs.expt_tp, ctx.pgs.expt_dp) if adapter.expert else (ctx.pgs.tp, ctx.pgs.dp_cp)
        sharded = make_sharded_tensors_for_checkpoint(
            tensors, f"{linear}.{ADAPTER_MODULE}.", axis, tp_group=tp, dp_cp_group=dp
        )
        b_key = f"{linear}.{ADAPTER_MODULE}.weight_b"
        if adapter.gated:  # at every TP size, as Megatron stores linear_fc1: reloadable at any other
            sharded[b_key] = apply_swiglu_sharded_factory(sharded[b_key], ())
        out.update(sharded)
    return out


def adapter_tensors(model: torch.nn.Module, global_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """{``<global linear name>.lora.weight_a|b``: this rank's tensor} (one rank holding every adapter whole,
    TP 1, is what an export reads)."""
    out = {}
    for name, _, adapter in adapters(model):
        linear = global_names[f"{name}.weight"].removesuffix(".weight")
        out[f"{linear}.{ADAPTER_MODULE}.weight_a"] = adapter.weight_a.detach()
        out[f"{linear}.{ADAPTER_MODULE}.weight_b"] = adapter.weight_b.detach()
    return out


def base_state_keys(model: torch.nn.Module) -> set[str] | None:
    """The model's state dict names without its adapters' (what a base checkpoint loads); None when the
    model has no adapters (load everything)."""
    if not has_adapters(model):
        return None
    return {key for key in model.state_dict() if f".{ADAPTER_MODULE}." not in key}


def adapter_params_per_rank(
    shape, targets: tuple[str, ...], rank: int, tp: int, *, ep: int = 1, etp: int | None = None
) -> int:
    """Adapter elements one rank holds per transformer layer (``megagrpo plan``): a column-parallel
    target's ``A`` whole and ``1/tp`` of ``B``, a row-parallel one's ``1/tp`` of ``A`` and ``B`` whole; a
    routed expert's target once for each of the rank's ``num_experts / ep`` experts, split ``etp`` ways
    (None: ``tp``)."""
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    f = shape.moe_ffn_hidden_size or shape.ffn_hidden_size
    dims = {  # (in, out) of each layer
        "linear_qkv": (h, q + 2 * kv),
        "linear_proj": (q, h),
        "linear_fc1": (h, 2 * shape.ffn_hidden_size),
        "linear_fc2": (shape.ffn_hidden_size, h),
        "experts.linear_fc1": (h, 2 * f),
        "experts.linear_fc2": (f, h),
    }
    total = 0
    for target in targets:
        fan_in, fan_out = dims[target]
        split, copies = (etp or tp, shape.num_experts // ep) if target.startswith("experts.") else (tp, 1)
        if TARGET_KINDS[target] == "column":
            total += copies * (rank * fan_in + fan_out // split * rank)
        else:
            total += copies * (rank * fan_in // split + fan_out * rank)
    return total
