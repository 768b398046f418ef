"""What the e2e tests share: one undisturbed GRPO run, which resumed and disturbed runs must repeat."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from _grpo_runs import metrics, run_overrides


@dataclass(frozen=True)
class Reference:
    root: Path
    """Where the runs of the session live (``root/runs/<run_name>``)."""
    metrics: dict[int, dict]
    """The undisturbed run's metrics by step."""
    ckpt: Path
    """Its checkpoint directory."""


@pytest.fixture(scope="session")
def undisturbed(tmp_path_factory) -> Reference:
    """4 steps of the tiny config (``_grpo_runs.run_overrides``), nothing disturbed."""
    from megagrpo.config import load_config
    from megagrpo.trainers.grpo import train

    root = tmp_path_factory.mktemp("grpo")
    run_dir = train(load_config(None, run_overrides(root, "reference", root / "ckpt_ref")))
    return Reference(root, metrics(run_dir), root / "ckpt_ref")
