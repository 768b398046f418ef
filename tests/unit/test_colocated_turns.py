"""Colocated GPUs handed over in turns (``runtime.colocated``), as the engine pool drives them: the
order of every sync, the first one included, and of the re-sync of an engine replaced because it died
while waking (stand-in engines and policy; the order on real ones: ``tests/e2e/test_colocated.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megagrpo.config import load_config

pytestmark = pytest.mark.unit


class Engine:
    """``sleep`` / ``wake_up`` / ``generate`` ``.remote`` log the call and return (engine, answer)."""

    def __init__(self, name, log):
        self.name, self.log, self.dies_on = name, log, None
        for method in ("sleep", "wake_up", "generate"):
            setattr(self, method, SimpleNamespace(remote=self._call(method)))

    def _call(self, method):
        def remote(*args):
            self.log.append((self.name, method, *args))
            return self, method

        return remote


class Policy:
    def __init__(self, log):
        self.log = log

    def ready(self):
        return self

    def call_all(self, method, *args):
        self.log.append(("trainer", method.__name__, *args))
        return [1]


class Sync:
    stats = None  # what the sync put on the links (WeightSync.stats)

    def __init__(self, log):
        self.log = log

    def sync(self):
        self.log.append(("sync",))

    def probe(self):
        self.log.append(("probe",))
        return SimpleNamespace(error=1.0)


def _pool(monkeypatch, log):
    import ray

    from megagrpo.runtime import engines

    started = []

    def start_engines(cfg, model_dir, *, policy=None, engine_cls=None, indices=None, timeout_s=600.0):
        new = [
            Engine(f"engine {i}.{len(started)}", log) for i in indices or range(cfg.generation.num_engines)
        ]
        started.extend(new)
        return new

    def get(ref, timeout=None):
        engine, method = ref
        if engine.dies_on == method:
            raise ray.exceptions.ActorDiedError()
        return None

    monkeypatch.setattr(engines, "start_engines", start_engines)
    monkeypatch.setattr(engines, "WeightSync", lambda cfg, policy, actors, vocab_size: Sync(log))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: None)
    cfg = load_config(None, ["generation.placement=colocated", "policy.offload=all"])
    return engines.EnginePool.start(cfg, "model", Policy(log))


def _turn(engines: list[str]) -> list[tuple]:
    """One sync's hand-over, ``engines`` by name."""
    return [
        ("trainer", "offload", "sync"),
        *[(e, "sleep") for e in engines],
        *[(e, "wake_up", ["weights"]) for e in engines],
        ("sync",),
        ("trainer", "offload", "generation"),
        *[(e, "wake_up", ["kv_cache"]) for e in engines],
        ("probe",),
    ]


def test_every_sync_wakes_the_weights_then_parks_the_trainer_then_wakes_the_kv_cache(monkeypatch):
    log = []
    pool = _pool(monkeypatch, log)
    outcome = pool.sync_weights(step=0)  # the first sync: the engine just started, put to sleep first
    assert log == _turn(["engine 0.0"]) and outcome.offloaded == 2  # both parkings, the most of any rank
    assert not pool.asleep and pool.turns.events[-1] == (0, "engines wake kv_cache")
    log.clear()
    pool.hand_to_trainer(step=1)
    assert log == [("engine 0.0", "sleep"), ("trainer", "reload")] and pool.asleep
    log.clear()
    pool.sleep(step=1)  # before a checkpoint: asleep already, asked again (vLLM keeps it so)
    assert log == [("engine 0.0", "sleep")] and pool.asleep


def test_an_engine_that_dies_waking_is_replaced_and_resynced_in_the_same_order(monkeypatch):
    log = []
    pool = _pool(monkeypatch, log)
    pool.actors[0].dies_on = "wake_up"
    pool.sync_weights(step=3)
    first, replaced = "engine 0.0", "engine 0.1"
    woken = _turn([first])
    failed_at = woken.index((first, "wake_up", ["weights"])) + 1
    # The replacement starts holding its whole claim: it sleeps before its weights wake.
    assert log == woken[:failed_at] + _turn([replaced])
    assert pool.restarts[0][0] == 0
