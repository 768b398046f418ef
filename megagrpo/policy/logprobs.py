"""Token log-probabilities from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism each rank holds logits for its slice of the vocabulary. The log-softmax
needs only three scalars per token from across the TP group: the max (for stability), the sum of
exponentials, and the logit of the target token (which lives on exactly one rank). So we
all-reduce those per token instead of gathering [tokens, vocab] logits, and work in fp32 on one
chunk of tokens at a time: the peak fp32 buffer is [chunk, vocab / TP], never [tokens, vocab].

The backward pass recomputes the softmax chunk by chunk from the saved logits and the per-token
log-sum-exp (no fp32 [tokens, vocab] tensor is kept between passes) and needs no communication:
d logprob / d logit_j = onehot(target)_j - softmax_j, scaled by 1/temperature.

Rows of Megatron's padded vocabulary beyond the real vocabulary are excluded (their logits would
otherwise take probability mass that vLLM, which has no such rows, never assigns).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _Chunks:
    """Shared per-chunk preparation of the forward and backward passes."""

    def __init__(self, logits: torch.Tensor, vocab_start: int, vocab_size: int, inv_temp: float):
        self.logits, self.inv_temp = logits, inv_temp
        local_vocab = logits.shape[-1]
        ids = vocab_start + torch.arange(local_vocab, device=logits.device)
        self.padding = ids >= vocab_size  # [vocab / tp]
        self.any_padding = bool(self.padding.any())

    def scaled(self, start: int, end: int) -> torch.Tensor:
        x = self.logits[start:end].float() * self.inv_temp  # [chunk, vocab / tp]
        if self.any_padding:
            x = x.masked_fill(self.padding, float("-inf"))
        return x


def _local_targets(targets: torch.Tensor, vocab_start: int, local_vocab: int):
    local = targets - vocab_start
    here = (local >= 0) & (local < local_vocab)  # this rank owns the target's logit
    return local.clamp(0, local_vocab - 1), here


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, inv_temp, chunk, with_entropy):
        tokens, local_vocab = logits.shape
        chunks = _Chunks(logits, vocab_start, vocab_size, inv_temp)
        local_t, here = _local_targets(targets, vocab_start, local_vocab)
        lse = torch.empty(tokens, dtype=torch.float32, device=logits.device)  # [tokens]
        target_logit = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            x = chunks.scaled(start, end)
            row_max = _all_reduce(x.max(dim=-1).values, dist.ReduceOp.MAX, group)
            shifted_exp = (x - row_max[:, None]).exp()
            sum_exp = _all_reduce(shifted_exp.sum(dim=-1), dist.ReduceOp.SUM, group)
            lse[start:end] = row_max + sum_exp.log()
            picked = x.gather(1, local_t[start:end, None]).squeeze(1)
            target_logit[start:end] = _all_reduce(
                torch.where(here[start:end], picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group
            )
            if entropy is not None:
                # H = lse - E_p[x]; padded columns have p = 0 (and x = -inf), so exclude them explicitly.
                p_x = torch.where(shifted_exp > 0, shifted_exp * x, torch.zeros_like(x)).sum(dim=-1)
                entropy[start:end] = lse[start:end] - _all_reduce(p_x, dist.ReduceOp.SUM, group) / sum_exp
        ctx.save_for_backward(logits, targets, lse)
        ctx.args = (vocab_start, vocab_size, inv_temp, chunk)
        if entropy is None:
            return target_logit - lse, torch.zeros(0, device=logits.device)
        ctx.mark_non_differentiable(entropy)
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        vocab_start, vocab_size, inv_temp, chunk = ctx.args
        tokens, local_vocab = logits.shape
        chunks = _Chunks(logits, vocab_start, vocab_size, inv_temp)
        local_t, here = _local_targets(targets, vocab_start, local_vocab)
        grad = torch.empty_like(logits)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            g = grad_logprobs[start:end].float()  # [chunk]
            softmax = (chunks.scaled(start, end) - lse[start:end, None]).exp()
            grad_chunk = softmax.mul_(-g[:, None])
            onehot_g = torch.where(here[start:end], g, torch.zeros_like(g))
            grad_chunk.scatter_add_(1, local_t[start:end, None], onehot_g[:, None])
            grad[start:end] = (grad_chunk * inv_temp).to(grad.dtype)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` under softmax(logits / temperature), in fp32.

    Args:
        logits: [..., vocab / TP] this rank's vocabulary slice (any float dtype; not copied).
        targets: [...] token ids in the global vocabulary.
        group: the tensor-parallel process group (None or size 1: no communication).
        vocab_start: global id of this rank's first vocabulary row.
        vocab_size: the real vocabulary; ids at or beyond it (Megatron's padding) get probability 0.
        chunk_size: tokens per fp32 chunk; bounds the extra memory to [chunk, vocab / TP] fp32.
        with_entropy: also return the per-token entropy (no gradient), e.g. for metrics.

    Returns:
        (logprobs [...] fp32 with gradient to ``logits``, entropy [...] fp32 or None)
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    lead = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    local_vocab = flat_logits.shape[-1]
    tp = dist.get_world_size(group) if group is not None else 1
    vocab_size = vocab_size if vocab_size is not None else local_vocab * tp
    logprobs, entropy = _VocabParallelLogprobs.apply(
        flat_logits,
        targets.reshape(-1),
        group,
        vocab_start,
        vocab_size,
        1.0 / temperature,
        chunk_size,
        with_entropy,
    )
    return logprobs.view(lead), (entropy.view(lead) if with_entropy else None)
