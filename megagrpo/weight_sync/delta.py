"""Delta weight sync (``generation.sync_mode: delta``): after a full sync, a bucket travels as the elements
whose bytes changed since the last sync, and each receiver patches its copy of the bucket with them.

**Encoding.** A bucket's bytes are read as words of its slots' element size (2 bytes for bf16/fp16, 4 for
fp32); the changed words are sent as int32 flat word indices followed (at a 16-byte boundary) by the new
words: ``6 n`` bytes for ``n`` changed bf16 elements. A bitmask of changed words with their values would
cost a fixed 1/16 of a bf16 bucket plus ``2 n``: cheaper only past 3.1% changed, while a bf16 step
changes a few percent of a dense model's elements (the rest round back to the value they had) and far
fewer of a mixture-of-experts model's; an XOR stream compressed by zlib or similar would need a codec
the device cannot run. So: indices and values, and a bucket goes whole (:data:`FULL`) when more than
``generation.sync_delta_max_fraction`` of its words changed or the encoding would not be smaller.

**Headers.** Every bucket of a delta-mode sync is announced by a 16-byte header, two int64: the count
of changed words (``FULL``: the whole bucket follows) and the payload's bytes, so that receivers post
a payload of the right size; a broadcast link sends the header, then the payload, in plan order.

**Copies.** Each sender keeps the last-sent bytes of each of its buckets (:class:`SentCopies`, host
memory: ``megagrpo plan`` counts them), each receiving worker the bytes it rebuilt
(:class:`ReceivedCopies`, host memory too). A sender's copies are dropped when its links are opened
(engines started, restarted, replaced, or a run resumed: any engine whose bytes are not known gets whole
buckets) and after a send that failed; a receiver's when it joins, and after a receive that failed; a
receiver asked to patch a bucket it holds no copy of raises naming the bucket. The rebuilt bucket is
what the engine digests and loads, so the digests the controller compares prove that the engine's
bytes equal the trainer's after every delta sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megagrpo.weight_sync.buckets import _DTYPES, ALIGN, Bucket, checksum

FULL = -1
"""A header's count for a bucket sent whole."""
HEADER_WORDS = 2
"""A header: (count of changed words or FULL, payload bytes), int64 each."""
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_WORDS = 2**31 - 1  # int32 indices


def word_dtype(bucket: Bucket) -> torch.dtype:
    """The integer type a bucket's bytes are compared in: its slots' smallest element size (every slot's
    offset and size are multiples of it)."""
    size = min((_DTYPES[s.dtype].itemsize for s in bucket.slots), default=1)
    return _WORDS[size]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def payload_bytes(count: int, word: torch.dtype) -> int:
    """Bytes of an encoded delta of ``count`` changed words."""
    return _align(4 * count) + count * word.itemsize


@dataclass(frozen=True)
class Encoded:
    """One bucket as a sender puts it on the wire."""

    count: int
    """Changed words, or FULL."""
    nbytes: int
    """The payload's bytes: the bucket's own for FULL."""
    words: int
    """The bucket's words (for the changed fraction)."""
    changed: int = -1
    """Words whose bytes changed since the last sync (also when sent whole past the threshold); -1: not
    known (no earlier bytes: the first sync)."""

    def header(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor([self.count, self.nbytes], dtype=torch.int64, device=device)


def changed_words(new: torch.Tensor, old: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """Flat indices (int64, ascending) of the words where the bytes ``new`` and ``old`` differ."""
    return (new.view(word) != old.view(word)).nonzero().squeeze(1)


def encode(
    new: torch.Tensor, old: torch.Tensor, word: torch.dtype, max_fraction: float, out: torch.Tensor
) -> tuple[Encoded, torch.Tensor | None]:
    """Encode ``new`` (a bucket's uint8 bytes) against ``old`` (the same bucket as last sent, on the same
    device) into ``out`` (uint8, at least ``new``'s size): (the encoding, the changed indices) or, when more
    than ``max_fraction`` of the words changed or the delta would not be smaller, (a FULL one, None)."""
    words = new.numel() // word.itemsize
    idx = changed_words(new, old, word)
    count = idx.numel()
    nbytes = payload_bytes(count, word)
    if words > _MAX_WORDS or count > max_fraction * words or nbytes >= new.numel():
        return Encoded(FULL, new.numel(), words, count), None
    start = _align(4 * count)
    out[: 4 * count].view(torch.int32).copy_(idx)
    out[start:nbytes].view(word).copy_(new.view(word)[idx])
    return Encoded(count, nbytes, words, count), idx


def decode(payload: torch.Tensor, count: int, word: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 word indices, new words) of an encoded delta of ``count`` words."""
    idx = payload[: 4 * count].view(torch.int32).long()
    start = _align(4 * count)
    return idx, payload[start : start + count * word.itemsize].view(word)


def apply(buf: torch.Tensor, payload: torch.Tensor, count: int, word: torch.dtype) -> None:
    """Patch ``buf`` (a bucket's uint8 bytes as last received) in place with an encoded delta."""
    idx, values = decode(payload, count, word)
    buf.view(word)[idx] = values


class _Copies:
    """Bytes of buckets, by plan index, in host memory: what one side of a link last had of each."""

    def __init__(self):
        self.last: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.last.values())

    def clear(self) -> None:
        self.last = {}


class SentCopies(_Copies):
    """A sender's last-sent bytes of each of its buckets."""

    def __init__(self, max_fraction: float):
        super().__init__()
        self.max_fraction = max_fraction

    def encode(self, index: int, bucket: Bucket, buf: torch.Tensor, out: torch.Tensor) -> Encoded:
        """Encode bucket ``index``, packed in ``buf``, into ``out`` against its last-sent bytes (FULL when
        there are none: the receivers do not have them either), and remember ``buf`` as sent."""
        word = word_dtype(bucket)
        last = self.last.get(index)
        if last is None or last.numel() != buf.numel():
            self.last[index] = buf.to("cpu", copy=True)
            return Encoded(FULL, buf.numel(), buf.numel() // word.itemsize)
        encoded, idx = encode(buf, last.to(buf.device), word, self.max_fraction, out)
        if idx is None:
            last.copy_(buf)
        else:
            last.view(word)[idx.cpu()] = buf.view(word)[idx].cpu()
        return encoded


class ReceivedCopies(_Copies):
    """A receiving worker's bytes of each bucket it received."""

    def restore(self, index: int, bucket: Bucket, count: int, payload: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s whole bytes from what arrived (``payload``, on the worker's device): the
        payload itself when it came whole, else its last bytes patched with the delta (on the payload's
        device; a CPU worker patches its host copy in place and loads from it)."""
        if count == FULL:
            if payload.numel() != bucket.nbytes:
                raise RuntimeError(
                    f"delta weight sync: bucket {index} came whole with {payload.numel()} bytes, "
                    f"the plan says {bucket.nbytes}"
                )
            self.last[index] = payload.to("cpu", copy=True)
            return payload
        last = self.last.get(index)
        if last is None:
            names = ", ".join(s.name for s in bucket.slots[:3])
            raise RuntimeError(
                f"delta weight sync: bucket {index} ({names}) came as a delta of {count} elements, but this "
                "worker holds no earlier bytes of it: its sender believed this engine had them"
            )
        word = word_dtype(bucket)
        if payload.device.type == "cpu":
            apply(last, payload, count, word)
            return last
        whole = last.to(payload.device)
        apply(whole, payload, count, word)
        idx, values = decode(payload, count, word)
        last.view(word)[idx.cpu()] = values.cpu()
        return whole


def slot_digests(bucket: Bucket, buf: torch.Tensor) -> str:
    """A bucket's digest in delta mode: one ``checksum`` per slot (its tensor's bytes), joined by ``;``,
    so that a mismatch names the tensor whose bytes differ, not only the bucket."""
    return ";".join(checksum(buf[s.offset : s.offset + s.nbytes]) for s in bucket.slots)


def differing_tensor(bucket: Bucket, got: str, want: str) -> str | None:
    """The first tensor of ``bucket`` whose per-slot digest (:func:`slot_digests`) differs; None when the
    digests are not per slot."""
    parts_got, parts_want = got.split(";"), want.split(";")
    if len(parts_got) != len(bucket.slots) or len(parts_want) != len(bucket.slots):
        return None
    for slot, a, b in zip(bucket.slots, parts_got, parts_want, strict=True):
        if a != b:
            return slot.name
    return None
