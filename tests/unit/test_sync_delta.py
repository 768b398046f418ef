"""Delta weight sync's encoding (``weight_sync.delta``): hand-made buckets through a sender's and a
receiver's copies, byte for byte; the threshold and size fallbacks; per-tensor digests; the config key."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megagrpo.config import ConfigError, load_config
from megagrpo.weight_sync.buckets import SentBuckets, pack, plan_buckets
from megagrpo.weight_sync.delta import (
    FULL,
    ReceivedCopies,
    SentCopies,
    apply,
    differing_tensor,
    encode,
    payload_bytes,
    slot_digests,
    word_dtype,
)
from megagrpo.weight_sync.sync import sync_stats

pytestmark = pytest.mark.unit

SHAPES = [
    ("a.weight", torch.bfloat16, (7, 5)),
    ("b.weight", torch.bfloat16, (3,)),
    ("c.bias", torch.bfloat16, (9,)),
]


def _bucket():
    (bucket,) = plan_buckets(SHAPES, 1 << 20, 0)
    return bucket


def _tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _, dtype, shape in SHAPES]


def _packed(bucket, tensors):
    return pack(bucket, tensors, torch.zeros(bucket.nbytes, dtype=torch.uint8)).clone()


def _roundtrip(sender: SentCopies, receiver: ReceivedCopies, bucket, tensors):
    """One sync of one bucket: packed, encoded, 'sent' (the payload bytes copied), rebuilt."""
    buf = _packed(bucket, tensors)
    wire = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)  # stale bytes the payload overwrites
    sent = sender.encode(0, bucket, buf, wire)
    payload = (buf if sent.count == FULL else wire)[: sent.nbytes].clone()
    return buf, sent, receiver.restore(0, bucket, sent.count, payload)


def test_sender_and_receiver_copies_rebuild_the_bucket_exactly_over_syncs():
    bucket = _bucket()
    assert word_dtype(bucket) == torch.int16  # bf16 elements compared as 2-byte words
    sender, receiver = SentCopies(max_fraction=0.25), ReceivedCopies()
    tensors = _tensors(0)
    buf, sent, got = _roundtrip(sender, receiver, bucket, tensors)
    assert sent.count == FULL and sent.changed == -1  # nothing known yet: whole
    assert torch.equal(got, buf)
    # Two elements of a.weight and one of c.bias change: three words, at their flat word indices.
    tensors[0][2, 3] += 1.0
    tensors[0][6, 4] = -tensors[0][6, 4] - 1
    tensors[2][8] = 0.0 if tensors[2][8] != 0 else 1.0
    buf, sent, got = _roundtrip(sender, receiver, bucket, tensors)
    c_offset = bucket.slots[2].offset // 2
    assert (sent.count, sent.changed, sent.nbytes) == (3, 3, payload_bytes(3, torch.int16))
    assert torch.equal(got, buf) and torch.equal(sender.last[0], buf) and torch.equal(receiver.last[0], buf)
    idx = torch.tensor([2 * 5 + 3, 6 * 5 + 4, c_offset + 8])
    changed = (buf.view(torch.int16) != _packed(bucket, _tensors(0)).view(torch.int16)).nonzero().squeeze(1)
    assert torch.equal(changed, idx)
    # Nothing changed: an empty delta, the header alone.
    _, sent, got = _roundtrip(sender, receiver, bucket, tensors)
    assert (sent.count, sent.nbytes) == (0, 0) and torch.equal(got, buf)


def test_past_the_threshold_or_without_gain_a_bucket_goes_whole():
    bucket = _bucket()
    words = bucket.nbytes // 2
    old = _packed(bucket, _tensors(0))
    out = torch.empty(bucket.nbytes, dtype=torch.uint8)
    new = old.clone()
    new.view(torch.int16)[: words // 5] += 1  # 20% of the words
    enc, idx = encode(new, old, torch.int16, 0.25, out)
    assert enc.count == words // 5 and idx is not None
    enc, idx = encode(new, old, torch.int16, 0.1, out)  # over the threshold
    assert (enc.count, enc.nbytes, enc.changed, idx) == (FULL, bucket.nbytes, words // 5, None)
    # Under any threshold, a delta as large as the bucket is not sent: 6 bytes per bf16 word vs 2.
    new.view(torch.int16)[: words // 2] += 1
    enc, _ = encode(new, old, torch.int16, 1.0, out)
    assert enc.count == FULL and enc.changed == words // 2
    # The sender's copy follows the whole bucket too.
    sender = SentCopies(max_fraction=0.1)
    sender.encode(0, bucket, old, out)
    assert sender.encode(0, bucket, new, out).count == FULL and torch.equal(sender.last[0], new)


def test_apply_patches_fp32_words_in_place():
    old = torch.arange(16, dtype=torch.float32).view(torch.uint8).clone()
    new = old.clone()
    new.view(torch.float32)[[1, 14]] = torch.tensor([-1.5, 1e30])
    out = torch.empty_like(old)
    enc, _ = encode(new, old, torch.int32, 0.5, out)
    assert enc.count == 2 and enc.nbytes == 16 + 2 * 4
    apply(old, out[: enc.nbytes], enc.count, torch.int32)
    assert torch.equal(old, new)


def test_a_delta_for_a_bucket_the_receiver_never_had_is_refused_naming_it():
    bucket = _bucket()
    with pytest.raises(
        RuntimeError, match=r"bucket 0 \(a\.weight, b\.weight, c\.bias\) came as a delta of 1"
    ):
        ReceivedCopies().restore(0, bucket, 1, torch.zeros(32, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"bucket 0 came whole with 3 bytes, the plan says"):
        ReceivedCopies().restore(0, bucket, FULL, torch.zeros(3, dtype=torch.uint8))


def test_per_tensor_digests_name_the_tensor_that_differs():
    bucket = _bucket()
    buf = _packed(bucket, _tensors(0))
    want = slot_digests(bucket, buf)
    assert differing_tensor(bucket, want, want) is None
    buf[bucket.slots[1].offset] ^= 1
    assert differing_tensor(bucket, slot_digests(bucket, buf), want) == "b.weight"
    assert differing_tensor(bucket, "0" * 32, want) is None  # a bucket-wide digest: not per tensor


def test_sync_stats_count_each_links_bytes_and_the_changed_fraction():
    a = plan_buckets(SHAPES[:1], 1 << 20, 0) + plan_buckets(SHAPES[1:], 1 << 20, 1)
    plan = tuple(a)
    full = sync_stats(plan, [SentBuckets(None), None])
    assert full.link_bytes == (plan[0].nbytes, plan[1].nbytes) and math.isnan(full.changed_fraction)
    assert "sync/changed_fraction" not in full.metrics
    sent = [SentBuckets(None, ((0, 3, 32, 35, 3),)), SentBuckets(None, ((1, FULL, plan[1].nbytes, 12, 10),))]
    stats = sync_stats(plan, sent)
    assert stats.link_bytes == (16 + 32, 16 + plan[1].nbytes) and stats.delta_buckets == 1
    assert stats.changed_fraction == pytest.approx(13 / 47)
    first = sync_stats(plan, [SentBuckets(None, ((0, FULL, plan[0].nbytes, 35, -1),)), None])
    assert math.isnan(first.changed_fraction)


def test_the_sync_mode_keys_are_checked_and_fp32_delta_is_warned():
    with pytest.raises(ConfigError, match=r"generation\.sync_mode"):
        load_config(None, ["generation.sync_mode=sparse"])
    with pytest.raises(ConfigError, match=r"generation\.sync_delta_max_fraction"):
        load_config(None, ["generation.sync_delta_max_fraction=0"])
    with pytest.warns(
        UserWarning, match=r"generation\.sync_mode: delta with model\.dtype float32 buys little"
    ):
        load_config(None, ["generation.sync_mode=delta", "model.dtype=float32"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, ["generation.sync_mode=delta", "model.dtype=bfloat16"])
    assert cfg.generation.sync_mode == "delta" and cfg.generation.sync_delta_max_fraction == 0.25
