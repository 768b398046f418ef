"""Weight sync Megatron -> vLLM over gloo: exact after real optimizer steps, at TP=1/TP=2/PP=2 with
1 and 2 engines; a corrupted bucket is caught; a dead engine is an error within the timeout; on groups
that connect as NCCL's do, an engine killed before its first receive is replaced and re-synced.

The shared engines are ``DamagingGenerationWorker``s (``_damaging_engine.py``): production engines
plus a way to damage a bucket of the next sync.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import policy_batch, policy_config

from megagrpo.models.mapping import hf_tensor_shapes
from megagrpo.policy.worker import PolicyWorker

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Ray, a tiny Qwen2 (head size 32, as vLLM's CPU attention needs) and two vLLM engines."""
    from _damaging_engine import DamagingGenerationWorker

    from megagrpo.runtime.engines import start_engines
    from megagrpo.runtime.ray_session import start_ray

    hf_dir = str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("sync") / "qwen2", hidden_size=128))
    cfg = policy_config(hf_dir, extra=["generation.num_engines=2", "generation.sync_timeout_s=30"])
    start_ray(cfg.cluster, num_cpus=6)  # 2 engines, a TP-2 engine, up to 2 trainer ranks
    engines = start_engines(cfg, hf_dir, engine_cls=DamagingGenerationWorker)
    yield hf_dir, engines
    ray.shutdown()


@pytest.fixture(scope="module")
def policy_group(stack):
    """``get(cfg)``: a policy group of ``cfg``'s layout (TP, PP, layers), kept for the next tests that ask
    for the same layout (the tests are ordered so that they follow one another). Starting one is two Ray
    actors importing Megatron and building the model; ``WeightSync`` takes its settings (path, buckets,
    timeout, placement) from its own config, the group only its layout. One group at a time: the Ray of
    ``stack`` has CPUs for one."""
    from _deferred_groups import DeferringPolicyWorker

    from megagrpo.runtime.groups import RankGroup

    held: dict[tuple, RankGroup] = {}

    def get(cfg) -> RankGroup:
        par = cfg.parallel
        key = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.transformer_impl)
        if key not in held:
            for group in held.values():
                group.shutdown()
            held.clear()
            # Disaggregated: a colocated group's bundles would only reserve room for engines these tests
            # start elsewhere (``stack``).
            generation = dataclasses.replace(cfg.generation, placement="disaggregated")
            cfg = dataclasses.replace(cfg, generation=generation)
            # Policy workers that can be told to make their groups as NCCL does (the last test).
            held[key] = RankGroup(cfg, DeferringPolicyWorker, timeout_s=300)
        return held[key]

    yield get
    for group in held.values():
        group.shutdown()


def _sampled_logprob_error(sync, group, engines, cfg) -> float:
    """Sample with vLLM, score the same tokens with the trainer: mean exp|delta| over sampled tokens."""
    from megagrpo.types import SamplingSettings, TrainBatch

    prompts = [[5, 17, 42, 7], [99, 3, 250, 18, 6], [11, 12]]
    settings = SamplingSettings(max_tokens=12, temperature=1.0, seed=3)
    worst = 1.0
    for engine in engines:
        comps = ray.get(engine.generate.remote(prompts, settings))
        seqs = [prompts[c.prompt_index] + c.token_ids for c in comps]
        batch = TrainBatch.from_sequences(seqs, [len(prompts[c.prompt_index]) for c in comps])
        trainer = group.call_first(PolicyWorker.logprobs, batch, 1.0)
        mask = batch.response_mask()
        gen = torch.zeros_like(trainer)
        for row, c in enumerate(comps):
            start = len(prompts[c.prompt_index]) - 1
            gen[row, start : start + len(c.logprobs)] = torch.tensor(c.logprobs)
        worst = max(worst, float(torch.exp((gen - trainer).abs())[mask].mean()))
    return worst


# Ordered by the policy group each needs (``policy_group``); test_engine_with_tensor_parallel_workers
# starts with PP 2, this list's last layout.
@pytest.mark.parametrize(
    "layout",
    [
        dict(),
        dict(path="gathered", colocated=True),
        dict(tp=2, layers="torch"),
        dict(tp=2),
        dict(tp=2, colocated=True),
        dict(pp=2),
    ],
    ids=["tp1", "gathered-colocated", "tp2-torch-layers", "tp2", "tp2-colocated", "pp2"],
)
def test_engines_match_trainer_after_real_updates(layout, stack, policy_group):
    from megagrpo.weight_sync.sync import WeightSync

    hf_dir, engines = stack
    sizes = {k: v for k, v in layout.items() if k in ("tp", "pp")}
    # Small buckets: several per stage, so double buffering and bucket order are exercised. The torch
    # layers (SDPA, packed micro-batches) send the same names and are probed the same way. Engine
    # TP 1: shard-wise (trainer TP 2: both trainer ranks send; the gathered path is tested at engine
    # TP 2, in test_engine_with_tensor_parallel_workers). Colocated: engine i shares trainer rank i's
    # device and takes that rank's buckets from shared slots; the other links reach it by broadcast.
    path = layout.get("path", "auto")
    colocated = layout.get("colocated", False)
    extra = [
        "generation.sync_timeout_s=60",
        "generation.sync_bucket_mb=0.25",
        f"parallel.transformer_impl={layout.get('layers', 'local')}",
        f"generation.weight_sync_path={path}",
        f"generation.placement={'colocated' if colocated else 'disaggregated'}",
    ]
    cfg = policy_config(hf_dir, **sizes, extra=extra)
    group = policy_group(cfg)
    for targets in (engines[:1], engines):
        sync = WeightSync(cfg, group, targets, vocab_size=300)
        assert sync.path.kind == ("gathered" if path == "gathered" else "shard")
        assert sync.transport.startswith("colocated: engine(s) 0") == colocated, sync.transport
        batch = policy_batch(seed=len(targets))
        metrics = group.call_first(
            PolicyWorker.train, batch.replace(old_logprobs=group.call_first(PolicyWorker.logprobs, batch))
        )
        assert metrics[0].update_applied == 1.0  # a real optimizer step changed the weights
        sync.sync(with_checksums=True)  # debug mode: every bucket's digest matches on arrival
        # Two receive buffers of a bucket each (kept between syncs on CPU), not one per bucket.
        largest = max(b.nbytes for b in sync.plan)
        assert all(
            2 * largest <= n <= 2 * 2**18 < sync.total_bytes
            for n in ray.get(targets[0].receive_buffer_bytes.remote())
        )
        probe = sync.probe()
        assert probe.error <= 1.001 and probe.max_abs_delta < 1e-4
        assert _sampled_logprob_error(sync, group, targets, cfg) <= 1.001


def test_delta_sync_rebuilds_every_engine_exactly(stack, policy_group):
    """``generation.sync_mode: delta`` at PP 2 (the group the last layout left), into both engines:
    shard-wise with engine 0 colocated (stage 0's buckets through shared slots, stage 1's by broadcast),
    then gathered by broadcast. A first sync goes whole, an unchanged one as headers alone, one after a
    real optimizer step as deltas where few enough elements changed (fp32: few buckets); each is checked
    by per-tensor digests and the probe. A damaged payload is named by its tensor, and the sync after it
    goes whole again and repairs the engine."""
    from megagrpo.weight_sync.sync import WeightSync, WeightSyncError

    hf_dir, engines = stack
    for path, colocated in (("auto", True), ("gathered", False)):
        extra = [
            "generation.sync_timeout_s=60",
            "generation.sync_bucket_mb=0.25",
            "generation.sync_mode=delta",
            f"generation.weight_sync_path={path}",
            f"generation.placement={'colocated' if colocated else 'disaggregated'}",
        ]
        with pytest.warns(UserWarning, match="buys little"):  # these models are fp32
            cfg = policy_config(hf_dir, pp=2, extra=extra)
        group = policy_group(cfg)
        sync = WeightSync(cfg, group, engines, vocab_size=300)
        assert sync.transport.startswith("colocated: engine(s) 0") == colocated, sync.transport
        buckets = len(sync.plan)
        sync.sync()  # nothing known yet: every bucket whole
        assert sync.stats.delta_buckets == 0 and math.isnan(sync.stats.changed_fraction)
        assert sum(sync.stats.link_bytes) == sync.total_bytes + 16 * buckets
        verified = sync.verified_buckets
        assert verified >= 2 * buckets and sync.probe().error <= 1.001
        sync.sync()  # nothing changed: headers alone
        assert (sync.stats.delta_buckets, sync.stats.changed_fraction) == (buckets, 0.0)
        assert sum(sync.stats.link_bytes) == 16 * buckets and sync.verified_buckets == verified
        assert sync.probe().error <= 1.001
        batch = policy_batch(seed=7)
        metrics = group.call_first(
            PolicyWorker.train, batch.replace(old_logprobs=group.call_first(PolicyWorker.logprobs, batch))
        )
        assert metrics[0].update_applied == 1.0
        sync.sync()
        assert 0 < sync.stats.changed_fraction <= 1 and sync.verified_buckets == verified
        probe = sync.probe()
        assert probe.error <= 1.001 and probe.max_abs_delta < 1e-4
    # The senders forget what they sent (as after a failed sync): the next sync goes whole, and its
    # broadcast 1, bucket 0's payload after its header, arrives damaged on engine 1.
    group.call_all(PolicyWorker.forget_sent_weights)
    ray.get(engines[1].damage_next_sync.remote(1))
    with pytest.raises(
        WeightSyncError, match=r"bucket 0: tensor model\.\S+ differs on engine 1 worker 0 after a"
    ):
        sync.sync()
    sync.sync()  # after a failed sync every bucket goes whole: the engine is repaired
    assert sync.stats.delta_buckets == 0 and sync.probe().error <= 1.001


def _model_rules(hf_dir: str):
    from megagrpo.models.registry import load_hf_config, shape_from_hf_config

    arch, shape = shape_from_hf_config(load_hf_config(hf_dir))
    return shape, [r for r in arch.rules(shape) if r.export]


def test_engine_with_tensor_parallel_workers(stack, policy_group):
    """An engine with two TP workers (vLLM worker processes) fed by trainers of TP 2 (shard-wise: each
    trainer rank feeds one worker; and gathered), and of PP 2 (shard-wise: each stage's rank feeds
    both workers): the workers join their groups through the plugin, each receives exactly its shard
    (shard-wise) or the whole model (gathered), and after a real optimizer step the engine scores and
    samples exactly like the trainer."""
    from megagrpo.generation.vllm_layout import VLLM_LAYOUT, vllm_placement
    from megagrpo.runtime.engines import start_engines
    from megagrpo.weight_sync.shards import shard_bytes
    from megagrpo.weight_sync.sync import WeightSync

    hf_dir, _ = stack
    shape, rules = _model_rules(hf_dir)
    engine_cfg = [
        "generation.num_engines=1",
        "generation.engine_tensor_parallel_size=2",
        "generation.sync_timeout_s=60",
        "generation.sync_bucket_mb=0.25",
    ]
    (engine,) = start_engines(policy_config(hf_dir, extra=engine_cfg), hf_dir)
    try:
        # PP 2 first: the group test_engines_match_trainer_after_real_updates ended with.
        for tp, pp, path in ((1, 2, "auto"), (2, 1, "auto"), (2, 1, "gathered")):
            cfg = policy_config(
                hf_dir, tp=tp, pp=pp, extra=[*engine_cfg, f"generation.weight_sync_path={path}"]
            )
            group = policy_group(cfg)
            sync = WeightSync(cfg, group, [engine], vocab_size=300)
            # The start-up coverage checks passed over every parameter of both workers.
            workers = ray.get(engine.param_shapes.remote())
            assert sync.coverage.engine_params == (tuple(len(p) for p in workers),)
            fused = {vllm_placement(name).param for name in hf_tensor_shapes(shape)}
            assert all(set(p) - {"lm_head.weight"} == fused - {"lm_head.weight"} for p in workers)
            batch = policy_batch(seed=7 + tp)
            metrics = group.call_first(
                PolicyWorker.train,
                batch.replace(old_logprobs=group.call_first(PolicyWorker.logprobs, batch)),
            )
            assert metrics[0].update_applied == 1.0
            sync.sync(with_checksums=True)
            received = ray.get(engine.received_bytes.remote())
            itemsize = torch.empty(0, dtype=getattr(torch, sync.plan[0].slots[0].dtype)).element_size()
            whole = itemsize * sum(math.prod(s) for s in hf_tensor_shapes(shape).values())
            if path == "gathered":
                assert sync.path.kind == "gathered" and received == [whole, whole]
            else:
                assert sync.path.kind == "shard"
                assert (
                    received
                    == shard_bytes(shape, rules, tp, 2, itemsize, layout=VLLM_LAYOUT)[1]
                    == sync.worker_bytes
                )
                assert all(r < 0.55 * whole for r in received)  # half the model, plus the norms
            probe = sync.probe()
            assert probe.error <= 1.001 and probe.max_abs_delta < 1e-4
            assert _sampled_logprob_error(sync, group, [engine], cfg) <= 1.001
    finally:
        ray.kill(engine)


def test_corrupted_bucket_is_caught_by_the_probe(stack, policy_group):
    from megagrpo.weight_sync.sync import WeightSync, WeightSyncError

    hf_dir, engines = stack
    cfg = policy_config(hf_dir, extra=["generation.sync_bucket_mb=0.25"])
    sync = WeightSync(cfg, policy_group(cfg), engines[:1], vocab_size=300)
    assert len(sync.plan) >= 2  # the damaged bucket is one of several
    sync.sync()
    assert sync.verified_buckets == len(sync.plan) and sync.probe().error <= 1.001
    # Digests off: the probe alone catches it, and cannot say more.
    ray.get(engines[0].damage_next_sync.remote(1))
    sync.sync(with_checksums=False)
    with pytest.raises(WeightSyncError, match=r"probe failed.*engine 0.*digests were not checked"):
        sync.probe()
    # Digests on (every sync of a run): the damaged bucket is named, with its tensors.
    ray.get(engines[0].damage_next_sync.remote(1))
    with pytest.raises(WeightSyncError, match=r"bucket 1 \(model\..*\) differs on engine 0 worker 0"):
        sync.sync()
    sync.sync()  # a clean sync repairs the engine
    assert sync.probe().error <= 1.001
    # Intact bytes, different logprobs: reported as numerics, with the position.
    ray.get(engines[0].drift_loaded_weights.remote())
    with pytest.raises(
        WeightSyncError, match=r"at engine 0, probe sequence .*digests match\), so this is numerics"
    ):
        sync.probe()
    sync.sync()
    assert sync.probe().error <= 1.001


def test_a_tensor_a_sync_misses_is_caught_once_the_engine_slept(stack, policy_group):
    """A colocated engine sleeps at vLLM's level 2 (its weights discarded; on CPU, where vLLM's worker
    ignores sleep, imitated: every weight the forward reads becomes NaN), so every sync must fill
    every weight: a tensor it leaves out fails the probe, although every bucket's digest matched."""
    from megagrpo.types import SamplingSettings
    from megagrpo.weight_sync.sync import WeightSync, WeightSyncError

    hf_dir, engines = stack
    engine, missed = engines[0], "model.layers.0.mlp.down_proj.weight"
    cfg = policy_config(hf_dir, extra=["generation.sync_bucket_mb=0.25"])
    sync = WeightSync(cfg, policy_group(cfg), [engine], vocab_size=300)
    sync.sync()
    assert sync.probe().error <= 1.001
    # Awake, a missed tensor goes unnoticed: the engine still holds it from the sync before.
    ray.get(engine.skip_in_next_sync.remote(missed))
    sync.sync()
    assert ray.get(engine.skipped_in_last_sync.remote()) == [missed]
    assert sync.probe().error <= 1.001
    # Asleep, it neither generates nor is probed; woken without a sync it holds no weights at all.
    ray.get(engine.sleep.remote())
    with pytest.raises(Exception, match="generate on vLLM engine 0 while its kv_cache and weights sleep"):
        ray.get(engine.generate.remote([[5, 6]], SamplingSettings(max_tokens=2)))
    ray.get(engine.wake_up.remote(["weights", "kv_cache"]))
    with pytest.raises(WeightSyncError, match="non-finite logprobs"):
        sync.probe()
    # Slept, its weights woken, synced but for one tensor, its KV cache woken: caught by the probe.
    ray.get(engine.sleep.remote())
    ray.get(engine.wake_up.remote(["weights"]))
    ray.get(engine.skip_in_next_sync.remote(missed))
    sync.sync()
    ray.get(engine.wake_up.remote(["kv_cache"]))
    assert ray.get(engine.skipped_in_last_sync.remote()) == [missed]
    with pytest.raises(WeightSyncError, match=r"non-finite logprobs.*; \d+ bucket digests matched"):
        sync.probe()
    # The same order with nothing missed: exact again.
    ray.get(engine.sleep.remote())
    ray.get(engine.wake_up.remote(["weights"]))
    sync.sync()
    ray.get(engine.wake_up.remote(["kv_cache"]))
    assert sync.probe().error <= 1.001


def test_a_stuck_engine_ends_the_sync_on_the_trainer_rank_naming_the_link(stack, policy_group):
    """An engine that is alive but does not receive: the sending rank stops waiting by itself at the
    timeout (host-side, as on NCCL, where ``Work.wait`` does not block), aborts the group and names
    it; the rank is free for the next call, and re-formed groups sync again."""
    from megagrpo.weight_sync.sync import WeightSync, WeightSyncError

    hf_dir, engines = stack
    cfg = policy_config(hf_dir, extra=["generation.sync_timeout_s=6"])
    group = policy_group(cfg)
    sync = WeightSync(cfg, group, engines[:1], vocab_size=300)
    sync.sync()
    ray.get(engines[0].stall_next_sync.remote(15))
    with pytest.raises(WeightSyncError) as err:
        sync.sync()
    said = str(err.value)
    assert "weight sync failed on trainer 0" in said, said
    assert "weight sync link (0, 0, 0) (trainer rank 0 -> engine(s) 0): the broadcast of bucket 0" in said
    assert "did not finish within 6s" in said and "engine(s) 0 still receiving" in said
    assert err.value.engine == 0  # the one a pool would replace
    batch = policy_batch()
    assert group.call_first(PolicyWorker.logprobs, batch).shape == (
        batch.size,
        batch.input_ids.shape[1] - 1,
    )
    sync = WeightSync(cfg, group, engines[:1], vocab_size=300)  # once the engine is back
    sync.sync()
    assert sync.probe().error <= 1.001


def test_dead_engine_is_an_error_within_the_timeout(stack, policy_group):
    """Runs after every other test of the group's layout: it kills the module's engine 1 and leaves the
    group's ranks with a failed sync."""
    from megagrpo.weight_sync.sync import WeightSync, WeightSyncError

    hf_dir, engines = stack
    cfg = policy_config(hf_dir, extra=["generation.sync_timeout_s=20"])
    sync = WeightSync(cfg, policy_group(cfg), engines, vocab_size=300)
    sync.sync()
    ray.kill(engines[1])
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"weight sync (failed on vLLM engine 1|did not finish)"):
        sync.sync()
    elapsed = time.monotonic() - start
    # A generous deadline for two loaded cores, still short of the rank group's own 300 s: the sync's
    # configured 20 s is what ended it, not the group's timeout nor a hang.
    assert math.isfinite(elapsed) and elapsed < 20 + 200, f"a dead engine took {elapsed:.0f}s to report"


def test_seeded_rollouts_longer_than_one_scheduler_step(stack):
    """More prompt tokens than vLLM schedules in one step (4096 on CPU), every request seeded.

    Chunked prefill would split a prompt across steps and make vLLM rewind its seeded generator,
    which the CPU build cannot do; and each prompt's samples must not depend on its batch-mates.
    """
    from megagrpo.types import SamplingSettings

    _, engines = stack
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (50,), generator=gen).tolist() for _ in range(100)]  # 5000 tokens
    seeds = list(range(1000, 1100))
    settings = SamplingSettings(max_tokens=4, temperature=1.0, n=2)
    together = ray.get(engines[0].generate.remote(prompts, settings, seeds))
    assert len(together) == 200 and all(len(c.token_ids) == 4 for c in together)
    for index in (0, 57, 99):
        alone = ray.get(engines[0].generate.remote([prompts[index]], settings, [seeds[index]]))
        batched = [c for c in together if c.prompt_index == index]
        assert [c.token_ids for c in alone] == [c.token_ids for c in batched]
        for a, b in zip(alone, batched, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_ignore_eos_generates_max_tokens_past_stop_tokens(stack):
    """generation.ignore_eos: every response runs to max_tokens, even where each sampled token is a
    stop token (without it, every response ends at its first token)."""
    from megagrpo.types import SamplingSettings

    _, engines = stack
    prompts, seeds = [[5, 6, 7], [8, 9]], [1, 2]
    stops = tuple(range(300))  # every token of the vocabulary (make_tiny_hf: 300)
    stopping = SamplingSettings(max_tokens=6, temperature=1.0, n=2, stop_token_ids=stops)
    stopped = ray.get(engines[0].generate.remote(prompts, stopping, seeds))
    assert [len(c.token_ids) for c in stopped] == [1] * 4
    running = dataclasses.replace(stopping, ignore_eos=True)
    ran = ray.get(engines[0].generate.remote(prompts, running, seeds))
    assert [len(c.token_ids) for c in ran] == [6] * 4
    assert all(c.finish_reason == "length" for c in ran)


def test_engine_killed_before_its_first_receive_is_replaced_on_groups_that_connect_like_nccl(
    stack, policy_group
):
    """NCCL connects a group in its first broadcast, unless made to at set-up; here gloo groups that
    wait the same way (``tests/lazy_groups.py``: connecting then blocks with no deadline). The
    transport connects them at set-up; an engine killed after that and before its first receive fails
    the sync within its timeout on the trainer side too (else its rank would still be inside the call
    1.5 x the timeout later and the pool would stop: a RankFailure), the pool replaces the engine,
    re-syncs, probes, and the new engine generates. Runs last: it kills the module's engine 0."""
    from _deferred_groups import DeferringGenerationWorker, DeferringPolicyWorker

    from megagrpo.runtime.engines import EnginePool
    from megagrpo.types import SamplingSettings

    hf_dir, engines = stack
    cfg = policy_config(hf_dir, extra=["generation.num_engines=1", "generation.sync_timeout_s=10"])
    group = policy_group(cfg)
    group.call_all(DeferringPolicyWorker.defer_group_creation)
    ray.get(engines[0].defer_group_creation.remote())
    pool = EnginePool(
        cfg, hf_dir, engines[:1], policy=group, engine_cls=DeferringGenerationWorker, vocab_size=300
    )
    # Connected at set-up on both sides, not by a first broadcast.
    assert group.call_first(DeferringPolicyWorker.group_connections) == ["eager"]
    assert ray.get(engines[0].group_connections.remote()) == ["eager"]
    ray.kill(engines[0])

    outcome = pool.sync_weights(step=1)
    assert [engine for engine, _ in pool.restarts] == [0] and pool.actors[0] is not engines[0]
    assert outcome.probe.error <= 1.001 and outcome.probe.verified_buckets > 0
    assert ray.get(pool.actors[0].group_connections.remote()) == ["eager"]
    settings = SamplingSettings(max_tokens=4, temperature=1.0, seed=3)
    (completions,) = pool.call("generate", {0: ([[5, 17, 42, 7]], settings)}, 120, step=1).values()
    assert len(completions) == 1 and 1 <= len(completions[0].token_ids) <= 4
