"""Reading and writing HF checkpoint directories: safetensors shards, index, config/tokenizer files.

Reads are lazy: one tensor (or row range) at a time, either read into memory of the caller's or,
for a conversion that only writes the bytes out again, viewed in place through a read-only mapping
of the file (no copy; the pages stay the page cache's), whose place in the file a writer may copy
from instead (``CopyingFile``). Every input is validated from
the file headers before any tensor is read: a truncated file, an index that points at a missing
file or tensor, and tensors that are missing, unexpected or of the wrong shape are reported by
name. Output directories are built under a temporary name, synced, and renamed only when complete.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import mmap
import os
import shutil
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy
import torch

from megagrpo.models.durable import (
    WRITEBACK_STEP,
    WritebackThread,
    background_writeback,
    fsync_dir,
    fsync_tree,
)

# Files that travel with the weights: what transformers and vLLM read besides the tensors.
AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """An input checkpoint is malformed; the message names the file and tensor."""


# One run of file bytes: (descriptor, offset, length).
Piece = tuple[int, int, int]


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's data in ``file``."""
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes and shapes of one safetensors file, checking the file is complete."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file (header of {header_len} bytes, file {size})"
            )
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from err
    header.pop("__metadata__", None)
    out, data_end = {}, 0
    for name, meta in header.items():
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        dtype, shape = _DTYPES[meta["dtype"]], tuple(meta["shape"])
        begin, end = meta["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name} spans {end - begin} bytes, its shape {list(shape)} and dtype "
                f"{meta['dtype']} need {math.prod(shape) * dtype.itemsize}"
            )
        out[name] = TensorInfo(path, dtype, shape, 8 + header_len + begin, end - begin)
        data_end = max(data_end, end)
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensors end at byte {8 + header_len + data_end}, "
            f"file has {size}"
        )
    return out


class FileMaps:
    """Files mapped read-only and shared, each kept open: a tensor viewing one holds the file's
    bytes at every moment (writing to it faults), so where it lies in its file can stand for it
    (``locate``), and a writer may copy those bytes file to file instead."""

    def __init__(self):
        self._maps: dict[Path, mmap.mmap] = {}
        self._files: dict[Path, BinaryIO] = {}
        self._spans: list[tuple[int, int, BinaryIO]] = []  # (address, length, open file)

    def map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            fh = open(path, "rb")  # noqa: SIM115  (kept open for locate)
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path], self._files[path] = mapped, fh
            self._spans.append((self.view(mapped, torch.uint8, 1, 0).data_ptr(), len(mapped), fh))
        return self._maps[path]

    @staticmethod
    def view(mapped: mmap.mmap, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
        """``count`` elements of ``mapped`` from byte ``offset``; the storage is exactly those bytes."""
        with warnings.catch_warnings():  # read-only on purpose: see the class docstring
            warnings.filterwarnings("ignore", message=".*buffer is not writable.*")
            return torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset)

    def descriptor(self, path: Path) -> int:
        """The open descriptor of ``path`` (mapped first if it is not yet)."""
        self.map(path)
        return self._files[path].fileno()

    def locate(self, address: int, nbytes: int) -> Piece | None:
        """Where the ``nbytes`` at ``address`` lie in a file, if a mapping of it holds them."""
        for base, length, fh in self._spans:
            if base <= address and address + nbytes <= base + length:
                return fh.fileno(), address - base, nbytes
        return None


class HFCheckpoint:
    """The tensors of an HF checkpoint directory, read lazily."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.maps = FileMaps()
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.tensors: dict[str, TensorInfo] = {}
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise CheckpointError(
                f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors is supported)"
            )
        for fname in files:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"{index}: refers to {fname}, which does not exist")
            for name, info in read_safetensors_header(path).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{path}: tensor {name} also appears in {self.tensors[name].file.name}"
                    )
                self.tensors[name] = info
        if weight_map is not None:
            for name, fname in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != fname:
                    raise CheckpointError(f"{index}: lists tensor {name} in {fname}, which does not hold it")

    def validate(self, expected: dict[str, tuple[int, ...]]) -> torch.dtype:
        """Check names and shapes against ``expected``; return the (single) floating dtype."""
        missing = sorted(set(expected) - set(self.tensors))
        if missing:
            raise CheckpointError(f"{self.dir}: missing tensor {missing[0]} ({len(missing)} missing in all)")
        extra = sorted(set(self.tensors) - set(expected))
        if extra:
            raise CheckpointError(
                f"{self.dir}: unexpected tensor {extra[0]} in {self.tensors[extra[0]].file.name} "
                f"({len(extra)} unexpected in all); the config does not describe this checkpoint"
            )
        for name, want in expected.items():
            got = self.tensors[name].shape
            if got != tuple(want):
                raise CheckpointError(
                    f"{self.tensors[name].file}: tensor {name} has shape {list(got)}, "
                    f"config.json implies {list(want)}"
                )
        example = {info.dtype: name for name, info in self.tensors.items()}
        if len(example) != 1:
            listing = ", ".join(f"{name} is {dtype}" for dtype, name in example.items())
            raise CheckpointError(f"{self.dir}: tensors of mixed dtypes ({listing}); one dtype is expected")
        return next(iter(example))

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in memory of its own (the file is read, not mapped)."""
        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=info.dtype)
        self._read_bytes(name, info.offset, out)
        return out

    def read_rows_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows ``[start, stop)`` of tensor ``name`` (elements, for a 1-D tensor) into ``out``, a
        contiguous CPU tensor of that shape and the file's dtype (e.g. a slice of a parameter)."""
        info, first_byte = self._row_range(name, start, stop)
        want = (stop - start, *info.shape[1:])
        if tuple(out.shape) != want or out.dtype != info.dtype or not out.is_contiguous() or out.is_cuda:
            raise ValueError(
                f"{name}: rows {start}:{stop} are {info.dtype} {list(want)}; the destination is "
                f"{out.dtype} {list(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
            )
        self._read_bytes(name, first_byte, out)

    def map_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` as a view of the file's bytes, read by nobody
        until used (``FileMaps``: read-only, so ``maps.locate`` may stand for it). The tensor's
        storage is exactly these rows (a checkpoint writer that copies out views of larger storages
        takes it as it is) and keeps the mapping alive."""
        info, first_byte = self._row_range(name, start, stop)
        shape = (stop - start, *info.shape[1:])
        if start == stop:
            return torch.empty(shape, dtype=info.dtype)
        mapped = self.maps.map(info.file)
        return self.maps.view(mapped, info.dtype, math.prod(shape), first_byte).view(shape)

    def row_piece(self, name: str, start: int, stop: int) -> Piece:
        """Where rows ``[start, stop)`` of tensor ``name`` lie: (descriptor, offset, length)."""
        info, first_byte = self._row_range(name, start, stop)
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        return self.maps.descriptor(info.file), first_byte, (stop - start) * row_bytes

    def _row_range(self, name: str, start: int, stop: int) -> tuple[TensorInfo, int]:
        """Tensor ``name``'s info and the file offset of its row ``start``, checking ``[start, stop)``."""
        info = self.tensors[name]
        if not 0 <= start <= stop <= (info.shape[0] if info.shape else 0):
            raise CheckpointError(f"{info.file}: rows {start}:{stop} of tensor {name} {list(info.shape)}")
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        return info, info.offset + start * row_bytes

    def _read_bytes(self, name: str, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous CPU) with the file bytes from ``offset`` on."""
        nbytes = out.numel() * out.element_size()
        if not nbytes:
            return
        info = self.tensors[name]
        view = memoryview(out.detach().view(-1).view(torch.uint8).numpy())
        with open(info.file, "rb", buffering=0) as fh:
            fh.seek(offset)
            got = 0
            while got < nbytes:
                n = fh.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{info.file}: tensor {name} ends early (truncated while read)")
                got += n


_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def write_sharded(
    out_dir: Path,
    specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int,
    *,
    copies: FileCopies | None = None,
) -> list[Path]:
    """Write safetensors shards of at most ``max_shard_bytes`` plus an index, streaming.

    ``specs`` (name, shape, dtype), in order, plan the shards and their headers before any data;
    ``tensors`` then yields each tensor in that order, and its bytes go straight to its file (a
    contiguous copy only of a strided view), so the producer may compute each one on demand and
    nothing like a whole shard is ever held. Shards are named ``model-XXXXX-of-YYYYY.safetensors``;
    a single shard is ``model.safetensors`` with no index. Writeback to disk is started as the
    bytes go out (``durable.start_writeback``), so syncing the shards afterwards waits for little.

    ``copies``: tensors whose bytes also lie in files; the shards are ``CopyingFile``s over them, so
    those bytes are copied file to file by the kernel, never passing through this process (1.5x the
    speed of writing them from a mapping here).
    """
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for name, shape, dtype in specs:
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors")
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(shape), dtype))
        size += nbytes
    count = len(shards)
    paths = (
        [out_dir / SINGLE_NAME]
        if count == 1
        else [out_dir / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    stream = iter(tensors)
    weight_map, total = {}, 0
    with background_writeback() as writeback:
        for path, shard in zip(paths, shards, strict=True):
            total += _write_shard(path, shard, stream, copies or FileCopies(), writeback)
            weight_map.update(dict.fromkeys((name for name, _, _ in shard), path.name))
    extra = next(stream, None)
    if extra is not None:
        raise ValueError(f"tensor {extra[0]} was not in the plan")
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def _write_shard(
    path: Path,
    shard: list[tuple[str, tuple[int, ...], torch.dtype]],
    stream: Iterator[tuple[str, torch.Tensor]],
    copies: FileCopies,
    writeback: WritebackThread,
) -> int:
    """Write one safetensors shard holding ``shard``'s tensors, taken in order from ``stream``;
    return its data bytes."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in shard:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _DTYPE_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with CopyingFile(path, copies) as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        written, queued = 8 + len(raw), 0  # bytes in the file; bytes queued for the disk
        for name, shape, dtype in shard:
            got_name, tensor = next(stream, (None, None))
            if got_name != name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                got = "nothing" if got_name is None else f"{got_name} {list(tensor.shape)} {tensor.dtype}"
                raise ValueError(f"{path.name}: expected tensor {name} {list(shape)} {dtype}, got {got}")
            if not tensor.numel():
                continue
            data = tensor.detach().to("cpu").contiguous()  # a copy only of a strided view
            fh.write(memoryview(data.view(-1).view(torch.uint8).numpy()))
            written += tensor.numel() * tensor.element_size()
            if written - queued >= WRITEBACK_STEP:
                writeback.start(fh.fileno(), queued, written - queued)
                queued = written
        writeback.start(fh.fileno(), queued, written - queued)  # the tail, as the file is done
    return offset


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _copy_range(src_fd: int, src_offset: int, dst_fd: int, nbytes: int) -> bool:
    """Append ``nbytes`` of ``src_fd`` from ``src_offset`` to ``dst_fd`` in the kernel. False (and
    nothing written) where the system cannot (no ``copy_file_range``, or files it will not copy
    between); a failure part-way raises."""
    copied = 0
    while copied < nbytes:
        try:
            n = os.copy_file_range(src_fd, dst_fd, nbytes - copied, src_offset + copied)
        except (AttributeError, OSError) as err:
            if copied or (isinstance(err, OSError) and err.errno not in _NO_KERNEL_COPY):
                raise
            return False
        if n == 0:
            raise OSError(f"source file ended {nbytes - copied} bytes early (copy_file_range)")
        copied += n
    return True


# Errors that mean "this kernel or filesystem pair does not copy ranges": write from memory instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class FileCopies:
    """Buffers whose bytes lie in files, for ``CopyingFile``s to copy from there.

    A buffer is known by (address, length): any that lies in a mapping of ``maps`` (one piece of
    its file), and those ``add``ed, made of pieces of files in order (a tensor laid out from
    several file ranges and never filled: interleaved Q/K/V). ``share()``, before writer processes
    fork, puts the record of which added buffers were written from their files in memory the
    writers share, so the parent can check (``written``) that no never-filled buffer was written
    as it is.
    """

    def __init__(self, maps: FileMaps | None = None):
        self.maps = maps
        self.pieces: dict[tuple[int, int], tuple[Piece, ...]] = {}
        self._slots: dict[tuple[int, int], int] = {}
        self._written: mmap.mmap | None = None

    def add(self, tensor: torch.Tensor, pieces: Sequence[Piece]) -> None:
        key = _buffer_key(tensor)
        if not tensor.is_contiguous() or sum(n for _, _, n in pieces) != key[1]:
            raise ValueError(f"pieces of {sum(n for _, _, n in pieces)} bytes for a tensor of {key[1]}")
        self.pieces[key] = tuple(pieces)
        self._slots.setdefault(key, len(self._slots))

    def find(self, address: int, nbytes: int) -> tuple[Piece, ...] | None:
        """The file pieces that the ``nbytes`` at ``address`` are, or None."""
        pieces = self.pieces.get((address, nbytes))
        if pieces is None and self.maps is not None:
            piece = self.maps.locate(address, nbytes)
            pieces = None if piece is None else (piece,)
        return pieces

    def share(self) -> None:
        self._written = mmap.mmap(-1, max(1, len(self._slots)))  # anonymous, shared across fork

    def mark_written(self, key: tuple[int, int]) -> None:
        if self._written is not None and key in self._slots:
            self._written[self._slots[key]] = 1

    def written(self, tensor: torch.Tensor) -> bool:
        key = _buffer_key(tensor)
        return self._written is not None and key in self._slots and self._written[self._slots[key]] == 1


def _buffer_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, byte length) of a tensor's bytes, as ``CopyingFile`` sees them written."""
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


class CopyingFile(io.FileIO):
    """A file opened for writing in which writing a buffer that ``copies`` knows becomes copies
    from the files its bytes lie in: by the kernel (``copy_file_range``: the bytes never pass
    through this process), or read and written where the kernel cannot copy between the files.

    A buffer is taken from its files only when ``copies`` knows exactly its bytes (an added
    tensor's, or bytes that a mapped file holds); anything else is written from memory. Every
    write is whole (a writer such as ``torch.save`` ignores a short count).
    """

    def __init__(self, path: str | os.PathLike, copies: FileCopies):
        super().__init__(path, "wb")
        self.copies = copies

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes:
            key = (numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data, view.nbytes)
            pieces = self.copies.find(*key)
            if pieces is not None:
                for fd, offset, nbytes in pieces:
                    if not _copy_range(fd, offset, self.fileno(), nbytes):
                        _copy_by_reading(fd, offset, self.fileno(), nbytes)
                self.copies.mark_written(key)
                return view.nbytes
        _write_all(self.fileno(), view)
        return view.nbytes


def _copy_by_reading(src_fd: int, src_offset: int, dst_fd: int, nbytes: int) -> None:
    """Append ``nbytes`` of ``src_fd`` from ``src_offset`` to ``dst_fd`` through this process, a
    bounded chunk at a time (where the kernel cannot copy between the files)."""
    copied = 0
    while copied < nbytes:
        chunk = os.pread(src_fd, min(nbytes - copied, _READ_CHUNK), src_offset + copied)
        if not chunk:
            raise OSError(f"source file ended {nbytes - copied} bytes early")
        _write_all(dst_fd, memoryview(chunk))
        copied += len(chunk)


_READ_CHUNK = 64 * 1024**2


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    """Copy config, generation config and tokenizer files present in ``src``; return their names."""
    copied = []
    for name in AUX_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


@contextlib.contextmanager
def atomic_output_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` only if the block completes.

    A crash or kill leaves at most a ``.<name>.tmp-<pid>`` directory, never a directory at ``out``;
    and what is renamed to ``out`` is on disk first (every file and directory fsync'd), so not even
    a power loss leaves a directory at ``out`` with missing or zeroed data.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: output directory already exists; remove it or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)
    os.replace(tmp, out)
    fsync_dir(out.parent)
