"""vLLM engines as Ray actors, and the pool that keeps a run's engines answering.

An engine is a single Ray actor of the :class:`~megagrpo.generation.engine.RolloutEngine` that
``generation.engine`` names (``generation.engine.ENGINES``; or a subclass given as ``engine_cls``), called
through that Protocol's methods as ``engine.generate.remote(...)``. Colocated placement puts engine
``i`` in the policy's bundle ``i`` (sharing that rank's GPU); disaggregated engines get devices of their
own.

``EnginePool`` holds a run's engines and their weight sync with the policy: it generates (a step's
prompts split across the engines), sends the trainer's weights and probes them, and replaces an engine
that dies or stops answering (restarted on its placement, weights re-synced, probe re-run, its requests
re-run with the same seeds), up to ``generation.max_engine_restarts`` in a window of steps. What the
run is doing is passed to every call (``step=``, ``restartable=``): the pool holds no run state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megagrpo.config import Config
from megagrpo.generation.engine import engine_spec
from megagrpo.runtime.colocated import GpuTurns
from megagrpo.runtime.faults import EngineFailure, RankFailure, first_line
from megagrpo.runtime.groups import COLOCATED_SHARE, NODE_LABEL_AMOUNT, RankGroup
from megagrpo.weight_sync.sync import ProbeResult, SyncStats, WeightSync, WeightSyncError

if TYPE_CHECKING:
    from megagrpo.generation.engine import RolloutEngine
    from megagrpo.weight_sync.shards import SyncPath


def start_engines(
    cfg: Config,
    model_dir: str,
    *,
    policy: RankGroup | None = None,
    engine_cls: type[RolloutEngine] | None = None,
    timeout_s: float = 600.0,
    indices: Sequence[int] | None = None,
) -> list:
    """``generation.num_engines`` vLLM engines as Ray actors (started in parallel, returned when ready).

    Each is an ``engine_cls(cfg, model_dir, index)`` (default: the class ``generation.engine`` names).
    Colocated placement needs ``policy`` (its placement group). ``indices``: start only these engines
    (a replacement starts where the engine it replaces was placed).
    """
    engines = launch_engines(cfg, model_dir, policy=policy, engine_cls=engine_cls, indices=indices)
    return wait_for_engines(engines, timeout_s)


def launch_engines(
    cfg: Config,
    model_dir: str,
    *,
    policy: RankGroup | None = None,
    engine_cls: type[RolloutEngine] | None = None,
    indices: Sequence[int] | None = None,
) -> list:
    """``start_engines`` without the wait: the actors, still starting (``wait_for_engines``)."""
    if engine_cls is None:
        engine_cls = engine_spec(cfg.generation.engine).load_class()
    actor_cls = ray.remote(engine_cls)
    colocated = cfg.generation.placement == "colocated"
    if colocated and (policy is None or cfg.generation.num_engines > policy.world_size):
        raise ValueError("colocated placement needs the policy group and at most one engine per trainer rank")
    engines = []
    for index in range(cfg.generation.num_engines) if indices is None else indices:
        options: dict = {"num_cpus": cfg.cluster.cpus_per_worker}
        if colocated:
            options["num_gpus"] = 1 - COLOCATED_SHARE if cfg.cluster.gpus_per_node > 0 else 0
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


@dataclasses.dataclass(frozen=True)
class SyncOutcome:
    """What a weight sync ended with."""

    probe: ProbeResult
    """How far the engines' probe logprobs are from the trainer's."""
    probe_s: float
    """Time the probe took (scored by every engine and the trainer; part of the sync's time)."""
    offloaded: int = 0
    """Colocated: the device bytes the trainer parked around the sync (the most of any rank)."""
    stats: SyncStats | None = None
    """What the sync put on the links (bytes; delta mode: the changed fraction)."""

    @property
    def metrics(self) -> dict[str, float]:
        """The sync's ``sync/...`` metrics of bytes (``SyncStats.metrics``); none without stats."""
        return {} if self.stats is None else self.stats.metrics


@dataclasses.dataclass(frozen=True)
class SyncLayout:
    """How the weights reach the engines (for the run's start-up report)."""

    backend: str
    """The collective backend of the sync groups (nccl, gloo)."""
    path: SyncPath
    """Shard-wise or gathered, and why."""
    total_bytes: int
    """What the senders broadcast per sync (each to every engine)."""
    worker_bytes: tuple[int, ...]
    """What each of an engine's vLLM workers receives, by engine TP rank."""
    transport: str = ""
    """How the engines receive: broadcast, or shared slots for an engine on its sender's device."""


class EnginePool:
    """A run's vLLM engines and their weight sync with the policy; an engine that dies or does not
    answer in time is replaced.

    Replacing engine ``i``: its actor is killed, a new one started on its placement, the sync groups
    re-formed, the trainer's current weights sent to every engine and probed; the calls engine ``i``
    had not answered are then made again with the same arguments (rollouts carry their seeds, so the
    step's samples are the ones the lost engine would have returned). A failure past the
    ``RestartBudget`` raises ``EngineFailure``.

    Without a policy (``megagrpo eval``) the engines load their weights from ``model_dir`` themselves:
    nothing is sent or probed, and a replacement only restarts.

    Build it with :meth:`start`; the constructor takes engines already started and ready.
    """

    def __init__(
        self,
        cfg: Config,
        model_dir: str,
        actors: Sequence,
        *,
        policy: RankGroup | None = None,
        engine_cls: type[RolloutEngine] | None = None,
        vocab_size: int | None = None,
        log_dir: Path | None = None,
    ):
        """``actors``: the engines, started and ready; with ``policy``, its weight-sync groups are formed
        with them (``vocab_size``: the model's, for the probe). Colocated with a policy, the GPUs are
        handed over by ``turns`` (``runtime.colocated``; its events go to ``log_dir``)."""
        if policy is not None and vocab_size is None:
            raise TypeError("EnginePool with a policy needs the model's vocab_size (the probe's tokens)")
        self.cfg, self.model_dir, self.policy, self.engine_cls = cfg, model_dir, policy, engine_cls
        self.vocab_size = vocab_size
        self.actors = list(actors)
        self._weights: WeightSync | None = self._connect()
        gen = cfg.generation
        colocated = gen.placement == "colocated" and policy is not None
        self.turns = GpuTurns(policy, timeout_s=gen.sync_timeout_s, log_dir=log_dir) if colocated else None
        self.budget = RestartBudget(gen.max_engine_restarts, gen.engine_restart_window_steps)
        self.restarts: list[tuple[int, float]] = []
        """(engine, seconds from its failure to the probe of its replacement), one per restart."""

    @classmethod
    def start(
        cls,
        cfg: Config,
        model_dir: str,
        policy: RankGroup | None = None,
        *,
        launched: list | None = None,
        engine_cls: type[RolloutEngine] | None = None,
        log_dir: Path | None = None,
    ) -> EnginePool:
        """The pool of ``generation.num_engines`` engines loading ``model_dir``: ``launched`` (started by
        ``launch_engines``, still starting) once they are ready, or engines started now. With
        ``policy`` (which may still be setting up: it is waited for once the engines are up), the
        weight-sync groups are formed; replacements are always started anew."""
        vocab_size = None
        if policy is not None:
            from megagrpo.models.description import describe_model

            vocab_size = describe_model(cfg).shape.vocab_size
        if launched is not None:
            actors = wait_for_engines(launched)
        else:
            actors = start_engines(cfg, model_dir, policy=policy, engine_cls=engine_cls)
        return cls(
            cfg,
            model_dir,
            actors,
            policy=policy,
            engine_cls=engine_cls,
            vocab_size=vocab_size,
            log_dir=log_dir,
        )

    @property
    def sync(self) -> SyncLayout:
        """How the weights reach the engines (a pool with a policy only)."""
        weights = self._require_weights()
        return SyncLayout(
            weights.backend, weights.path, weights.total_bytes, tuple(weights.worker_bytes), weights.transport
        )

    def generate(
        self, prompts: Sequence, settings, seeds: Sequence[int], *, step: int, restartable: bool = True
    ) -> list:
        """Completions (``Completion``) for ``prompts`` (objects with ``token_ids``; ``settings.n`` each,
        in prompt order), split across the engines; prompts with a ``task`` get multi-turn episodes
        (``RolloutEngine.run_episodes``). An engine that fails is replaced and its share
        generated again, with the same seeds; ``step``: the GRPO step asking (restart windows count
        steps); ``restartable=False`` while the trainer changes the weights a replacement would be sent
        (``grpo.max_staleness``): a failure then is an EngineFailure."""
        per = math.ceil(len(prompts) / len(self.actors))
        # Multi-turn: prompts carry tasks, and each engine runs its share's episodes (env.*).
        episodes = bool(prompts) and prompts[0].task is not None
        shares = {}
        for i in range(len(self.actors)):
            chunk = slice(i * per, (i + 1) * per)
            if prompts[chunk]:
                inputs = [p.task if episodes else p.token_ids for p in prompts[chunk]]
                shares[i] = (inputs, settings, seeds[chunk])
        out = []
        timeout_s = self.cfg.generation.timeout_s
        method = "run_episodes" if episodes else "generate"
        self.record(step, "engines generate")
        for i, comps in self.call(method, shares, timeout_s, step=step, restartable=restartable).items():
            out += [dataclasses.replace(c, prompt_index=c.prompt_index + i * per) for c in comps]
        return out

    def call(
        self,
        method: str,
        args_by_engine: dict[int, tuple],
        timeout_s: float,
        *,
        step: int,
        restartable: bool = True,
    ) -> dict[int, Any]:
        """``method(*args)`` on each engine of ``args_by_engine``; results by engine. An engine that
        fails (dies, or has not answered within ``timeout_s``) is replaced and asked again (see
        ``generate`` for ``step`` and ``restartable``)."""
        refs = {i: getattr(self.actors[i], method).remote(*args) for i, args in args_by_engine.items()}
        results = {}
        for i, args in args_by_engine.items():
            while i not in results:
                try:
                    results[i] = ray.get(refs[i], timeout=timeout_s)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                    self.replace(i, err, step=step, restartable=restartable)
                    refs[i] = getattr(self.actors[i], method).remote(*args)
        return results

    def sync_weights(self, *, step: int, after_load: Callable[[], None] | None = None) -> SyncOutcome:
        """Send the trainer's weights to every engine and probe them (colocated: in the order of
        ``runtime.colocated``); an engine that fails meanwhile is replaced (counted at ``step``), which
        sends and probes again. ``after_load``: called once the weights are in, before the probe."""
        weights = self._require_weights()
        try:
            return self._sync_and_probe(weights, step, after_load)
        except WeightSyncError as err:
            if err.ranks:  # a replacement's groups would queue behind the stuck ranks' call
                raise RankFailure(f"policy rank(s) stuck in a weight sync: {first_line(err)}") from err
            if err.engine is None:
                raise
            return self.replace(err.engine, err, step=step, after_load=after_load)

    def _sync_and_probe(self, weights: WeightSync, step: int, after_load=None) -> SyncOutcome:
        """Colocated: wake the weights, sync, park the trainer, wake the KV cache, probe."""
        offloaded = self.turns.before_sync(self.actors, step) if self.turns else 0
        weights.sync()
        if after_load is not None:
            after_load()
        if self.turns:
            offloaded += self.turns.after_sync(self.actors, step)
        return dataclasses.replace(self._probe(weights), offloaded=offloaded, stats=weights.stats)

    def replace(
        self,
        index: int,
        err: BaseException,
        *,
        step: int,
        restartable: bool = True,
        after_load: Callable[[], None] | None = None,
    ) -> SyncOutcome | None:
        """Restart engine ``index`` on its placement, then (with a policy) re-form the sync groups,
        re-sync and probe: that probe's outcome, None without a policy. An EngineFailure when
        ``restartable`` is False or the restart budget is spent at ``step``. ``after_load``: as
        ``sync_weights``'s."""
        gen = self.cfg.generation
        if not restartable:
            raise EngineFailure(
                f"vLLM engine {index} failed while generating the next step's rollouts during training "
                f"(grpo.max_staleness = {self.cfg.grpo.max_staleness}): engines are not restarted while "
                f"the trainer changes the weights; last error: {first_line(err)}",
                index,
            )
        if not self.budget.take(step):
            window = gen.engine_restart_window_steps
            raise EngineFailure(
                f"vLLM engine {index} failed after {len(self.budget.steps)} engine restart(s)"
                + (f" within {window} steps" if window else "")
                + f" (generation.max_engine_restarts = {gen.max_engine_restarts}); "
                f"last error: {first_line(err)}",
                index,
            )
        start = time.perf_counter()
        print(f"vLLM engine {index} failed ({first_line(err)}); restarting it on its placement", flush=True)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = start_engines(
            self.cfg, self.model_dir, policy=self.policy, engine_cls=self.engine_cls, indices=[index]
        )[0]
        self._weights = self._connect()
        outcome = None
        if self._weights is not None:
            outcome = self._sync_and_probe(self._weights, step, after_load)
        seconds = time.perf_counter() - start
        self.restarts.append((index, seconds))
        print(f"vLLM engine {index} restarted, weights re-synced and probed in {seconds:.1f}s", flush=True)
        return outcome

    def record(self, step: int, event: str) -> None:
        """Colocated: an event in the log of the GPUs' hand-overs (``runtime.colocated``)."""
        if self.turns is not None:
            self.turns.record(step, event)

    @property
    def asleep(self) -> bool:
        """Colocated: whether the engines gave their GPU memory back (the next sync wakes them)."""
        return self.turns is not None and self.turns.engines_asleep

    def hand_to_trainer(self, *, step: int) -> None:
        """Colocated: the engines sleep and the trainer's parked states come back (else nothing)."""
        if self.turns is not None:
            self.turns.to_trainer(self.actors, step)

    def sleep(self, *, step: int, tolerate_dead: bool = False) -> None:
        """Colocated: the engines sleep (a checkpoint is written, or one loaded, beside them); the next
        ``sync_weights`` wakes them. ``tolerate_dead``: skip engines that died."""
        if self.turns is not None:
            self.turns.engines_sleep(self.actors, step, tolerate_dead=tolerate_dead)

    def close(self) -> None:
        """Stop the engines (their actors are killed; ``shutdown_ray`` also does)."""
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)

    def _connect(self) -> WeightSync | None:
        """The weight-sync groups between the policy (waited for) and the current engines."""
        if self.policy is None:
            return None
        return WeightSync(self.cfg, self.policy.ready(), self.actors, vocab_size=self.vocab_size)

    def _probe(self, weights: WeightSync) -> SyncOutcome:
        start = time.perf_counter()
        probe = weights.probe()
        return SyncOutcome(probe, time.perf_counter() - start)

    def _require_weights(self) -> WeightSync:
        if self._weights is None:
            raise RuntimeError(
                "this pool's engines load their weights from disk (started without a policy): "
                "it has no weight sync"
            )
        return self._weights
