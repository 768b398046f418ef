import pytest
import torch

from megagrpo.policy.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.unit


def _reference(logits, targets, vocab_size, temperature):
    x = logits[..., :vocab_size] / temperature
    logp = torch.log_softmax(x, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_values_and_gradients(chunk, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 40, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 33, (3, 7), generator=gen)
    weights = torch.randn(3, 7, generator=gen, dtype=torch.float64)

    got, entropy = vocab_parallel_logprobs(
        logits, targets, vocab_size=33, temperature=temperature, chunk_size=chunk, with_entropy=True
    )
    (got * weights).sum().backward()
    grad_got = logits.grad.clone()

    logits.grad = None
    want, want_entropy = _reference(logits, targets, 33, temperature)
    (want * weights).sum().backward()

    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), want_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_got, logits.grad, atol=1e-6, rtol=1e-6)
    # Padded vocabulary rows get exactly zero gradient.
    assert not grad_got[..., 33:].any()


def test_bf16_logits_stay_bf16_and_loss_is_fp32():
    logits = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 16, (4,))
    lp, _ = vocab_parallel_logprobs(logits, targets, chunk_size=2)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    want = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, want)


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_size=0)
