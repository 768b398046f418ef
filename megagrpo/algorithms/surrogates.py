"""The policy-gradient term of each loss ``grpo.loss`` names, per token, as pure tensor functions.

Shape letters: B sequences of one micro-batch, T token positions. Every function takes the policy's
logprobs [B, T] (with grad), the logprobs of the policy that sampled the batch before this update
(``old``, detached) [B, T], advantages broadcastable to [B, T] and the valid-token mask [B, T] (masked
positions already hold 0 in ``logprobs_BT`` and ``old_BT``), and returns a :class:`Surrogate`. The caller
(:func:`megagrpo.algorithms.grpo.grpo_loss`) adds TIS, the KL term and aggregates.

- ``grpo``: PPO's clipped surrogate per token, max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) with
  r = pi / pi_old, and the dual clip (Ye et al. 2020) as an option.
- ``gspo``: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), Eq. 5-7: one ratio per sequence,
  s_i = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|) = exp(mean_t log r_i,t), clipped like PPO's, per sequence.
  The sequence's loss is placed on each of its valid tokens, so that aggregating by sequence (the token mean
  of each sequence, then the mean over sequences: ``loss_agg: sequence``, which GSPO requires) gives the
  paper's (1/G) sum_i of per-sequence terms. |y_i| counts the tokens in the loss mask.
- ``gspo_token``: GSPO-token (same paper, Eq. 13-14): s_i,t = sg[s_i] pi(y_i,t) / sg[pi(y_i,t)], whose
  value is s_i but whose gradient flows through each token's own logprob; with the same advantage on every
  token of a sequence (all single-turn rollouts) its gradient equals GSPO's.
- ``cispo``: CISPO (MiniMax-M1, 2025, Eq. 4-5): the importance weight is clipped and gradient-stopped, never
  the update: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi. Every token keeps its gradient; with an
  infinite clip the gradient is plain importance-weighted REINFORCE's, -A grad r.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MAX_LOG_RATIO",
    "Surrogate",
    "cispo",
    "gspo",
    "gspo_token",
    "ppo_clip",
    "sequence_log_ratio",
    "sequence_ratio",
]

# exp(20) ~ 4.9e8: far beyond any useful ratio, still finite in fp32 (an inf in a forward pass makes the
# backward of a later clamp/where 0 * inf = NaN). The log-ratio is clamped before exp, as verl does.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class Surrogate:
    """Per-token policy-gradient loss of one micro-batch and what the metrics report about it."""

    pg_BT: Tensor
    """[B, T] loss per token (with grad); its masked positions are zeroed by the caller."""
    ratio_BT: Tensor
    """[B, T] the ratio the loss clips: r_i,t (grpo, cispo) or the sequence's s_i on each token (gspo*)."""
    clip_low_BT: Tensor
    """[B, T] bool: tokens whose ratio was clipped from below (their term has no gradient, or a clipped
    weight for cispo)."""
    clip_high_BT: Tensor
    """[B, T] bool: tokens whose ratio was clipped from above."""
    dual_clip_BT: Tensor
    """[B, T] bool: tokens where the dual-clip bound -c A was active (grpo only; all False otherwise)."""


def ppo_clip(
    logprobs_BT: Tensor,
    old_BT: Tensor,
    adv_BT: Tensor,
    valid_BT: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float | None = None,
) -> Surrogate:
    """GRPO's (PPO's) clipped surrogate per token, with the dual clip's bound -c A for A < 0 when given."""
    ratio_BT = torch.exp((logprobs_BT - old_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    pg_BT = _clipped(ratio_BT, adv_BT, clip_eps_low, clip_eps_high)
    dual_BT = torch.zeros_like(valid_BT)
    if dual_clip is not None:
        dual_BT = (adv_BT < 0) & (pg_BT > -dual_clip * adv_BT)
        pg_BT = torch.where(dual_BT, -dual_clip * adv_BT, pg_BT)
    return _surrogate(pg_BT, ratio_BT, adv_BT, clip_eps_low, clip_eps_high, dual_BT)


def sequence_log_ratio(logprobs_BT: Tensor, old_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """[B] log s_i = mean over the sequence's valid tokens of log pi - log pi_old (GSPO's length-normalised
    log-ratio); 0 for a sequence without valid tokens."""
    tokens_B = valid_BT.sum(dim=1).clamp(min=1)
    return torch.where(valid_BT, logprobs_BT - old_BT, 0.0).sum(dim=1) / tokens_B


def sequence_ratio(logprobs_BT: Tensor, old_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """[B] GSPO's s_i = exp(mean log-ratio over the sequence's valid tokens), clamped as a token's."""
    return torch.exp(sequence_log_ratio(logprobs_BT, old_BT, valid_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def gspo(
    logprobs_BT: Tensor,
    old_BT: Tensor,
    adv_BT: Tensor,
    valid_BT: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> Surrogate:
    """GSPO: the clipped surrogate of the sequence ratio s_i, placed on each of the sequence's tokens.

    ``adv_BT`` must hold one advantage per sequence (GSPO's objective is sequence-level); the value on the
    sequence's first position is used.
    """
    s_B1 = sequence_ratio(logprobs_BT, old_BT, valid_BT)[:, None]
    adv_B1 = adv_BT.expand_as(logprobs_BT)[:, :1]
    pg_B1 = _clipped(s_B1, adv_B1, clip_eps_low, clip_eps_high)
    shape = logprobs_BT.shape
    return _surrogate(
        pg_B1.expand(shape), s_B1.expand(shape), adv_B1.expand(shape), clip_eps_low, clip_eps_high, None
    )


def gspo_token(
    logprobs_BT: Tensor,
    old_BT: Tensor,
    adv_BT: Tensor,
    valid_BT: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> Surrogate:
    """GSPO-token: s_i,t = sg[s_i] * exp(log pi_t - sg[log pi_t]), clipped like PPO's per token, so that each
    token may carry its own advantage while the clipping decision stays the sequence's."""
    s_BT = sequence_ratio(logprobs_BT, old_BT, valid_BT).detach()[:, None] * torch.exp(
        logprobs_BT - logprobs_BT.detach()
    )
    adv_BT = adv_BT.expand_as(logprobs_BT)
    pg_BT = _clipped(s_BT, adv_BT, clip_eps_low, clip_eps_high)
    return _surrogate(pg_BT, s_BT, adv_BT, clip_eps_low, clip_eps_high, None)


def cispo(
    logprobs_BT: Tensor,
    old_BT: Tensor,
    adv_BT: Tensor,
    valid_BT: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> Surrogate:
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi per token. ``clip_eps_low`` 1 (a weight
    floor of 0) and ``clip_eps_high`` inf remove a bound; the paper tunes only the upper one."""
    ratio_BT = torch.exp((logprobs_BT - old_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()
    weight_BT = ratio_BT.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    adv_BT = adv_BT.expand_as(logprobs_BT)
    pg_BT = -adv_BT * weight_BT * logprobs_BT
    return Surrogate(
        pg_BT=pg_BT,
        ratio_BT=ratio_BT,
        # The weight is clipped whatever the advantage's sign: CISPO bounds the weight, not the update.
        clip_low_BT=ratio_BT < 1 - clip_eps_low,
        clip_high_BT=ratio_BT > 1 + clip_eps_high,
        dual_clip_BT=torch.zeros_like(valid_BT),
    )


def _clipped(ratio: Tensor, adv: Tensor, clip_eps_low: float, clip_eps_high: float) -> Tensor:
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high))


def _surrogate(
    pg_BT: Tensor, ratio_BT: Tensor, adv_BT: Tensor, low: float, high: float, dual_BT: Tensor | None
) -> Surrogate:
    # PPO's clip removes the gradient only on the side where the objective is pessimistic: A < 0 below the
    # range, A > 0 above it.
    ratio = ratio_BT.detach()
    return Surrogate(
        pg_BT=pg_BT,
        ratio_BT=ratio_BT,
        clip_low_BT=(adv_BT < 0) & (ratio < 1 - low),
        clip_high_BT=(adv_BT > 0) & (ratio > 1 + high),
        dual_clip_BT=torch.zeros(ratio.shape, dtype=torch.bool, device=ratio.device)
        if dual_BT is None
        else dual_BT,
    )
