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


def test_pack_sequences_layout():
    import torch

    from megagrpo.policy.packing import pack_sequences

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11], [12, 0, 0, 0]])
    packed = pack_sequences(ids, torch.tensor([3, 4, 1]), total_multiple=3)  # 8 tokens -> 9
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 0]]
    assert packed.targets.tolist() == [[6, 7, 0, 9, 10, 11, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 7, 9]
    assert packed.max_seqlen == 4
    assert packed.valid.tolist() == [[True, True, False], [True, True, True], [False, False, False]]


def test_packed_logprobs_equal_padded_ones_with_gradients():
    """Scoring the packed row and unpacking gives the padded layout's [b, s - 1] values and gradients."""
    import torch

    from megagrpo.policy.logprobs import vocab_parallel_logprobs
    from megagrpo.policy.packing import pack_sequences
    from megagrpo.types import TrainBatch

    gen = torch.Generator().manual_seed(0)
    vocab, seqs = 37, [[int(t) for t in torch.randint(1, 37, (n,), generator=gen)] for n in (6, 2, 9, 4)]
    batch = TrainBatch.from_sequences(seqs, [1, 1, 3, 2])
    table = torch.randn(vocab, 50, generator=gen, dtype=torch.float64)  # 50 > vocab: Megatron-style padding
    pos_table = torch.randn(16, 50, generator=gen, dtype=torch.float64)

    def logits_of(tokens, positions):  # a per-position "model": the token's and position's rows
        return table[tokens] + pos_table[positions]

    table.requires_grad_()
    seq = batch.input_ids.shape[1]
    padded_logits = logits_of(batch.input_ids, torch.arange(seq).expand(batch.size, -1))
    rolled = torch.roll(batch.input_ids, -1, dims=1)
    want, _ = vocab_parallel_logprobs(padded_logits, rolled, vocab_size=vocab)
    want = want[:, :-1] * batch.response_mask()
    (want_grad,) = torch.autograd.grad(want.sum(), table)

    packed = pack_sequences(batch.input_ids, batch.lengths, total_multiple=4)
    packed_logits = logits_of(packed.tokens, packed.position_ids)
    got, _ = vocab_parallel_logprobs(packed_logits, packed.targets, vocab_size=vocab)
    got = packed.unpack(got) * batch.response_mask()
    (got_grad,) = torch.autograd.grad(got.sum(), table)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert batch.response_mask().sum() > 0


def test_pack_sequences_rejects_bad_lengths():
    import torch

    from megagrpo.policy.packing import pack_sequences

    with pytest.raises(ValueError, match="length"):
        pack_sequences(torch.zeros(2, 4, dtype=torch.long), torch.tensor([3, 5]))


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_split_and_placement_give_the_whole_rows(cp):
    """Every CP rank scores its two chunks (targets rolled before the split); placed back and summed
    over ranks, the logprobs and their gradients are those of the unsplit row."""
    import torch

    from megagrpo.policy.logprobs import vocab_parallel_logprobs
    from megagrpo.policy.packing import context_parallel_positions, place_positions, round_up

    gen = torch.Generator().manual_seed(cp)
    vocab = 29
    ids = torch.randint(1, vocab, (3, 11), generator=gen)
    seq = round_up(ids.shape[1], 2 * cp)
    tokens = torch.nn.functional.pad(ids, (0, seq - ids.shape[1]))
    targets = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(seq).expand(3, -1)
    table = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    pos_table = torch.randn(seq, vocab, generator=gen, dtype=torch.float64)

    def score(tok, pos, tgt):  # a per-position "model"
        return vocab_parallel_logprobs(table[tok] + pos_table[pos], tgt)[0]

    want = score(tokens, positions, targets)
    (want_grad,) = torch.autograd.grad(want.sum(), table)
    held_all = [context_parallel_positions(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held_all)).values, torch.arange(seq))  # a partition
    got = sum(place_positions(score(tokens[:, h], positions[:, h], targets[:, h]), h, seq) for h in held_all)
    (got_grad,) = torch.autograd.grad(got.sum(), table)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="multiple of 2 x context parallel size"):
        context_parallel_positions(seq + 1, cp, 0)
