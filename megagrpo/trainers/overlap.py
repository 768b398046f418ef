"""GRPO's schedule of generation, training and weight sync, with the staleness rule (``grpo.max_staleness``).

Sequential (k = 0): each step generates its rollouts from the weights of the step before, trains on them,
then sends the new weights to the engines.

Overlapped (k >= 1): while step s trains, the engines generate step s + 1's rollouts (in a thread of
this process) from the weights they hold; weights reach the engines only between batches. The rollouts
of step s + 1 are trained by policy version s, so the engines' version may lag s + 1 by at most k:
weights are sent at the end of step s only when the engines' version is older than s + 1 - k, or when
validation or a checkpoint (``forced``) needs the trained weights (so that a resumed run's engines hold
what the uninterrupted run's did).

The schedule knows versions and threads, not engines: ``produce(step, position, version, restartable)``
makes the rollouts of ``step`` from data ``position``, by engines holding policy ``version`` (a failing
engine may be restarted only when ``restartable``: not while the trainer changes the weights it would
be sent).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from megagrpo.trainers.rollouts import Pending

Produce = Callable[[int, int, int, bool], Pending]
"""(step, data position, engines' policy version, restartable) -> that step's scored rollouts."""


class RolloutSchedule:
    """Which rollouts each step trains on, when the next ones are generated, and when weights go out."""

    def __init__(
        self,
        produce: Produce,
        *,
        max_staleness: int,
        num_steps: int,
        engine_version: int,
        pending: Pending | None = None,
    ):
        """``engine_version``: the policy version (GRPO steps trained) the engines hold now; ``pending``:
        rollouts already generated for the next step (restored from a checkpoint)."""
        self.produce, self.max_staleness, self.num_steps = produce, max_staleness, num_steps
        self.engine_version = engine_version
        self.pending = pending
        """Rollouts generated ahead for the next step, once the step that generated them has them."""
        self._ahead: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-ahead") if max_staleness else None

    def rollouts_for(self, step: int, position: int) -> tuple[Pending, bool]:
        """(the rollouts ``step`` trains on, whether they were generated now): generated ahead during the
        previous step, or else now, from data ``position``."""
        if self.pending is not None:
            current, self.pending = self.pending, None
            return current, False
        return self.produce(step, position, self.engine_version, True), True

    def start_ahead(self, step: int, position: int) -> None:
        """Overlapped: start generating step + 1's rollouts (from data ``position``) while ``step`` trains."""
        if self._pool is not None and step < self.num_steps:
            # No engine restart meanwhile: a replacement would be sent the weights the trainer is changing.
            self._ahead = self._pool.submit(self.produce, step + 1, position, self.engine_version, False)

    def wait_ahead(self) -> Pending | None:
        """The rollouts started by ``start_ahead`` (None when none were): they become ``pending``."""
        if self._ahead is None:
            return None
        future, self._ahead = self._ahead, None
        self.pending = future.result()
        return self.pending

    def needs_sync(self, step: int, forced: bool) -> bool:
        """Whether the weights of ``step`` go to the engines at the end of that step (see the module
        docstring; ``forced``: validation or a checkpoint at this step)."""
        k = self.max_staleness
        return k == 0 or forced or self.engine_version < step + 1 - k

    def synced(self, step: int) -> None:
        """The engines now hold the weights of ``step``."""
        self.engine_version = step

    def close(self) -> None:
        """Stop the generation thread (waiting for rollouts still being generated)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
