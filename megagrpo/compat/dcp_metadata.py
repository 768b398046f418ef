"""Distributed-checkpoint ``.metadata`` read through a restricted unpickler.

Verified with torch 2.13.0. ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` reads a
checkpoint's ``.metadata`` with plain ``pickle.load``, so a checkpoint directory someone hands over
(``--resume``, ``model.megatron_ckpt``, ``init_from``, ``export --ckpt``) could run any code it names
while being opened; the manifest checks a checkpoint's integrity, not who wrote it. Megatron-Core
reads the metadata through that method (or a subclass that calls it). Within
:func:`restricted_metadata`, the method unpickles with :class:`MetadataUnpickler`, which admits only
the classes a checkpoint's metadata is made of (the metadata, planner and storage-info records of
``torch.distributed.checkpoint``, ``torch.Size``, dtypes, torch's layout lookup, a ``pathlib`` path);
anything else is refused with :class:`UntrustedCheckpointError`, naming the file and the class. The
records it admitted are then checked (``dcp_reader.check_metadata``: their own fields only, entries
in ``.distcp`` files of the directory), and within the same block the entries themselves are read
through ``dcp_reader`` (bytes entries, tensor chunks, Megatron's ``common.pt``), and by
``ckpt.dist_files`` with its own one-tensor unpickler.

Restored on exit (the original methods are put back; nested uses are counted). Where a torch version
has none of the methods to replace, :func:`restricted_metadata` refuses to open anything rather
than read unchecked.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from megagrpo.compat.dcp_reader import check_metadata, load_common, read_data
from megagrpo.compat.safe_load import UntrustedCheckpointError

__all__ = ["MetadataUnpickler", "UntrustedCheckpointError", "read_metadata_file", "restricted_metadata"]

# What a torch_dist checkpoint's .metadata names (torch 2.13, Megatron-Core 0.16 writers): module ->
# the names it may take from there.
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "ChunkStorageMetadata",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.planner": frozenset(
        {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    # StorageMeta.checkpoint_id, when the writer was given a path
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``; ``path`` is named in the error when anything else is found."""

    def __init__(self, file, path: str | Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedCheckpointError(
            f"{self.path}: refusing to load {module}.{name}: a checkpoint's metadata holds only "
            "torch.distributed.checkpoint records, so this file was not written by a checkpoint save "
            "(a crafted pickle can run code when loaded)"
        )

    def persistent_load(self, pid):
        raise UntrustedCheckpointError(f"{self.path}: unexpected persistent id in checkpoint metadata")


def read_metadata_file(path: str | Path):
    """The ``Metadata`` record of a DCP ``.metadata`` file, through :class:`MetadataUnpickler`."""
    with open(path, "rb") as file:
        metadata = MetadataUnpickler(file, path).load()
    check_metadata(metadata, path, Path(path).parent)
    return metadata


_lock = threading.Lock()
_depth = 0
_originals: list[tuple[object, str, object]] = []  # (owner, attribute, original) while installed
_refusals: list[list[str]] = []  # the lists the open blocks yield, innermost last


def _recording(fn):
    """``fn``, with each refusal it raises also told to the open blocks (torch and Megatron re-raise
    it as other exceptions on the way out)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UntrustedCheckpointError as err:
            for refused in list(_refusals):
                refused.append(str(err))
            raise

    return wrapper


def _read_metadata(self, *args, **kwargs):
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = MetadataUnpickler(stream, path).load()
    check_metadata(metadata, path, Path(self.path))
    # What the original does after reading.
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _replacements() -> list[tuple[object, str, object]]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    needed = ("read_metadata", "_get_metadata_path", "read_data", "_slice_file")
    if not all(callable(getattr(FileSystemReader, name, None)) for name in needed):
        raise RuntimeError(
            f"this torch's FileSystemReader lacks one of {needed}, through which checkpoints are read "
            "safely; refusing to open checkpoints (megagrpo.compat.dcp_metadata)"
        )
    found = [
        (FileSystemReader, "read_metadata", _recording(_read_metadata)),
        (FileSystemReader, "read_data", _recording(read_data)),
    ]
    try:
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    except ImportError:  # no Megatron: plain torch checkpoints only
        return found
    return [*found, (TorchCommonLoadStrategy, "load_common", _recording(load_common))]


@contextlib.contextmanager
def restricted_metadata() -> Iterator[list[str]]:
    """Within the block, every checkpoint read goes through the checks: ``FileSystemReader``'s
    ``read_metadata`` unpickles restrictedly (and checks the records, ``dcp_reader.check_metadata``),
    its ``read_data`` loads entries through ``safe_load``, Megatron's ``common.pt`` too.

    Yields a list that collects the refusals' messages: torch's loader re-raises a failed read as
    another exception (``CheckpointException``, or an ``AssertionError`` on the ranks that only
    receive it), so the caller can still tell a refusal from other failures."""
    global _depth
    replacements = _replacements()
    with _lock:
        if _depth == 0:
            for owner, name, replacement in replacements:
                _originals.append((owner, name, owner.__dict__[name]))
                setattr(owner, name, replacement)
        _depth += 1
        refused: list[str] = []
        _refusals.append(refused)
    try:
        yield refused
    finally:
        with _lock:
            _refusals.remove(refused)
            _depth -= 1
            if _depth == 0:
                for owner, name, original in reversed(_originals):
                    setattr(owner, name, original)
                _originals.clear()
