"""The zero-copy file layer: files mapped read-only, and writers that copy mapped bytes file to file.

A conversion moves gigabytes whose bytes already lie in files. ``FileMaps`` maps the input files
read-only, so a tensor viewing one always equals its file range and can stand for it; a
``CopyingFile`` (the file a writer writes, ours or Megatron's) recognises such a buffer when it is
written and copies its bytes from their file in the kernel (``copy_file_range``) instead of from
memory. ``FileCopies`` says which buffers lie where: any in a mapping, and tensors never filled
whose bytes are pieces of files in order (interleaved Q/K/V rows).
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy
import torch

# One run of file bytes: (descriptor, offset, length).
Piece = tuple[int, int, int]


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
