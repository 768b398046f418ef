"""Off-policy correction as pure functions: the behaviour weight of each token and the staleness rule.

Three policies meet in one update (Hilton et al. 2022, "Batch size-invariance for policy optimization",
arXiv 2110.00641; AReaL, Fu et al. 2025, arXiv 2505.24298): the *behaviour* policy pi_behav that sampled
a token (the engine, with whichever weights it held when it sampled that token: with weights swapped into
running requests, one response mixes versions), the *proximal* policy pi_prox (the trainer's logprobs
before the step: ``old_logprobs``) and the policy being optimized pi_theta. PPO's clip (or GSPO's, CISPO's)
acts on pi_theta / pi_prox; the behaviour weight w = pi_prox / pi_behav, per token, corrects for the tokens
having been sampled by pi_behav. ``grpo.off_policy_correction`` picks what is done with w:

- ``none``: w is not applied (weight 1): pi_behav is taken to be pi_prox.
- ``decoupled_ppo``: w as is, unbounded: the decoupled PPO objective of Hilton et al., which AReaL
  uses for asynchronous RL. (AReaL's optional ``behav_imp_weight_cap``, which drops the tokens whose
  weight is above it, is ``mis`` with ``behav_weight_cap`` here.)
- ``tis``: min(w, cap): truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training").
- ``mis``: w where floor <= w <= cap, else 0: masked importance sampling (token-level MIS, Liu et al. 2025,
  "When speed kills stability: demystifying RL collapse from the training-inference mismatch", with no
  floor; IcePop's [alpha, beta] band, Ling Team 2025, with one). A masked token keeps its place in the
  loss's token count (the normaliser must not depend on data-dependent masking) and its KL term; only
  its policy-gradient term is removed.

w is computed from detached logprobs: it is data, no gradient flows through it. Its log is clamped to
[-20, 20] before ``exp`` like the PPO ratio (an infinite weight would turn gradients into NaN).

Staleness is counted in policy versions (optimizer steps of GRPO trained): a sample's staleness is the
trainer's version minus the version of its *oldest* token. A group with a member staler than
``grpo.max_staleness`` is dropped whole: its baseline (group mean, leave-one-out, group std) would
otherwise be taken over a different set of responses than the one sampled for the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from megagrpo.algorithms.surrogates import MAX_LOG_RATIO

__all__ = [
    "CORRECTIONS",
    "BehaviourWeight",
    "Correction",
    "StalenessVerdict",
    "behaviour_weight",
    "judge_staleness",
]

Correction = Literal["none", "decoupled_ppo", "tis", "mis"]
CORRECTIONS: tuple[str, ...] = Correction.__args__


@dataclass(frozen=True)
class BehaviourWeight:
    """The weight each token's policy-gradient term is multiplied by, and what the metrics report."""

    weight_BT: Tensor
    """[B, T] detached: the applied weight (1 everywhere with ``none``)."""
    ratio_BT: Tensor
    """[B, T] detached: w = pi_prox / pi_behav before truncation or masking."""
    truncated_BT: Tensor
    """[B, T] bool: tis: tokens whose weight was truncated to the cap (w > cap)."""
    masked_BT: Tensor
    """[B, T] bool: mis: tokens whose weight was outside [floor, cap] (weight 0)."""


def behaviour_weight(
    prox_BT: Tensor,
    behav_BT: Tensor,
    correction: Correction,
    *,
    cap: float | None = None,
    floor: float | None = None,
) -> BehaviourWeight:
    """Per-token behaviour weights from the proximal (trainer before the step) and behaviour (sampling)
    logprobs [B, T], both finite at the positions that matter (the caller zeroes the others)."""
    log_w_BT = (prox_BT - behav_BT).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_BT = torch.exp(log_w_BT)
    none_BT = torch.zeros(ratio_BT.shape, dtype=torch.bool, device=ratio_BT.device)
    if correction == "none":
        return BehaviourWeight(torch.ones_like(ratio_BT), ratio_BT, none_BT, none_BT)
    if correction == "decoupled_ppo":
        return BehaviourWeight(ratio_BT, ratio_BT, none_BT, none_BT)
    if correction == "tis":
        assert cap is not None, "tis needs a cap"
        truncated_BT = ratio_BT > cap
        return BehaviourWeight(ratio_BT.clamp(max=cap), ratio_BT, truncated_BT, none_BT)
    if correction == "mis":
        assert cap is not None, "mis needs a cap"
        masked_BT = (ratio_BT > cap) | (ratio_BT < (floor or 0.0))
        return BehaviourWeight(torch.where(masked_BT, 0.0, ratio_BT), ratio_BT, none_BT, masked_BT)
    raise ValueError(f"off_policy_correction must be one of {CORRECTIONS}, got {correction!r}")


@dataclass(frozen=True)
class StalenessVerdict:
    """Which groups of a batch are trained on, given each sample's staleness."""

    staleness: Tensor
    """[P * G] int64: the trainer's version minus the version of each sample's oldest token."""
    keep: Tensor
    """[P] bool: groups whose every member is at most ``max_staleness`` versions old."""

    @property
    def dropped_groups(self) -> int:
        return int((~self.keep).sum())

    def metrics(self) -> dict[str, float]:
        """``staleness/mean`` and ``/max`` over all samples (dropped ones included: what arrived), and
        ``staleness/dropped_groups``."""
        s = self.staleness.double()
        return {
            "staleness/mean": float(s.mean()) if s.numel() else math.nan,
            "staleness/max": float(s.max()) if s.numel() else math.nan,
            "staleness/dropped_groups": float(self.dropped_groups),
        }


def judge_staleness(
    oldest_versions: Sequence[int], current_version: int, max_staleness: int, num_generations: int
) -> StalenessVerdict:
    """Per sample, staleness = ``current_version`` - the version of its oldest token; a group (G samples
    in a row) is kept when none of its samples is staler than ``max_staleness``."""
    oldest_N = torch.as_tensor(list(oldest_versions), dtype=torch.int64)
    if oldest_N.numel() % num_generations:
        raise ValueError(
            f"{oldest_N.numel()} samples do not form groups of num_generations={num_generations}"
        )
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    staleness_N = current_version - oldest_N
    if bool((staleness_N < 0).any()):
        newest = int(oldest_N.max())
        raise ValueError(
            f"a sample's oldest token comes from policy version {newest}, newer than the trainer's "
            f"{current_version}"
        )
    keep_P = (staleness_N <= max_staleness).view(-1, num_generations).all(dim=1)
    return StalenessVerdict(staleness=staleness_N, keep=keep_P)
