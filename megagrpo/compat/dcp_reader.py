"""What a distributed checkpoint's metadata may say, and its entries read without running anything.

Verified with torch 2.13.0 and Megatron-Core 0.16.1; installed by ``dcp_metadata.restricted_metadata``.

- :func:`check_metadata`: the records the metadata's unpickler admitted carry only their own fields
  (plus the two Megatron adds to ``Metadata``), hold the value types those fields hold, and every
  entry's bytes lie in a ``.distcp`` file inside the checkpoint directory.
- :func:`read_data` replaces ``FileSystemReader.read_data``, which loads a bytes entry with
  ``DefaultLoadPlanner.load_bytes``, i.e. ``torch.load(weights_only=False)``: an entry the model
  loads as a tensor but the metadata calls bytes is refused before anything is read; bytes entries
  go through ``safe_load`` (an ``_extra_state`` one against its allow-list), tensor chunks through
  ``safe_load`` too (torch reads them with ``weights_only=True`` already; this names the entry).
- :func:`load_common` replaces Megatron's ``TorchCommonLoadStrategy.load_common`` (``common.pt``,
  ``torch.load`` with torch's default, which an environment variable can turn off).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
from pathlib import Path
from typing import Any

import torch

from megagrpo.compat.safe_load import (
    EXTRA_STATE,
    TENSORS,
    UntrustedCheckpointError,
    check_extra_state,
    load_archive,
    load_file,
)

# Attributes Megatron's writer sets on Metadata besides its fields (state_dict_saver.py,
# strategies/torch.py).
_EXTRA_FIELDS = {"Metadata": frozenset({"all_local_plans", "mcore_data"})}
_PLAIN = (str, int, float, bool, type(None), bytes, torch.dtype, torch.layout, torch.memory_format)
COMMON = TENSORS
"""What ``common.pt`` may name: Megatron stores plain values there (an empty dict for a model)."""


def _check_value(value: Any, where: str, depth: int = 0) -> None:
    """Only admitted records, containers and plain values, each record with its own fields only."""
    if depth > 64:
        raise UntrustedCheckpointError(f"{where}: nested deeper than a checkpoint's metadata is")
    if isinstance(value, (*_PLAIN, enum.Enum, torch.Size, pathlib.PurePath)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_value(key, where, depth + 1)
            _check_value(item, where, depth + 1)
        return
    if isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _check_value(item, where, depth + 1)
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        fields = {f.name for f in dataclasses.fields(value)} | _EXTRA_FIELDS.get(name, frozenset())
        unexpected = sorted(set(vars(value)) - fields)
        if unexpected:
            raise UntrustedCheckpointError(
                f"{where}: a {name} record carries {unexpected[0]!r}, which is none of its fields"
            )
        for field in vars(value).values():
            _check_value(field, where, depth + 1)
        return
    raise UntrustedCheckpointError(f"{where}: holds a {type(value).__name__}, which metadata never holds")


def check_metadata(metadata: Any, where: str | os.PathLike, directory: Path) -> None:
    """Refuse metadata (read from ``where``, of the checkpoint in ``directory``) that carries
    attributes its records do not have or places an entry's bytes outside the directory."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    where = str(where)
    if type(metadata) is not Metadata:
        raise UntrustedCheckpointError(f"{where}: holds a {type(metadata).__name__}, not checkpoint Metadata")
    _check_value(metadata, where)
    for index, info in (metadata.storage_data or {}).items():
        if type(info) is not _StorageInfo:
            raise UntrustedCheckpointError(f"{where}: entry {index.fqn}: storage is a {type(info).__name__}")
        check_storage(info, where, index.fqn, directory)


def check_storage(info: Any, where: str, entry: str, directory: Path) -> Path:
    """The file an entry's bytes are in: a ``.distcp`` file directly in ``directory`` (a name, not a
    path; not a link to elsewhere), at a non-negative offset and length."""
    rel = info.relative_path
    bad = (
        not isinstance(rel, str)
        or not rel.endswith(".distcp")
        or rel != os.path.basename(rel)
        or "\\" in rel
        or rel.startswith(".")
    )
    if bad:
        raise UntrustedCheckpointError(
            f"{where}: entry {entry}: its bytes are said to be in {rel!r}, not a .distcp file of the "
            "checkpoint directory"
        )
    for number in (info.offset, info.length):
        if type(number) is not int or number < 0:
            raise UntrustedCheckpointError(f"{where}: entry {entry}: offset/length {number!r}")
    path = directory / rel
    if path.is_symlink() and path.resolve().parent != directory.resolve():
        raise UntrustedCheckpointError(f"{path}: a link out of the checkpoint directory (entry {entry})")
    return path


def _bytes_target_is_tensor(planner: Any, fqn: str) -> bool:
    state = getattr(planner, "state_dict", None)
    target = state.get(fqn) if isinstance(state, dict) else None
    return isinstance(target, torch.Tensor) or hasattr(target, "__create_chunk_list__")


def _set_loaded_bytes(planner: Any, item: Any, value: Any, where: str) -> None:
    """What ``DefaultLoadPlanner.load_bytes`` does with the value it loaded (torch 2.13)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if not isinstance(planner, DefaultLoadPlanner) or type(planner).load_bytes is not (
        DefaultLoadPlanner.load_bytes
    ):
        raise UntrustedCheckpointError(
            f"{where}: a bytes entry for a planner ({type(planner).__name__}) "
            "whose loading is not known to be safe"
        )
    fqn = item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def read_data(self, plan, planner):
    """``FileSystemReader.read_data`` (torch 2.13) with every entry loaded through ``safe_load``."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    directory = Path(self.path)
    metadata_file = directory / ".metadata"
    for item in plan.items:  # every kind checked before anything is read
        if item.type == LoadItemType.BYTE_IO and _bytes_target_is_tensor(planner, item.dest_index.fqn):
            raise UntrustedCheckpointError(
                f"{metadata_file}: entry {item.dest_index.fqn}: the model loads it as a tensor, the "
                "metadata stores it as bytes"
            )
    per_file: dict[str, list] = {}
    for item in plan.items:
        per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
    for items in per_file.values():
        first = items[0].storage_index
        path = check_storage(self.storage_data[first], str(metadata_file), first.fqn, directory)
        with open(path, "rb") as stream:
            for item in items:
                info = self.storage_data[item.storage_index]
                fqn = item.storage_index.fqn
                where = f"{path}: entry {fqn}"
                if info.transform_descriptors:
                    raise UntrustedCheckpointError(f"{where}: stored through {info.transform_descriptors}")
                chunk = self._slice_file(stream, info)
                if item.type == LoadItemType.BYTE_IO:
                    value = load_archive(chunk, where, EXTRA_STATE if "_extra_state" in fqn else TENSORS)
                    if "_extra_state" in fqn:
                        check_extra_state(value, where)
                    _set_loaded_bytes(planner, item, value, where)
                    continue
                tensor = load_archive(chunk, where, TENSORS)
                if type(tensor) is not torch.Tensor:
                    raise UntrustedCheckpointError(f"{where}: holds a {type(tensor).__name__}, not a tensor")
                tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise UntrustedCheckpointError(
                        f"{where}: a chunk of {list(tensor.size())}, the model expects {list(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(item, target)
    done: Future = Future()
    done.set_result(None)
    return done


def load_common(self, checkpoint_dir):
    """Megatron's ``TorchCommonLoadStrategy.load_common`` (0.16.1) through ``safe_load``."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    path = Path(checkpoint_dir) / COMMON_STATE_FNAME
    if not path.is_file():
        raise CheckpointingException(f"Common file {path} does not exist")
    return load_file(path, COMMON)
