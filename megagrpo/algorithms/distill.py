"""On-policy distillation's learning signal, as a pure function.

The student samples; a teacher scores the student's own tokens; each sampled token gets the advantage
A_t = reverse_kl_coef * (log p_teacher(y_t) - log p_student(y_t)), the negative of the per-token reverse-KL
estimate log p_student / p_teacher at a token sampled from the student (Agarwal et al. 2024, GKD with
on-policy data and the reverse KL; Lu and Thinking Machines, "On-Policy Distillation", 2025, who use it as a
per-token advantage in the RL loss, as here). ``log p_student`` is the sampler's (the generator's logprobs, as
the published method takes them), so the advantage is fixed for the step, like a reward. An optional task term
adds ``task_reward_weight`` times the sequence's reward advantage (``grpo.baseline``) on every token.

Shape letters: B sequences, T positions (``TrainBatch``'s [B, S - 1] layout).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DistillSignal", "reverse_kl_advantages"]


@dataclass(frozen=True)
class DistillSignal:
    advantages_BT: Tensor
    """[B, T] float32 per-token advantages, 0 off the response."""
    reverse_kl_mean: float
    """Mean over response tokens of log p_student - log p_teacher (the reverse-KL estimate; 0 at a match)."""
    teacher_logprob_mean: float
    """Mean teacher logprob of the student's tokens."""


def reverse_kl_advantages(
    student_BT: Tensor,
    teacher_BT: Tensor,
    response_BT: Tensor,
    *,
    reverse_kl_coef: float,
    task_advantages_B: Tensor | None = None,
    task_reward_weight: float = 0.0,
    norm: str = "none",
) -> DistillSignal:
    """Per-token advantages from the student's sampling logprobs ``student_BT`` and the teacher's
    ``teacher_BT`` of the same tokens; ``response_BT`` (bool) marks the sampled positions. ``norm``
    (``distill.advantage_norm``) is applied to the reverse-KL term over all response tokens, before the
    task term is added: ``none``, ``center`` (less the mean) or ``standardize`` (less the mean, over the
    standard deviation)."""
    if norm not in ("none", "center", "standardize"):
        raise ValueError(f"norm must be 'none', 'center' or 'standardize', got {norm!r}")
    if not (student_BT.shape == teacher_BT.shape == response_BT.shape):
        raise ValueError(
            f"student {tuple(student_BT.shape)}, teacher {tuple(teacher_BT.shape)} and response "
            f"{tuple(response_BT.shape)} logprobs must have one shape"
        )
    valid_BT = response_BT.bool()
    zero = torch.zeros((), dtype=torch.float64)
    # where, not a multiply: positions off the response may hold -inf or garbage.
    reverse_kl_BT = torch.where(valid_BT, student_BT.double() - teacher_BT.double(), zero)
    adv_BT = -reverse_kl_coef * reverse_kl_BT
    if norm != "none":
        adv_BT = _normalized(adv_BT, valid_BT, standardize=norm == "standardize")
    if task_advantages_B is not None and task_reward_weight:
        adv_BT = adv_BT + torch.where(
            valid_BT, task_reward_weight * task_advantages_B.double()[:, None], zero
        )
    tokens = int(valid_BT.sum())
    mean = (lambda x: float(x.sum()) / tokens) if tokens else (lambda x: float("nan"))
    return DistillSignal(
        advantages_BT=adv_BT.float(),
        reverse_kl_mean=mean(reverse_kl_BT),
        teacher_logprob_mean=mean(torch.where(valid_BT, teacher_BT.double(), zero)),
    )


def _normalized(adv_BT: Tensor, valid_BT: Tensor, *, standardize: bool) -> Tensor:
    """``adv_BT`` less its mean over the valid tokens (a baseline: the expected gradient is unchanged, its
    variance falls), over their population standard deviation when ``standardize`` (kept as is when
    that is 0); 0 off the valid tokens."""
    tokens = int(valid_BT.sum())
    if tokens == 0:
        return adv_BT
    values = adv_BT[valid_BT]
    out = adv_BT - values.mean()
    if standardize:
        std = float(values.std(correction=0))
        out = out / std if std > 0 else out
    return torch.where(valid_BT, out, torch.zeros((), dtype=out.dtype))
