"""The partial-rollout buffer's bookkeeping (``trainers.partial.GroupBuffer``): groups queued, on engines,
finished; whole groups re-queued when their engine or a request fails, dropped after their last failed
try; staleness per sample, dropped per group."""

from __future__ import annotations

import pytest
import torch

from megagrpo.data.prompts import Prompt
from megagrpo.trainers.group_buffer import MAX_GROUP_FAILURES, FinishedGroup, GroupBuffer, GroupRequest
from megagrpo.types import Completion

pytestmark = pytest.mark.unit

G = 2


def make(position: int) -> GroupRequest:
    return GroupRequest(position, Prompt([1, 2, position], str(position)), seed=100 + position)


def runs(versions: list[int]) -> list[tuple[int, int]]:
    """[(version, count)] runs of per-token versions."""
    out: list[tuple[int, int]] = []
    for v in versions:
        out = [*out[:-1], (v, out[-1][1] + 1)] if out and out[-1][0] == v else [*out, (v, 1)]
    return out


def finished(request: GroupRequest, versions: list[list[int]], rewards: list[float]) -> FinishedGroup:
    comps = [Completion(0, [5] * len(v), [-0.5] * len(v), "stop", versions=runs(v)) for v in versions]
    return FinishedGroup(request, comps, torch.tensor(rewards))


def test_groups_move_from_queue_to_engines_to_ready_in_data_order():
    buf = GroupBuffer(G, per_step=2, max_staleness=1, filter_flat=False, next_position=10)
    buf.open(make, buf.room(version=0))
    assert [r.position for r in buf.queued] == [10, 11, 12, 13] and buf.room(version=0) == 0
    a = buf.assign(0, 3)
    b = buf.assign(1, 3)
    assert [r.position for r in a] == [10, 11, 12] and [r.position for r in b] == [13]
    buf.finished(1, finished(b[0], [[0, 0], [0]], [1.0, 0.0]))
    buf.finished(0, finished(a[1], [[0], [0]], [0.0, 1.0]))
    assert [g.request.position for g in buf.ready] == [13, 11]  # in the order they finished
    assert buf.outstanding() == 4 and buf.room(version=0) == 0
    taken = buf.take(2, trained_version=0, max_staleness=1)
    assert [g.request.position for g in taken] == [13, 11]
    # Taken by step 1: the engines, still at version 0, start no more (the bound is (0 + 1 + 1) x 2);
    # at version 1 they may start two.
    assert buf.room(version=0) == 0 and buf.room(version=1) == 2 and buf.next_position == 14


def test_an_engine_failure_requeues_its_groups_whole_at_the_front():
    buf = GroupBuffer(G, per_step=2, max_staleness=1, filter_flat=False)
    buf.open(make, 4)
    on0 = buf.assign(0, 2)
    buf.assign(1, 2)
    lost = buf.engine_lost(0)
    assert lost == on0
    assert [r.position for r in buf.queued] == [0, 1]
    assert 0 not in buf.on_engine and buf.outstanding() == 4
    counts = buf.take_counts()
    assert counts.requeued == 2 and counts.engine_failures == 1
    assert buf.failures == {}  # an engine's death is not its groups' failure
    # A late answer from the lost engine is refused: its samples were discarded.
    with pytest.raises(RuntimeError, match="engine 0 returned group 0"):
        buf.finished(0, finished(on0[0], [[1], [1]], [0.0, 1.0]))
    again = buf.assign(1, 2)
    assert [r.position for r in again] == [0, 1] and again[0].seed == 100


def test_a_group_that_keeps_failing_is_dropped_after_its_last_try_and_frees_its_place():
    buf = GroupBuffer(G, per_step=1, max_staleness=1, filter_flat=False)
    buf.open(make, buf.room(version=0))
    assert buf.room(version=0) == 0
    for attempt in range(1, MAX_GROUP_FAILURES + 1):
        (request,) = buf.assign(0, 1)
        assert request.position == 0  # queued again at the front, the same group
        assert buf.requeue(0, 0) is (attempt < MAX_GROUP_FAILURES)
    assert [r.position for r in buf.queued] == [1] and buf.room(version=0) == 1
    counts = buf.take_counts()
    assert counts.requeued == MAX_GROUP_FAILURES - 1 and counts.failed == 1
    # A group that finishes after failing starts its count anew if it is ever generated again.
    (request,) = buf.assign(0, 1)
    assert buf.requeue(0, 1) and buf.failures == {1: 1}
    (request,) = buf.assign(0, 1)
    buf.finished(0, finished(request, [[0], [0]], [0.0, 1.0]))
    assert buf.failures == {} and [g.request.position for g in buf.ready] == [1]


def test_staleness_is_measured_from_the_oldest_token_and_drops_the_whole_group():
    buf = GroupBuffer(G, per_step=3, max_staleness=1, filter_flat=False)
    buf.open(make, 3)
    reqs = buf.assign(0, 3)
    # Group 0: one response began at version 3 and ended at 5; the other is all version 5.
    buf.finished(0, finished(reqs[0], [[3, 3, 4, 5], [5, 5]], [1.0, 0.0]))
    buf.finished(0, finished(reqs[1], [[4, 5], [5]], [1.0, 0.0]))
    buf.finished(0, finished(reqs[2], [[5], [5, 5]], [0.0, 1.0]))
    # Training version 5 with max_staleness 1: group 0 (oldest token 3: staleness 2) leaves whole.
    assert buf.take(3, trained_version=5, max_staleness=1) is None
    assert buf.take_counts().stale == 1
    taken = buf.take(2, trained_version=5, max_staleness=1)
    assert [g.request.position for g in taken] == [1, 2]


def test_groups_start_within_the_staleness_bound_of_the_engines_version():
    # AReaL's bound: taken + outstanding <= (version + k + 1) x per_step.
    buf = GroupBuffer(G, per_step=4, max_staleness=2, filter_flat=False, consumed=8)
    assert buf.room(version=2) == (2 + 2 + 1) * 4 - 8
    buf.open(make, 10)
    assert buf.room(version=2) == 2 and buf.room(version=3) == 6
    assert buf.in_flight_limit() == 12


def test_dynamic_sampling_drops_flat_groups_when_they_finish():
    buf = GroupBuffer(G, per_step=1, max_staleness=1, filter_flat=True)
    buf.open(make, 2)
    reqs = buf.assign(0, 2)
    buf.finished(0, finished(reqs[0], [[1], [1]], [1.0, 1.0]))
    buf.finished(0, finished(reqs[1], [[1], [1]], [0.0, 1.0]))
    assert [g.request.position for g in buf.ready] == [1]
    # A filtered group is not trained on: it leaves room for another.
    assert buf.take_counts().filtered == 1 and buf.room(version=0) == 1


def test_a_group_must_come_back_whole():
    buf = GroupBuffer(G, per_step=1, max_staleness=1, filter_flat=False)
    buf.open(make, 1)
    (req,) = buf.assign(0, 1)
    with pytest.raises(RuntimeError, match="returned 1 responses for group 0, expected 2"):
        buf.finished(0, finished(req, [[1]], [1.0]))


def test_state_lists_in_flight_and_finished_groups():
    buf = GroupBuffer(G, per_step=3, max_staleness=1, filter_flat=False, next_position=7, consumed=6)
    buf.open(make, 3)
    reqs = buf.assign(0, 1)
    buf.finished(0, finished(reqs[0], [[2], [2]], [1.0, 0.0]))
    buf.assign(1, 1)
    state = buf.state()
    assert state["next_position"] == 10 and state["consumed"] == 6
    assert sorted(r["position"] for r in state["queued"]) == [8, 9]
    assert [r["request"]["position"] for r in state["ready"]] == [7]
    assert state["ready"][0]["completions"][0]["versions"] == [(2, 1)]


@pytest.mark.parametrize(
    ("overrides", "keys", "message"),
    [
        (["grpo.async_mode=partial"], ("grpo.async_mode", "grpo.max_staleness"), "must be >= 1"),
        (
            [
                "grpo.async_mode=partial",
                "grpo.max_staleness=1",
                "generation.placement=colocated",
                "cluster.gpus_per_node=2",
                "parallel.backend=nccl",
            ],
            ("grpo.async_mode", "generation.placement"),
            "colocated engines sleep while the trainer runs",
        ),
        (["generation.stream_slice_s=0"], ("generation.stream_slice_s",), "> 0 and <= timeout_s"),
    ],
)
def test_partial_mode_config_errors_name_their_keys(overrides, keys, message):
    from megagrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    text = str(info.value)
    assert all(k in text for k in keys) and message in text, text


def test_step_metrics_count_restarted_episodes_only_with_episodes():
    from megagrpo.trainers.group_buffer import BufferCounts
    from megagrpo.trainers.partial import Taken, partial_metrics

    groups = [finished(make(0), [[0, 1], [1, 1]], [0.0, 1.0])]
    taken = Taken(groups, BufferCounts(), 0.1, 1.0, 2.0, 1)
    assert "async/episodes_restarted" not in partial_metrics(taken, trained_version=1)
    with_episodes = Taken(groups, BufferCounts(), 0.1, 1.0, 2.0, 1, episodes_restarted=3)
    got = partial_metrics(with_episodes, trained_version=1)
    assert got["async/episodes_restarted"] == 3 and got["staleness/max"] == 1
