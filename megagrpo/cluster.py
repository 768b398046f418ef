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
``engine.generate.remote(...)``; ``EnginePool`` holds a run's engines and replaces one that dies or
stops answering (restarted on its placement, weights re-synced, probe re-run, its requests re-run
with the same seeds), up to ``generation.max_engine_restarts`` in a window of steps.

Faults end a run with a ``RunFault`` naming what failed (a policy rank and its node, an engine and
its last error); ``megagrpo train`` exits with status 75 (``FAULT_EXIT``) on one, which the
supervisor in ``launch/`` answers with a relaunch under ``--resume``. A local Ray listens on
127.0.0.1 only (``compat.ray_loopback``) and does not outlive its driver (``megagrpo.local_ray``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megagrpo import local_ray
from megagrpo.compat.ray_loopback import local_ray_on_loopback
from megagrpo.config import ClusterConfig, Config

if TYPE_CHECKING:
    from megagrpo.generation.worker import GenerationWorker

# How much of a node-label resource (cluster.policy_resource / engine_resource) an actor takes: a
# label, not a count, so a node started with {"NAME": 1} takes any number of actors.
NODE_LABEL_AMOUNT = 0.001

# Fraction of a GPU a trainer rank reserves under colocated placement; its engine takes the rest.
COLOCATED_SHARE = 0.5

# Exit status of a run stopped by a fault that ``--resume`` continues from (EX_TEMPFAIL).
FAULT_EXIT = 75

# Environment of every Ray worker of a local run: process groups on the loopback interface.
_LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}


class RunFault(RuntimeError):
    """A fault that stopped the run (a policy rank lost, engines failing past their restarts);
    the latest checkpoint continues it (``--resume``)."""


class RankFailure(RunFault):
    """A rank of a RankGroup died or did not answer in time; the message names it and its node."""


class EngineFailure(RunFault):
    """An engine failed once more than ``generation.max_engine_restarts`` allow."""

    def __init__(self, message: str, engine: int):
        super().__init__(message)
        self.engine = engine


_local_session: tuple[Path, Any] | None = None  # (session dir, watchdog) of the Ray this process started


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
        return
    env |= {k: v for k, v in _LOOPBACK_ENV.items() if k not in os.environ}
    with local_ray_on_loopback():
        context = ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            num_gpus=cluster.gpus_per_node or None,
            include_dashboard=False,
            runtime_env={"env_vars": env},
            log_to_driver=True,
        )
    global _local_session
    session = Path(context.address_info["session_dir"])
    _local_session = (session, local_ray.claim(session))
    for swept in local_ray.sweep_orphans(session.parent):
        print(f"stopped the processes left by {swept}, the local Ray of a driver that was killed")


def shutdown_ray() -> None:
    """``ray.shutdown``; a local Ray's watchdog is dismissed (its session ended cleanly)."""
    global _local_session
    ray.shutdown()
    if _local_session is not None:
        local_ray.release(*_local_session)
        _local_session = None


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

    def address(self) -> tuple[str, int]:
        from megagrpo.parallel.local import free_port

        return ray.util.get_node_ip_address(), free_port()

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
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            # Ray gives each GPU actor exactly one visible device.
            LOCAL_RANK="0",
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        self.worker = worker_cls(cfg)
        return threads

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[float, Any]:
        """(seconds inside the method, its result)."""
        start = time.perf_counter()
        # By name, so a subclass's override runs (the group checked the method against the class).
        result = getattr(self.worker, name)(*args, **kwargs)
        return time.perf_counter() - start, result


class RankGroup:
    """``world_size`` actors forming one torch.distributed job, placed together.

    ``worker_cls`` is instantiated as ``worker_cls(cfg)`` on every rank (it travels to the actors
    by reference: an importable class, or a script's class by value).
    """

    def __init__(
        self,
        cfg: Config,
        worker_cls: type,
        *,
        name: str = "policy",
        timeout_s: float = 600.0,
        wait: bool = True,
    ):
        """Start the ranks and set them up; ``wait=False`` returns while they set up (call
        ``ready()`` before the first method: a set-up error surfaces there)."""
        if not isinstance(worker_cls, type):
            raise TypeError(
                f"RankGroup needs the worker class itself (e.g. PolicyWorker), got {worker_cls!r}"
            )
        self.worker_cls = worker_cls
        self.name = name
        self.world_size = cfg.parallel.world_size
        self.timeout_s = timeout_s
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
        ray.get(self.pg.ready(), timeout=timeout_s)
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
        master = ray.get(self.actors[0].address.remote(), timeout=timeout_s)
        self.nodes = ray.get([a.node.remote() for a in self.actors], timeout=timeout_s)
        self.node_ids = ray.get([a.node_id.remote() for a in self.actors], timeout=timeout_s)
        per_node = Counter(self.node_ids)
        self._setup: list | None = [
            a.setup.remote(worker_cls, cfg, rank, self.world_size, master, per_node[self.node_ids[rank]])
            for rank, a in enumerate(self.actors)
        ]
        self.cpu_threads: list[int | None] = []
        """Intra-op CPU threads of each rank (None on GPUs); filled in by ``ready()``."""
        self.last_call_s = 0.0
        """Time the slowest rank spent inside the last method called (the call's wall time minus
        this is Ray's: scheduling, argument and result transfer)."""
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
                    f"{self.timeout_s:.0f}s: {silent}"
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
        return RankFailure(f"{self.name} rank {rank} on {self.nodes[rank]} died: {_first_line(err)}")

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
        """Run ``method`` on every rank; large arguments go to the object store once."""
        return self.wait(self.submit_all(method, *args, **kwargs))

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


def _first_line(err: BaseException) -> str:
    """An error's message without the traceback Ray appends."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
    indices: Sequence[int] | None = None,
) -> list:
    """``generation.num_engines`` vLLM engines as Ray actors (started in parallel, returned when ready).

    Each is an ``engine_cls(cfg, model_dir, index)`` (default ``GenerationWorker``). Colocated
    placement puts engine ``i`` in the policy's bundle ``i`` (sharing that rank's GPU);
    disaggregated engines get devices of their own. ``indices``: start only these engines (a
    replacement starts where the engine it replaces was placed).
    """
    engines = launch_engines(cfg, model_dir, policy=policy, engine_cls=engine_cls, indices=indices)
    return wait_for_engines(engines, timeout_s)


def launch_engines(
    cfg: Config,
    model_dir: str,
    *,
    policy: RankGroup | None = None,
    engine_cls: type[GenerationWorker] | None = None,
    indices: Sequence[int] | None = None,
) -> list:
    """``start_engines`` without the wait: the actors, still starting (``wait_for_engines``)."""
    if engine_cls is None:
        from megagrpo.generation.worker import GenerationWorker

        engine_cls = GenerationWorker
    actor_cls = ray.remote(engine_cls)
    colocated = cfg.generation.placement == "colocated"
    if colocated and (policy is None or cfg.generation.num_engines > policy.world_size):
        raise ValueError("colocated placement needs the policy group and at most one engine per trainer rank")
    engines = []
    for index in range(cfg.generation.num_engines) if indices is None else indices:
        options: dict = {"num_cpus": cfg.cluster.cpus_per_worker}
        if colocated:
            options["num_gpus"] = 1 - COLOCATED_SHARE
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=policy.pg, placement_group_bundle_index=index
            )
        elif cfg.cluster.gpus_per_node > 0:
            options["num_gpus"] = cfg.generation.engine_tensor_parallel_size
        if cfg.cluster.engine_resource:
            options["resources"] = {cfg.cluster.engine_resource: NODE_LABEL_AMOUNT}
        engines.append(actor_cls.options(**options).remote(cfg, model_dir, index))
    return engines


def wait_for_engines(engines: list, timeout_s: float = 600.0) -> list:
    """``engines`` once each has constructed (an engine that failed to start raises here)."""
    ready = [e.__ray_ready__.remote() for e in engines]
    done, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
    for ref in done:
        ray.get(ref)
    if pending:
        raise TimeoutError(f"{len(pending)} vLLM engine(s) did not start within {timeout_s:.0f}s")
    return engines


def placement_summary(policy: RankGroup, engines: Sequence) -> str:
    """Which Ray node each policy rank and each engine runs on (node ids shortened), one line."""
    engine_nodes = ray.get([e.node_id.remote() for e in engines], timeout=policy.timeout_s)

    def spans(label: str, node_ids: Sequence[str]) -> list[str]:
        by_node: dict[str, list[int]] = {}
        for index, node in enumerate(node_ids):
            by_node.setdefault(node, []).append(index)
        return [f"{label} {','.join(map(str, idx))} on node {node[:12]}" for node, idx in by_node.items()]

    return "; ".join(spans("policy rank", policy.node_ids) + spans("engine", engine_nodes))


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_steps`` consecutive GRPO steps (0: the
    whole run)."""

    def __init__(self, max_restarts: int, window_steps: int):
        self.max_restarts, self.window_steps = max_restarts, window_steps
        self.steps: deque[int] = deque()

    def take(self, step: int) -> bool:
        """Count a restart at ``step`` if one more is allowed; False (nothing counted) if not."""
        while self.window_steps and self.steps and self.steps[0] <= step - self.window_steps:
            self.steps.popleft()
        if len(self.steps) >= self.max_restarts:
            return False
        self.steps.append(step)
        return True


class EnginePool:
    """A run's vLLM engines and their weight sync; an engine that dies or does not answer in time is
    replaced.

    ``start(indices)`` starts the engines at those indices on their placements (``start_engines``);
    ``connect(engines)`` forms the weight-sync groups with them (a ``WeightSync``). Replacing engine
    ``i``: its actor is killed, a new one started on its placement, the sync groups re-formed, the
    trainer's current weights sent to every engine and probed; the calls engine ``i`` had not
    answered are then made again with the same arguments (rollouts carry their seeds, so the step's
    samples are the ones the lost engine would have returned). A failure past the
    ``RestartBudget`` raises ``EngineFailure``.
    """

    def __init__(self, cfg: Config, start: Callable[[list[int]], list], connect: Callable[[list], Any]):
        self.cfg, self._start, self._connect = cfg, start, connect
        self.actors = start(list(range(cfg.generation.num_engines)))
        self.sync = connect(self.actors)
        gen = cfg.generation
        self.budget = RestartBudget(gen.max_engine_restarts, gen.engine_restart_window_steps)
        self.step = 0
        """The GRPO step now running (restart windows count in steps)."""
        self.restarts: list[tuple[int, float]] = []
        """(engine, seconds from its failure to the probe of its replacement), one per restart."""
        self.last_probe_s = 0.0
        """Time the last sync's probe took (scored by every engine and the trainer)."""
        self.restartable = True
        """False while engines generate ahead of a training step (``grpo.max_staleness``): a
        replacement would be sent the weights the trainer is changing, so a failure then stops."""

    def call(self, method: str, args_by_engine: dict[int, tuple], timeout_s: float) -> dict[int, Any]:
        """``method(*args)`` on each engine of ``args_by_engine``; results by engine. An engine that
        fails (dies, or has not answered within ``timeout_s``) is replaced and asked again."""
        refs = {i: getattr(self.actors[i], method).remote(*args) for i, args in args_by_engine.items()}
        results = {}
        for i, args in args_by_engine.items():
            while i not in results:
                try:
                    results[i] = ray.get(refs[i], timeout=timeout_s)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                    self.replace(i, err)
                    refs[i] = getattr(self.actors[i], method).remote(*args)
        return results

    def generate(self, prompts: Sequence, settings, seeds: Sequence[int]) -> list:
        """Completions (``Completion``) for ``prompts`` (objects with ``token_ids``; ``settings.n`` each,
        in prompt order), split across the engines. An engine that fails is replaced and its share
        generated again, with the same seeds."""
        per = math.ceil(len(prompts) / len(self.actors))
        shares = {}
        for i in range(len(self.actors)):
            chunk = slice(i * per, (i + 1) * per)
            if prompts[chunk]:
                shares[i] = ([p.token_ids for p in prompts[chunk]], settings, seeds[chunk])
        out = []
        for i, comps in self.call("generate", shares, self.cfg.generation.timeout_s).items():
            out += [dataclasses.replace(c, prompt_index=c.prompt_index + i * per) for c in comps]
        return out

    def sync_weights(self):
        """Send the trainer's weights to every engine and probe them (a ``ProbeResult``); an engine
        that fails meanwhile is replaced, which sends and probes again."""
        from megagrpo.weight_sync.sync import WeightSyncError

        try:
            self.sync.sync()
            start = time.perf_counter()
            probe = self.sync.probe()
            self.last_probe_s = time.perf_counter() - start
            return probe
        except WeightSyncError as err:
            if err.engine is None:
                raise
            return self.replace(err.engine, err)

    def replace(self, index: int, err: BaseException):
        """Restart engine ``index`` on its placement, re-sync and probe; returns the probe result."""
        gen = self.cfg.generation
        if not self.restartable:
            raise EngineFailure(
                f"vLLM engine {index} failed while generating the next step's rollouts during training "
                f"(grpo.max_staleness = {self.cfg.grpo.max_staleness}): engines are not restarted while "
                f"the trainer changes the weights; last error: {_first_line(err)}",
                index,
            )
        if not self.budget.take(self.step):
            window = gen.engine_restart_window_steps
            raise EngineFailure(
                f"vLLM engine {index} failed after {len(self.budget.steps)} engine restart(s)"
                + (f" within {window} steps" if window else "")
                + f" (generation.max_engine_restarts = {gen.max_engine_restarts}); "
                f"last error: {_first_line(err)}",
                index,
            )
        start = time.perf_counter()
        print(f"vLLM engine {index} failed ({_first_line(err)}); restarting it on its placement", flush=True)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._start([index])[0]
        self.sync = self._connect(self.actors)
        self.sync.sync()
        probe = self.sync.probe()
        seconds = time.perf_counter() - start
        self.restarts.append((index, seconds))
        print(f"vLLM engine {index} restarted, weights re-synced and probed in {seconds:.1f}s", flush=True)
        return probe
