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
``durable``) before they are renamed into place.

Checkpoint directory layout::

    <ckpt>/megatron/      Megatron distributed checkpoint (torch_dist)
    <ckpt>/hf/            config.json, generation_config.json, tokenizer files of the source model
    <ckpt>/megagrpo.json  architecture, dtype, padded vocabulary, the TP/PP it was written with
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import json
import math
import queue
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.models.builder import GPTShape, build_gpt_model, padded_vocab_size, transformer_config
from megagrpo.models.dist_files import MappedDistCheckpoint
from megagrpo.models.durable import writeback_as_written
from megagrpo.models.hf_io import (
    CheckpointError,
    CopyingFile,
    FileCopies,
    FileMaps,
    HFCheckpoint,
    Piece,
    atomic_output_dir,
    copy_aux_files,
    write_sharded,
)
from megagrpo.models.layout import is_gated_fc1, layer_offset, shift_layer_index, tp_partition_dim, tp_shard
from megagrpo.models.mapping import Rule, canonical_name, hf_tensor_shapes, shard_rows, to_hf, to_megatron
from megagrpo.models.registry import _LLAMA3_FIXED, Architecture, load_hf_config, shape_from_hf_config
from megagrpo.parallel import ParallelContext, ParallelSizes, destroy_parallel, init_parallel
from megagrpo.parallel.local import run_in_this_process, run_local_ranks

META_NAME = "megagrpo.json"
FORMAT_VERSION = 1
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class ModelSource:
    """What a model is, independent of where its weights live."""

    arch: Architecture
    shape: GPTShape
    dtype: torch.dtype
    hf_config_dir: Path
    """Directory holding config.json and the tokenizer files."""


def stage_param_names(model: torch.nn.Module, ctx: ParallelContext, num_layers: int) -> dict[str, str]:
    """This stage's parameter names -> canonical global names (layer index offset by the stage)."""
    offset = layer_offset(num_layers, ctx.sizes.pp, ctx.pp_rank)
    return {name: shift_layer_index(canonical_name(name), offset) for name, _ in model.named_parameters()}


# A weight taken from mapped files instead of a filled parameter: a tensor, or the (gate, up) halves
# Megatron checkpoints a fused linear_fc1 weight as.
Mapped = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def load_hf_into_stage(
    model: torch.nn.Module,
    ctx: ParallelContext,
    hf: HFCheckpoint,
    shape: GPTShape,
    rules: list[Rule],
    *,
    mapped: dict[str, Mapped] | None = None,
    pieces: dict[str, list[Piece]] | None = None,
) -> None:
    """Fill every parameter of this rank's model stage from the HF checkpoint (TP slice of each).

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
    """
    by_name = {rule.megatron: rule for rule in rules}
    padded = padded_vocab_size(shape.vocab_size, ctx.sizes.tp)
    params = dict(model.named_parameters())
    for local, global_name in stage_param_names(model, ctx, shape.num_layers).items():
        rule = by_name.get(global_name)
        if rule is None:
            raise CheckpointError(f"Megatron parameter {global_name} has no rule in the HF map")
        param = params[local]
        dim = tp_partition_dim(global_name)
        plan = shard_rows(
            rule,
            {n: hf.tensors[n].shape[0] for n in rule.hf},
            shape,
            padded,
            partition_dim=dim,
            tp_rank=ctx.tp_rank,
            tp_size=ctx.sizes.tp,
        )
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
        covered = 0
        target = param.detach()
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
    shard = tp_shard(
        full,
        partition_dim=dim,
        tp_rank=ctx.tp_rank,
        tp_size=ctx.sizes.tp,
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

    A generator in rule order (embedding, layer 0, layer 1, ...): callers stream the result.
    """
    for rule in rules:
        if rule.export and rule.megatron in full:
            tensor = full[rule.megatron]
            if isinstance(tensor, tuple):
                if rule.transform != "gated":
                    raise ValueError(f"{rule.megatron}: two halves given for a {rule.transform} rule")
                yield from zip(rule.hf, tensor, strict=True)
            else:
                yield from zip(rule.hf, to_hf(rule, tensor, shape), strict=True)


def build_stage(ctx: ParallelContext, shape: GPTShape, dtype: torch.dtype, *, initialize: bool = False):
    config = transformer_config(
        shape,
        tp=ctx.sizes.tp,
        pp=ctx.sizes.pp,
        dtype=dtype,
        on_cpu=ctx.device.type == "cpu",
        initialize=initialize,
    )
    return build_gpt_model(
        shape,
        config,
        ctx.pgs,
        transformer_impl="local" if ctx.device.type == "cpu" else "auto",
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
    )


def _gated_factories(state: dict) -> list[str]:
    """Keys of the fused gate/up (``linear_fc1``) weights, which Megatron checkpoints as two halves."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return [k for k, v in state.items() if isinstance(v, ShardedTensorFactory) and v.flattened_range is None]


def save_megatron(
    model: torch.nn.Module,
    path: Path,
    *,
    mapped: dict[str, Mapped] | None = None,
    pieces: dict[str, list[Piece]] | None = None,
    maps: FileMaps | None = None,
) -> None:
    """Write ``model`` as a Megatron distributed checkpoint.

    ``mapped`` (conversion, from ``load_hf_into_stage``): tensors written in place of the parameters
    they are keyed by, which were never filled. For a fused gate/up weight, the two halves Megatron
    checkpoints it as (its writer would otherwise copy them out of the fused weight).
    ``maps``: the files mapped tensors view; Megatron's writers copy their bytes from there, file to
    file (``CopyingFile``).
    ``pieces``: unfilled parameters, by key, and where their bytes lie in files; the writers copy
    them from there, and a checkpoint in which any was not is refused (it would hold garbage).
    """
    path.mkdir(parents=True, exist_ok=True)
    state = model.sharded_state_dict()
    gated = set(_gated_factories(state)) if mapped else set()
    copies = FileCopies(maps)
    for key, given in (mapped or {}).items():
        if key not in state:
            # A parameter left unfilled would be written as garbage: refuse rather than guess.
            raise RuntimeError(f"{key}: tensors were mapped for it, the model's checkpoint has no such key")
        if isinstance(given, tuple):
            if key not in gated:
                raise RuntimeError(f"{key}: gate/up halves were mapped for a weight that is not fused")
            targets = state[key].build()
            state[key] = targets
        else:
            targets, given = [state[key]], (given,)
        for target, tensor in zip(targets, given, strict=True):
            if tensor.shape != target.data.shape or tensor.dtype != target.data.dtype:
                raise ValueError(
                    f"{key}: mapped {tensor.dtype} {list(tensor.shape)}, the checkpoint expects "
                    f"{target.data.dtype} {list(target.data.shape)}"
                )
            target.data = tensor
    for key, runs in (pieces or {}).items():
        if key not in state:
            raise RuntimeError(f"{key}: file pieces were given for it; the checkpoint has no such key")
        copies.add(state[key].data, runs)
    save_dist_checkpoint(state, path, copies)
    unwritten = [key for key in pieces or {} if not copies.written(state[key].data)]
    if unwritten:
        raise RuntimeError(
            f"{path}: Megatron's checkpoint writer did not take {unwritten[0]} (and {len(unwritten) - 1} "
            "more) from the HF files as arranged; those tensors were never filled, so the checkpoint "
            "is refused. Does this Megatron version open its checkpoint files another way?"
        )


@contextlib.contextmanager
def _lean_torch_dist_writer():
    """Two costs of Megatron's torch_dist writer that a synchronous save does not need.

    - Its results queue is a ``Manager`` in a spawned Python process (~1.5 s to start on two cores),
      there so that an asynchronous save's proxy process can report back. A synchronous save runs
      the writers' coordinator in this process, so a plain in-process queue carries the results.
    - ``torch.save`` computes a CRC32 of every record it writes (~0.15 s per GB per writer),
      which ``torch.load`` never checks.

    Both are restored on exit. Where a Megatron or torch version lacks either hook, it is left alone.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    try:
        from torch.utils.serialization import config as ser_config

        save_config = ser_config.save
        crc = save_config.compute_crc32
        save_config.compute_crc32 = False
    except (ImportError, AttributeError):
        save_config = None
    swap_queue = getattr(filesystem_async, "_results_queue", False) is None
    if swap_queue:
        filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        if swap_queue:
            filesystem_async._results_queue = None
        if save_config is not None:
            save_config.compute_crc32 = crc


def save_dist_checkpoint(state: dict, path: Path, copies: FileCopies | None = None) -> None:
    """``dist_checkpointing.save`` (synchronous, torch_dist) without the costs it only needs for
    asynchronous saves, its files' writeback started while its writers write them (they fsync).

    ``copies``: tensors whose bytes the writers copy from files (see ``CopyingFile``).
    """
    from megatron.core import dist_checkpointing

    with (
        _lean_torch_dist_writer(),
        _writers_copy_from(copies),
        writeback_as_written(path, ".distcp"),
    ):
        dist_checkpointing.save(state, str(path))


def _writers_can_copy() -> bool:
    """Whether Megatron's checkpoint writers can be given ``CopyingFile``s (``_writers_copy_from``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return "open" not in vars(filesystem_async)


@contextlib.contextmanager
def _writers_copy_from(copies: FileCopies | None):
    """Megatron's checkpoint writers open their files as ``CopyingFile``s over ``copies``.

    Its writer processes (forked during the save, so they inherit this) open each file with the
    builtin ``open(name, "wb")`` and ``torch.save`` each tensor into it, which writes a tensor's
    bytes as one buffer at the tensor's address: exactly what ``CopyingFile`` turns into a kernel
    copy. The format written is unchanged. Should a Megatron version open its files another way,
    a mapped tensor's bytes are written from memory as before, and ``save_megatron`` refuses a
    checkpoint in which an unfilled tensor was (``FileCopies.written``).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if copies is None or not _writers_can_copy():
        yield
        return
    copies.share()  # before the writers fork

    def open_for_writer(file, mode="r", *args, **kwargs):
        if mode == "wb" and not args and not kwargs:
            # Unbuffered: a buffer would gather small tensors' bytes with the records around them.
            return CopyingFile(file, copies)
        return open(file, mode, *args, **kwargs)

    filesystem_async.open = open_for_writer
    try:
        yield
    finally:
        del filesystem_async.open


def load_megatron(model: torch.nn.Module, path: Path, keys: set[str] | None = None) -> None:
    """Load a Megatron distributed checkpoint into ``model`` at whatever TP/PP it was built with.

    The gate/up halves of each fused ``linear_fc1`` weight are read straight into the two halves of
    the parameter (Megatron would read them into new tensors and concatenate: one more copy).
    ``keys``: load only these entries of the model's state dict (whole parameters, all layers).
    """
    from megatron.core import dist_checkpointing

    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: not a Megatron distributed checkpoint (no metadata.json)")
    state = model.sharded_state_dict()
    if keys is not None:
        state = {key: value for key, value in state.items() if key in keys}
    fused = {}
    for key in _gated_factories(state):
        fused[key] = state[key].data
        state[key] = state[key].build()  # ShardedTensors over views of the parameter
    state = dist_checkpointing.load(state, str(path))
    for key, param in fused.items():
        with torch.no_grad():
            for loaded, half in zip(state[key], torch.chunk(param, 2, dim=0), strict=True):
                if loaded.data_ptr() != half.data_ptr():  # not read in place: copy
                    half.copy_(loaded)
        state[key] = param
    # The loaded tensors are the model's own parameters, filled in place; this only checks names.
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and (keys is None or k in keys)]
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing {missing[:3]}, unexpected {unexpected[:3]}")


def mapped_checkpoint_tensors(
    model: torch.nn.Module, path: Path
) -> tuple[MappedDistCheckpoint, dict[str, Mapped], list[str]]:
    """The model's parameters as they are stored in the checkpoint at ``path``, without filling the
    model: views of the mapped checkpoint files where the stored chunks allow, keyed by the
    model's state dict names; a fused gate/up weight as its (gate, up) halves. Returns the mapped
    files (whose ``maps.locate`` places a view in them), those tensors, and the names it could not
    take that way (for ``load_megatron(..., keys=...)``)."""
    files = MappedDistCheckpoint(path)
    state = model.sharded_state_dict()
    gated = set(_gated_factories(state))
    mapped: dict[str, Mapped] = {}
    key_of: dict[str, str | None] = {}  # parameter -> its checkpoint key (one for all layers)
    for name, _ in model.named_parameters():
        entry = state.get(name)
        key_of[name] = getattr(entry, "key", None)
        pieces = entry.build() if name in gated else [entry]
        views = [_mapped_shard(files, piece) for piece in pieces] if entry is not None else [None]
        if all(view is not None for view in views):
            mapped[name] = (views[0], views[1]) if name in gated else views[0]
    # Megatron loads a checkpoint key for all its layers or not at all: a key that is not mapped
    # for every parameter it holds goes to Megatron whole.
    unmapped_keys = {key_of[name] for name in key_of if name not in mapped}
    rest = [name for name in key_of if name not in mapped or key_of[name] in unmapped_keys]
    for name in rest:
        mapped.pop(name, None)
    return files, mapped, rest


def _mapped_shard(files, sharded) -> torch.Tensor | None:
    """One Megatron ShardedTensor's data from the mapped checkpoint, or None."""
    if getattr(sharded, "flattened_range", None) is not None:
        return None
    local = tuple(sharded.local_shape)
    sizes = (1,) * sharded.prepend_axis_num + local
    # Megatron prepends a layer axis to per-layer keys: the weight's own rows come after it.
    tensor = files.read(sharded.key, tuple(sharded.global_offset), sizes, axis=sharded.prepend_axis_num)
    if tensor is None or tensor.dtype != sharded.data.dtype:
        return None
    return tensor.view(local)


def read_source(ckpt: Path) -> ModelSource:
    meta_path = ckpt / META_NAME
    if not meta_path.is_file():
        raise CheckpointError(f"{ckpt}: no {META_NAME}; not a checkpoint written by megagrpo")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')} is not {FORMAT_VERSION}")
    hf_config_dir = ckpt / "hf"
    arch, shape = shape_from_hf_config(load_hf_config(hf_config_dir), str(hf_config_dir / "config.json"))
    dtype = {v: k for k, v in _DTYPE_NAMES.items()}[meta["dtype"]]
    return ModelSource(arch=arch, shape=shape, dtype=dtype, hf_config_dir=hf_config_dir)


def write_checkpoint_meta(
    path: Path,
    arch: Architecture,
    shape: GPTShape,
    dtype: torch.dtype,
    *,
    tp: int,
    pp: int,
    hf_files: Path | None,
) -> None:
    """``megagrpo.json`` and ``hf/`` (config + tokenizer) beside a Megatron checkpoint, so that it
    can be loaded by a policy at any layout and exported with ``megagrpo export``.

    ``hf_files`` is the source HF directory; without one (a tiny model built in-process) an HF
    config describing the model is written instead.
    """
    (path / "hf").mkdir(parents=True, exist_ok=True)
    if hf_files is not None:
        copy_aux_files(hf_files, path / "hf")
    else:
        (path / "hf" / "config.json").write_text(
            json.dumps(hf_config_for(arch, shape, dtype), indent=2) + "\n"
        )
    meta = {
        "format": FORMAT_VERSION,
        "arch": arch.name,
        "dtype": _DTYPE_NAMES[dtype],
        "vocab_size": shape.vocab_size,
        "padded_vocab_size": padded_vocab_size(shape.vocab_size),
        "saved_tp": tp,
        "saved_pp": pp,
    }
    (path / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")


def hf_config_for(arch: Architecture, shape: GPTShape, dtype: torch.dtype) -> dict:
    """An HF config.json for a model built from ``shape`` (so vLLM and transformers can load it)."""
    config = {
        "architectures": list(arch.hf_classes),
        "model_type": arch.name,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    if shape.rope_scaling_factor is not None:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": shape.rope_scaling_factor, **_LLAMA3_FIXED}
    return config


# --- HF -> Megatron -------------------------------------------------------------------------------


def _compile_on_first_call(compile_fn):
    """A ``torch.compile`` that, given a function, compiles it when it is first called."""

    def deferred(model=None, **options):
        if model is None:  # the decorator form, @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        if not inspect.isfunction(model):
            return compile_fn(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


@contextlib.contextmanager
def _weights_only_process() -> Iterator[None]:
    """Two start-up costs that a rank which only moves weights need not pay.

    - Megatron decorates its fused kernels with ``torch.compile`` when imported, which imports
      dynamo and inductor (~0.7 s on two cores). If Megatron is first imported here, compiling each
      of those functions waits for its first call, which a conversion never makes.
    - Python's cyclic garbage collector is off for the block: Megatron's import alone leaves ~400K
      tracked objects that every full collection walks again (~1 s of a conversion), and a
      conversion creates no cycles worth collecting.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        if "megatron.core" not in sys.modules:
            compile_fn = torch.compile
            torch.compile = _compile_on_first_call(compile_fn)
            try:
                import megatron.core  # noqa: F401
            finally:
                torch.compile = compile_fn
        yield
    finally:
        if collecting:
            gc.enable()


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


def _import_rank(
    rank: int, world_size: int, hf_dir: str, out: str, tp: int, pp: int, exits_after: bool = False
) -> None:
    with _weights_only_process():
        _import_stage(hf_dir, out, tp, pp, exits_after)


def _import_stage(hf_dir: str, out: str, tp: int, pp: int, exits_after: bool) -> None:
    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), f"{hf_dir}/config.json")
    hf = HFCheckpoint(hf_dir)
    dtype = hf.validate(hf_tensor_shapes(shape))
    with _rank_groups(ParallelSizes(tp=tp, pp=pp), exits_after) as ctx:
        model = build_stage(ctx, shape, dtype)
        mapped: dict[str, Mapped] = {}
        pieces: dict[str, list[Piece]] | None = {} if _writers_can_copy() else None
        load_hf_into_stage(model, ctx, hf, shape, arch.rules(shape), mapped=mapped, pieces=pieces)
        save_megatron(model, Path(out) / "megatron", mapped=mapped, pieces=pieces, maps=hf.maps)


def _run_ranks(fn, world_size: int, in_process: bool, *args) -> None:
    if in_process and world_size == 1:
        # The command-line tool exits next: its cyclic garbage collector stays off, which also
        # skips the full collection over Megatron's objects at interpreter exit (~0.15 s), and
        # the rank's process groups are left for the exit.
        gc.disable()
        run_in_this_process(functools.partial(fn, exits_after=True), *args)
    else:
        run_local_ranks(fn, world_size, *args, timeout_s=24 * 3600)


def hf_to_megatron(
    hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, in_process: bool = False
) -> Path:
    """Convert an HF directory into a megagrpo Megatron checkpoint at ``out`` (written atomically).

    ``in_process``: with TP = PP = 1, convert in this process instead of a spawned rank (for
    command-line tools, which exit afterwards; it leaves Megatron's global state behind).
    """
    hf_dir, out = Path(hf_dir), Path(out)
    # Everything that can be wrong with the input is reported here, before any rank starts.
    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), str(hf_dir / "config.json"))
    dtype = HFCheckpoint(hf_dir).validate(hf_tensor_shapes(shape))
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"{hf_dir}: weights are {dtype}; supported: float32, bfloat16, float16")
    if shape.num_layers % pp:
        raise ValueError(f"--pp {pp} does not divide the model's {shape.num_layers} layers")
    if shape.num_attention_heads % tp or shape.num_query_groups % tp:
        raise ValueError(
            f"--tp {tp} must divide num_attention_heads {shape.num_attention_heads} "
            f"and num_key_value_heads {shape.num_query_groups}"
        )
    padded_vocab_size(shape.vocab_size, tp)  # raises if this TP cannot split the padded vocabulary
    with atomic_output_dir(out) as tmp:
        _run_ranks(_import_rank, tp * pp, in_process, str(hf_dir), str(tmp), tp, pp)
        write_checkpoint_meta(tmp, arch, shape, dtype, tp=tp, pp=pp, hf_files=hf_dir)
    return out


# --- Megatron -> HF -------------------------------------------------------------------------------


def _export_rank(
    rank: int, world_size: int, ckpt: str, out: str, max_shard_bytes: int, exits_after: bool = False
) -> int:
    with _weights_only_process():
        return _export_stage(ckpt, out, max_shard_bytes, exits_after)


def _export_stage(ckpt: str, out: str, max_shard_bytes: int, exits_after: bool) -> int:
    source = read_source(Path(ckpt))
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
    source = read_source(ckpt)  # validates before any rank starts
    if not (ckpt / "megatron" / "metadata.json").is_file():
        raise CheckpointError(f"{ckpt / 'megatron'}: missing or incomplete Megatron checkpoint")
    with atomic_output_dir(out) as tmp:
        _run_ranks(_export_rank, 1, in_process, str(ckpt), str(tmp), max_shard_bytes)
        copy_aux_files(source.hf_config_dir, tmp)
    return out
