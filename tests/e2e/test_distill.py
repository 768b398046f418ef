"""``megagrpo distill`` end to end: the tiny student (TP 2) samples on a vLLM engine, a larger random teacher
on a Megatron rank of its own (TP 1) scores the student's tokens, the student moves toward it, and a resumed
run repeats the uninterrupted one."""

from __future__ import annotations

import math
import shutil

import pytest
from _grpo_runs import assert_same_steps, metrics, reuse_warmup, run_overrides
from hf_models import make_tiny_teacher

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e


def _overrides(root, name, ckpt, teacher, *extra):
    teacher_keys = (f"distill.teacher_hf_dir={teacher}", "distill.teacher_tensor_parallel_size=1")
    return run_overrides(root, name, ckpt, steps=3, extra=(*teacher_keys, "policy.lr=1e-3", *extra))


def test_distillation_lowers_the_reverse_kl_to_the_teacher_and_resumes(undisturbed, tmp_path):
    from megagrpo.trainers.grpo import train

    teacher = make_tiny_teacher(tmp_path / "teacher", num_layers=3)
    root, ckpt = undisturbed.root, tmp_path / "ckpt"
    reuse_warmup(root, "distill")
    got = metrics(train(load_config(None, _overrides(root, "distill", ckpt, teacher), trainer="distill")))
    assert sorted(got) == [0, 1, 2, 3]
    kl = [got[step]["distill/reverse_kl"] for step in (1, 2, 3)]
    assert all(math.isfinite(x) for x in kl)
    # a random teacher is far from the warmed-up student: the per-token reverse KL is large, and falls
    assert kl[0] > 1.0 and kl[2] < kl[0], kl
    assert all(got[step]["timing/teacher_s"] > 0 for step in (1, 2, 3))
    # the student's rollouts and updates go on as in GRPO (the weights reach the engine)
    assert all(got[step]["sync/probe_error"] <= 1.001 for step in (1, 2, 3))
    assert math.isfinite(got[2]["val/accuracy"])

    # Resumed from its step-2 checkpoint, the run repeats step 3 (the teacher holds no state).
    resumed_ckpt = tmp_path / "ckpt_resumed"
    resumed_ckpt.mkdir()
    shutil.copytree(ckpt / "step_2", resumed_ckpt / "step_2")
    reuse_warmup(root, "distill-resumed")
    resumed = _overrides(root, "distill-resumed", resumed_ckpt, teacher, "checkpoint.resume=true")
    again = metrics(train(load_config(None, resumed, trainer="distill")))
    assert sorted(again) == [3]
    assert_same_steps(again, got, (3,))
    assert again[3]["distill/reverse_kl"] == pytest.approx(got[3]["distill/reverse_kl"], rel=1e-6)
