"""Colocated placement: engine ``i`` and trainer rank ``i`` share one GPU, and the controller hands it
from one to the other in this order, every step:

    wake the engines' weights -> sync -> park the trainer -> wake the KV cache -> probe, generate
    -> the engines sleep -> the trainer's states come back -> train

so that the GPU never holds the trainer's optimizer beside an awake engine, nor the engine's KV cache
beside the trainer's weights: before the engines wake, the trainer parks what ``policy.offload`` moves
(``sync``: the optimizer; with ``all`` the gradient buffers too) and its allocator's free blocks; once
the weights are synced, with ``all``, the weights (``generation``). The first sync of a run and the
re-sync of a replaced engine take the same path (an engine that just started holds the GPU share it
claimed: it sleeps first). Checkpoints are written, and resumed ones loaded, with the engines asleep;
the next step wakes them through a sync (their weights were discarded, vLLM's sleep level 2).

:class:`GpuTurns` makes the calls and records each hand-over (``events``, and a line per event in the
run's ``colocated.jsonl``), which is how the order is tested. ``megagrpo.plan.colocated_phases``
sizes each phase.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from megagrpo.runtime.groups import RankGroup

EVENTS_FILE = "colocated.jsonl"


class GpuTurns:
    """The hand-overs of colocated GPUs between the policy's ranks and the engines (module docstring).

    ``log_dir``: where ``colocated.jsonl`` is appended to (None: ``events`` only). ``timeout_s``: how
    long an engine may take to sleep or wake."""

    def __init__(self, policy: RankGroup, *, timeout_s: float, log_dir: Path | None = None):
        self.policy, self.timeout_s = policy, timeout_s
        self.log = None if log_dir is None else Path(log_dir) / EVENTS_FILE
        self.events: list[tuple[int, str]] = []
        """(step, what happened), in order."""
        self.engines_asleep = False
        """Whether the engines gave their GPU memory back (then a sync wakes them)."""

    def record(self, step: int, event: str) -> None:
        self.events.append((step, event))
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("a") as f:
                f.write(json.dumps({"step": step, "event": event, "time": time.time()}) + "\n")

    def engines_sleep(self, engines: Sequence, step: int, *, tolerate_dead: bool = False) -> None:
        """Every engine gives its weights and KV cache back (an engine asleep already stays so).
        ``tolerate_dead``: an engine that died holds no memory (a checkpoint after engine failures)."""
        self._engines(engines, "sleep", tolerate_dead=tolerate_dead)
        self.engines_asleep = True
        self.record(step, "engines sleep")

    def before_sync(self, engines: Sequence, step: int) -> int:
        """The trainer parks what goes before a sync, then the engines (asleep, or put to sleep: one
        just started holds its whole claim) wake their weights only. Returns the bytes the
        trainer freed (the most of any rank)."""
        from megagrpo.policy.rank import MegatronRank

        freed = max(self.policy.call_all(MegatronRank.offload, "sync"))
        self.record(step, "trainer parks (sync)")
        self._engines(engines, "sleep")
        self._engines(engines, "wake_up", ["weights"])
        self.record(step, "engines wake weights")
        return freed

    def after_sync(self, engines: Sequence, step: int) -> int:
        """The weights arrived: the trainer parks what goes during generation, then the engines take
        their KV cache back. Returns the bytes the trainer freed (the most of any rank)."""
        from megagrpo.policy.rank import MegatronRank

        self.record(step, "weights synced")
        freed = max(self.policy.call_all(MegatronRank.offload, "generation"))
        self.record(step, "trainer parks (generation)")
        self._engines(engines, "wake_up", ["kv_cache"])
        self.engines_asleep = False
        self.record(step, "engines wake kv_cache")
        return freed

    def to_trainer(self, engines: Sequence, step: int) -> None:
        """Before training: the engines sleep, and the trainer's parked states come back."""
        from megagrpo.policy.rank import MegatronRank

        self.engines_sleep(engines, step)
        self.policy.call_all(MegatronRank.reload)
        self.record(step, "trainer reloads")

    def _engines(self, engines: Sequence, method: str, *args, tolerate_dead: bool = False) -> None:
        """``method(*args)`` on every engine; one that died or did not answer in time is a
        WeightSyncError naming it (the pool replaces it), unless ``tolerate_dead``."""
        from megagrpo.weight_sync.sync import WeightSyncError

        refs = [getattr(e, method).remote(*args) for e in engines]
        for index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                if not tolerate_dead:
                    raise WeightSyncError(
                        f"vLLM engine {index}: {method}{list(args)} failed: {err}", index
                    ) from err
