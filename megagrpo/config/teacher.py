"""The teacher of on-policy distillation (``megagrpo distill``): its own config (checked at load by
``megagrpo.config.rules``).

The teacher runs as Megatron ranks of its own (``megagrpo.policy.teacher.TeacherWorker``: forward passes
only), with ``distill.teacher_*_parallel_size``; everything else (sequence length, layers, backend,
micro-batch budget) is the student's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megagrpo.config.errors import ConfigError

if TYPE_CHECKING:
    from megagrpo.config.schema import Config

__all__ = ["teacher_config", "teacher_temperature"]


def teacher_config(cfg: Config) -> Config:
    """The config the teacher's ranks are built from: the student's, with the teacher's model and layout."""
    from megagrpo.config.model import ModelConfig
    from megagrpo.config.resolution import resolve

    d = cfg.distill
    if d.teacher_hf_dir is None:
        raise ConfigError("distill.teacher_hf_dir", "is required by megagrpo distill")
    model = ModelConfig(
        hf_dir=d.teacher_hf_dir, tiny=None, seq_length=cfg.model.seq_length, dtype=cfg.model.dtype
    )
    parallel = dataclasses.replace(
        cfg.parallel,
        tensor_model_parallel_size=d.teacher_tensor_parallel_size,
        pipeline_model_parallel_size=d.teacher_pipeline_parallel_size,
        data_parallel_size=d.teacher_data_parallel_size,
        context_parallel_size=1,
        sequence_parallel=cfg.parallel.sequence_parallel and d.teacher_tensor_parallel_size > 1,
        use_distributed_optimizer=False,
    )
    # Its ranks take devices of their own: no engine shares their GPUs.
    generation = dataclasses.replace(cfg.generation, placement="disaggregated")
    teacher = dataclasses.replace(cfg, model=model, parallel=parallel, generation=generation, resolution=None)
    return resolve(teacher)


def teacher_temperature(cfg: Config) -> float:
    """The temperature of the teacher's logprobs: ``distill.teacher_temperature``, else the student's
    sampling temperature (the advantage then compares two logprobs of one distribution family)."""
    t = cfg.distill.teacher_temperature
    return cfg.generation.temperature if t is None else t
