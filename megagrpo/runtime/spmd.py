"""SPMD rank groups, without Ray: the :class:`RankCalls` protocol every rank group implements, the group
of a trainer-only job (SFT, DPO, the warm-up) as one of its ranks sees it (:class:`LocalGroup`), and
running such a job on its ranks (:func:`run_ranks`: spawned locally, or this process's rank under
torchrun). The Ray group of GRPO (``megagrpo.runtime.groups.RankGroup``) implements the same protocol.
Nothing here imports Ray: a trainer-only rank does not pay for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypeVar, runtime_checkable

from megagrpo.config import Config

T = TypeVar("T")


@runtime_checkable
class RankCalls(Protocol):
    """The call surface of a rank group, as trainer loops and the checkpoint writer use it."""

    is_controller: bool
    """Whether this process is the run's controller (logs metrics, writes the run's own files)."""
    last_call_s: float
    """Seconds the slowest rank (of those this process sees) spent inside the last method called."""

    def call_all(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` (a method of the worker class) on every rank; the results this process sees."""
        ...

    def call_first(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """``call_all``'s first result."""
        ...

    def barrier(self) -> None:
        """Return once every process of the group has reached this point."""
        ...

    def gather_to_controller(self, value: Any) -> list[Any]:
        """Every process's ``value``, in rank order, on the controller; an empty list elsewhere."""
        ...

    def from_controller(self, make: Callable[[], T]) -> T:
        """``make()`` run once, on the controller; its result (or its exception) in every process."""
        ...

    def controller_only(self, make: Callable[[], Any]) -> AbstractContextManager:
        """``make()`` (a context manager) on the controller; a no-op context elsewhere."""
        ...


def method_name(worker_cls: type, method: Callable) -> str:
    """The name ``method`` (e.g. ``PolicyWorker.train``) is called by on a ``worker_cls`` instance.

    A TypeError unless it is a method of ``worker_cls`` (defined there or inherited): a name given
    as a string, a bound method or another class's function. Called by name, a subclass's override
    of the method is what runs.
    """
    name = getattr(method, "__name__", None)
    if not any(name is not None and vars(c).get(name) is method for c in worker_cls.__mro__):
        raise TypeError(
            f"{method!r} is not a method of {worker_cls.__qualname__}: "
            f"pass the function itself, e.g. {worker_cls.__name__}.<method>"
        )
    return name


# ------------------------------------------------------------------------------------ SPMD ranks


class LocalGroup:
    """The rank group of an SPMD job as seen from one of its ranks (a :class:`RankCalls`): calls run on
    this rank's worker; global rank 0 is the controller."""

    last_call_s = 0.0
    """Time this rank spent inside the last method called."""

    def __init__(self, worker: Any):
        import torch.distributed as dist

        self.worker = worker
        self.is_controller: bool = dist.get_rank() == 0

    def call_all(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """This rank's result of ``method`` (a method of the worker's class), as a one-element list."""
        name = method_name(type(self.worker), method)  # the same check as the Ray group's
        start = time.perf_counter()
        result = getattr(self.worker, name)(*args, **kwargs)
        self.last_call_s = time.perf_counter() - start
        return [result]

    def call_first(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """``method``'s result on this rank (the workers return the same result on every rank)."""
        return self.call_all(method, *args, **kwargs)[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def gather_to_controller(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on the controller (an empty list elsewhere)."""
        import torch.distributed as dist

        values = [None] * dist.get_world_size() if self.is_controller else None
        dist.gather_object(value, values, dst=0)
        return values if self.is_controller else []

    def from_controller(self, make: Callable[[], T]) -> T:
        """``make()`` run once, on the controller; its result on every rank (an exception there is
        raised on every rank, so none is left waiting)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.is_controller:
            try:
                box[0] = ("ok", make())
            except Exception as err:  # re-raised on every rank below
                box[0] = ("error", err)
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    def controller_only(self, make: Callable[[], Any]) -> AbstractContextManager:
        """``make()`` on the controller (a context manager, e.g. the metrics logger); elsewhere a no-op."""
        return make() if self.is_controller else nullcontext()


def run_ranks(fn: Callable, cfg: Config, *args: Any, timeout_s: float = 86_400.0) -> Any:
    """``fn(rank, world_size, cfg, *args)`` on every rank of the job; the controller's (rank 0's) result.

    Under torchrun this process is one rank (other ranks return None here); otherwise
    ``parallel.world_size`` local processes are spawned.
    """
    from megagrpo.parallel.local import run_local_ranks

    world = cfg.parallel.world_size
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but the config's parallel layout "
                f"needs DP x TP x PP x CP = {world}"
            )
        rank = int(os.environ["RANK"])
        result = fn(rank, world, cfg, *args)
        return result if rank == 0 else None
    with ranks_decide_on_first_interrupt():
        return run_local_ranks(fn, world, cfg, *args, timeout_s=timeout_s)[0]


@contextlib.contextmanager
def ranks_decide_on_first_interrupt():
    """While this process waits for the local ranks it spawned: a terminal's Ctrl-C reaches them too,
    and the ranks' controller answers the first one (finish the step, checkpoint, stop: see
    ``megagrpo.trainers.run``), so this process lets it pass; a second one aborts (KeyboardInterrupt:
    the ranks are stopped). A Python handler, not SIG_IGN: the spawned ranks must not inherit an ignored
    SIGINT."""
    seen = [False]

    def on_sigint(signum, frame):
        if seen[0]:
            raise KeyboardInterrupt
        seen[0] = True

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def end_rank() -> None:
    """Tear down this rank's parallel state after a job. Under torchrun the process may run another job
    next (``megagrpo dpo`` on a tiny model first runs its warm-up): the default group is kept for it,
    since a new rendezvous on gloo races the old store's shutdown (seen as a hang)."""
    from megagrpo.parallel import destroy_parallel

    destroy_parallel(keep_world="TORCHELASTIC_RUN_ID" in os.environ)
