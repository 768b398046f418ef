import pytest
import torch

from megagrpo.models.layout import (
    is_gated_fc1,
    layer_offset,
    shift_layer_index,
    tp_merge,
    tp_shard,
)
from megagrpo.models.shape import padded_vocab_size

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shard_merge_round_trip(dim, tp):
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    shards = [tp_shard(full, partition_dim=dim, tp_rank=r, tp_size=tp) for r in range(tp)]
    assert all(s.shape[dim] == full.shape[dim] // tp for s in shards)
    assert torch.equal(tp_merge(shards, partition_dim=dim), full)


def test_gated_fc1_shard_keeps_gate_and_up_rows_together():
    ffn, hidden, tp = 4, 3, 2
    gate = torch.full((ffn, hidden), 1.0) * torch.arange(ffn)[:, None]
    up = 100 + gate
    full = torch.cat([gate, up])  # TP=1 layout: [gate; up]
    shard0 = tp_shard(full, partition_dim=0, tp_rank=0, tp_size=tp, gated=True)
    # Rank 0 holds gate rows 0-1 and the matching up rows 0-1.
    assert torch.equal(shard0, torch.cat([gate[:2], up[:2]]))
    shards = [tp_shard(full, partition_dim=0, tp_rank=r, tp_size=tp, gated=True) for r in range(tp)]
    assert torch.equal(tp_merge(shards, partition_dim=0, gated=True), full)
    # A plain concatenation would interleave gate/up blocks: the gated path is not a no-op.
    assert not torch.equal(torch.cat(shards), full)


def test_replicated_tensor_is_not_split():
    norm = torch.ones(5)
    assert tp_shard(norm, partition_dim=-1, tp_rank=1, tp_size=2) is norm


def test_indivisible_shard_names_shape():
    with pytest.raises(ValueError, match=r"\(5, 2\).*TP=2"):
        tp_shard(torch.zeros(5, 2), partition_dim=0, tp_rank=0, tp_size=2)


def test_layer_names_and_offsets():
    assert layer_offset(8, 4, 3) == 6
    with pytest.raises(ValueError, match=r"num_layers=6.*pipeline parallel size 4"):
        layer_offset(6, 4, 0)
    assert (
        shift_layer_index("decoder.layers.1.mlp.linear_fc1.weight", 6)
        == "decoder.layers.7.mlp.linear_fc1.weight"
    )
    assert shift_layer_index("embedding.word_embeddings.weight", 6) == "embedding.word_embeddings.weight"
    assert is_gated_fc1("decoder.layers.0.mlp.linear_fc1.weight")
    assert not is_gated_fc1("decoder.layers.0.mlp.linear_fc2.weight")


def test_padded_vocab_size_is_tp_independent():
    assert padded_vocab_size(151936, 1) == padded_vocab_size(151936, 2) == 151936
    assert padded_vocab_size(300, 1) == padded_vocab_size(300, 4) == 384
    assert padded_vocab_size(128256, 8) == 128256
    with pytest.raises(ValueError, match=r"384.*TP=5"):
        padded_vocab_size(300, 5)
