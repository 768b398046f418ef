"""The interleaved timer every benchmark times with.

``interleave({"a": fa, "b": fb}, repeat)`` calls each function once per round, alternating the
order between rounds (a b, b a, a b, ...), so that a drift of a shared machine (another job
starting, the CPU clock changing) hits every contender alike and the ratio of one round's pair is
the steadiest figure. Each call is a ``Timed``: wall seconds, the CPU seconds of the processes
watched (this one by default: a rank that other jobs keep off the cores accrues none, so CPU time
is steadier than wall time on a shared machine), the CPUs every other process kept busy meanwhile,
and the function's value.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .machine import Contention
from .record import Measurement


@dataclass(frozen=True)
class Timed:
    """One timed call."""

    seconds: float
    """Wall-clock seconds."""
    cpu_s: float
    """CPU seconds of the watched processes (10 ms ticks)."""
    other_cpus: float
    """CPUs that every other process of the machine kept busy, on average over the call."""
    value: object = None
    """What the call returned."""


def timed(fn: Callable[[], object], pids: Sequence[int] | None = None, settle=None) -> Timed:
    """``fn()`` timed; ``pids``: the processes whose CPU time counts (default: this one); ``settle``:
    called before the clock starts and before it stops (a device synchronize)."""
    if settle is not None:
        settle()
    with Contention(list(pids) if pids is not None else [os.getpid()]) as load:
        start = time.perf_counter()
        value = fn()
        if settle is not None:
            settle()
        seconds = time.perf_counter() - start
    return Timed(seconds, load.ours_cpu_s, load.other_cpus, value)


def interleave(
    steps: dict[str, Callable[[], object]],
    repeat: int,
    *,
    warmup: int = 0,
    pids: Sequence[int] | dict[str, Sequence[int]] | None = None,
    settle=None,
    before: Callable[[str], None] | None = None,
    log: Callable[[int, dict[str, Timed]], None] | None = None,
) -> dict[str, list[Timed]]:
    """``warmup`` untimed rounds, then ``repeat`` timed ones, of every step in alternating order;
    ``pids``: the processes whose CPU time counts, or per step (a step not named: this process);
    ``before(step)`` runs untimed before each call (a clean-up); ``log(round, {step: Timed})``
    after each round (round < 0: a warm-up)."""
    names = list(steps)
    out: dict[str, list[Timed]] = {n: [] for n in names}
    for r in range(warmup + repeat):
        done = {}
        for name in names if r % 2 == 0 else names[::-1]:
            if before is not None:
                before(name)
            watched = pids.get(name) if isinstance(pids, dict) else pids
            done[name] = timed(steps[name], watched, settle)
            if r >= warmup:
                out[name].append(done[name])
        if log is not None:
            log(r - warmup, done)
    return out


def seconds(runs: Iterable[Timed]) -> tuple[float, ...]:
    return tuple(t.seconds for t in runs)


def other_load(*series: Iterable[Timed], **settings) -> Measurement:
    """How busy other jobs kept the machine during the timed calls: the context of every figure."""
    samples = [t.other_cpus for runs in series for t in runs]
    return Measurement("other jobs' load during the timed calls", samples, "CPUs", settings)


def slowest_rank(per_rank: Sequence[Sequence[Timed]]) -> list[Timed]:
    """Per round, the rank that took longest (a collective step ends with its slowest rank), with
    the most CPU seconds of any rank and the other jobs' load averaged."""
    return [
        Timed(
            max(t.seconds for t in calls),
            max(t.cpu_s for t in calls),
            statistics.mean(t.other_cpus for t in calls),
        )
        for calls in zip(*per_rank, strict=True)
    ]
