"""Rank groups: how a trainer calls its Megatron ranks, whether they are Ray actors or SPMD processes.

Both groups implement :class:`RankCalls`, so a trainer loop (``megagrpo.trainers.run``) and the
checkpoint writer run unchanged on either. Methods are named by reference, never by string:

- ``call_all(PolicyWorker.train, batch)``: every rank runs the method (Megatron methods are collective);
  a function that is not a method of the hosted class is a TypeError (``method_name``);
- ``call_first(...)``: the same, returning the first rank's result (the workers return identical results
  on every rank, combining data-parallel shards themselves).

``RankGroup`` (GRPO): ``parallel.world_size`` Ray actors, one per Megatron rank, placed by a placement
group (one bundle per rank: a GPU on GPU clusters, ``cluster.cpus_per_worker`` CPUs otherwise), each
hosting an instance of the worker class the group was made with (``RankGroup(cfg, PolicyWorker)``).
This process is the controller; it talks to the group, never to a single rank. Large arguments (a
rollout batch) are put in the object store once and every rank reads the shared copy.

``LocalGroup`` (SFT, DPO, the warm-up; ``megagrpo.runtime.spmd``, which imports no Ray, re-exported
here): one process per rank, every one running the same trainer loop (``run_ranks``: spawned locally, or
this process's rank under torchrun); calls run on this rank's own worker, global rank 0 is the controller
that logs metrics and commits checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megagrpo.config import Config
from megagrpo.runtime.faults import RankFailure, first_line
from megagrpo.runtime.spmd import LocalGroup, RankCalls, T, end_rank, method_name, run_ranks

# How much of a node-label resource (cluster.policy_resource / engine_resource) an actor takes: a
# label, not a count, so a node started with {"NAME": 1} takes any number of actors.
NODE_LABEL_AMOUNT = 0.001

# Fraction of a GPU a trainer rank reserves under colocated placement; its engine takes the rest.
COLOCATED_SHARE = 0.5


# ------------------------------------------------------------------------------------- Ray ranks


def rank_cpu_threads(cfg: Config, ranks_on_node: int, node_cores: int) -> int:
    """Intra-op threads of a CPU trainer rank (``cluster.cpu_threads``): as configured, or the node's
    cores shared out among its ranks when nothing else computes while they train (engines wait
    during training unless ``grpo.max_staleness`` > 0), else its reserved ``cpus_per_worker``."""
    if cfg.cluster.cpu_threads is not None:
        return cfg.cluster.cpu_threads
    if cfg.grpo.max_staleness > 0:
        return max(1, int(cfg.cluster.cpus_per_worker))
    return max(1, node_cores // max(1, ranks_on_node))


@ray.remote
class RankActor:
    """Hosts one rank of a distributed worker (e.g. a PolicyWorker) inside a Ray actor."""

    def __init__(self) -> None:
        self.worker = None
        self.store = None
        self._joined = contextlib.ExitStack()

    def address(self, world_size: int) -> tuple[str, int]:
        """Host the group's rendezvous store (the first rank's actor does): bound here, on a port
        picked as it binds, and kept for the actor's life, so no other process takes the port between
        its choice and the rendezvous."""
        from megagrpo.parallel.local import host_store

        self.store = host_store(ray.util.get_node_ip_address(), world_size, 600.0)
        return ray.util.get_node_ip_address(), self.store.port

    def node(self) -> str:
        """Where this rank runs: node address and process id."""
        return f"{ray.util.get_node_ip_address()} (pid {os.getpid()})"

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        return ray.get_runtime_context().get_node_id()

    def setup(
        self,
        worker_cls: type,
        cfg: Config,
        rank: int,
        world_size: int,
        master: tuple[str, int],
        ranks_on_node: int = 1,
    ) -> int | None:
        """Start the worker; returns its intra-op CPU threads (None with a GPU: left as Ray set them)."""
        threads = None
        if cfg.cluster.gpus_per_node == 0:
            import torch

            threads = rank_cpu_threads(cfg, ranks_on_node, len(os.sched_getaffinity(0)))
            torch.set_num_threads(threads)  # Ray starts a 1-CPU actor with one thread
        from megagrpo.compat.torch_store import rendezvous_at_hosted_store
        from megagrpo.parallel.local import hosted_store_env

        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            # Ray gives each GPU actor exactly one visible device.
            LOCAL_RANK="0",
            **hosted_store_env(*master),
        )
        # For the actor's life: a worker may destroy its world and make it again.
        self._joined.close()
        self._joined.enter_context(rendezvous_at_hosted_store())
        self.worker = worker_cls(cfg)
        return threads

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[float, Any]:
        """(seconds inside the method, its result)."""
        start = time.perf_counter()
        # By name, so a subclass's override runs (the group checked the method against the class).
        result = getattr(self.worker, name)(*args, **kwargs)
        return time.perf_counter() - start, result


class RankGroup:
    """``world_size`` actors forming one torch.distributed job, placed together; a :class:`RankCalls`
    whose one process, this one, is the controller.

    ``worker_cls`` is instantiated as ``worker_cls(cfg)`` on every rank (it travels to the actors
    by reference: an importable class, or a script's class by value).
    """

    is_controller = True
    """The ranks are actors this process drives: it is the group's only controller process."""
    last_call_s = 0.0
    """Time the slowest rank spent inside the last method called (the call's wall time minus this is
    Ray's: scheduling, argument and result transfer)."""

    def __init__(
        self,
        cfg: Config,
        worker_cls: type,
        *,
        name: str = "policy",
        timeout_s: float | None = None,
        wait: bool = True,
    ):
        """Start the ranks and set them up; ``wait=False`` returns while they set up (call
        ``ready()`` before the first method: a set-up error surfaces there). ``timeout_s``: how long
        one call (set-up included) may take on the slowest rank; None: ``cluster.rank_call_timeout_s``."""
        if not isinstance(worker_cls, type):
            raise TypeError(
                f"RankGroup needs the worker class itself (e.g. PolicyWorker), got {worker_cls!r}"
            )
        self.worker_cls = worker_cls
        self.name = name
        self.world_size = cfg.parallel.world_size
        self.timeout_s = cfg.cluster.rank_call_timeout_s if timeout_s is None else timeout_s
        gpus = cfg.cluster.gpus_per_node > 0
        colocated = cfg.generation.placement == "colocated"
        bundle = {"CPU": cfg.cluster.cpus_per_worker}
        if cfg.cluster.policy_resource:
            bundle[cfg.cluster.policy_resource] = NODE_LABEL_AMOUNT
        if gpus:
            bundle["GPU"] = 1
        if colocated:
            bundle["CPU"] += cfg.cluster.cpus_per_worker  # room for the engine sharing the bundle
        self.pg = placement_group([bundle] * self.world_size, strategy="PACK", name=f"megagrpo-{name}")
        ray.get(self.pg.ready(), timeout=self.timeout_s)
        self.nodes = ["?"] * self.world_size  # filled in once the actors answer
        self.actors = [
            RankActor.options(
                num_cpus=cfg.cluster.cpus_per_worker,
                # Colocated: a rank and an engine share each GPU (the engine sleeps while we train).
                num_gpus=(COLOCATED_SHARE if colocated else 1) if gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
                name=f"megagrpo-{name}-{rank}-{int(time.time() * 1000)}",
            ).remote()
            for rank in range(self.world_size)
        ]
        master = ray.get(self.actors[0].address.remote(self.world_size), timeout=self.timeout_s)
        self.nodes = ray.get([a.node.remote() for a in self.actors], timeout=self.timeout_s)
        self.node_ids = ray.get([a.node_id.remote() for a in self.actors], timeout=self.timeout_s)
        per_node = Counter(self.node_ids)
        self._setup: list | None = [
            a.setup.remote(worker_cls, cfg, rank, self.world_size, master, per_node[self.node_ids[rank]])
            for rank, a in enumerate(self.actors)
        ]
        self.cpu_threads: list[int | None] = []
        """Intra-op CPU threads of each rank (None on GPUs); filled in by ``ready()``."""
        if wait:
            self.ready()

    def ready(self) -> RankGroup:
        """Wait until every rank has set up (a failed rank raises, named); a no-op after the first."""
        if self._setup is not None:
            refs, self._setup = self._setup, None
            self.cpu_threads = self._get(refs)
        return self

    def _get(self, refs: list) -> list:
        # One failed rank usually leaves the others waiting in a collective: report the first
        # failure (with its traceback) instead of waiting for all of them. A rank that died or
        # does not answer is a RankFailure naming it and its node.
        pending, results = list(refs), {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                silent = ", ".join(f"rank {refs.index(r)} on {self.nodes[refs.index(r)]}" for r in pending)
                raise RankFailure(
                    f"{len(pending)} of {len(refs)} {self.name} ranks did not answer within "
                    f"{self.timeout_s:.0f}s (cluster.rank_call_timeout_s): {silent}"
                )
            try:
                results[done[0]] = ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                raise self._died(refs, done[0], err) from err
            except ray.exceptions.RayTaskError as err:
                # A rank whose peer died fails in its next collective: name the dead one instead.
                ready, _ = ray.wait(pending, num_returns=len(pending), timeout=5.0)
                for ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as dead:
                        raise self._died(refs, ref, dead) from err
                    except Exception:  # the first error is the one raised
                        continue
                raise
        return [results[r] for r in refs]

    def _died(self, refs: list, ref, err: BaseException) -> RankFailure:
        rank = refs.index(ref)
        return RankFailure(f"{self.name} rank {rank} on {self.nodes[rank]} died: {first_line(err)}")

    def submit_all(self, method: Callable, *args: Any, **kwargs: Any) -> list:
        """Start ``method`` on every rank; returns the pending results (see ``wait``)."""
        name = method_name(self.worker_cls, method)
        shared = [ray.put(a) if _is_large(a) else a for a in args]
        return [a.call.remote(name, *shared, **kwargs) for a in self.actors]

    def wait(self, refs: list) -> list[Any]:
        """The results of ``submit_all``'s calls (``last_call_s``: the slowest rank's time inside)."""
        timed = self._get(refs)
        self.last_call_s = max(seconds for seconds, _ in timed)
        return [result for _, result in timed]

    def call_all(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method`` on every rank; every rank's result, in rank order. Large arguments go to the
        object store once."""
        return self.wait(self.submit_all(method, *args, **kwargs))

    def call_first(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on every rank and return rank 0's result."""
        return self.call_all(method, *args, **kwargs)[0]

    def barrier(self) -> None:
        """Nothing to wait for: the controller is the one process, and every call returns once every
        rank has answered."""

    def gather_to_controller(self, value: Any) -> list[Any]:
        """``[value]``: the controller is the group's one process (the ranks' results come from
        ``call_all``)."""
        return [value]

    def from_controller(self, make: Callable[[], T]) -> T:
        """``make()``: this process is the controller."""
        return make()

    def controller_only(self, make: Callable[[], Any]) -> AbstractContextManager:
        """``make()``: this process is the controller."""
        return make()

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)


def _is_large(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() > 1 << 20
    return dataclasses.is_dataclass(value)


__all__ = [
    "COLOCATED_SHARE",
    "NODE_LABEL_AMOUNT",
    "LocalGroup",
    "RankActor",
    "RankCalls",
    "RankGroup",
    "end_rank",
    "method_name",
    "rank_cpu_threads",
    "run_ranks",
]
