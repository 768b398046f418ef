"""Bucket plans: how HF-named tensors are laid out in the fixed-size byte buffers that get broadcast.

Sender and receivers agree on the plan before any byte moves (it only depends on names, dtypes
and shapes, so it is computed once and reused every step). A bucket is a flat uint8 buffer; each
tensor sits at an offset aligned to 16 bytes so it can be viewed in place with its dtype.

These frozen dataclasses are also the weight sync's wire format: a plan (``tuple[Bucket, ...]``,
in broadcast order) goes from the trainer's senders to the controller and from there to the
senders and to every vLLM worker as it is; each sender answers a sync with :class:`SentBuckets`.

A slot holds either a whole HF tensor (the gathered path: vLLM's ``load_weights`` cuts out each
worker's shard) or a block of one engine rank's vLLM parameter (the shard-wise path, ``into``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

ALIGN = 16

_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits in its bucket."""

    name: str
    """HF tensor name, as vLLM's ``load_weights`` expects it; with ``into``, the vLLM parameter's name."""
    dtype: str
    """Torch dtype name without the ``torch.`` prefix ("bfloat16", "float32", ...)."""
    shape: tuple[int, ...]
    """The HF tensor's shape (whole, not a TP shard); with ``into``, the block's shape."""
    offset: int
    """Byte offset in the bucket (a multiple of ALIGN)."""
    into: tuple[int, int] | None = None
    """Shard-wise: (dim, start): the slot is the block of the receiving rank's parameter at ``start`` along
    ``dim``; None: a whole HF tensor."""
    pad: bool = False
    """Shard-wise: zero the parameter's rows after the block (vLLM's vocabulary padding)."""

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Bucket:
    """One broadcast: a uint8 buffer of ``nbytes`` holding ``slots``' tensors."""

    source: int
    """The broadcast group (link) it travels on: index into the sync's group addresses."""
    nbytes: int
    """Bytes used: the end of the last slot."""
    slots: tuple[Slot, ...] = field(default_factory=tuple)
    """In the order the sender produces the tensors (rule order of the model's HF map)."""


@dataclass(frozen=True)
class SentBuckets:
    """What a stage's sender reports once it has broadcast its buckets of a sync."""

    digests: tuple[tuple[int, str], ...] | None
    """(index in the plan, :func:`checksum` as sent) of every bucket it sent (checksum mode); else None."""
    encoded: tuple[tuple[int, int, int, int, int], ...] = ()
    """Delta mode (``weight_sync.delta``): (index in the plan, words sent as a delta or FULL, payload
    bytes, the bucket's words, its changed words or -1 when not known) of every bucket it sent; empty in
    full mode."""


def plan_buckets(tensors: Iterable[tuple | Slot], bucket_bytes: int, source: int) -> list[Bucket]:
    """Pack tensors in order into buckets of at most ``bucket_bytes``: (name, dtype, shape) each, or a
    :class:`Slot` whose offset is to be set.

    A tensor larger than a bucket gets a bucket of its own (never split: vLLM loads whole tensors).
    """
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for item in tensors:
        slot = item if isinstance(item, Slot) else Slot(item[0], dtype_name(item[1]), tuple(item[2]), 0)
        start = -(-used // ALIGN) * ALIGN
        if slots and start + slot.nbytes > bucket_bytes:
            buckets.append(Bucket(source, used, tuple(slots)))
            slots, start = [], 0
        slots.append(replace(slot, offset=start))
        used = start + slot.nbytes
    if slots:
        buckets.append(Bucket(source, used, tuple(slots)))
    return buckets


def interleave(per_link: Iterable[Sequence[Bucket]]) -> tuple[Bucket, ...]:
    """One plan from every link's buckets: round robin (first buckets of every link, in link order,
    then the second ones, ...), so that all senders work at once. Senders and receivers follow this
    one order, each on its own links, which keeps the broadcasts of different groups free of
    deadlock."""
    lists = [list(b) for b in per_link]
    return tuple(b for row in itertools.zip_longest(*lists) for b in row if b is not None)


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


_DIGEST_CHUNK = 2**23  # 64-bit words digested at a time (64 MiB): bounds the temporaries


def checksum(buf: torch.Tensor) -> str:
    """A digest of a bucket's bytes, computed where they are (no copy to the host), to compare what
    a sender packed with what each receiver got.

    The bytes as little-endian 64-bit words w_1..w_n (the last, short one zero-padded): the sum of
    w_i and the sum of i * w_i, both modulo 2**64. Integer sums do not depend on the order a device
    reduces in, so sender and receiver agree bit for bit on any hardware; a changed word changes the
    first sum, and a moved one the second. It is a check against transport faults, not a
    cryptographic hash.
    """
    flat = buf.detach().reshape(-1)
    n = flat.numel()
    whole = n // 8 * 8
    if whole and flat.data_ptr() % 8:
        flat = flat.clone()  # 64-bit views need an aligned start
    words = flat[:whole].view(torch.int64)
    if whole < n:
        tail = torch.zeros(8, dtype=torch.uint8, device=flat.device)
        tail[: n - whole] = flat[whole:]
        words = torch.cat([words, tail.view(torch.int64)])
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _DIGEST_CHUNK):
        chunk = words[start : start + _DIGEST_CHUNK]
        index = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=flat.device)
        plain += chunk.sum()
        weighted += (chunk * index).sum()
    mask = 2**64 - 1
    return f"{int(plain) & mask:016x}{int(weighted) & mask:016x}"
