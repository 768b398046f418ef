"""Reading and writing HF checkpoint directories: safetensors shards, index, config/tokenizer files.

Reads are lazy (one tensor at a time from memory-mapped files) and every input is validated from
the file headers before any tensor is read: a truncated file, an index that points at a missing
file or tensor, and tensors that are missing, unexpected or of the wrong shape are reported by
name. Output directories are built under a temporary name and renamed only when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

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


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


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
        out[name] = TensorInfo(path, _DTYPES[meta["dtype"]], tuple(meta["shape"]))
        data_end = max(data_end, meta["data_offsets"][1])
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
        self._handles: dict[Path, object] = {}

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
        from safetensors import safe_open

        info = self.tensors[name]
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
        return handle.get_tensor(name)


class ShardedWriter:
    """Writes tensors to safetensors shards of at most ``max_shard_bytes`` plus an index.

    Holds at most one shard in memory. Shards are named ``model-XXXXX-of-YYYYY.safetensors`` once
    the count is known (``close``); a single shard becomes ``model.safetensors`` with no index.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # Own contiguous storage: safetensors refuses views that share memory with each other.
        self._pending[name] = tensor.detach().contiguous().clone()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".shard-{len(self._written):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            final = self.out_dir / SINGLE_NAME
            os.replace(self._written[0][0], final)
            return [final]
        weight_map, finals = {}, []
        for i, (path, names) in enumerate(self._written):
            final = self.out_dir / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(path, final)
            finals.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return finals


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

    A crash or kill leaves at most a ``.<name>.tmp-<pid>`` directory, never a directory at ``out``.
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
    os.replace(tmp, out)
