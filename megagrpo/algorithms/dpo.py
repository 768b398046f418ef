"""Preference losses on sequence log-probabilities, as pure tensor functions: DPO (sigmoid, with label
smoothing), IPO, and their length-normalised variant.

Shape letters: P preference pairs. Inputs are per-sequence sums (or, length-normalised, means) of response
token logprobs under the policy (with grad) and under the frozen reference policy.

With h = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected), the log-ratio margin of a pair:

- sigmoid (DPO, Rafailov et al. 2023, eq. 7; label smoothing eps as in "conservative DPO", Mitchell 2023):
  loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h). eps = 0 is the published DPO loss.
- ipo (IPO, Azar et al. 2023, eq. 17, with its regularisation tau called beta here):
  loss = (h - 1 / (2 beta))^2.

Optionally, ``nll_weight`` alpha adds alpha times the chosen response's mean token negative log-likelihood
to each pair's loss (the NLL term of Iterative RPO, Pang et al. 2024, eq. 1), which keeps the chosen
responses likely: DPO alone tends to lower both responses' likelihood, and with them greedy accuracy.

Implicit rewards (reported, not differentiated): r_chosen = beta (logp_chosen - ref_chosen), likewise
r_rejected; the reward margin is r_chosen - r_rejected = beta h, and a pair is "right" when it is > 0.
At the first step (policy == reference) every margin is exactly 0 and the sigmoid loss is log 2.

Normalization contract (as in :mod:`megagrpo.algorithms.grpo`): :func:`preference_loss` returns the sum of
per-pair losses and the number of pairs of one micro-batch; Megatron divides the summed gradients by the
pairs of the whole batch (all micro-batches and data-parallel ranks), so micro-batching never changes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PREFERENCE_METRICS",
    "PreferenceLossConfig",
    "PreferenceLossOutput",
    "preference_loss",
    "preference_metrics",
    "sequence_logps",
]


@dataclass(frozen=True, kw_only=True)
class PreferenceLossConfig:
    """The ``dpo.*`` keys of the loss (checked at load)."""

    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    length_normalize: bool = False
    nll_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in ("sigmoid", "ipo"):
            raise ValueError(f"loss must be 'sigmoid' or 'ipo', got {self.loss!r}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be finite and > 0, got {self.beta!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        if not (math.isfinite(self.nll_weight) and self.nll_weight >= 0):
            raise ValueError(f"nll_weight must be finite and >= 0, got {self.nll_weight!r}")


@dataclass(frozen=True)
class PreferenceLossOutput:
    """One micro-batch's share: the step's loss is sum(loss_sum) / sum(count) over all micro-batches."""

    loss_sum: Tensor
    """[] float, with grad: sum of per-pair losses."""
    count: Tensor
    """[] int64: pairs."""
    metrics: dict[str, Tensor]
    """[] float64 detached sums over pairs, keys in PREFERENCE_METRICS."""


PREFERENCE_METRICS = (
    "pairs",
    "accuracy_sum",
    "margin_sum",
    "chosen_reward_sum",
    "rejected_reward_sum",
    "chosen_logp_sum",
    "rejected_logp_sum",
    "chosen_nll_sum",
)
"""Keys of :attr:`PreferenceLossOutput.metrics`; each sums over pairs (micro-batches and ranks add up)."""


def sequence_logps(token_logps: Tensor, mask: Tensor, *, length_normalize: bool) -> Tensor:
    """[B] sum (or mean) over the masked positions of [B, T] token logprobs (masked entries may be anything).

    A row without any masked position gives 0 (sum) or 0 (mean over a count clamped to 1).
    """
    valid = mask.bool()
    total_B = torch.where(valid, token_logps, torch.zeros_like(token_logps)).sum(dim=-1)
    if not length_normalize:
        return total_B
    return total_B / valid.sum(dim=-1).clamp(min=1).to(total_B.dtype)


def preference_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    cfg: PreferenceLossConfig,
    *,
    chosen_nll: Tensor | None = None,
) -> PreferenceLossOutput:
    """DPO / IPO loss of P pairs from [P] sequence logprobs (policy with grad, reference without);
    ``chosen_nll`` [P] (with grad): the chosen responses' mean token NLL, needed when nll_weight > 0."""
    shapes = {t.shape for t in (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)}
    if len(shapes) != 1 or chosen_logps.dim() != 1:
        raise ValueError(f"all four logprob tensors must be [P], got shapes {sorted(map(tuple, shapes))}")
    chosen_ratio_P = chosen_logps - ref_chosen_logps.detach()
    rejected_ratio_P = rejected_logps - ref_rejected_logps.detach()
    h_P = chosen_ratio_P - rejected_ratio_P
    if cfg.loss == "sigmoid":
        eps = cfg.label_smoothing
        loss_P = -(1 - eps) * F.logsigmoid(cfg.beta * h_P)
        if eps:
            loss_P = loss_P - eps * F.logsigmoid(-cfg.beta * h_P)
    else:
        loss_P = (h_P - 1 / (2 * cfg.beta)).square()
    if cfg.nll_weight > 0:
        if chosen_nll is None or chosen_nll.shape != h_P.shape:
            raise ValueError("nll_weight > 0 needs chosen_nll of shape [P]")
        loss_P = loss_P + cfg.nll_weight * chosen_nll
    chosen_reward_P = cfg.beta * chosen_ratio_P.detach().double()
    rejected_reward_P = cfg.beta * rejected_ratio_P.detach().double()
    margin_P = chosen_reward_P - rejected_reward_P
    metrics = {
        "pairs": torch.tensor(float(h_P.numel()), dtype=torch.float64, device=h_P.device),
        "accuracy_sum": (margin_P > 0).double().sum(),
        "margin_sum": margin_P.sum(),
        "chosen_reward_sum": chosen_reward_P.sum(),
        "rejected_reward_sum": rejected_reward_P.sum(),
        "chosen_logp_sum": chosen_logps.detach().double().sum(),
        "rejected_logp_sum": rejected_logps.detach().double().sum(),
        "chosen_nll_sum": chosen_nll.detach().double().sum()
        if chosen_nll is not None
        else h_P.new_zeros((), dtype=torch.float64),
    }
    return PreferenceLossOutput(
        loss_sum=loss_P.sum(),
        count=torch.tensor(h_P.numel(), dtype=torch.int64, device=h_P.device),
        metrics=metrics,
    )


def preference_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Per-pair means of summed metrics: ``X_sum`` -> ``X`` / pairs (NaN without pairs), ``pairs`` as is."""
    pairs = sums.get("pairs", 0.0)
    out = {"pairs": pairs}
    for key in PREFERENCE_METRICS[1:]:
        name = key.removesuffix("_sum")
        out[name if name == "accuracy" else f"{name}_mean"] = (
            sums.get(key, 0.0) / pairs if pairs else math.nan
        )
    return out
