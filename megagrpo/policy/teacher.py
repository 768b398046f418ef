"""The teacher of on-policy distillation: a frozen model on Megatron ranks of its own.

Why Megatron ranks rather than the vLLM engines' prompt logprobs: the teacher's logprobs then come from the
same kernels, vocab-parallel log-softmax and temperature as the student's trainer logprobs (no bf16 sampler
numerics in the learning signal), the teacher takes its own TP / PP / DP whatever its size, and the engines
stay the student's, holding one model and syncing only the student's weights. The cost is the teacher's
forward passes on the trainer's side of the step (``timing/teacher_s``).
"""

from __future__ import annotations

from megagrpo.config import Config
from megagrpo.config.teacher import teacher_temperature
from megagrpo.policy.rank import MegatronRank

__all__ = ["TeacherWorker"]


class TeacherWorker(MegatronRank):
    """One rank of the teacher, built from ``megagrpo.config.teacher.teacher_config(cfg)``; it answers
    ``logprobs(batch)`` at ``distill.teacher_temperature``, by default the student's sampling temperature."""

    def __init__(self, cfg: Config):
        super().__init__(
            cfg,
            seed=cfg.grpo.seed + 4321,
            total_steps=1,
            keep_reference=False,
            temperature=teacher_temperature(cfg),
            trainable=False,
        )
