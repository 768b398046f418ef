"""``megagrpo plan`` under ``grpo.async_mode: partial`` (``megagrpo.plan_partial``): the group buffer's host
bytes and the engines' KV cache for the requests in flight, against numbers computed by hand."""

from __future__ import annotations

import pytest

from megagrpo.config import load_config
from megagrpo.plan import GIB, make_plan, read_shape

pytestmark = pytest.mark.unit

# The tiny MoE (2 layers, 4 heads in 2 KV groups of width 32, 8 experts, top-2, float32, seq_length 256):
# 4 prompts x 8 per step, 2 staleness versions, 2 engines decoding at most 32 sequences each.
PARTIAL = [
    "grpo.async_mode=partial",
    "grpo.max_staleness=2",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations=8",
    "policy.mini_batch_size=16",
    "generation.num_engines=2",
    "generation.max_new_tokens=64",
    "generation.max_num_seqs=32",
]


def plan_of(overrides):
    cfg = load_config("tiny_moe", overrides)
    shape, where = read_shape(cfg, None)
    return make_plan(cfg, shape, where, gpu_memory_gib=1.0)


def test_the_buffer_and_the_kv_in_flight_by_hand():
    plan = plan_of(PARTIAL)
    p, e = plan.partial, plan.engine_worker_bytes
    assert p["groups"] == (2 + 1) * 4 and p["responses"] == 12 * 8
    # Per token 36 (id) + 32 (logprob) + 8 (version) bytes; routing: 255 positions x 2 layers x top-2 x 1 B.
    assert p["routing_bytes_per_response"] == 255 * 4
    assert p["bytes_per_response"] == 64 * 76 + 1020 == 5884
    assert p["buffer_bytes"] == 96 * 5884
    # 12 groups over 2 engines: 6 groups x 8 requests each; 32 of them decode at once.
    assert p["requests_per_engine"] == 48 and p["running_per_engine"] == 32
    # KV per token: K and V x 2 layers x 2 groups x 32 x 4 bytes = 1024; x 256 positions x 32 sequences.
    assert p["kv_in_flight"] == 1024 * 256 * 32 == 8 * 2**20
    assert e["concurrency"] == 32 and e["kv_cache"] == p["kv_in_flight"]
    assert p["kv_headroom"] == int(0.5 * GIB) - e["weights"] - 8 * 2**20
    assert plan.errors == []


def test_without_routing_replay_no_rows_and_fewer_requests_than_the_engine_decodes():
    plan = plan_of([*PARTIAL, "grpo.routing_replay=none", "generation.max_num_seqs=64"])
    p = plan.partial
    assert p["routing_bytes_per_response"] == 0 and p["bytes_per_response"] == 64 * 76
    assert p["requests_per_engine"] == p["running_per_engine"] == 48
    assert p["kv_in_flight"] == 1024 * 256 * 48


def test_kv_for_the_requests_in_flight_that_does_not_fit_is_an_error():
    # 31 x 4 groups over 2 engines: 62 x 8 = 496 requests, all decoding: 496 x 256 KiB = 124 MiB of KV,
    # more than a tenth of the 1 GiB GPU. A step's 32 rollouts in the batch modes: 16 per engine, 4 MiB.
    tight = ["generation.max_num_seqs=512", "generation.gpu_memory_utilization=0.1"]
    plan = plan_of([*PARTIAL, *tight, "grpo.max_staleness=30"])
    assert plan.partial["running_per_engine"] == plan.partial["requests_per_engine"] == 496
    assert plan.partial["kv_in_flight"] == 124 * 2**20 and plan.partial["kv_headroom"] < 0
    assert any("KV cache for 496 sequences" in err for err in plan.errors), plan.errors
    batch = [o for o in PARTIAL if not o.startswith(("grpo.async_mode", "grpo.max_staleness"))]
    assert plan_of([*batch, *tight]).errors == []


def test_batch_modes_have_no_partial_part():
    assert plan_of([]).partial is None
