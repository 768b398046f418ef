"""Mixture-of-experts models on the vLLM engines (CPU build): weight sync, and the routed experts every
completion carries.

The trainer (Megatron, TP 1) sends its weights, gathered and shard-wise, to an engine that started with
dummy weights: Qwen3-MoE at engine TP 1 (expert width 32: without ``compat.vllm_moe_reload`` vLLM's
reload leaves the new experts unpacked and its outputs silently wrong) and Qwen2-MoE at engine TP 2,
two vLLM worker processes (its gated shared expert and every expert split in halves, each received by
its worker; vLLM's CPU kernel pads an expert's 16 columns per rank, where the reload would raise
without the fix), and Qwen3-MoE at engine TP 2 with vLLM's expert parallelism (each worker holds four
experts whole and receives them from the trainer; vLLM's CPU kernel would crash on the global expert
ids without ``compat.vllm_cpu_moe_ep``). After the sync the engine decodes exactly transformers' greedy
tokens for the trainer's weights, and each completion's routed experts (``grpo.routing_replay``:
``megagrpo.generation.routing``) are transformers' router top-k for every token of prompt + response,
for concurrent requests with two samples each, through Ray; also for a request vLLM preempted and
computed again, and for the probe's sequences, whose routing the trainer replays after a sync.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import MOE_ARCHS, make_tiny_hf, router_topk, transformers_greedy
from policy_cases import policy_config

from megagrpo.policy.worker import PolicyWorker
from megagrpo.types import SamplingSettings

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")

# vLLM's CPU attention needs a head size of at least 32 (Qwen3-MoE's tiny model sets head_dim 32).
SHAPES = {"qwen3_moe": {}, "qwen2_moe": {"hidden_size": 128}}
# The engines: (architecture, engine TP, vLLM's expert parallelism).
ENGINES = {
    "qwen3_moe-engine-tp1": ("qwen3_moe", 1, False),
    "qwen2_moe-engine-tp2": ("qwen2_moe", 2, False),
    "qwen3_moe-engine-tp2-ep": ("qwen3_moe", 2, True),
}
# Weights of std 0.1: routers and logits pick clearly (the default 0.02 leaves router top-k gaps of
# 1e-5, close enough to rounding to make a comparison of vLLM and transformers luck).
INIT = {"initializer_range": 0.1}
PROMPTS = [[5, 17, 42, 7], [99, 3, 250, 18, 6, 71], [11, 12], list(range(30, 50))]
NEW_TOKENS = 10
# Closest calls allowed in the reference (top-1 - top-2 logit; k-th - (k+1)-th router probability): far
# above the ~1e-7 by which vLLM's fp32 kernels and torch's differ.
MIN_LOGIT_MARGIN, MIN_ROUTER_GAP = 1e-4, 1e-5
# The trainer's weights each path syncs (a different checkpoint each, so that no sync finds the engine
# already holding them).
SEEDS = {"gathered": 1, "auto": 2}


def _config(hf_dir, *extra):
    return policy_config(
        str(hf_dir),
        extra=[
            "model.dtype=float32",
            "parallel.transformer_impl=local",
            "generation.max_num_seqs=16",
            "generation.sync_timeout_s=60",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Ray, each architecture's checkpoints (by seed) and an engine per architecture at its engine TP
    that returns routed experts (started with dummy weights)."""
    from megagrpo.runtime.engines import launch_engines, wait_for_engines
    from megagrpo.runtime.ray_session import start_ray

    root = tmp_path_factory.mktemp("moe")
    dirs = {
        (arch, seed): make_tiny_hf(arch, root / f"{arch}-{seed}", seed=seed, **SHAPES[arch], **INIT)
        for arch in MOE_ARCHS
        for seed in SEEDS.values()
    }
    start_ray(_config(dirs["qwen3_moe", 1]).cluster, num_cpus=5)  # the engines, a trainer rank
    launched = {
        case: launch_engines(
            _engine_config(dirs[arch, 1], case, "grpo.routing_replay=rollout"), str(dirs[arch, 1])
        )[0]
        for case, (arch, _, _) in ENGINES.items()
    }
    engines = dict(zip(launched, wait_for_engines(list(launched.values())), strict=True))
    yield dirs, engines
    ray.shutdown()


def _engine_config(hf_dir, case: str, *extra):
    _, tp, ep = ENGINES[case]
    return _config(
        hf_dir,
        f"generation.engine_tensor_parallel_size={tp}",
        f"generation.engine_expert_parallel={str(ep).lower()}",
        *extra,
    )


def _sync(cfg, engine, kind: str) -> None:
    """The trainer (loading ``cfg``'s checkpoint) sends its weights to ``engine`` by ``kind``; the probe
    agrees, replayed where ``cfg`` replays routing."""
    from megagrpo.runtime.groups import RankGroup
    from megagrpo.weight_sync.sync import WeightSync

    group = RankGroup(cfg, PolicyWorker, timeout_s=300)
    try:
        sync = WeightSync(cfg, group, [engine], vocab_size=300)
        assert sync.path.kind == kind, sync.path.reason
        assert sync.path.engine_ep == cfg.generation.engine_expert_parallel
        _assert_covered(sync, engine)
        sync.sync(with_checksums=True)  # every bucket's digest matches on arrival
        probe = sync.probe()
        assert probe.error <= 1.001 and probe.max_abs_delta < 1e-4, probe
        assert probe.replayed == (cfg.grpo.routing_replay == "rollout")
    finally:
        group.shutdown()


def _assert_covered(sync, engine) -> None:
    """The start-up coverage checks passed over every parameter: each trainer rank's, and each vLLM
    worker's, routed experts' stacked parameters included."""
    workers = ray.get(engine.param_shapes.remote())
    assert sync.coverage.engine_params == (tuple(len(params) for params in workers),)
    assert all(any(name.endswith("experts.routed_experts.w13_weight") for name in p) for p in workers)
    assert all(n > 0 for n in sync.coverage.trainer_params + sync.coverage.trainer_shares)


def _assert_probe_routing_is_transformers(engine, hf_dir) -> None:
    """What the replayed probe hands the trainer: the engine's routing of every probe position equals
    transformers' router top-k."""
    from transformers import AutoModelForCausalLM

    from megagrpo.weight_sync.sync import probe_sequences

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sequences = probe_sequences(300)
    logprobs, routed = ray.get(engine.prompt_logprobs.remote(sequences, routed=True))
    assert [len(lp) for lp in logprobs] == [len(s) - 1 for s in sequences]
    for seq, got in zip(sequences, routed, strict=True):
        want, gap = router_topk(model, seq)
        assert gap > MIN_ROUTER_GAP, f"probe sequence {seq}: a router top-k near-tie ({gap:.1e})"
        assert got.shape == want.shape, (got.shape, want.shape)
        assert torch.equal(got.long().sort(-1).values, want.sort(-1).values), f"routing of probe {seq}"


def _assert_matches_transformers(engine, hf_dir) -> None:
    """Greedy tokens and every completion's routed experts equal transformers' (concurrent requests,
    two sampled completions each, greedy ones too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    greedy = SamplingSettings(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingSettings(max_tokens=NEW_TOKENS, temperature=1.0, n=2, ignore_eos=True)
    comps = ray.get(engine.generate.remote(PROMPTS, greedy))
    for prompt, comp in zip(PROMPTS, comps, strict=True):
        want, margin = transformers_greedy(model, prompt, NEW_TOKENS)
        assert margin > MIN_LOGIT_MARGIN, f"prompt {prompt}: transformers decodes near a tie ({margin:.1e})"
        assert comp.token_ids == want, f"prompt {prompt}: vLLM {comp.token_ids} != transformers {want}"
    comps += ray.get(engine.generate.remote(PROMPTS, sampled, [7, 8, 9, 10]))
    assert len(comps) == 3 * len(PROMPTS)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for comp in comps:
        tokens = PROMPTS[comp.prompt_index] + comp.token_ids
        want, gap = router_topk(model, tokens)
        got = comp.routed_experts
        # The last sampled token is never fed forward: one row per token before it.
        assert got.dtype == torch.uint8 and got.shape == (len(tokens) - 1, layers, k), (got.dtype, got.shape)
        assert gap > MIN_ROUTER_GAP, f"{tokens}: a router top-k near-tie ({gap:.1e})"
        assert torch.equal(got.long().sort(-1).values, want[:-1].sort(-1).values), f"routing of {tokens}"


@pytest.mark.parametrize("path", list(SEEDS))
@pytest.mark.parametrize("case", list(ENGINES))
def test_engine_decodes_and_routes_as_transformers_after_a_sync(case, path, moe):
    dirs, engines = moe
    hf_dir = dirs[ENGINES[case][0], SEEDS[path]]
    # The shard-wise sync's probe replays the engine's routing (grpo.routing_replay), the gathered one's not.
    replay = ["grpo.routing_replay=rollout"] if path == "auto" else []
    cfg = _engine_config(hf_dir, case, f"generation.weight_sync_path={path}", *replay)
    _sync(cfg, engines[case], "gathered" if path == "gathered" else "shard")
    _assert_matches_transformers(engines[case], hf_dir)
    if replay:
        _assert_probe_routing_is_transformers(engines[case], hf_dir)


def test_routed_experts_of_a_preempted_request_are_those_of_its_last_computation(moe):
    """Four concurrent requests of 37 + 40 tokens in a KV cache of 6 blocks of 32 tokens: vLLM preempts
    one and computes it again from its first token; every completion's rows are still transformers'
    routing of its tokens (the rows of the last computation replace the earlier ones)."""
    from _preempting_engine import PreemptingEngine
    from transformers import AutoModelForCausalLM

    dirs, _ = moe
    hf_dir = dirs["qwen3_moe", SEEDS["gathered"]]
    engine = ray.remote(PreemptingEngine).options(num_cpus=1).remote(str(hf_dir), 8, 6)
    try:
        prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
        tokens, routed, preemptions = ray.get(engine.generate.remote(prompts, 40))
    finally:
        ray.kill(engine)
    assert preemptions >= 1, "the KV cache held every request: nothing was recomputed"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, response, got in zip(prompts, tokens, routed, strict=True):
        want, gap = router_topk(model, prompt + response)
        assert gap > MIN_ROUTER_GAP and got.shape == want[:-1].shape, (gap, got.shape)
        assert torch.equal(got.long().sort(-1).values, want[:-1].sort(-1).values)
