"""HF tensors <-> a Megatron model stage, over the declarative map.

- ``load_hf_into_stage``: fill a rank's stage from an HF checkpoint (the policy's initial weights,
  and the import converter, which may leave parameters to be copied file to file instead);
- ``hf_tensors_from_full``: HF (name, tensor) pairs from full Megatron tensors, streamed (export).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.files import Piece
from megagrpo.ckpt.hf_files import HFCheckpoint
from megagrpo.ckpt.megatron import Mapped
from megagrpo.models.layout import (
    CoverageError,
    check_stage,
    is_expert,
    is_gated_fc1,
    listing,
    param_numels,
    stage_param_names,
    tensor_split,
    tp_partition_dim,
    tp_shard,
)
from megagrpo.models.mapping import Rule, shard_rows, to_hf, to_megatron
from megagrpo.models.shape import GPTShape, padded_vocab_size
from megagrpo.parallel import ParallelContext


def load_hf_into_stage(
    model: torch.nn.Module,
    ctx: ParallelContext,
    hf: HFCheckpoint,
    shape: GPTShape,
    rules: list[Rule],
    *,
    mapped: dict[str, Mapped] | None = None,
    pieces: dict[str, list[Piece]] | None = None,
    written_only: bool = False,
) -> None:
    """Fill every parameter of this rank's model stage from the HF checkpoint (TP slice of each; a routed
    expert's expert-TP slice).

    Where a shard is whole rows of its HF tensors (everything but row-parallel weights at TP > 1)
    and the parameter is a CPU tensor of the file's dtype, the rows are read from the file straight
    into the parameter: no HF tensor is materialized and nothing is read that another rank owns.
    Otherwise the HF tensors are read whole and transformed.

    ``mapped`` (conversion, where the stage is written once and discarded): a shard that is one
    contiguous row range of a file tensor, or two for gate/up, is not read at all. Views of the
    file's bytes (``HFCheckpoint.map_rows``) are stored there by the stage's parameter name (as
    Megatron's checkpoint keys spell it) and the parameter is left unfilled; ``save_megatron``
    writes them in its place, so the checkpoint writer reads those bytes once, from the page cache.

    ``pieces`` (with ``mapped``, where the checkpoint writer copies from files: ``FileCopies``): a
    shard made of several row ranges (Q/K/V, interleaved per query group) is not read either; where
    its bytes lie in the files, in order, is stored by parameter name, and the parameter is left
    unfilled. Padded vocabularies are still read into the parameter.

    ``written_only`` (conversion, where replicas are written by one rank each): only the parameters
    this rank writes are filled: dense ones on data-parallel rank 0, routed experts on expert
    data-parallel rank 0 (under expert parallelism the data-parallel ranks hold other experts).
    """
    by_name = {rule.megatron: rule for rule in rules}
    padded = padded_vocab_size(shape.vocab_size, ctx.sizes.tp)
    params = dict(model.named_parameters())
    names = stage_param_names(model, ctx, shape.num_layers)
    # Every parameter filled and every HF tensor of this stage read, before anything is read.
    check_stage(param_numels(model), names, rules, shape, ctx)
    for local, global_name in names.items():
        rule = by_name[global_name]
        if written_only and (ctx.expert_dp_rank if is_expert(global_name) else ctx.dp_rank) > 0:
            continue
        param, dim = params[local], tp_partition_dim(global_name)
        tp_rank, tp_size = tensor_split(ctx, global_name)
        rows = {n: hf.tensors[n].shape[0] for n in rule.hf}
        plan = shard_rows(rule, rows, shape, padded, partition_dim=dim, tp_rank=tp_rank, tp_size=tp_size)
        direct = (
            plan is not None
            and param.device.type == "cpu"
            and param.is_contiguous()
            and all(hf.tensors[n].dtype == param.dtype for n in rule.hf)
        )
        if not direct:
            _load_transformed(param, rule, hf, shape, padded, ctx, dim, global_name)
            continue
        row_shape = {tuple(hf.tensors[n].shape[1:]) for n in rule.hf}
        if row_shape != {tuple(param.shape[1:])} or plan.rows != param.shape[0]:
            raise CheckpointError(
                f"{global_name}: HF tensors {list(rule.hf)} give a shard of shape "
                f"{[plan.rows, *next(iter(row_shape))]}, the Megatron parameter has {list(param.shape)}"
            )
        if pieces is not None and rule.transform == "qkv" and _tiles_rows(plan.reads, plan.rows):
            pieces[local] = [hf.row_piece(read.hf, read.start, read.stop) for read in plan.reads]
            continue
        if mapped is not None and rule.transform in ("copy", "vocab", "gated"):
            views = [hf.map_rows(read.hf, read.start, read.stop) for read in plan.reads]
            if rule.transform == "gated":
                mapped[local] = (views[0], views[1])
                continue
            if len(views) == 1 and views[0].shape[0] == plan.rows:  # not a padded vocabulary
                mapped[local] = views[0]
                continue
        _read_rows(hf, plan, param.detach())


def _read_rows(hf: HFCheckpoint, plan, target: torch.Tensor) -> None:
    """Fill ``target`` (a shard) from the file, row range by row range, as ``plan`` places them."""
    covered = 0
    for read in plan.reads:
        rows = read.stop - read.start
        hf.read_rows_into(read.hf, read.start, read.stop, target[read.dest : read.dest + rows])
        covered += rows
    if covered < plan.rows:  # vocabulary padding: the reads cover the leading rows
        target[covered:].zero_()


def _tiles_rows(reads, rows: int) -> bool:
    """Whether ``reads``, in order, land on rows 0, 1, ... ``rows`` - 1 of the shard, each once."""
    end = 0
    for read in reads:
        if read.dest != end:
            return False
        end += read.stop - read.start
    return end == rows


def _load_transformed(param, rule, hf, shape, padded, ctx, dim: int, global_name: str) -> None:
    """The general path: whole HF tensors, transformed to the Megatron tensor, then sliced."""
    full = to_megatron(rule, [hf.read(n) for n in rule.hf], shape, padded)
    tp_rank, tp_size = tensor_split(ctx, global_name)
    shard = tp_shard(
        full,
        partition_dim=dim,
        tp_rank=tp_rank,
        tp_size=tp_size,
        gated=is_gated_fc1(global_name),
    )
    if shard.shape != param.shape:
        raise CheckpointError(
            f"{global_name}: HF tensors {list(rule.hf)} give a shard of shape {list(shard.shape)}, "
            f"the Megatron parameter has {list(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(shard)


def hf_tensors_from_full(
    full: dict[str, Mapped], shape: GPTShape, rules: list[Rule]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs from full canonical Megatron tensors (TP-merged, global names); a
    fused gate/up weight may be given as its two halves.

    A generator in rule order (embedding, layer 0, layer 1, ...): callers stream the result. ``full``
    must hold every exported rule's tensor and nothing without a rule (:class:`CoverageError`, raised
    before the first pair): an export never leaves a tensor out silently.
    """
    check_export(full, rules)
    for rule in rules:
        if rule.export and rule.megatron in full:
            tensor = full[rule.megatron]
            if isinstance(tensor, tuple):
                if rule.transform != "gated":
                    raise ValueError(f"{rule.megatron}: two halves given for a {rule.transform} rule")
                yield from zip(rule.hf, tensor, strict=True)
            else:
                yield from zip(rule.hf, to_hf(rule, tensor, shape), strict=True)


def check_export(full: dict[str, object], rules: list[Rule]) -> None:
    """Raise :class:`CoverageError` unless the full Megatron tensors and the HF map's rules match: each
    exported rule's tensor given, each tensor given written or derived (the tied output layer)."""
    known = {rule.megatron for rule in rules}
    unwritten = sorted(name for name in full if name not in known)
    missing = sorted(r.megatron for r in rules if r.export and r.megatron not in full)
    problems = []
    if unwritten:
        problems.append(listing(unwritten, "Megatron tensors the HF map has no rule for"))
    if missing:
        problems.append(listing(missing, "rules whose Megatron tensor is not in the model"))
    if problems:
        raise CoverageError(f"HF export would not write the whole model: {'; '.join(problems)}")
