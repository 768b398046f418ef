"""The partial-rollout buffer (``grpo.async_mode: partial``, ``megagrpo.trainers.partial``): groups queued,
on an engine, finished; what a checkpoint keeps of them. Bookkeeping only: no engines, no threads.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.algorithms.grpo import zero_variance_groups
from megagrpo.algorithms.off_policy import judge_staleness
from megagrpo.ckpt import CheckpointError
from megagrpo.compat.safe_load import load_file, refusals_as
from megagrpo.data.prompts import Prompt
from megagrpo.types import Completion


@dataclass(frozen=True)
class GroupRequest:
    """One prompt's G samples, sent to one engine as one request (they share the prompt's prefill)."""

    position: int
    """The prompt's data position: the group's id in the run."""
    prompt: Prompt
    seed: int


@dataclass
class FinishedGroup:
    """A group whose G responses all finished, scored."""

    request: GroupRequest
    completions: list[Completion]
    rewards: torch.Tensor
    """[G] float32."""
    timeouts: int = 0
    errors: int = 0


def oldest_version(completion: Completion) -> int:
    """The oldest policy version among a response's tokens (its ``versions``, which a stream fills)."""
    if completion.versions is None:
        raise ValueError("a response of a partial rollout carries the versions of its tokens")
    return completion.oldest_version(default=-1)


@dataclass
class BufferCounts:
    """What the buffer did since it was last asked (``GroupBuffer.take_counts``)."""

    filtered: int = 0
    """Finished groups whose rewards were all equal, dropped by dynamic sampling."""
    stale: int = 0
    """Finished groups dropped for staleness (a response older than ``grpo.max_staleness``)."""
    requeued: int = 0
    """Groups sent back to the queue because their engine failed."""
    failed: int = 0
    """Groups dropped after ``MAX_GROUP_FAILURES`` failed tries (``GroupBuffer.requeue``)."""
    engine_failures: int = 0


MAX_GROUP_FAILURES = 3
"""Tries a group's requests may fail (an environment that raises, hangs or dies; a request the engine ends
without a sample) before the group is dropped: an environment that always fails on a task would otherwise
hold a place among the groups the staleness bound lets start, on and on (and with enough such tasks no
step could fill). An engine's death is not the group's failure and does not count."""


class GroupBuffer:
    """Groups by state: queued (not on an engine), on an engine, finished; pure bookkeeping, no engines.

    Not thread-safe: ``ContinuousRollouts`` calls it under its lock."""

    def __init__(
        self,
        num_generations: int,
        per_step: int,
        max_staleness: int,
        *,
        filter_flat: bool,
        next_position: int = 0,
        consumed: int = 0,
    ):
        """``per_step``: groups a step trains on; ``consumed``: groups the steps so far took."""
        self.num_generations, self.per_step, self.max_staleness = num_generations, per_step, max_staleness
        self.filter_flat = filter_flat
        self.next_position = next_position
        """The data position of the next new group."""
        self.consumed = consumed
        self.queued: deque[GroupRequest] = deque()
        self.on_engine: dict[int, dict[int, GroupRequest]] = {}
        """Engine index -> {position: request} of the groups it is generating."""
        self.ready: deque[FinishedGroup] = deque()
        self.counts = BufferCounts()
        self.failures: dict[int, int] = {}
        """Group position -> its failed tries so far (not kept by a checkpoint: a resume counts anew)."""

    def outstanding(self) -> int:
        """Groups queued, on engines, or finished and not yet trained on."""
        return len(self.queued) + sum(len(g) for g in self.on_engine.values()) + len(self.ready)

    def room(self, version: int) -> int:
        """New groups the engines may start now, holding policy ``version``: with the groups taken and
        outstanding, at most ``(version + max_staleness + 1) * per_step`` (AReaL's bound). Groups are
        taken in about the order they started, so the last one started now is taken by step
        ``version + max_staleness + 1`` at the latest, which trains version ``version + max_staleness``:
        none is dropped for staleness unless it outlives groups started after it."""
        limit = (version + self.max_staleness + 1) * self.per_step
        return max(0, limit - self.consumed - self.outstanding())

    def in_flight_limit(self) -> int:
        """The most groups outstanding at once (a step's worth more than the staleness allows ahead)."""
        return (self.max_staleness + 1) * self.per_step

    def open(self, make: Callable[[int], GroupRequest], count: int) -> None:
        """Queue ``count`` new groups (``make(position)`` each), positions in data order."""
        for _ in range(count):
            self.queued.append(make(self.next_position))
            self.next_position += 1

    def assign(self, engine: int, count: int) -> list[GroupRequest]:
        """Up to ``count`` queued groups, now on ``engine`` (oldest first)."""
        out = []
        while self.queued and len(out) < count:
            out.append(self.queued.popleft())
        mine = self.on_engine.setdefault(engine, {})
        for request in out:
            mine[request.position] = request
        return out

    def finished(self, engine: int, group: FinishedGroup) -> None:
        """``engine`` returned ``group`` whole; dynamic sampling drops it if its rewards are all equal."""
        request = self.on_engine.get(engine, {}).pop(group.request.position, None)
        if request is None:
            raise RuntimeError(
                f"engine {engine} returned group {group.request.position}, which it was not generating"
            )
        self.failures.pop(request.position, None)
        if len(group.completions) != self.num_generations:
            raise RuntimeError(
                f"engine {engine} returned {len(group.completions)} responses for group "
                f"{request.position}, expected {self.num_generations}"
            )
        if self.filter_flat and bool(zero_variance_groups(group.rewards, self.num_generations)[0]):
            self.counts.filtered += 1
            return
        self.ready.append(group)

    def requeue(self, engine: int, position: int) -> bool:
        """A request of group ``position`` on ``engine`` ended without a sample: the group goes back to
        the front of the queue whole (none of its samples is kept), or, on its ``MAX_GROUP_FAILURES``-th
        failed try, is dropped (counted). Whether it was queued again."""
        request = self.on_engine[engine].pop(position)
        tries = self.failures.get(position, 0) + 1
        if tries >= MAX_GROUP_FAILURES:
            self.failures.pop(position, None)
            self.counts.failed += 1
            return False
        self.failures[position] = tries
        self.queued.appendleft(request)
        self.counts.requeued += 1
        return True

    def engine_lost(self, engine: int) -> list[GroupRequest]:
        """``engine`` failed: its groups go back to the front of the queue, in data order (none of their
        samples is kept); returns them."""
        lost = sorted(self.on_engine.pop(engine, {}).values(), key=lambda r: r.position)
        self.queued.extendleft(reversed(lost))
        self.counts.requeued += len(lost)
        self.counts.engine_failures += 1
        return lost

    def take(self, count: int, trained_version: int, max_staleness: int) -> list[FinishedGroup] | None:
        """``count`` finished groups in the order they finished, or None (nothing taken) while fewer
        are there. Groups with a sample more than ``max_staleness`` versions older than
        ``trained_version`` are dropped whole first (``algorithms.off_policy.judge_staleness``;
        counted): a group only grows staler."""
        if self.ready:
            oldest = [oldest_version(c) for g in self.ready for c in g.completions]
            verdict = judge_staleness(oldest, trained_version, max_staleness, self.num_generations)
            self.counts.stale += verdict.dropped_groups
            self.ready = deque(g for g, keep in zip(self.ready, verdict.keep.tolist(), strict=True) if keep)
        if len(self.ready) < count:
            return None
        self.consumed += count
        return [self.ready.popleft() for _ in range(count)]

    def take_counts(self) -> BufferCounts:
        counts, self.counts = self.counts, BufferCounts()
        return counts

    def state(self) -> dict:
        """What a checkpoint keeps of the bookkeeping (the engines' partial responses are saved beside)."""
        in_flight = [r for groups in self.on_engine.values() for r in groups.values()]
        return {
            "next_position": self.next_position,
            "consumed": self.consumed,
            "queued": [_request_state(r) for r in [*self.queued, *in_flight]],
            "ready": [_finished_state(g) for g in self.ready],
        }


def _request_state(request: GroupRequest) -> dict:
    p = request.prompt
    return {
        "position": request.position,
        "seed": request.seed,
        "prompt": {"token_ids": p.token_ids, "answer": p.answer, "task": p.task},
    }


def _finished_state(group: FinishedGroup) -> dict:
    return {
        "request": _request_state(group.request),
        "completions": [dataclasses.asdict(c) for c in group.completions],
        "rewards": group.rewards,
        "timeouts": group.timeouts,
        "errors": group.errors,
    }


def request_from(row: dict) -> GroupRequest:
    return GroupRequest(row["position"], Prompt(**row["prompt"]), row["seed"])


IN_FLIGHT_FILE = "rollouts_in_flight.pt"
"""A checkpoint's partial-rollout state: the buffer's groups and the engines' partial responses."""


def save_in_flight(state: dict, directory: Path) -> None:
    """Into a checkpoint being written (its manifest covers the file)."""
    torch.save(state, directory / IN_FLIGHT_FILE)


def load_in_flight(checkpoint: Path) -> dict | None:
    """A checkpoint's partial-rollout state, or None when it has none (a batch-mode checkpoint)."""
    path = checkpoint / IN_FLIGHT_FILE
    if not path.is_file():
        return None
    with refusals_as(CheckpointError):
        state = load_file(path)  # torch.load(weights_only=True), its globals checked first
    if not isinstance(state, dict) or not {"buffer", "partials", "version"} <= set(state):
        raise CheckpointError(f"{path}: not the partial-rollout state a checkpoint saves")
    return state


def rollouts_of(groups: Sequence[FinishedGroup]):
    """The step's ``Rollouts`` (trainers.rollouts) from its finished groups, in the order taken."""
    from megagrpo.trainers.rollouts import Rollouts

    return Rollouts(
        [g.request.prompt for g in groups],
        [c for g in groups for c in g.completions],
        torch.cat([g.rewards for g in groups]),
        sum(g.timeouts for g in groups),
        sum(g.errors for g in groups),
    )
