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


def _real_columns(local_vocab: int, vocab_start: int, vocab_size: int) -> int:
    """How many of this rank's vocabulary columns are real tokens.

    Megatron's padding rows are the last global ids, so on every rank the real ones are a prefix of
    its slice; slicing them off costs nothing, where masking would cost a pass over the chunk.
    """
    return max(0, min(local_vocab, vocab_size - vocab_start))


def _local_targets(targets: torch.Tensor, vocab_start: int, real: int):
    local = targets - vocab_start
    here = (local >= 0) & (local < real)  # this rank owns the target's logit
    return local.clamp(0, max(real - 1, 0)), here


def _scaled_chunk(logits: torch.Tensor, start: int, end: int, real: int, inv_temp: float) -> torch.Tensor:
    """One fp32 copy of a chunk's real columns, divided by the temperature in place."""
    x = logits[start:end, :real].to(torch.float32, copy=True)  # [chunk, real]
    if inv_temp != 1.0:
        x.mul_(inv_temp)
    return x


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, inv_temp, chunk, with_entropy):
        tokens, local_vocab = logits.shape
        real = _real_columns(local_vocab, vocab_start, vocab_size)
        local_t, here = _local_targets(targets, vocab_start, real)
        lse = torch.empty(tokens, dtype=torch.float32, device=logits.device)  # [tokens]
        target_logit = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            # A rank whose slice is all padding still joins every all-reduce, with neutral values.
            x = _scaled_chunk(logits, start, end, real, inv_temp)
            picked = x.gather(1, local_t[start:end, None]).squeeze(1) if real else lse.new_zeros(end - start)
            target_logit[start:end] = _all_reduce(
                torch.where(here[start:end], picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group
            )
            row_max = x.amax(dim=-1) if real else lse.new_full((end - start,), float("-inf"))
            row_max = _all_reduce(row_max, dist.ReduceOp.MAX, group)
            x.sub_(row_max[:, None])  # x - max, in place
            shifted_exp = x.exp()
            sum_exp = _all_reduce(shifted_exp.sum(dim=-1), dist.ReduceOp.SUM, group)
            log_sum_exp = sum_exp.log()
            lse[start:end] = row_max + log_sum_exp
            if entropy is not None:
                # H = lse - E_p[x] = log(sum_exp) - E_p[x - max]; padding columns were never included.
                p_x = _all_reduce(torch.linalg.vecdot(shifted_exp, x), dist.ReduceOp.SUM, group)
                entropy[start:end] = log_sum_exp - p_x / sum_exp
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
        real = _real_columns(local_vocab, vocab_start, vocab_size)
        local_t, here = _local_targets(targets, vocab_start, real)
        grad = torch.empty_like(logits)
        grad[:, real:] = 0  # padding columns never carry probability
        if real == 0:
            return grad, None, None, None, None, None, None, None
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            g = grad_logprobs[start:end].float() * inv_temp  # [chunk]
            # d/dx_j = (onehot(target)_j - softmax_j) * g / temperature, built in one fp32 buffer.
            x = _scaled_chunk(logits, start, end, real, inv_temp)
            x.sub_(lse[start:end, None]).exp_().mul_(-g[:, None])
            onehot_g = torch.where(here[start:end], g, torch.zeros_like(g))
            x.scatter_add_(1, local_t[start:end, None], onehot_g[:, None])
            grad[start:end, :real].copy_(x)
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
