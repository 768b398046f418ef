"""Ray: start or join a cluster, place the trainer's ranks, drive them as one group, start the engines.

The policy is ``world_size`` Ray actors, one per Megatron rank, placed by a placement group
(one bundle per rank: a GPU on GPU clusters, ``cluster.cpus_per_worker`` CPUs otherwise), each
hosting an instance of the worker class the group was made with (``RankGroup(cfg, PolicyWorker)``).
The controller talks to the group, never to a single rank, and names methods by reference:

- ``call_all(PolicyWorker.train, batch)``: every rank runs the method (Megatron methods are
  collective); a function that is not a method of the hosted class is a TypeError;
- ``call_first(...)``: the same, returning rank 0's result (the policy returns identical results
  on every rank, combining data-parallel shards itself);
- large arguments (a rollout batch) are put in the object store once and every rank reads the
  shared copy; each rank then selects its own data-parallel shard.

vLLM engines are single Ray actors of ``GenerationWorker`` (or a subclass), called as
``engine.generate.remote(...)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megagrpo.config import ClusterConfig, Config

if TYPE_CHECKING:
    from megagrpo.generation.worker import GenerationWorker

# Fraction of a GPU a trainer rank reserves under colocated placement; its engine takes the rest.
COLOCATED_SHARE = 0.5


def start_ray(cluster: ClusterConfig, *, num_cpus: int | None = None, cfg: Config | None = None) -> None:
    """Join ``cluster.ray_address`` or start a local Ray; idempotent.

    A local Ray gets at least as many logical CPUs as the job's actors reserve (trainer ranks and
    engines, ``cpus_per_worker`` each): on a small machine they share the cores, and a placement
    group that cannot be satisfied would otherwise wait forever.
    """
    if ray.is_initialized():
        return
    if num_cpus is None and cfg is not None:
        actors = cfg.parallel.world_size + cfg.generation.num_engines
        num_cpus = max(os.cpu_count() or 1, int(actors * cluster.cpus_per_worker + 0.999))
    env = {
        # Our Megatron workers print their own progress; Ray's per-actor log prefixing is enough.
        "RAY_DEDUP_LOGS": "0",
    }
    if cluster.ray_address:
        ray.init(address=cluster.ray_address, runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            num_gpus=cluster.gpus_per_node or None,
            include_dashboard=False,
            runtime_env={"env_vars": env},
            log_to_driver=True,
        )


@ray.remote
class RankActor:
    """Hosts one rank of a distributed worker (e.g. a PolicyWorker) inside a Ray actor."""

    def __init__(self) -> None:
        self.worker = None

    def address(self) -> tuple[str, int]:
        from megagrpo.parallel.local import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(
        self, worker_cls: type, cfg: Config, rank: int, world_size: int, master: tuple[str, int]
    ) -> bool:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            # Ray gives each GPU actor exactly one visible device.
            LOCAL_RANK="0",
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        self.worker = worker_cls(cfg)
        return True

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        # By name, so a subclass's override runs (the group checked the method against the class).
        return getattr(self.worker, name)(*args, **kwargs)


class RankGroup:
    """``world_size`` actors forming one torch.distributed job, placed together.

    ``worker_cls`` is instantiated as ``worker_cls(cfg)`` on every rank (it travels to the actors
    by reference: an importable class, or a script's class by value).
    """

    def __init__(self, cfg: Config, worker_cls: type, *, name: str = "policy", timeout_s: float = 600.0):
        if not isinstance(worker_cls, type):
            raise TypeError(
                f"RankGroup needs the worker class itself (e.g. PolicyWorker), got {worker_cls!r}"
            )
        self.worker_cls = worker_cls
        self.world_size = cfg.parallel.world_size
        self.timeout_s = timeout_s
        gpus = cfg.cluster.gpus_per_node > 0
        colocated = cfg.generation.placement == "colocated"
        bundle = {"CPU": cfg.cluster.cpus_per_worker}
        if gpus:
            bundle["GPU"] = 1
        if colocated:
            bundle["CPU"] += cfg.cluster.cpus_per_worker  # room for the engine sharing the bundle
        self.pg = placement_group([bundle] * self.world_size, strategy="PACK", name=f"megagrpo-{name}")
        ray.get(self.pg.ready(), timeout=timeout_s)
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
        master = ray.get(self.actors[0].address.remote(), timeout=timeout_s)
        self._get(
            [
                a.setup.remote(worker_cls, cfg, rank, self.world_size, master)
                for rank, a in enumerate(self.actors)
            ]
        )

    def _get(self, refs: list) -> list:
        # One failed rank usually leaves the others waiting in a collective: report the first
        # failure (with its traceback) instead of waiting for all of them.
        pending, results = list(refs), {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(
                    f"{len(pending)} of {len(refs)} ranks did not answer within {self.timeout_s:.0f}s"
                )
            results[done[0]] = ray.get(done[0])
        return [results[r] for r in refs]

    def submit_all(self, method: Callable, *args: Any, **kwargs: Any) -> list:
        """Start ``method`` on every rank; returns the pending results (see ``wait``)."""
        name = method_name(self.worker_cls, method)
        shared = [ray.put(a) if _is_large(a) else a for a in args]
        return [a.call.remote(name, *shared, **kwargs) for a in self.actors]

    def wait(self, refs: list) -> list[Any]:
        return self._get(refs)

    def call_all(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method`` on every rank; large arguments go to the object store once."""
        return self._get(self.submit_all(method, *args, **kwargs))

    def call_first(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` on every rank and return rank 0's result."""
        return self.call_all(method, *args, **kwargs)[0]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.pg)


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


def _is_large(value: Any) -> bool:
    import dataclasses

    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() > 1 << 20
    return dataclasses.is_dataclass(value)


def start_engines(
    cfg: Config,
    model_dir: str,
    *,
    policy: RankGroup | None = None,
    engine_cls: type[GenerationWorker] | None = None,
    timeout_s: float = 600.0,
) -> list:
    """``generation.num_engines`` vLLM engines as Ray actors (started in parallel, returned when ready).

    Each is an ``engine_cls(cfg, model_dir, index)`` (default ``GenerationWorker``). Colocated
    placement puts engine ``i`` in the policy's bundle ``i`` (sharing that rank's GPU);
    disaggregated engines get devices of their own.
    """
    if engine_cls is None:
        from megagrpo.generation.worker import GenerationWorker

        engine_cls = GenerationWorker
    actor_cls = ray.remote(engine_cls)
    colocated = cfg.generation.placement == "colocated"
    if colocated and (policy is None or cfg.generation.num_engines > policy.world_size):
        raise ValueError("colocated placement needs the policy group and at most one engine per trainer rank")
    engines = []
    for index in range(cfg.generation.num_engines):
        options: dict = {"num_cpus": cfg.cluster.cpus_per_worker}
        if colocated:
            options["num_gpus"] = 1 - COLOCATED_SHARE
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=policy.pg, placement_group_bundle_index=index
            )
        elif cfg.cluster.gpus_per_node > 0:
            options["num_gpus"] = cfg.generation.engine_tensor_parallel_size
        engines.append(actor_cls.options(**options).remote(cfg, model_dir, index))
    # Construction happens in the actor's __init__; any method call waits for it.
    ready = [e.__ray_ready__.remote() for e in engines]
    done, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
    for ref in done:
        ray.get(ref)
    if pending:
        raise TimeoutError(f"{len(pending)} vLLM engine(s) did not start within {timeout_s:.0f}s")
    return engines
