"""HF <-> Megatron conversion over the declarative map, one tensor at a time.

Import: every rank of a TP x PP layout builds its own model stage (no random init) for its
checkpoint layout, and Megatron's ``dist_checkpointing`` writes a checkpoint that loads at any
TP/PP. What it writes for each parameter is, where the shard is a contiguous row range of the HF
files, a view of the file's mapped bytes, which Megatron's writers copy file to file in the kernel
(never read into a process); otherwise the parameter, filled from the HF tensors the map names (its
own rows read straight into it where the layout allows, whole tensors transformed otherwise).

Export: one rank builds the model at TP=PP=1 and streams HF tensors into size-capped safetensors
shards, taking each weight as a view of the mapped checkpoint files where the stored chunks allow (a
checkpoint this converter wrote, or any saved at TP=1) and loading the rest through Megatron into the
model.

Neither holds the model twice: peak memory is at most the model (or the rank's stage) plus the
tensor in hand. Both outputs are on disk (fsync'd, with writeback started while writing:
``durable``) before they are renamed into place. The checkpoint layout is ``megatron.py``'s.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from pathlib import Path

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.durable import atomic_output_dir
from megagrpo.ckpt.files import FileCopies, Piece
from megagrpo.ckpt.hf_files import HFCheckpoint, copy_aux_files, write_sharded
from megagrpo.ckpt.hf_weights import check_export, hf_tensors_from_full, load_hf_into_stage
from megagrpo.ckpt.megatron import (
    Mapped,
    load_megatron,
    mapped_checkpoint_tensors,
    read_model,
    save_megatron,
    write_checkpoint_meta,
    writers_can_copy,
)
from megagrpo.compat.startup import paused_gc, weights_only_process
from megagrpo.models.builder import build_stage
from megagrpo.models.layout import check_stage, param_numels, stage_param_names
from megagrpo.models.mapping import hf_tensor_shapes
from megagrpo.models.registry import load_hf_config, shape_from_hf_config
from megagrpo.models.shape import DTYPE_NAMES, padded_vocab_size
from megagrpo.parallel import ParallelContext, ParallelSizes, destroy_parallel, init_parallel
from megagrpo.parallel.local import run_in_this_process, run_local_ranks

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


# --- HF -> Megatron -------------------------------------------------------------------------------


@contextlib.contextmanager
def _rank_groups(sizes: ParallelSizes, exits_after: bool) -> Iterator[ParallelContext]:
    """The process groups of one conversion rank, torn down after it, or on success left to the
    process's exit where that comes next (``exits_after``): freeing Megatron's ~18 gloo groups
    joins their ~50 threads (~0.1 s on two cores)."""
    ctx = init_parallel(sizes, backend="gloo")
    try:
        yield ctx
    except BaseException:
        destroy_parallel()
        raise
    if not exits_after:
        destroy_parallel()


def import_rank(
    rank: int,
    world_size: int,
    hf_dir: str,
    out: str,
    tp: int,
    pp: int,
    ep: int = 1,
    etp: int | None = None,
    exits_after: bool = False,
) -> None:
    """One rank of ``hf_to_megatron``, as ``run_local_ranks`` calls it (``out``: the directory the
    checkpoint's ``megatron/`` goes into; no validation, metadata or atomic publish, which are the
    caller's). ``exits_after``: the process exits next, so its process groups are left to the exit."""
    with weights_only_process():
        _import_stage(hf_dir, out, ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp), exits_after)


def _import_stage(hf_dir: str, out: str, sizes: ParallelSizes, exits_after: bool) -> None:
    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), f"{hf_dir}/config.json")
    hf = HFCheckpoint(hf_dir)
    dtype = hf.validate(hf_tensor_shapes(shape))
    with _rank_groups(sizes, exits_after) as ctx:
        model = build_stage(ctx, shape, dtype)
        mapped: dict[str, Mapped] = {}
        pieces: dict[str, list[Piece]] | None = {} if writers_can_copy() else None
        # Under EP, the data-parallel ranks hold the same dense weights (replicas, written by the first)
        # and their own experts; with ETP < TP, tensor-parallel ranks also hold replicas of experts.
        load_hf_into_stage(
            model,
            ctx,
            hf,
            shape,
            arch.rules(shape),
            mapped=mapped,
            pieces=pieces,
            written_only=True,
        )
        save_megatron(model, Path(out) / "megatron", mapped=mapped, pieces=pieces, maps=hf.maps)


def _run_ranks(fn, world_size: int, in_process: bool, *args) -> None:
    if in_process and world_size == 1:
        # The command-line tool exits next: the rank's process groups are left for the exit.
        run_in_this_process(functools.partial(fn, exits_after=True), *args)
    else:
        run_local_ranks(fn, world_size, *args, timeout_s=24 * 3600)


def _conversion(in_process: bool) -> contextlib.AbstractContextManager:
    """In a command-line tool's own process (which exits next), the cyclic garbage collector is
    off for the whole conversion, not only inside the rank (``compat.startup.paused_gc``)."""
    return paused_gc() if in_process else contextlib.nullcontext()


def hf_to_megatron(
    hf_dir: str | Path,
    out: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    in_process: bool = False,
) -> Path:
    """Convert an HF directory into a megagrpo Megatron checkpoint at ``out`` (written atomically).

    ``ep``, ``etp`` (mixture-of-experts models): the experts split over ``ep`` ranks, each expert's width
    over ``etp`` (default ``tp``), each rank reading and writing only its own experts (the checkpoint's
    expert tensors are global: it loads at any EP and ETP). A stage takes the fewest ranks that both
    grids fold over: lcm(TP, EP x ETP) (TP 2 x EP 2 at ETP 1: two ranks).

    ``in_process``: with TP = PP = 1, convert in this process instead of a spawned rank (for
    command-line tools, which exit afterwards; it leaves Megatron's global state behind).
    """
    hf_dir, out = Path(hf_dir), Path(out)
    # Everything that can be wrong with the input is reported here, before any rank starts.
    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), str(hf_dir / "config.json"))
    dtype = HFCheckpoint(hf_dir).validate(hf_tensor_shapes(shape))
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{hf_dir}: weights are {dtype}; supported: float32, bfloat16, float16")
    if shape.num_layers % pp:
        raise ValueError(f"--pp {pp} does not divide the model's {shape.num_layers} layers")
    if shape.num_attention_heads % tp or shape.num_query_groups % tp:
        raise ValueError(
            f"--tp {tp} must divide num_attention_heads {shape.num_attention_heads} "
            f"and num_key_value_heads {shape.num_query_groups}"
        )
    padded_vocab_size(shape.vocab_size, tp)  # raises if this TP cannot split the padded vocabulary
    etp = tp if etp is None else etp
    if ep > 1 and shape.num_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the model's {shape.num_experts} experts (num_experts)")
    if shape.is_moe and shape.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"--etp {etp} does not divide the model's expert width {shape.moe_ffn_hidden_size} "
            "(moe_intermediate_size)"
        )
    stage_ranks = math.lcm(tp, ep * etp)
    with _conversion(in_process), atomic_output_dir(out) as tmp:
        _run_ranks(import_rank, stage_ranks * pp, in_process, str(hf_dir), str(tmp), tp, pp, ep, etp)
        write_checkpoint_meta(tmp, arch, shape, dtype, tp=tp, pp=pp, hf_files=hf_dir)
    return out


# --- Megatron -> HF -------------------------------------------------------------------------------


def export_rank(
    rank: int, world_size: int, ckpt: str, out: str, max_shard_bytes: int, exits_after: bool = False
) -> int:
    """The single rank (TP = PP = 1) of ``megatron_to_hf``, as ``run_local_ranks`` calls it: the HF
    shards and index into ``out`` (an existing directory; no auxiliary files or atomic publish,
    which are the caller's). Returns the bytes of the tensors written; ``exits_after`` as for
    ``import_rank``."""
    with weights_only_process():
        return _export_stage(ckpt, out, max_shard_bytes, exits_after)


def _export_stage(ckpt: str, out: str, max_shard_bytes: int, exits_after: bool) -> int:
    source = read_model(Path(ckpt))
    with _rank_groups(ParallelSizes(), exits_after) as ctx:
        model = build_stage(ctx, source.shape, source.dtype)
        # The stored chunks, viewed in the mapped checkpoint files where they allow (the model is
        # never filled); Megatron loads the rest into the model's parameters.
        files, mapped, rest = mapped_checkpoint_tensors(model, Path(ckpt) / "megatron")
        if rest:
            load_megatron(model, Path(ckpt) / "megatron", keys=set(rest))
        names = stage_param_names(model, ctx, source.shape.num_layers)
        params = dict(model.named_parameters())
        full = {names[local]: mapped.get(local, params[local].detach()) for local in params}
        rules = source.arch.rules(source.shape)
        check_stage(param_numels(model), names, rules, source.shape, ctx)  # every tensor written
        check_export(full, rules)
        shapes = hf_tensor_shapes(source.shape)
        specs = [
            (name, shapes[name], source.dtype)
            for rule in rules
            if rule.export and rule.megatron in full
            for name in rule.hf
        ]
        # Made one at a time as the writer asks (views where the layout allows: gate/up halves, the
        # unpadded vocabulary; Q/K/V come out of the interleaved weight as copies). Megatron keeps
        # norm weights in fp32 whatever the model's dtype: they go back in the checkpoint's.
        tensors = (
            (name, tensor.to(source.dtype))
            for name, tensor in hf_tensors_from_full(full, source.shape, rules)
        )
        write_sharded(Path(out), specs, tensors, max_shard_bytes, copies=FileCopies(files.maps))
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)


def megatron_to_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    in_process: bool = False,
) -> Path:
    """Write an HF directory (safetensors shards + index, config, tokenizer) from a megagrpo checkpoint.

    ``in_process`` as for ``hf_to_megatron``.
    """
    ckpt, out = Path(ckpt), Path(out)
    source = read_model(ckpt)  # validates before any rank starts
    if not (ckpt / "megatron" / "metadata.json").is_file():
        raise CheckpointError(f"{ckpt / 'megatron'}: missing or incomplete Megatron checkpoint")
    with _conversion(in_process), atomic_output_dir(out) as tmp:
        _run_ranks(export_rank, 1, in_process, str(ckpt), str(tmp), max_shard_bytes)
        copy_aux_files(source.hf_dir, tmp)
    return out
