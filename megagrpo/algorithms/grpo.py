"""GRPO advantages, KL estimators and the clipped surrogate loss, as pure tensor functions.

Shape letters: P prompts, G generations per prompt, B sequences of one micro-batch, T token positions.

Normalization contract. :func:`grpo_loss` returns, for one micro-batch, a ``loss_sum`` and a ``count``; the
loss of the step is (sum of ``loss_sum`` over all micro-batches and data-parallel ranks) / (sum of ``count``).
This is Megatron-Core's ``calculate_per_token_loss=True`` protocol: a loss function that returns
``(loss_sum, count, metrics)`` gets ``count`` accumulated over micro-batches, all-reduced over the DP x CP
group in ``finalize_model_grads``, and the gradients scaled by its inverse. So the result does not depend
on the micro-batch size, on gradient accumulation or on the DP size.

Choices made here, and where they depart from the papers:

- Advantages (``grpo.baseline``): ``mean`` is GRPO's group-mean baseline,
  A_i = (r_i - mean r) / (std r + eps); without std normalization it is Dr. GRPO's r_i - mean r.
  ``leave_one_out`` is RLOO's baseline, A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean r),
  optionally divided by the same std. The std is the group's *unbiased* reward std (``torch.std``, as
  GRPO implementations do). Groups whose rewards are all equal get exactly zero advantages.
  ``reinforce_pp`` is REINFORCE++'s global normalisation (Hu et al. 2025, arXiv 2501.03262):
  A_i = (r_i - mean_batch r) / (std_batch r + eps); ``reinforce_pp_baseline`` is its group variant,
  A~_i = r_i - mean_group r, then A_i = A~_i / (std_batch A~ + eps) (mean_batch A~ is 0 by construction, so a
  group of equal rewards keeps advantage 0). "Batch" is the step's whole rollout batch, each response once;
  the paper's reference code weights each response by its token count instead, and folds the KL penalty into
  the reward where megagrpo keeps it a loss term (``grpo.kl_coef``). Without std normalisation only the
  means are subtracted.
- DAPO's overlong filtering is a loss mask: the caller leaves truncated responses out of ``mask``
  (``TrainBatch.in_loss``), which removes them from the loss sum, its token count and the KL term alike.
- Off-policy correction (``grpo.off_policy_correction``, :mod:`megagrpo.algorithms.off_policy`): the
  surrogate's ratio is pi_theta / pi_old with pi_old the trainer before the step (the proximal policy of
  decoupled PPO), and each token's policy-gradient term is multiplied by its behaviour weight
  pi_old / pi_gen as is (decoupled PPO), truncated (TIS), masked (MIS) or not at all. A masked token stays
  in ``count``: the normalizer must not depend on data-dependent masking (it is also what Megatron already
  summed for other micro-batches).
- The log-ratio policy/old is clamped to [-20, 20] before ``exp`` (as verl does): beyond that the step has
  diverged anyway, and an inf ratio would turn gradients into NaN.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from megagrpo.algorithms import off_policy, surrogates

__all__ = [
    "METRIC_REDUCTIONS",
    "LossConfig",
    "LossOutput",
    "combine_metrics",
    "group_advantages",
    "grpo_loss",
    "kl_estimate",
    "overlong_penalty",
    "reduce_metrics",
    "zero_variance_groups",
]

_MAX_LOG_RATIO = surrogates.MAX_LOG_RATIO


# ----------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------


def _grouped(rewards: Tensor, num_generations: int) -> Tensor:
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 (a group needs a baseline), got {num_generations}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be a flat [num_prompts * num_generations] tensor, "
            f"got shape {tuple(rewards.shape)} with num_generations={num_generations}"
        )
    return rewards.view(-1, num_generations)  # [P, G]


def zero_variance_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """[P] bool: True for groups whose rewards are all equal (zero advantages, no learning signal)."""
    rewards_PG = _grouped(rewards, num_generations).float()
    return rewards_PG.amax(dim=1) == rewards_PG.amin(dim=1)


Baseline = Literal["mean", "leave_one_out", "reinforce_pp", "reinforce_pp_baseline"]
GROUP_BASELINES = ("mean", "leave_one_out", "reinforce_pp_baseline")
"""Baselines under which a group of equal rewards has zero advantages (``reinforce_pp`` is not one)."""


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    baseline: Baseline = "mean",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Advantages [P * G] from rewards [P * G] laid out group after group.

    ``mean`` (GRPO): A_i = r_i - mean r; ``leave_one_out`` (RLOO): A_i = r_i - mean_{j != i} r_j, which is
    G/(G-1) times the former. Divided by (unbiased std of the group's rewards + eps) when
    ``normalize_std``; ``mean`` without it is Dr. GRPO. ``reinforce_pp`` (REINFORCE++): r_i - mean of the
    whole batch; ``reinforce_pp_baseline``: r_i - mean r of the group; both divided by the unbiased std of
    those centred values over the whole batch (+ eps) when ``normalize_std``. Under the group baselines a
    zero-variance group gives exactly 0.
    """
    G = num_generations
    rewards_PG = _grouped(rewards, G).to(torch.promote_types(rewards.dtype, torch.float32))
    if baseline == "reinforce_pp":
        adv_PG = rewards_PG - rewards_PG.mean()
        if normalize_std:
            adv_PG = adv_PG / (adv_PG.std() + eps)
        # A batch of equal rewards carries no signal: 0, not its rounding residue over eps.
        return torch.where(rewards_PG.amax() == rewards_PG.amin(), 0.0, adv_PG).reshape(-1)
    if baseline in ("mean", "reinforce_pp_baseline"):
        adv_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    elif baseline == "leave_one_out":
        # r_i - (S - r_i) / (G - 1) == (G r_i - S) / (G - 1)
        adv_PG = (G * rewards_PG - rewards_PG.sum(dim=1, keepdim=True)) / (G - 1)
    else:
        raise ValueError(f"baseline must be one of {Baseline.__args__}, got {baseline!r}")
    flat_P1 = zero_variance_groups(rewards, G)[:, None]
    # Equal rewards must give 0, not the rounding residue of G r - S amplified by 1 / eps.
    adv_PG = torch.where(flat_P1, torch.zeros_like(adv_PG), adv_PG)
    if normalize_std and baseline == "reinforce_pp_baseline":
        adv_PG = adv_PG / (adv_PG.std() + eps)
    elif normalize_std:
        adv_PG = adv_PG / (rewards_PG.std(dim=1, keepdim=True) + eps)
    return torch.where(flat_P1, torch.zeros_like(adv_PG), adv_PG).reshape(-1)


def overlong_penalty(response_lengths: Tensor, max_tokens: int, buffer_tokens: int, penalty: float) -> Tensor:
    """Soft length penalty (DAPO): 0 up to ``max_tokens - buffer_tokens`` response tokens, then a
    linear ramp reaching ``-penalty`` at ``max_tokens``. [N] lengths -> [N] reward adjustments."""
    if buffer_tokens <= 0:
        return torch.where(response_lengths >= max_tokens, -penalty, 0.0).to(torch.float32)
    over = (response_lengths - (max_tokens - buffer_tokens)).clamp(min=0, max=buffer_tokens)
    return -penalty * over.to(torch.float32) / buffer_tokens


# ----------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------


Loss = Literal["grpo", "gspo", "gspo_token", "cispo"]


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Knobs of the policy loss; each is a ``grpo.*`` key, checked at load (which combinations are allowed
    is decided there, in ``megagrpo.config``)."""

    loss: Loss = "grpo"
    """The policy-gradient term, see :mod:`megagrpo.algorithms.surrogates`: grpo (PPO's clipped token
    ratio), gspo / gspo_token (GSPO's sequence ratio), cispo (clipped, stop-gradient token weights)."""
    clip_eps_low: float = 0.2
    """Ratios below 1 - clip_eps_low are clipped (PPO, GSPO: negative-advantage terms lose their gradient;
    CISPO: the weight is raised to the bound)."""
    clip_eps_high: float = 0.2
    """Ratios above 1 + clip_eps_high are clipped; > clip_eps_low is clip-higher."""
    dual_clip: float | None = None
    """Dual-clip PPO bound c > 1 (loss grpo): a negative-advantage token's loss is at most -c * A; None
    disables it."""
    kl_coef: float = 0.0
    """Weight of the per-token KL(policy || reference) penalty; > 0 requires ref_logprobs."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman), see :func:`kl_estimate`."""
    kl_clamp: float = 10.0
    """The per-token KL estimate is clamped to [-kl_clamp, kl_clamp] (k2/k3 are >= 0: [0, kl_clamp])."""
    off_policy_correction: off_policy.Correction = "none"
    """What multiplies each token's policy-gradient term, from the behaviour weight w = exp(old - gen):
    none (1), decoupled_ppo (w), tis (min(w, cap)), mis (w inside [floor, cap], else 0); see
    :mod:`megagrpo.algorithms.off_policy`. Anything but none needs gen_logprobs."""
    behav_weight_cap: float | None = None
    """tis: the truncation cap; mis: the upper bound of the kept band (both need it)."""
    behav_weight_floor: float | None = None
    """mis: the lower bound of the kept band (None: 0)."""
    loss_agg: Literal["token", "sequence"] = "token"
    """token: mean over all valid tokens of the batch; sequence: mean over sequences of their token means."""

    def __post_init__(self) -> None:
        # The knobs a run sets (grpo.* in megagrpo.config) are validated once, when the config is loaded;
        # kl_clamp is also checked here: a non-finite clamp would let an infinite KL through to the loss.
        if not (math.isfinite(self.kl_clamp) and self.kl_clamp > 0):
            raise ValueError(f"LossConfig.kl_clamp must be finite and > 0, got {self.kl_clamp!r}")
        assert self.loss in _SURROGATES, self.loss
        assert self.dual_clip is None or self.loss == "grpo", (self.loss, self.dual_clip)
        assert self.kl_estimator in ("k1", "k2", "k3"), self.kl_estimator
        assert self.off_policy_correction in off_policy.CORRECTIONS, self.off_policy_correction
        assert (self.behav_weight_cap is not None) == (self.off_policy_correction in ("tis", "mis"))
        assert self.behav_weight_floor is None or self.off_policy_correction == "mis"
        assert self.loss_agg in ("token", "sequence"), self.loss_agg


@dataclass(frozen=True)
class LossOutput:
    """One micro-batch's share of the loss: the step's loss is sum(loss_sum) / sum(count) over all of them."""

    loss_sum: Tensor
    """[] float, with grad: sum of per-token losses (token mode) or of per-sequence mean losses (sequence)."""
    count: Tensor
    """[] int64: valid tokens (token mode) or sequences with >= 1 valid token (sequence mode)."""
    metrics: dict[str, Tensor]
    """[] float64 detached sums and extremes, keys and cross-rank reductions in METRIC_REDUCTIONS."""


def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: Literal["k1", "k2", "k3"], clamp: float
) -> Tensor:
    """Per-token estimate of KL(policy || ref) from tokens sampled from the policy, clamped to ±clamp.

    With d = logprobs - ref_logprobs: k1 = d (unbiased, noisy, can be < 0); k2 = d^2 / 2 (biased, >= 0);
    k3 = exp(-d) - 1 + d (unbiased, low variance, >= 0): E_pi[r - 1 - log r] with r = ref / pi.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    elif estimator == "k3":
        kl = torch.exp(-log_ratio.clamp(min=-_MAX_LOG_RATIO)) - 1 + log_ratio
    else:
        raise ValueError(f"estimator must be one of 'k1', 'k2', 'k3', got {estimator!r}")
    return kl.clamp(-clamp, clamp)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    ref_logprobs: Tensor | None = None,
    gen_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> LossOutput:
    """Policy loss of one micro-batch (see the module docstring for the normalization contract).

    logprobs [B, T] (with grad), old_logprobs / ref_logprobs / gen_logprobs [B, T] (trainer before the update,
    reference model, generator), advantages [B] or [B, T] (per token; not for gspo), mask [B, T] (1: a
    response token that counts), entropy [B, T]
    (metric only). Per token: the policy-gradient term of ``cfg.loss`` (for grpo, max(-A r, -A clip(r,
    1 - eps_low, 1 + eps_high)) with r = exp(logprobs - old), capped at -c A for A < 0 by the dual clip; see
    :mod:`megagrpo.algorithms.surrogates` for the others), times the behaviour weight
    (``cfg.off_policy_correction``), plus kl_coef * KL. Masked positions may hold anything (-inf, NaN):
    they contribute exactly 0 to the loss and its gradient.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs, gen_logprobs, entropy)
    valid_BT = mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero_BT = torch.zeros(valid_BT.shape, dtype=dtype, device=logprobs.device)

    def clean(x_BT: Tensor) -> Tensor:
        # where, not a multiply by mask: 0 * inf = NaN, in the forward and in the backward.
        return torch.where(valid_BT, x_BT.to(dtype), zero_BT)

    logprobs_BT, old_BT = clean(logprobs), clean(old_logprobs).detach()
    # [B, 1] one per sequence, or [B, T] one per token (distillation)
    adv = advantages.detach().to(dtype)[:, None] if advantages.dim() == 1 else clean(advantages).detach()
    surrogate = _surrogate(logprobs_BT, old_BT, adv, valid_BT, cfg)
    pg_BT, ratio_BT = surrogate.pg_BT, surrogate.ratio_BT

    metrics: dict[str, Tensor] = {}
    if gen_logprobs is not None:
        gen_BT = clean(gen_logprobs).detach()
        metrics["token_mult_prob_error_sum"] = _sum(torch.exp((old_BT - gen_BT).abs()), valid_BT)
        behav = off_policy.behaviour_weight(
            old_BT,
            gen_BT,
            cfg.off_policy_correction,
            cap=cfg.behav_weight_cap,
            floor=cfg.behav_weight_floor,
        )
        metrics |= _behaviour_metrics(behav, valid_BT, cfg.off_policy_correction)
        if cfg.off_policy_correction != "none":
            pg_BT = pg_BT * behav.weight_BT.to(dtype)

    loss_BT = pg_BT
    if ref_logprobs is not None:
        kl_BT = kl_estimate(logprobs_BT, clean(ref_logprobs).detach(), cfg.kl_estimator, cfg.kl_clamp)
        metrics["kl_sum"] = _sum(kl_BT, valid_BT)
        if cfg.kl_coef > 0:
            loss_BT = loss_BT + cfg.kl_coef * kl_BT
    loss_BT = torch.where(valid_BT, loss_BT, zero_BT)

    tokens_B = valid_BT.sum(dim=1)
    loss_sum, count = aggregate(loss_BT, tokens_B, cfg.loss_agg)
    metrics |= {
        "tokens": _sum(valid_BT, valid_BT),
        "sequences": (tokens_B > 0).sum().double(),
        "pg_loss_sum": _sum(pg_BT, valid_BT),
        "clip_low_count": _sum(surrogate.clip_low_BT, valid_BT),
        "clip_high_count": _sum(surrogate.clip_high_BT, valid_BT),
        "dual_clip_count": _sum(surrogate.dual_clip_BT, valid_BT),
        "ratio_sum": _sum(ratio_BT, valid_BT),
        "ratio_min": torch.where(valid_BT, ratio_BT.detach(), math.inf).amin().double(),
        "ratio_max": torch.where(valid_BT, ratio_BT.detach(), -math.inf).amax().double(),
    }
    if entropy is not None:
        metrics["entropy_sum"] = _sum(clean(entropy), valid_BT)
    return LossOutput(loss_sum=loss_sum, count=count.to(torch.int64), metrics=metrics)


def aggregate(loss_BT: Tensor, tokens_B: Tensor, loss_agg: str) -> tuple[Tensor, Tensor]:
    """(loss sum, count) of a micro-batch whose masked positions are 0 in ``loss_BT``: per token
    (``token``: every valid token counts once) or per sequence (``sequence``: each sequence's token mean
    counts once). The loss is the sum over the global batch divided by the global count."""
    if loss_agg == "token":
        return loss_BT.sum(), tokens_B.sum()
    # A sequence without valid tokens has a zero sum; clamping its divisor keeps it at 0 and out of count.
    return (loss_BT.sum(dim=1) / tokens_B.clamp(min=1)).sum(), (tokens_B > 0).sum()


_SURROGATES = {
    "grpo": surrogates.ppo_clip,
    "gspo": surrogates.gspo,
    "gspo_token": surrogates.gspo_token,
    "cispo": surrogates.cispo,
}


def _surrogate(
    logprobs_BT: Tensor, old_BT: Tensor, adv_B1: Tensor, valid_BT: Tensor, cfg: LossConfig
) -> surrogates.Surrogate:
    clip = {"clip_eps_low": cfg.clip_eps_low, "clip_eps_high": cfg.clip_eps_high}
    if cfg.loss == "grpo":
        return surrogates.ppo_clip(logprobs_BT, old_BT, adv_B1, valid_BT, **clip, dual_clip=cfg.dual_clip)
    return _SURROGATES[cfg.loss](logprobs_BT, old_BT, adv_B1, valid_BT, **clip)


def _sum(x_BT: Tensor, valid_BT: Tensor) -> Tensor:
    return torch.where(valid_BT, x_BT.detach().double(), 0.0).sum()


def _behaviour_metrics(behav: off_policy.BehaviourWeight, valid_BT: Tensor, correction: str) -> dict:
    ratio_BT = behav.ratio_BT
    metrics = {
        "behav_ratio_min": torch.where(valid_BT, ratio_BT, math.inf).amin().double(),
        "behav_ratio_max": torch.where(valid_BT, ratio_BT, -math.inf).amax().double(),
    }
    if correction != "none":
        metrics["behav_weight_sum"] = _sum(behav.weight_BT, valid_BT)
    if correction == "tis":
        metrics["behav_truncated_count"] = _sum(behav.truncated_BT, valid_BT)
    if correction == "mis":
        metrics["behav_masked_count"] = _sum(behav.masked_BT, valid_BT)
    return metrics


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logprobs: Tensor | None,
    gen_logprobs: Tensor | None,
    entropy: Tensor | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    same_shape = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs}
    same_shape |= {"gen_logprobs": gen_logprobs, "entropy": entropy}
    for name, x in same_shape.items():
        if x is not None and x.shape != logprobs.shape:
            raise ValueError(f"{name} must match logprobs {tuple(logprobs.shape)}, got {tuple(x.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] = {tuple(logprobs.shape[:1])} or [B, T] = {tuple(logprobs.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    if cfg.loss == "gspo" and advantages.dim() == 2:
        raise ValueError("loss 'gspo' takes one advantage per sequence, got per-token advantages")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("LossConfig.kl_coef > 0 needs ref_logprobs")
    if cfg.off_policy_correction != "none" and gen_logprobs is None:
        raise ValueError(
            f"LossConfig.off_policy_correction {cfg.off_policy_correction!r} needs gen_logprobs (the "
            "behaviour policy's logprobs)"
        )


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------

# Over valid tokens: tokens / sequences (with >= 1 valid token); pg_loss_sum (after dual clip and the
# behaviour weight, before KL); kl_sum (clamped estimate, when ref_logprobs is given); clip_low_count
# (A < 0 and r < 1 - eps_low); clip_high_count (A > 0 and r > 1 + eps_high); dual_clip_count (the -c A
# bound is active); ratio_*; entropy_sum; token_mult_prob_error_sum (exp|gen - old|, its mean is 1 when
# generator and trainer agree);
# with gen_logprobs, behav_ratio_min / max (the behaviour weight w = pi_old / pi_gen before any bound);
# with a correction, behav_weight_sum (weights applied), behav_truncated_count (tis: w > cap) or
# behav_masked_count (mis: w outside [floor, cap]).
METRIC_REDUCTIONS: dict[str, Literal["sum", "min", "max"]] = {
    "tokens": "sum",
    "sequences": "sum",
    "pg_loss_sum": "sum",
    "kl_sum": "sum",
    "clip_low_count": "sum",
    "clip_high_count": "sum",
    "dual_clip_count": "sum",
    "ratio_sum": "sum",
    "ratio_min": "min",
    "ratio_max": "max",
    "entropy_sum": "sum",
    "behav_ratio_min": "min",
    "behav_ratio_max": "max",
    "behav_weight_sum": "sum",
    "behav_truncated_count": "sum",
    "behav_masked_count": "sum",
    "token_mult_prob_error_sum": "sum",
}
"""How each metric of :class:`LossOutput` combines across micro-batches and ranks (all-reduce SUM/MIN/MAX).

The keys present depend only on which optional inputs were given, so they are the same on every rank.
"""

_COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}


def combine_metrics(metrics: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine per-micro-batch metric dicts into one, per METRIC_REDUCTIONS, without leaving the device.

    Cross-rank: all-reduce each value of the result with the op METRIC_REDUCTIONS names, then
    :func:`reduce_metrics` ``([result])``.
    """
    combined: dict[str, Tensor] = {}
    for m in metrics:
        for key, value in m.items():
            if key not in METRIC_REDUCTIONS:
                raise ValueError(f"unknown metric {key!r}; known: {sorted(METRIC_REDUCTIONS)}")
            combined[key] = (
                value if key not in combined else _COMBINE[METRIC_REDUCTIONS[key]](combined[key], value)
            )
    return combined


def reduce_metrics(metrics: Sequence[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Readable values from metric dicts: ``tokens``/``sequences`` as totals, ``X_sum`` -> ``X_mean`` and
    ``X_count`` -> ``X_frac`` per valid token (NaN when there is none), ``ratio_min``/``ratio_max`` as is.
    """
    combined = combine_metrics(
        [{k: torch.as_tensor(v, dtype=torch.float64) for k, v in m.items()} for m in metrics]
    )
    values = {key: float(v) for key, v in combined.items()}
    tokens = values.get("tokens", 0.0)
    out: dict[str, float] = {}
    for key, value in values.items():
        if key.endswith("_sum"):
            out[key.removesuffix("_sum") + "_mean"] = value / tokens if tokens else math.nan
        elif key.endswith("_count"):
            out[key.removesuffix("_count") + "_frac"] = value / tokens if tokens else math.nan
        else:
            out[key] = value
    return out
