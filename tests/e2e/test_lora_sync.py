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
    # recompute: the stream test's requests are prefilled again at the swap, so that every token after it
    # is the new adapters' exactly
    extra = [
        *ADAPTER,
        "generation.num_engines=1",
        "generation.sync_timeout_s=60",
        "generation.stream_kv=recompute",
    ]
    cfg = policy_config(hf_dir, tp=2, extra=extra)
    start_ray(cfg.cluster, num_cpus=4)
    engines = start_engines(cfg, hf_dir)
    group = RankGroup(cfg, PolicyWorker, timeout_s=300)
    yield cfg, group, engines, []
    group.shutdown()
    ray.shutdown()


def _engine_logprobs(engine, sequences) -> torch.Tensor:
    return torch.tensor(ray.get(engine.prompt_logprobs.remote(sequences)), dtype=torch.float64)


def _train_step(group, seed: int) -> None:
    batch = policy_batch(seed=seed)
    old = group.call_first(PolicyWorker.logprobs, batch)
    metrics = group.call_first(PolicyWorker.train, batch.replace(old_logprobs=old))
    assert metrics[0].update_applied == 1.0


def test_adapters_alone_reach_the_engine_and_change_its_logprobs(stack):
    """First sync: the base's buckets and the (zero-B) adapters; after a real optimizer step, a sync of
    the adapters alone. The engine's logprobs then move (the adapters are applied) and still match the
    trainer's (the probe), every worker's digest of the adapters matching the trainer's."""
    from megagrpo.weight_sync.sync import WeightSync

    cfg, group, engines, _ = stack
    sync = WeightSync(cfg, group, engines, vocab_size=300)
    sequences = sync.probe_batch.input_ids.tolist()
    sync.sync()
    stats = sync.stats
    assert sum(stats.link_bytes) == sync.total_bytes and stats.adapter_bytes > 0
    assert sync.verified_buckets == len(sync.plan) + 1  # every bucket, and the adapters, on one worker
    assert sync.probe().error <= 1.001
    before = _engine_logprobs(engines[0], sequences)

    _train_step(group, seed=7)
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
    stack[3].append(sync)  # the stream test goes on with these groups


def test_requests_in_flight_sample_with_the_new_adapters_after_a_swap(stack):
    """``grpo.async_mode: partial``'s swap with adapters: requests of the engine's stream, part sampled,
    get new adapters in place between two engine steps (``generation.stream_kv: recompute``: prefilled
    again). Every token sampled after the swap has the new adapters' logprob (the trainer's, after its
    step), those before it not; the probe beside the stream passes."""
    from megagrpo.generation.stream import StreamRequest
    from megagrpo.types import SamplingSettings, TrainBatch

    _, group, engines, held = stack
    sync, engine = held[-1], engines[0]
    settings = SamplingSettings(max_tokens=40, ignore_eos=True)
    prompts = [(5, 17, 33, 2), (9, 4, 120, 7, 60)]
    requests = [StreamRequest(f"r{i}", p, settings, seed=i, group_id=i) for i, p in enumerate(prompts)]
    ray.get(engine.set_version.remote(1))
    ray.get(engine.submit.remote(requests))
    ray.get(engine.advance.remote(0.05))
    _train_step(group, seed=8)
    sync.sync()  # the adapters alone, while both requests are in flight
    ray.get(engine.set_version.remote(2))
    assert sync.probe().error <= 1.001  # scored beside the stream's requests
    done = []
    while len(done) < len(requests):
        done += ray.get(engine.advance.remote(0.5)).finished
    done.sort(key=lambda c: c.request.request_id)
    sequences = [list(c.request.prompt_ids) + c.token_ids for c in done]
    lengths = [len(c.request.prompt_ids) for c in done]
    trainer = group.call_first(PolicyWorker.logprobs, TrainBatch.from_sequences(sequences, lengths), 1.0)
    before_gap = after_gap = 0.0
    for row, (c, p) in enumerate(zip(done, lengths, strict=True)):
        assert 1 in c.versions and c.versions[-1] == 2, c.versions
        for t, (lp, version) in enumerate(zip(c.logprobs, c.versions, strict=True)):
            gap = abs(lp - float(trainer[row, p - 1 + t]))
            if version == 2:
                after_gap = max(after_gap, gap)
            else:
                before_gap = max(before_gap, gap)
    assert after_gap < 1e-4 and before_gap > 100 * after_gap, (before_gap, after_gap)
