"""Reading and writing HF checkpoint directories: safetensors shards, index, config/tokenizer files.

Reads are lazy: one tensor (or row range) at a time, either read into memory of the caller's or,
for a conversion that only writes the bytes out again, viewed in place through a read-only mapping
of the file (no copy; the pages stay the page cache's), whose place in the file a writer may copy
from instead (``CopyingFile``). Every input is validated from
the file headers before any tensor is read: a truncated file, an index that points at a missing
file or tensor, and tensors that are missing, unexpected or of the wrong shape are reported by
name. Output directories are built under a temporary name and published whole (``durable``).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.durable import WRITEBACK_STEP, WritebackThread, background_writeback
from megagrpo.ckpt.files import CopyingFile, FileCopies, FileMaps, Piece
from megagrpo.ckpt.links import check_no_outside_links

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
        """Fill ``out`` (contiguous CPU) with the file bytes from ``offset`` on.

        Copied from the file's read-only mapping: reading into ``out`` through the buffer protocol
        would mark its storage unresizable for good, and a parameter's storage must stay resizable
        (``policy.offload`` parks it by resizing it in place)."""
        nbytes = out.numel() * out.element_size()
        if not nbytes:
            return
        info = self.tensors[name]
        mapped = self.maps.map(info.file)
        if offset + nbytes > len(mapped):
            raise CheckpointError(f"{info.file}: tensor {name} ends early (truncated while read)")
        out.detach().view(-1).view(torch.uint8).copy_(self.maps.view(mapped, torch.uint8, nbytes, offset))


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


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    """Copy config, generation config and tokenizer files present in ``src``; return their names.

    A directory with a link out of it is refused first (``links``): what is copied here is published
    with checkpoints and exports."""
    check_no_outside_links(src)
    copied = []
    for name in AUX_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
