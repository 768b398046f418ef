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

__all__ = ["DeadlinePool", "PoolResult"]

# What the fork server imports once, so that every worker forked from it has it already.
_PRELOAD = ["megagrpo.rewards.math", "megagrpo.rewards.arithmetic", "math_verify"]
# A worker that has not said it is ready after this long (a user module stuck at import) stops the call.
_START_LIMIT_S = 120.0


@dataclass(frozen=True)
class PoolResult:
    """Values of one ``DeadlinePool.map`` call, in task order."""

    values: list[float | None]
    """One float per task; None for a task that timed out or failed."""
    timeouts: int
    """Tasks cut at their deadline (their workers were killed and replaced)."""
    errors: int
    """Tasks whose function raised or returned a non-number / non-finite value, or whose worker died."""
    error_messages: list[str]
    """One line per error (the first few of the call), for logs and tests."""


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker when its parent (the fork server) exits: it does when the
    driver goes, and this holds even while the worker is stuck in C code holding the GIL."""
    import ctypes
    import signal

    # Not Linux (no prctl): the worker still ends on EOF of its pipe between tasks.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _worker_main(conn: Connection, function: str) -> None:
    """Worker loop: receive (task id, args), reply (task id, ok, value or error text)."""
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
            value = float(fn(*args))
            ok = math.isfinite(value)
            reply = value if ok else f"non-finite reward {value!r}"
        except Exception as err:
            ok, reply = False, f"{type(err).__name__}: {err}"
        conn.send((task, ok, reply))


class _Worker:
    def __init__(self, ctx, function: str):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, function), daemon=True)
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
    see ``megagrpo.rewards.user``) with each task's arguments, one task per process at a time."""

    def __init__(self, function: str, num_workers: int, timeout_s: float):
        if num_workers < 1 or not timeout_s > 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self.function, self.timeout_s = function, timeout_s
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        self._workers = [_Worker(self._ctx, function) for _ in range(num_workers)]
        self.replaced = 0
        """Workers started to replace one that was killed at a deadline or died (whole life of the pool)."""
        self._start_deaths = 0  # workers in a row that died before they were ready

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (one per slot)."""
        return [w.process.pid for w in self._workers]

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
        self._workers[slot] = _Worker(self._ctx, self.function)
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
                f"reward workers loading {self.function!r} keep dying as they start "
                f"(last exit code {worker.process.exitcode})"
            )
        self._replace(slot, kill=False)

    def _check_start_limit(self) -> None:
        now = time.monotonic()
        if any(not w.ready and now >= w.started + _START_LIMIT_S for w in self._workers):
            raise RuntimeError(
                f"a reward worker loading {self.function!r} did not start within {_START_LIMIT_S:.0f} s"
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

    def map(self, tasks: Sequence[tuple]) -> PoolResult:
        """Run every task (a tuple of arguments); returns when each has a value, an error or its deadline."""
        values: list[float | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        running: dict[int, tuple[int, float]] = {}  # slot -> (task, deadline)
        timeouts, errors, messages = 0, 0, []

        def failed(task: int, message: str) -> None:
            nonlocal errors
            errors += 1
            if len(messages) < 8:
                messages.append(f"task {task}: {message}")

        while queue or running:
            for slot, worker in enumerate(self._workers):
                if queue and worker.ready and slot not in running:
                    task = queue.popleft()
                    try:
                        worker.conn.send((task, tasks[task]))
                    except OSError:  # died while idle: replace it, the task goes to the next ready one
                        self._replace(slot, kill=True)
                        queue.appendleft(task)
                        continue
                    running[slot] = (task, time.monotonic() + self.timeout_s)
            waiting = {w.conn: slot for slot, w in enumerate(self._workers) if slot in running or not w.ready}
            deadlines = [d for _, d in running.values()]
            deadlines += [w.started + _START_LIMIT_S for w in self._workers if not w.ready]
            for conn in wait(list(waiting), timeout=max(0.0, min(deadlines) - time.monotonic())):
                slot = waiting[conn]
                if slot not in running:
                    self._starting(slot)
                    continue
                task, _ = running.pop(slot)
                try:
                    done, ok, value = conn.recv()
                except (EOFError, OSError):  # the worker died (segfault, os._exit, out of memory)
                    failed(task, f"worker process died (exit code {self._workers[slot].process.exitcode})")
                    self._replace(slot, kill=False)
                    continue
                assert done == task, (done, task)
                if ok:
                    values[task] = value
                else:
                    failed(task, value)
            now = time.monotonic()
            for slot, (_, deadline) in list(running.items()):
                if now >= deadline:
                    del running[slot]
                    timeouts += 1
                    self._replace(slot, kill=True)
            self._check_start_limit()
        return PoolResult(values, timeouts, errors, messages)

    def close(self) -> None:
        """Stop every worker (those stuck in a task are killed)."""
        for worker in self._workers:
            worker.stop()
        self._workers = []
