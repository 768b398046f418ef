"""Bucket plans: how HF-named tensors are laid out in the fixed-size byte buffers that get broadcast.

Sender and receivers agree on the plan before any byte moves (it only depends on names, dtypes
and shapes, so it is computed once and reused every step). A bucket is a flat uint8 buffer; each
tensor sits at an offset aligned to 16 bytes so it can be viewed in place with its dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

ALIGN = 16

_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Slot:
    name: str
    """HF tensor name, as vLLM's ``load_weights`` expects it."""
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the bucket."""

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Bucket:
    source: int
    """Which sender (pipeline stage) broadcasts it: rank ``source`` of the sync groups' senders."""
    nbytes: int
    slots: tuple[Slot, ...] = field(default_factory=tuple)


def plan_buckets(
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int, source: int
) -> list[Bucket]:
    """Pack (name, dtype, shape) in order into buckets of at most ``bucket_bytes``.

    A tensor larger than a bucket gets a bucket of its own (never split: vLLM loads whole tensors).
    """
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for name, dtype, shape in tensors:
        slot = Slot(name, dtype_name(dtype), tuple(shape), 0)
        start = -(-used // ALIGN) * ALIGN
        if slots and start + slot.nbytes > bucket_bytes:
            buckets.append(Bucket(source, used, tuple(slots)))
            slots, start = [], 0
        slots.append(Slot(slot.name, slot.dtype, slot.shape, start))
        used = start + slot.nbytes
    if slots:
        buckets.append(Bucket(source, used, tuple(slots)))
    return buckets


def pack(bucket: Bucket, tensors: Iterable[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` (in slot order) into ``out`` (uint8, >= bucket.nbytes); returns the used view."""
    buf = out[: bucket.nbytes]
    for slot, tensor in zip(bucket.slots, tensors, strict=True):
        if dtype_name(tensor.dtype) != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"{slot.name}: tensor is {tensor.dtype} {list(tensor.shape)}, "
                f"plan says {slot.dtype} {list(slot.shape)}"
            )
        view = buf[slot.offset : slot.offset + slot.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
    return buf


def unpack(bucket: Bucket, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor view into ``buf``) for every slot of the bucket."""
    for slot in bucket.slots:
        raw = buf[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(_DTYPES[slot.dtype]).view(slot.shape)


def checksum(buf: torch.Tensor) -> str:
    """A digest of a bucket's bytes (debug mode: compare sender and receiver)."""
    return hashlib.blake2b(buf.detach().cpu().numpy().tobytes(), digest_size=16).hexdigest()


def plan_to_dict(buckets: list[Bucket]) -> list[dict]:
    """Plain data for RPCs (vLLM's update_weights takes dicts)."""
    return [
        {
            "source": b.source,
            "nbytes": b.nbytes,
            "slots": [[s.name, s.dtype, list(s.shape), s.offset] for s in b.slots],
        }
        for b in buckets
    ]


def plan_from_dict(data: list[dict]) -> list[Bucket]:
    return [
        Bucket(d["source"], d["nbytes"], tuple(Slot(n, dt, tuple(sh), off) for n, dt, sh, off in d["slots"]))
        for d in data
    ]
