"""A small process pool whose tasks have deadlines: a task past its deadline has its process killed and
replaced, so the pool keeps its capacity.

``concurrent.futures`` cannot stop a running task (``Future.cancel`` only drops queued ones): a verification
that hangs would hold its worker for good. Here each worker is a process of our own with its own pipe and
runs one task at a time, so the driver knows which process holds which task and can SIGKILL it.

The deadline of a task is ``timeout_s`` after it is submitted to a worker (the moment it starts running):
a task queued behind others is not charged for their time, nor for a replacement worker's start-up (a
worker gets tasks once it has said it is ready), so a batch of M tasks on N workers takes at most about
ceil(M / N) x ``timeout_s``, and one that hangs costs its worker that long, once.

Workers are forked from a fork server (``multiprocessing``'s ``forkserver``): the driver has Ray's and
torch's threads, which a plain ``fork`` of it would copy mid-lock; the server preloads math-verify, so a
replacement starts in milliseconds. Workers end with the driver (parent-death signal, and EOF on their pipe).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["DeadlinePool", "Outcome", "PoolResult"]

# What the fork server imports once, so that every worker forked from it has it already.
_PRELOAD = ["megagrpo.rewards.math", "megagrpo.rewards.arithmetic", "math_verify"]
# A worker that has not said it is ready after this long (a user module stuck at import) stops the call.
_START_LIMIT_S = 120.0


@dataclass(frozen=True)
class PoolResult:
    """Values of one ``DeadlinePool.map`` call, in task order."""

    values: list
    """One value per task (a float for a numeric pool); None for a task that timed out or failed."""
    timeouts: int
    """Tasks cut at their deadline (their workers were killed and replaced)."""
    errors: int
    """Tasks whose function raised or returned a non-number / non-finite value, or whose worker died."""
    error_messages: list[str]
    """One line per error (the first few of the call), for logs and tests."""


@dataclass(frozen=True)
class Outcome:
    """How one submitted task ended (``DeadlinePool.poll``)."""

    value: Any = None
    """What the function returned (a finite float for a numeric pool); None unless ``ok``."""
    error: str | None = None
    """Why it failed (raised, bad value, worker died, deadline); None when ``ok``."""
    timed_out: bool = False
    """Cut at its deadline (its worker was killed and replaced)."""

    @property
    def ok(self) -> bool:
        return self.error is None


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when its parent (the fork server) exits: it does when the
    driver goes, and this holds even while the worker is stuck in C code holding the GIL."""
    import ctypes
    import signal

    # Not Linux (no prctl): the worker still ends on EOF of its pipe between tasks.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _worker_main(conn: Connection, function: str, numeric: bool) -> None:
    """Worker loop: receive (task id, args), reply (task id, ok, value or error text); a numeric pool's
    values must be finite numbers (taken as floats)."""
    _die_with_parent()
    from megagrpo.rewards.user import load_function

    try:
        fn, load_error = load_function(function), None
    except Exception as err:  # reported with every task, so the driver counts them as errors
        fn, load_error = None, f"loading {function!r}: {type(err).__name__}: {err}"
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task, args = message
        if fn is None:
            conn.send((task, False, load_error))
            continue
        try:
            value = fn(*args)
            ok = True
            if numeric:
                value = float(value)
                ok = math.isfinite(value)
            reply = value if ok else f"non-finite reward {value!r}"
        except Exception as err:
            ok, reply = False, f"{type(err).__name__}: {err}"
        conn.send((task, ok, reply))


class _Worker:
    def __init__(self, ctx, function: str, numeric: bool):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, function, numeric), daemon=True)
        self.process.start()
        child.close()  # the worker holds the only other end: its death is EOF here
        self.started = time.monotonic()
        self.ready = False

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class DeadlinePool:
    """``num_workers`` processes calling ``function`` (a ``"module:name"`` or ``"file.py:name"`` spec,
    see ``megagrpo.rewards.user``) with each task's arguments, one task per process at a time.

    Two ways to use it: :meth:`map` (a batch, in order) or :meth:`submit` / :meth:`poll` (tasks as they
    come, outcomes as they end: the multi-turn episode loop steps environments this way). ``numeric``:
    values must be finite numbers (rewards); otherwise any picklable value comes back.
    ``what`` names the workers in errors (e.g. "reward", "environment")."""

    def __init__(
        self,
        function: str,
        num_workers: int,
        timeout_s: float,
        *,
        numeric: bool = True,
        what: str = "reward",
        preload: Sequence[str] = (),
    ):
        if num_workers < 1 or not timeout_s > 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self.function, self.timeout_s, self.numeric, self.what = function, timeout_s, numeric, what
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload([*_PRELOAD, *preload])
        self._workers = [_Worker(self._ctx, function, numeric) for _ in range(num_workers)]
        self.replaced = 0
        """Workers started to replace one that was killed at a deadline or died (whole life of the pool)."""
        self._start_deaths = 0  # workers in a row that died before they were ready
        self._queue: deque[tuple[int, tuple]] = deque()  # (ticket, args) not yet given to a worker
        self._running: dict[int, tuple[int, float]] = {}  # slot -> (ticket, deadline)
        self._tickets = 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (one per slot)."""
        return [w.process.pid for w in self._workers]

    @property
    def pending(self) -> int:
        """Tasks submitted whose outcome :meth:`poll` has not returned yet."""
        return len(self._queue) + len(self._running)

    def alive(self) -> int:
        """Workers whose process is running."""
        return sum(w.process.is_alive() for w in self._workers)

    def _replace(self, slot: int, *, kill: bool) -> None:
        old = self._workers[slot]
        if kill:
            old.kill()
        else:
            old.process.join(timeout=1.0)
            old.conn.close()
        self._workers[slot] = _Worker(self._ctx, self.function, self.numeric)
        self.replaced += 1

    def _starting(self, slot: int) -> None:
        """A worker that is not ready yet has something to read: its "ready", or EOF (it died starting)."""
        worker = self._workers[slot]
        try:
            worker.ready = worker.conn.recv() == "ready"
            self._start_deaths = 0
            return
        except (EOFError, OSError):
            self._start_deaths += 1
        if self._start_deaths > 2 * len(self._workers):
            raise RuntimeError(
                f"{self.what} workers loading {self.function!r} keep dying as they start "
                f"(last exit code {worker.process.exitcode})"
            )
        self._replace(slot, kill=False)

    def _check_start_limit(self) -> None:
        now = time.monotonic()
        if any(not w.ready and now >= w.started + _START_LIMIT_S for w in self._workers):
            raise RuntimeError(
                f"a {self.what} worker loading {self.function!r} did not start within {_START_LIMIT_S:.0f} s"
            )

    def wait_ready(self) -> int:
        """Block until every worker has started (loaded its function); returns the number of workers."""
        while not all(w.ready for w in self._workers):
            starting = {w.conn: slot for slot, w in enumerate(self._workers) if not w.ready}
            limit = min(self._workers[slot].started for slot in starting.values()) + _START_LIMIT_S
            for conn in wait(list(starting), timeout=max(0.0, limit - time.monotonic())):
                self._starting(starting[conn])
            self._check_start_limit()
        return len(self._workers)

    def submit(self, args: tuple) -> int:
        """Queue one task (a tuple of arguments); returns its ticket, which :meth:`poll` reports it under.
        Its deadline starts when a worker takes it."""
        ticket, self._tickets = self._tickets, self._tickets + 1
        self._queue.append((ticket, args))
        self._dispatch()
        return ticket

    def _dispatch(self) -> None:
        for slot, worker in enumerate(self._workers):
            if not self._queue:
                return
            if worker.ready and slot not in self._running:
                ticket, args = self._queue.popleft()
                try:
                    worker.conn.send((ticket, args))
                except OSError:  # died while idle: replace it, the task goes to the next ready one
                    self._replace(slot, kill=True)
                    self._queue.appendleft((ticket, args))
                    continue
                self._running[slot] = (ticket, time.monotonic() + self.timeout_s)

    def poll(self, timeout: float | None = None) -> list[tuple[int, Outcome]]:
        """Outcomes of tasks that ended, as (ticket, outcome): waits up to ``timeout`` seconds for the
        first one (None: until one ends; 0: only those that have ended already). [] when none is pending."""
        stop = None if timeout is None else time.monotonic() + timeout
        ended: list[tuple[int, Outcome]] = []
        while self.pending and not ended:
            self._dispatch()
            waiting = {
                w.conn: slot for slot, w in enumerate(self._workers) if slot in self._running or not w.ready
            }
            limits = [d for _, d in self._running.values()]
            limits += [w.started + _START_LIMIT_S for w in self._workers if not w.ready]
            if stop is not None:
                limits.append(stop)
            for conn in wait(list(waiting), timeout=max(0.0, min(limits) - time.monotonic())):
                slot = waiting[conn]
                if slot not in self._running:
                    self._starting(slot)
                    continue
                ticket, _ = self._running.pop(slot)
                try:
                    done, ok, value = conn.recv()
                except (EOFError, OSError):  # the worker died (segfault, os._exit, out of memory)
                    code = self._workers[slot].process.exitcode
                    ended.append((ticket, Outcome(error=f"worker process died (exit code {code})")))
                    self._replace(slot, kill=False)
                    continue
                assert done == ticket, (done, ticket)
                ended.append((ticket, Outcome(value=value) if ok else Outcome(error=value)))
            now = time.monotonic()
            for slot, (ticket, deadline) in list(self._running.items()):
                if now >= deadline:
                    del self._running[slot]
                    ended.append(
                        (ticket, Outcome(error=f"cut at its {self.timeout_s:g} s deadline", timed_out=True))
                    )
                    self._replace(slot, kill=True)
            self._check_start_limit()
            if stop is not None and time.monotonic() >= stop:
                break
        self._dispatch()
        return ended

    def map(self, tasks: Sequence[tuple]) -> PoolResult:
        """Run every task (a tuple of arguments); returns when each has a value, an error or its deadline."""
        assert not self.pending, "map() on a pool with tasks of submit() in flight"
        first = self._tickets
        for args in tasks:
            self.submit(args)
        values: list = [None] * len(tasks)
        timeouts, errors, messages = 0, 0, []
        while self.pending:
            for ticket, outcome in self.poll():
                task = ticket - first
                if outcome.ok:
                    values[task] = outcome.value
                elif outcome.timed_out:
                    timeouts += 1
                else:
                    errors += 1
                    if len(messages) < 8:
                        messages.append(f"task {task}: {outcome.error}")
        return PoolResult(values, timeouts, errors, messages)

    def close(self) -> None:
        """Stop every worker (those stuck in a task are killed)."""
        for worker in self._workers:
            worker.stop()
        self._workers = []
        self._queue.clear()
        self._running.clear()
