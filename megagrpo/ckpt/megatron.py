"""Megatron distributed checkpoints (torch_dist) of a model: save, load, and read in place.

A megagrpo checkpoint directory::

    <ckpt>/megatron/      Megatron distributed checkpoint (torch_dist); loads at any TP/PP
    <ckpt>/hf/            config.json, generation_config.json, tokenizer files of the source model
    <ckpt>/megagrpo.json  architecture, dtype, padded vocabulary, the TP/PP it was written with

Saving goes through Megatron's own ``dist_checkpointing`` with two things it only needs for
asynchronous saves left out, and its writers optionally copying weights file to file
(``megagrpo.compat.megatron_writer``, ``megagrpo.compat.torch_save``). Loading reads each fused
gate/up weight straight into the parameter; ``mapped_checkpoint_tensors`` views stored chunks in
the mapped files without filling a model (``dist_files``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.dist_files import MappedDistCheckpoint, check_entry_kinds, trusted_metadata_only
from megagrpo.ckpt.durable import writeback_as_written
from megagrpo.ckpt.files import CopyingFile, FileCopies, FileMaps, Piece
from megagrpo.ckpt.hf_files import copy_aux_files
from megagrpo.ckpt.links import check_no_outside_links
from megagrpo.ckpt.manifest import DigestCollector
from megagrpo.compat.megatron_writer import in_process_results_queue, writers_can_open_with, writers_open_with
from megagrpo.compat.torch_save import without_crc32
from megagrpo.models.description import ModelDescription
from megagrpo.models.registry import Architecture, hf_config_for, load_hf_config, shape_from_hf_config
from megagrpo.models.shape import DTYPE_NAMES, DTYPES, GPTShape, padded_vocab_size

META_NAME = "megagrpo.json"
FORMAT_VERSION = 1

# A weight taken from mapped files instead of a filled parameter: a tensor, or the (gate, up) halves
# Megatron checkpoints a fused linear_fc1 weight as.
Mapped = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


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
    digests: DigestCollector | None = None,
) -> None:
    """Write ``model`` as a Megatron distributed checkpoint.

    ``mapped`` (conversion, from ``load_hf_into_stage``): tensors written in place of the parameters
    they are keyed by, which were never filled. For a fused gate/up weight, the two halves Megatron
    checkpoints it as (its writer would otherwise copy them out of the fused weight).
    ``maps``: the files mapped tensors view; Megatron's writers copy their bytes from there, file to
    file (``CopyingFile``).
    ``pieces``: unfilled parameters, by key, and where their bytes lie in files; the writers copy
    them from there, and a checkpoint in which any was not is refused (it would hold garbage).
    ``digests``: collects the digests of the files the writers write (``save_dist_checkpoint``).
    """
    path.mkdir(parents=True, exist_ok=True)
    state = model.sharded_state_dict()
    gated = set(_gated_factories(state)) if mapped else set()
    # Only a conversion has bytes to copy from files; a trainer's save lets its writers digest.
    copies = FileCopies(maps) if maps is not None or pieces else None
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
    save_dist_checkpoint(state, path, copies, digests=digests)
    unwritten = [key for key in pieces or {} if not copies.written(state[key].data)]
    if unwritten:
        raise RuntimeError(
            f"{path}: Megatron's checkpoint writer did not take {unwritten[0]} (and {len(unwritten) - 1} "
            "more) from the HF files as arranged; those tensors were never filled, so the checkpoint "
            "is refused. Does this Megatron version open its checkpoint files another way?"
        )


def save_dist_checkpoint(
    state: dict, path: Path, copies: FileCopies | None = None, *, digests: DigestCollector | None = None
) -> None:
    """``dist_checkpointing.save`` (synchronous, torch_dist) without the costs it only needs for
    asynchronous saves (its Manager results queue, torch.save's unchecked CRC32), its files'
    writeback started while its writers write them (they fsync).

    ``copies``: tensors whose bytes the writers copy from files (see ``CopyingFile``).
    ``digests``: the writers digest what they write (``manifest.HashingWriter``) and report it
    there; where this Megatron version opens its files another way, nothing is reported (the
    manifest then reads the files back). Not with ``copies`` (copied bytes never pass through).
    """
    from megatron.core import dist_checkpointing

    with (
        in_process_results_queue(),
        without_crc32(),
        _writers_copy_from(copies),
        _writers_digest_into(digests if copies is None else None),
        writeback_as_written(path, ".distcp"),
    ):
        try:
            dist_checkpointing.save(state, str(path))
        except CheckpointException as err:
            raise _write_failure(path, err) from None


def _write_failure(path: Path, err: BaseException) -> OSError:
    """Megatron's collective writer failure as an OSError every rank raises with the same message.

    Megatron raises torch's ``CheckpointException`` (a BaseException, which an actor framework
    takes for the process exiting) on every rank at once, but only the coordinator (rank 0)
    holds the writers' errors: it tells the others.
    """
    import torch.distributed as dist

    failures = getattr(err, "failures", {}) or {}
    details = "; ".join(f"rank {rank}: {exc}" for rank, (exc, _) in sorted(failures.items()))
    message = [details]
    if dist.is_initialized():
        dist.broadcast_object_list(message, src=0)
    found = re.search(r"\[Errno (\d+)\]", message[0])
    text = f"{path}: checkpoint writer failed ({message[0] or 'no detail'})"
    return OSError(int(found.group(1)), text) if found else OSError(text)


def writers_can_copy() -> bool:
    """Whether Megatron's checkpoint writers can be given ``CopyingFile``s (``_writers_copy_from``)."""
    return writers_can_open_with()


@contextlib.contextmanager
def _writers_copy_from(copies: FileCopies | None) -> Iterator[None]:
    """Megatron's checkpoint writers open their files as ``CopyingFile``s over ``copies``.

    Its writer processes (forked during the save, so they inherit this) open each file with the
    builtin ``open(name, "wb")`` and ``torch.save`` each tensor into it, which writes a tensor's
    bytes as one buffer at the tensor's address: exactly what ``CopyingFile`` turns into a kernel
    copy. The format written is unchanged. Should a Megatron version open its files another way,
    a mapped tensor's bytes are written from memory as before, and ``save_megatron`` refuses a
    checkpoint in which an unfilled tensor was (``FileCopies.written``).
    """
    if copies is None or not writers_can_copy():
        yield
        return
    copies.share()  # before the writers fork

    def open_for_writer(file, mode="r", *args, **kwargs):
        if mode == "wb" and not args and not kwargs:
            # Unbuffered: a buffer would gather small tensors' bytes with the records around them.
            return CopyingFile(file, copies)
        return open(file, mode, *args, **kwargs)

    with writers_open_with(open_for_writer):
        yield


@contextlib.contextmanager
def _writers_digest_into(digests: DigestCollector | None) -> Iterator[None]:
    """Megatron's checkpoint writers open their files as ``digests.writer``s (same buffering as
    the builtin ``open`` they call), which digest every byte on its way to the file."""
    if digests is None or not writers_can_open_with():
        yield
        return

    def open_for_writer(file, mode="r", *args, **kwargs):
        if mode == "wb" and not args and not kwargs:
            return digests.writer(file)
        return open(file, mode, *args, **kwargs)

    with writers_open_with(open_for_writer):
        yield


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
    check_entry_kinds(state, path)
    with trusted_metadata_only():
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
    state = model.sharded_state_dict()
    check_entry_kinds(state, path)
    files = MappedDistCheckpoint(path)
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


def read_model(ckpt: Path) -> ModelDescription:
    """The model a megagrpo checkpoint holds (its ``megagrpo.json`` and ``hf/config.json``)."""
    meta_path = ckpt / META_NAME
    if not meta_path.is_file():
        raise CheckpointError(f"{ckpt}: no {META_NAME}; not a checkpoint written by megagrpo")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')} is not {FORMAT_VERSION}")
    hf_dir = ckpt / "hf"
    check_no_outside_links(hf_dir, within=ckpt)  # before its config is read or its files are copied
    arch, shape = shape_from_hf_config(load_hf_config(hf_dir), str(hf_dir / "config.json"))
    return ModelDescription(
        arch=arch, shape=shape, dtype=DTYPES[meta["dtype"]], hf_dir=hf_dir, megatron_ckpt=ckpt
    )


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
        "dtype": DTYPE_NAMES[dtype],
        "vocab_size": shape.vocab_size,
        "padded_vocab_size": padded_vocab_size(shape.vocab_size),
        "saved_tp": tp,
        "saved_pp": pp,
    }
    (path / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
