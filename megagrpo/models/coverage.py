"""Whether the HF map covers a model stage exactly: checked before any weight moves.

A pipeline stage must hold one parameter for each rule of its layers (and the embedding on the first
stage, the final norm and output layer on the last; a routed expert's rules on the expert-parallel
rank that holds that expert), each with the element count of its tensor-parallel shard. A parameter
without a rule would be left unfilled at load and skipped by export and weight sync; a rule without a
parameter is an HF tensor that nothing reads. Either is an error naming the tensors
(:class:`CoverageError`), raised on the rank that finds it, before step 0.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from megagrpo.models.layout import is_expert, layer_offset, tp_partition_dim
from megagrpo.models.mapping import LEGACY_GROUPED_RE, Rule, hf_tensor_shapes, megatron_numel
from megagrpo.models.shape import GPTShape, padded_vocab_size

if TYPE_CHECKING:
    from megagrpo.parallel import ParallelContext

_LAYER = re.compile(r"\blayers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
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
        layer = _LAYER.search(name)
        if layer is not None:
            if not first_layer <= int(layer.group(1)) < first_layer + per_stage:
                continue
            expert = _EXPERT.search(name)
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
    """{name: numel} of a module's parameters (what :func:`check_stage` compares)."""
    return {name: math.prod(p.shape) for name, p in model.named_parameters()}
