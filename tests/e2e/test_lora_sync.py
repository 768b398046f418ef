"""``generation.lora_sync: adapter``: the base goes with the first sync, then the LoRA adapters alone into
vLLM's own LoRA support, gathered over the trainer's TP ranks; checked by the adapters' digests on every
engine worker and by the probe (``weight_sync.adapters``, ``generation.vllm_lora``).

Its own engine: an engine serving adapters starts with vLLM's LoRA support on.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import policy_batch, policy_config

from megagrpo.policy.worker import PolicyWorker

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")

ADAPTER = ["policy.lora.rank=4", "policy.lora.alpha=8.0", "generation.lora_sync=adapter", "policy.lr=0.02"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Ray, a tiny Qwen2 (head size 32, as vLLM's CPU attention needs), a TP-2 LoRA policy, one engine."""
    from megagrpo.runtime.engines import start_engines
    from megagrpo.runtime.groups import RankGroup
    from megagrpo.runtime.ray_session import start_ray

    hf_dir = str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("lora_sync") / "qwen2", hidden_size=128))
    extra = [*ADAPTER, "generation.num_engines=1", "generation.sync_timeout_s=60"]
    cfg = policy_config(hf_dir, tp=2, extra=extra)
    start_ray(cfg.cluster, num_cpus=4)
    engines = start_engines(cfg, hf_dir)
    group = RankGroup(cfg, PolicyWorker, timeout_s=300)
    yield cfg, group, engines
    group.shutdown()
    ray.shutdown()


def _engine_logprobs(engine, sequences) -> torch.Tensor:
    return torch.tensor(ray.get(engine.prompt_logprobs.remote(sequences)), dtype=torch.float64)


def test_adapters_alone_reach_the_engine_and_change_its_logprobs(stack):
    """First sync: the base's buckets and the (zero-B) adapters; after a real optimizer step, a sync of
    the adapters alone. The engine's logprobs then move (the adapters are applied) and still match the
    trainer's (the probe), every worker's digest of the adapters matching the trainer's."""
    from megagrpo.weight_sync.sync import WeightSync

    cfg, group, engines = stack
    sync = WeightSync(cfg, group, engines, vocab_size=300)
    sequences = sync.probe_batch.input_ids.tolist()
    sync.sync()
    stats = sync.stats
    assert sum(stats.link_bytes) == sync.total_bytes and stats.adapter_bytes > 0
    assert sync.verified_buckets == len(sync.plan) + 1  # every bucket, and the adapters, on one worker
    assert sync.probe().error <= 1.001
    before = _engine_logprobs(engines[0], sequences)

    batch = policy_batch(seed=7)
    old = group.call_first(PolicyWorker.logprobs, batch)
    metrics = group.call_first(PolicyWorker.train, batch.replace(old_logprobs=old))
    assert metrics[0].update_applied == 1.0
    sync.sync()
    assert sync.stats.link_bytes == (0,) * len(sync.keys)  # the base stays where it is
    assert sync.stats.adapter_bytes == stats.adapter_bytes and sync.verified_buckets == 1
    # The adapters' bytes: rank x (in + out) per adapted HF projection, fp32 (q/k/v and gate/up share A).
    h, q, kv, ffn = 128, 128, 64, 128
    per_layer = 4 * (3 * h + q + 2 * kv) + 4 * (q + h) + 4 * (2 * h + 2 * ffn) + 4 * (ffn + h)
    assert stats.adapter_bytes == 2 * per_layer * 4
    probe = sync.probe()
    after = _engine_logprobs(engines[0], sequences)
    moved = float((after - before).abs().max())
    assert probe.max_abs_delta < 1e-4 and moved > 100 * probe.max_abs_delta, (moved, probe)
