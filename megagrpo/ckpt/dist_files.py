"""Tensors of a Megatron ``torch_dist`` checkpoint as views of its mapped files: no read, no copy.

Megatron's ``torch_dist`` format is PyTorch Distributed Checkpoint (DCP): a ``.metadata`` file that
lists, for every key, the chunks it was saved in (global offsets and sizes) and where each chunk's
bytes are (``.distcp`` file, offset, length); each chunk is one ``torch.save`` archive (an
uncompressed zip) holding one tensor. An export, which only writes the weights out again, can take
each chunk straight from a read-only mapping of its file: the model is never filled, and the
bytes are copied once, into the output files (by the kernel, file to file, where
``maps.locate`` gives their place).

Only what this module checks is taken this way: uncompressed, untransformed chunks that hold one
contiguous little-endian tensor of the expected shape, tiling the requested region along one
axis (a weight's rows). Anything else (a checkpoint written with another serialization, a region split along a
later axis, e.g. a row-parallel weight saved at TP > 1) returns ``None``, and the caller loads
through Megatron instead.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import json
import math
import mmap
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.files import FileMaps
from megagrpo.compat.dcp_metadata import UntrustedCheckpointError, read_metadata_file, restricted_metadata
from megagrpo.compat.dcp_reader import load_common
from megagrpo.compat.safe_load import EXTRA_STATE, TENSORS, check_extra_state, load_archive

# A key's chunks: their first-axis starts, the longest first-axis size, (offsets, sizes) in order.
_ChunkIndex = tuple[list[int], int, list[tuple[tuple[int, ...], tuple[int, ...]]]]
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, 30 bytes
_LOCAL_HEADER_SIGNATURE = 0x04034B50


@contextlib.contextmanager
def trusted_metadata_only() -> Iterator[None]:
    """Checkpoint metadata read in the block goes through the allow-list of
    ``compat.dcp_metadata``; a refusal ends the block as a ``CheckpointError`` naming the file, however
    torch or Megatron wrapped it on the way out."""
    with restricted_metadata() as refused:
        try:
            yield
        except UntrustedCheckpointError as err:
            raise CheckpointError(str(err)) from None
        except BaseException:  # torch's CheckpointException is a BaseException
            if refused:
                raise CheckpointError(refused[0]) from None
            raise


def _check_backends(path: Path) -> None:
    """Megatron picks the loader a checkpoint's ``metadata.json`` names: only the ones whose reads
    go through ``compat.dcp_metadata`` (torch_dist, common state through torch) are let through."""
    if not path.is_file():
        return
    try:
        said = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not JSON ({err})") from None
    backends = (said.get("sharded_backend"), said.get("common_backend")) if isinstance(said, dict) else None
    if backends != ("torch_dist", "torch"):
        raise CheckpointError(
            f"{path}: names the backends {backends}; checkpoints load only as torch_dist "
            "(common state: torch)"
        )


def check_entry_kinds(state: dict, path: Path) -> None:
    """Refuse a checkpoint whose metadata stores an entry the model loads as a tensor as bytes, or
    the reverse, before Megatron plans the load: torch would load such bytes in place of the tensor.
    ``state``: the model's (or optimizer's) sharded state dict; ``path``: the checkpoint directory."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _check_backends(path / "metadata.json")
    metadata_file = path / ".metadata"
    if not metadata_file.is_file():
        return  # Megatron reports the checkpoint incomplete
    try:
        stored = read_metadata_file(metadata_file).state_dict_metadata
    except UntrustedCheckpointError as err:
        raise CheckpointError(str(err)) from None
    for sharded in nested_values(state):
        is_object = isinstance(sharded, ShardedObject)
        key = sharded.unique_key if is_object else getattr(sharded, "key", None)
        if key not in stored:
            continue
        as_bytes = isinstance(stored[key], BytesStorageMetadata)
        if as_bytes != is_object:
            want, got = ("bytes", "a tensor") if is_object else ("a tensor", "bytes")
            raise CheckpointError(
                f"{metadata_file}: entry {key}: the model loads it as {want}, the metadata stores it as {got}"
            )


class _Window(io.RawIOBase):
    """A read-only, seekable file over ``buffer[start : start + length]`` (no copy of the rest)."""

    def __init__(self, buffer: mmap.mmap, start: int, length: int):
        self._buffer, self._start, self._length, self._pos = buffer, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, out) -> int:
        n = min(len(out), self._length - self._pos)
        begin = self._start + self._pos
        out[:n] = self._buffer[begin : begin + n]
        self._pos += n
        return n


# The storage classes torch.save names in its pickle, by the dtype they hold.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class _StoredTensor(NamedTuple):
    storage_key: str
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _TensorRecord(pickle.Unpickler):
    """Unpickles a ``torch.save`` ``data.pkl`` that holds a single tensor, touching no storage
    (``tensor()``). Any other content is refused (``UnpicklingError``): nothing in a checkpoint
    file gets to name a callable."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a checkpoint chunk")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, dtype, key, _location, _numel = pid
        return key, dtype

    @staticmethod
    def _rebuild(storage, storage_offset, size, stride, requires_grad, hooks, *metadata):
        key, dtype = storage
        return _StoredTensor(key, dtype, storage_offset, tuple(size), tuple(stride))

    def tensor(self) -> _StoredTensor:
        """The one tensor the pickle holds (anything else is refused)."""
        found = self.load()
        if not isinstance(found, _StoredTensor):
            raise pickle.UnpicklingError(f"a checkpoint chunk holds {type(found).__name__}, not one tensor")
        return found


def _without_leading_ones(size) -> tuple[int, ...]:
    size = tuple(size)
    while size and size[0] == 1:
        size = size[1:]
    return size


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


class MappedDistCheckpoint:
    """The chunks of a ``torch_dist`` checkpoint directory, viewed through read-only mappings."""

    def __init__(self, path: str | Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        with trusted_metadata_only():
            self.metadata = FileSystemReader(str(self.path)).read_metadata()
            # Not needed for the weights, but a checkpoint with a crafted entry is refused whichever
            # of its entries a reader needs (the rest of the model load reads these).
            if (self.path / "common.pt").is_file():
                load_common(None, self.path)
            self._check_bytes_entries()
        self._storage = {
            (index.fqn, tuple(index.offset)): info
            for index, info in self.metadata.storage_data.items()
            if index.offset is not None
        }
        self.maps = FileMaps()
        self._by_key: dict[str, _ChunkIndex | None] = {}

    def _check_bytes_entries(self) -> None:
        """Every bytes entry (a layer's extra state: a few bytes each) as a load would take it."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        for index, info in self.metadata.storage_data.items():
            if not isinstance(self.metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue
            with open(self.path / info.relative_path, "rb") as file:
                file.seek(info.offset)
                where = f"{self.path / info.relative_path}: entry {index.fqn}"
                extra = "_extra_state" in index.fqn
                value = load_archive(file.read(info.length), where, EXTRA_STATE if extra else TENSORS)
            if extra:
                check_extra_state(value, where)

    def read(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], axis: int = 0
    ) -> torch.Tensor | None:
        """The region ``[offsets, offsets + sizes)`` of tensor ``key`` (global coordinates), shaped
        ``sizes``: a view of the files where one chunk holds it, a new tensor where several chunks
        tiling it along ``axis`` do; ``None`` where it cannot be taken from the chunks directly."""
        meta = self.metadata.state_dict_metadata.get(key)
        chunks = self._chunks_of(key)
        if not chunks or len(offsets) != len(sizes) or len(meta.size) != len(sizes):
            return None
        ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
        starts, longest, ordered = chunks
        # Only chunks that start less than the longest chunk before the region can reach into it.
        first = bisect.bisect_left(starts, offsets[0] - longest + 1)
        pieces = []
        for c_off, c_size in ordered[first : bisect.bisect_left(starts, ends[0])]:
            if any(o >= e or o + n <= b for o, n, b, e in zip(c_off, c_size, offsets, ends, strict=True)):
                continue  # no overlap
            others = [d for d in range(len(sizes)) if d != axis]
            if any(c_off[d] != offsets[d] or c_size[d] != sizes[d] for d in others):
                return None  # split along another axis, or a different region there
            pieces.append((c_off, c_size))
        lo, hi = offsets[axis], ends[axis]
        views, at = [], lo
        for c_off, c_size in pieces:
            begin, end = c_off[axis], c_off[axis] + c_size[axis]
            if not begin <= at < end:
                return None  # a gap between chunks
            tensor = self._chunk(key, c_off, c_size)
            if tensor is None:
                return None
            stop = min(hi, end)
            views.append(tensor.narrow(axis, at - begin, stop - at))
            at = stop
        if at != hi:
            return None
        return views[0] if len(views) == 1 else torch.cat(views, dim=axis)

    def _chunks_of(
        self, key: str
    ) -> tuple[list[int], int, list[tuple[tuple[int, ...], tuple[int, ...]]]] | None:
        """Tensor ``key``'s stored chunks (offsets, sizes) in order, their first-axis starts, and
        the longest first-axis size: a layer-stacked key has a chunk per layer, and each layer's
        read looks only at the chunks near it."""
        if key not in self._by_key:
            chunks = getattr(self.metadata.state_dict_metadata.get(key), "chunks", None)
            if not chunks or not all(len(c.offsets) for c in chunks):
                self._by_key[key] = None
            else:
                ordered = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
                starts = [c_off[0] for c_off, _ in ordered]
                self._by_key[key] = (starts, max(c_size[0] for _, c_size in ordered), ordered)
        return self._by_key[key]

    def _chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor | None:
        info = self._storage.get((key, offsets))
        if info is None or info.transform_descriptors:
            return None
        mapped = self.maps.map(self.path / info.relative_path)
        if info.offset + info.length > len(mapped):
            return None
        try:
            with zipfile.ZipFile(_Window(mapped, info.offset, info.length)) as archive:
                members = archive.infolist()
        except zipfile.BadZipFile:
            return None
        by_name = {m.filename.split("/", 1)[-1]: m for m in members}
        if any(m.compress_type != zipfile.ZIP_STORED for m in members) or "data.pkl" not in by_name:
            return None
        if bytes(self._member(mapped, info.offset, by_name.get("byteorder")) or b"little") != b"little":
            return None
        try:
            storage_key, dtype, storage_offset, size, stride = _TensorRecord(
                io.BytesIO(self._member(mapped, info.offset, by_name["data.pkl"]))
            ).tensor()
        except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError):
            return None
        data = by_name.get(f"data/{storage_key}")
        numel = math.prod(size)
        if (
            data is None
            or _without_leading_ones(size) != _without_leading_ones(sizes)
            or stride != _contiguous_strides(size)
            or (storage_offset + numel) * dtype.itemsize > data.file_size
        ):
            return None
        start = self._data_start(mapped, info.offset, data)
        if start is None or start + data.file_size > info.offset + info.length:
            return None
        return self.maps.view(mapped, dtype, numel, start + storage_offset * dtype.itemsize).view(sizes)

    @staticmethod
    def _data_start(mapped: mmap.mmap, base: int, member: zipfile.ZipInfo) -> int | None:
        """Where a stored member's bytes begin in the file (after its local header)."""
        at = base + member.header_offset
        if at + _LOCAL_HEADER.size > len(mapped):
            return None
        fields = _LOCAL_HEADER.unpack_from(mapped, at)
        if fields[0] != _LOCAL_HEADER_SIGNATURE:
            return None
        name_len, extra_len = fields[9], fields[10]
        return at + _LOCAL_HEADER.size + name_len + extra_len

    def _member(self, mapped: mmap.mmap, base: int, member: zipfile.ZipInfo | None) -> bytes | None:
        if member is None:
            return None
        start = self._data_start(mapped, base, member)
        return None if start is None else mapped[start : start + member.file_size]
