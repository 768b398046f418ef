import random

import pytest

from megagrpo.policy.packing import pack_by_token_budget

pytestmark = pytest.mark.unit


def cost(lengths, batch, padded):
    picked = [lengths[i] for i in batch]
    return len(picked) * max(picked) if padded else sum(picked)


def sequential_fill(lengths, max_tokens, padded):
    """The naive baseline: walk the sequences in order and open a new batch when the next one does not fit."""
    batches = [[]]
    for i in range(len(lengths)):
        if batches[-1] and cost(lengths, [*batches[-1], i], padded) > max_tokens:
            batches.append([])
        batches[-1].append(i)
    return [b for b in batches if b]


def random_cases():
    rng = random.Random(0)
    for _ in range(20):
        max_tokens = rng.choice([16, 64, 100])
        yield [rng.randint(1, max_tokens) for _ in range(rng.randint(1, 40))], max_tokens


@pytest.mark.parametrize("padded", [True, False])
def test_every_index_once_and_every_batch_within_budget(padded):
    for lengths, max_tokens in random_cases():
        batches = pack_by_token_budget(lengths, max_tokens, padded=padded)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(b and cost(lengths, b, padded) <= max_tokens for b in batches)


@pytest.mark.parametrize("padded", [True, False])
def test_no_more_micro_batches_than_sequential_fill(padded):
    cases = [*random_cases(), ([6, 5, 5, 4], 10), ([1, 8, 1, 8, 1, 1], 16)]
    for lengths, max_tokens in cases:
        ffd = pack_by_token_budget(lengths, max_tokens, padded=padded)
        assert len(ffd) <= len(sequential_fill(lengths, max_tokens, padded))


def test_ffd_beats_sequential_fill_on_hand_examples():
    # packed: sequential [6], [5, 5], [4]; FFD pairs 6 with 4
    assert pack_by_token_budget([6, 5, 5, 4], 10, padded=False) == [[0, 3], [1, 2]]
    # padded: sequential [1, 8] [1, 8] [1, 1]; FFD puts the two 8s together and the four 1s together
    assert pack_by_token_budget([1, 8, 1, 8, 1, 1], 16, padded=True) == [[1, 3], [0, 2, 4, 5]]


def test_padded_cost_counts_padding_to_the_longest():
    # [9, 1] fits packed (10) but not padded (2 * 9 = 18)
    assert pack_by_token_budget([9, 1], 10, padded=False) == [[0, 1]]
    assert pack_by_token_budget([9, 1], 10, padded=True) == [[0], [1]]


def test_oversize_sequence_is_named():
    with pytest.raises(ValueError, match=r"sequence 2 has length 11.*max_tokens=10"):
        pack_by_token_budget([3, 4, 11], 10)
    with pytest.raises(ValueError, match="max_tokens"):
        pack_by_token_budget([1], 0)


def test_deterministic_with_index_tie_breaks():
    assert pack_by_token_budget([3] * 5, 6) == [[0, 1], [2, 3], [4]]
    assert pack_by_token_budget([], 8) == []
    lengths, max_tokens = next(random_cases())
    assert pack_by_token_budget(lengths, max_tokens) == pack_by_token_budget(list(lengths), max_tokens)
