"""Short GRPO runs of the tiny config that the e2e tests compare: overrides, metrics, warm-up reuse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

# Metrics that a run repeats exactly from the same checkpoint and seeds (timings obviously do not).
DETERMINISTIC = ("reward/mean", "response/length_mean", "train/loss", "train/grad_norm", "train/ratio_mean")


def run_overrides(root: Path, name: str, ckpt: Path, *, steps: int = 4, extra=()) -> list[str]:
    """4 prompts x 8 per step, validation every 2 steps, a checkpoint every step (2 kept)."""
    return [
        f"logging.dir={root / 'runs'}",
        f"run_name={name}",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.val_every=2",
        "data.num_val_prompts=16",
        "warmup.steps=60",
        "grpo.num_prompts_per_step=4",
        f"grpo.num_steps={steps}",
        "policy.mini_batch_size=16",
        f"checkpoint.dir={ckpt}",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=2",
        "checkpoint.export_hf_at_end=false",
        *extra,
    ]


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def assert_same_steps(got: dict, want: dict, steps) -> None:
    for step in steps:
        for key in DETERMINISTIC:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-9), (step, key)


def reuse_warmup(root: Path, name: str) -> None:
    """Run ``name`` starts from the reference run's warm-up (same model, warm-up and data config)."""
    shutil.copytree(root / "runs" / "reference" / "warmup", root / "runs" / name / "warmup")
