"""Overlapped generation (``grpo.max_staleness``): when weights go to the engines, the staleness
metrics, the rollouts saved ahead in a checkpoint, and the config checks."""

from __future__ import annotations

import pytest
import torch

from megagrpo.config import ConfigError, load_config
from megagrpo.data.prompts import Prompt
from megagrpo.driver import Pending, Rollouts, needs_sync, staleness_metrics
from megagrpo.types import Completion

pytestmark = pytest.mark.unit


def _cfg(k: int, steps: int = 10):
    return load_config(None, [f"grpo.max_staleness={k}", f"grpo.num_steps={steps}"])


def _engine_versions(k: int, steps: int, forced=frozenset()) -> list[int]:
    """The version the engines hold when each step's rollouts are generated (step 1 from version 0,
    step s + 1 during step s: as the driver runs them)."""
    cfg, engine = _cfg(k, steps), 0
    generated = {1: 0}
    for step in range(1, steps + 1):
        if k and step < steps:
            generated[step + 1] = engine  # generated while step trains
        if needs_sync(cfg, step, engine, step in forced):
            engine = step
        if not k and step < steps:
            generated[step + 1] = engine
    return [generated[s] for s in range(1, steps + 1)]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_staleness_never_exceeds_k_and_reaches_it(k):
    steps = 12
    versions = _engine_versions(k, steps)
    staleness = [(s - 1) - v for s, v in zip(range(1, steps + 1), versions, strict=True)]
    assert max(staleness) == k and min(staleness) == 0 and all(x >= 0 for x in staleness)
    if k == 1:  # every step after the first trains on rollouts exactly one version old
        assert staleness == [0] + [1] * (steps - 1)


def test_sequential_loop_syncs_every_step_and_forced_syncs_happen():
    assert all(needs_sync(_cfg(0), step, step - 1, False) for step in range(1, 6))
    cfg = _cfg(3)
    assert not needs_sync(cfg, 2, 1, False)
    assert needs_sync(cfg, 2, 1, True)  # validation / checkpoint see the trained weights


def test_staleness_metrics():
    comps = [Completion(0, [1, 2, 3], [-0.1] * 3, "stop"), Completion(0, [4], [-0.2], "length")]
    rollouts = Rollouts([Prompt([7, 8], "3")], comps, torch.tensor([1.0, 0.0]))
    assert staleness_metrics(rollouts, 4, trained_version=5) == {
        "staleness/generator_version": 4.0,
        "staleness/mean": 1.0,
        "staleness/max": 1.0,
        "staleness/off_policy_token_frac": 1.0,
    }
    assert staleness_metrics(rollouts, 5, trained_version=5)["staleness/off_policy_token_frac"] == 0.0


def test_rollouts_ahead_round_trip_through_a_checkpoint(tmp_path):
    comps = [Completion(0, [1, 2, 3], [-0.1, -0.2, -0.3], "stop"), Completion(0, [4], [-0.5], "length")]
    pending = Pending(Rollouts([Prompt([7, 8], "3")], comps, torch.tensor([1.0, 0.0])), 12, 1, 3, 0.5)
    assert Pending.load(tmp_path) is None
    pending.save(tmp_path)
    back = Pending.load(tmp_path)
    assert (back.position, back.filtered, back.version, back.seconds) == (12, 1, 3, 0.5)
    assert back.rollouts.prompts == pending.rollouts.prompts
    assert back.rollouts.completions == comps
    assert torch.equal(back.rollouts.rewards, pending.rollouts.rewards)


def test_config_checks():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["grpo.max_staleness=5", "grpo.num_steps=4"])
    assert "grpo.max_staleness" in str(info.value) and "grpo.num_steps" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            ["grpo.max_staleness=1", "generation.placement=colocated", "cluster.gpus_per_node=2",
             "parallel.backend=gloo"],
        )  # fmt: skip
    assert "grpo.max_staleness" in str(info.value) and "generation.placement" in str(info.value)
    with pytest.raises(ConfigError):
        load_config(None, ["grpo.max_staleness=-1"])
