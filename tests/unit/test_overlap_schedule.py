"""Overlapped generation (``grpo.max_staleness``): the schedule of generate / train / sync
(``megagrpo.trainers.overlap.RolloutSchedule``, driven here as ``GRPOSteps.step`` drives it), the
staleness metrics, the rollouts saved ahead in a checkpoint, and the config checks."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from megagrpo.config import ConfigError, load_config
from megagrpo.data.prompts import Prompt, build_source
from megagrpo.policy.worker import PolicyWorker
from megagrpo.rewards import RewardScorer
from megagrpo.runtime.engines import SyncOutcome
from megagrpo.trainers.grpo import GRPOSteps
from megagrpo.trainers.overlap import RolloutSchedule
from megagrpo.trainers.rollouts import Pending, Rollouts, staleness_metrics
from megagrpo.trainers.run import Due, Trained
from megagrpo.types import Completion, TrainMetrics

pytestmark = pytest.mark.unit


class Engines:
    """``produce`` as the schedule calls it: records which step was generated from which policy version,
    whether a failing engine could have been restarted, and in which thread."""

    def __init__(self):
        self.calls: dict[int, tuple[int, bool, str]] = {}

    def produce(self, step: int, position: int, version: int, restartable: bool) -> Pending:
        self.calls[step] = (version, restartable, threading.current_thread().name)
        rollouts = Rollouts([Prompt([position], "1")], [Completion(0, [1], [-0.1], "stop")], torch.ones(1))
        return Pending(rollouts, position + 1, 0, version, 0.0)


def _run(k: int, steps: int, forced=frozenset()) -> tuple[Engines, list[int], list[int]]:
    """(the engines' record, the version each step's rollouts came from, the steps that synced): the
    schedule driven step by step, as GRPOSteps.step drives it."""
    engines, trained_from, synced = Engines(), [], []
    schedule = RolloutSchedule(engines.produce, max_staleness=k, num_steps=steps, engine_version=0)
    position = 0
    try:
        for step in range(1, steps + 1):
            current, _ = schedule.rollouts_for(step, position)
            position = current.position
            schedule.start_ahead(step, position)
            trained_from.append(current.version)  # ... the step trains here ...
            schedule.wait_ahead()
            if schedule.needs_sync(step, step in forced):
                schedule.synced(step)
                synced.append(step)
    finally:
        schedule.close()
    return engines, trained_from, synced


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_staleness_never_exceeds_k_and_reaches_it(k):
    steps = 12
    _, versions, _ = _run(k, steps)
    staleness = [(s - 1) - v for s, v in zip(range(1, steps + 1), versions, strict=True)]
    assert max(staleness) == k and min(staleness) == 0 and all(x >= 0 for x in staleness)
    if k == 1:  # every step after the first trains on rollouts exactly one version old
        assert staleness == [0] + [1] * (steps - 1)


def test_sequential_loop_generates_in_the_step_and_syncs_every_step():
    engines, versions, synced = _run(0, 5)
    assert versions == [0, 1, 2, 3, 4] and synced == [1, 2, 3, 4, 5]
    assert all(
        restartable and thread == threading.current_thread().name
        for _, restartable, thread in engines.calls.values()
    )


def test_overlapped_rollouts_come_from_the_generation_thread_without_restarts():
    engines, _, _ = _run(1, 4)
    assert sorted(engines.calls) == [1, 2, 3, 4]  # nothing generated for a step after the last
    first_version, first_restartable, first_thread = engines.calls[1]
    assert first_version == 0
    assert first_restartable and first_thread == threading.current_thread().name
    for step in (2, 3, 4):
        _, restartable, thread = engines.calls[step]
        assert not restartable and thread.startswith("rollouts-ahead")


def test_forced_syncs_happen_and_only_they_with_a_large_k():
    _, _, synced = _run(3, 8)
    assert synced == [3, 6]  # the engines' version may lag step + 1 by 3: version 0 < 3 + 1 - 3 at step 3
    _, _, synced = _run(3, 8, forced={2, 5})
    assert synced == [2, 5, 8]  # validation / checkpoint see the trained weights; the lag restarts there


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


# ------------------------------------------------------------------------------------------------------------
# The order GRPOSteps.step itself runs: generate, train, (wait for the rollouts ahead), sync
# ------------------------------------------------------------------------------------------------------------


class StandInPool:
    """The engine pool's surface ``GRPOSteps.step`` uses; it records the order of calls and which weights
    (policy version) each generation came from."""

    def __init__(self):
        self.version, self.log = 0, []

    def generate(self, prompts, settings, seeds, *, step, restartable=True):
        self.log.append(("generate", step, self.version, restartable))
        return [
            Completion(i, [7, 7], [-0.5, -0.5], "stop")
            for i, _ in enumerate(prompts)
            for _ in range(settings.n)
        ]

    def sync_weights(self, *, step):
        self.log.append(("sync", step))
        self.version = step
        return SyncOutcome(SimpleNamespace(error=1.0, verified_buckets=1), 0.0)


class StandInPolicy:
    last_call_s = 0.0

    def __init__(self, pool):
        self.pool = pool

    def call_first(self, method, batch):
        assert method is PolicyWorker.train
        self.pool.log.append(("train", batch.size))
        fields = {f.name: 0.0 for f in dataclasses.fields(TrainMetrics)}
        return [TrainMetrics(**{**fields, "token_mult_prob_error_mean": None, "behav_truncated_frac": None})]


def _grpo_steps(k: int, steps: int):
    cfg = load_config(
        None,
        [
            f"grpo.max_staleness={k}",
            f"grpo.num_steps={steps}",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations=2",
            "policy.mini_batch_size=8",
            "logging.val_every=0",
        ],
    )
    trainer = object.__new__(GRPOSteps)  # its parts, without starting Ray actors
    trainer.cfg, trainer.source, trainer.scorer = cfg, build_source(cfg), RewardScorer(cfg.reward)
    trainer.engines, trainer.teacher = StandInPool(), None
    trainer.policy = StandInPolicy(trainer.engines)
    trainer.position, trainer._trained = 0, Trained(0, 0)
    trainer.schedule = RolloutSchedule(trainer.produce, max_staleness=k, num_steps=steps, engine_version=0)
    return trainer


@pytest.mark.parametrize("k", [0, 1])
def test_grpo_step_generates_trains_and_syncs_in_order(k):
    steps = 3
    trainer = _grpo_steps(k, steps)
    try:
        metrics = [trainer.step(step, Due(validate=False, save=False)) for step in range(1, steps + 1)]
    finally:
        trainer.close()
    log = [e for e in trainer.engines.log if e[0] != "awake"]
    if k == 0:  # generate from the last step's weights, train, sync: every step
        assert log == [
            e for s in range(1, 4) for e in (("generate", s, s - 1, True), ("train", 8), ("sync", s))
        ]
    else:  # step s + 1's rollouts come from the weights of s - 1, generated during step s's training
        assert [e for e in log if e[0] == "generate"] == [
            ("generate", 1, 0, True),
            ("generate", 2, 0, False),
            ("generate", 3, 1, False),
        ]
        assert [e for e in log if e[0] == "sync"] == [("sync", 1), ("sync", 2), ("sync", 3)]
        assert log.index(("sync", 1)) > log.index(("generate", 2, 0, False))  # sync after the ahead batch
    assert [m["staleness/generator_version"] for m in metrics] == ([0, 1, 2] if k == 0 else [0, 0, 1])
    assert trainer.trained() == Trained(3, 12) and trainer.schedule.pending is None
