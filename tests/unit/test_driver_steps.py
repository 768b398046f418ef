"""Driver step helpers that run without Ray actors or engines (fakes stand in for them)."""

from types import SimpleNamespace

import pytest

from megagrpo import driver
from megagrpo.cluster import EnginePool
from megagrpo.config import load_config
from megagrpo.generation.worker import Completion, SamplingSettings

pytestmark = pytest.mark.unit


class FakeEngine:
    """An engine handle whose ``generate.remote`` returns the completions themselves, not a ref."""

    def __init__(self):
        self.generate = SimpleNamespace(remote=self._generate)

    @staticmethod
    def _generate(prompts, settings, seeds):
        return [Completion(i, list(p), [0.0] * len(p), "stop") for i, p in enumerate(prompts)]


def test_rollouts_are_awaited_for_generation_timeout_s(monkeypatch):
    waited = []

    def get(ref, timeout):
        waited.append(timeout)
        return ref

    monkeypatch.setattr(driver.ray, "get", get)
    cfg = load_config(
        None, ["generation.timeout_s=42", "generation.sync_timeout_s=5", "generation.num_engines=2"]
    )
    prompts = [SimpleNamespace(token_ids=[i]) for i in range(3)]
    engines = EnginePool(
        cfg, start=lambda indices: [FakeEngine() for _ in indices], connect=lambda actors: None
    )
    out = driver.generate(cfg, engines, prompts, SamplingSettings(max_tokens=4), [0] * 3)
    assert waited == [42.0, 42.0]  # one wait per engine, no longer tied to sync_timeout_s
    assert [(c.prompt_index, c.token_ids) for c in out] == [(0, [0]), (1, [1]), (2, [2])]
