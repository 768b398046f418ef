"""Continuous generation (``megagrpo.generation.stream``) on a real in-process vLLM engine (CPU build):
requests advanced in slices come back once each with tokens, logprobs and versions in line (and the
versions agree with vLLM's own labels: the stream checks every finished request); weights changed between
two slices reach the requests in flight, whose later tokens carry the new version; a request stopped and
continued from its snapshot, or kept across a swap that changes nothing, samples what it would have
uninterrupted; an aborted request never finishes; a new request never reuses KV computed by other weights.

The engine runs in a process of its own (``_stream_scenarios.py``, one engine start for every scenario);
each test checks one scenario's part of its results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import make_tiny_hf

pytestmark = pytest.mark.e2e

GREEDY_TOKENS = 12


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("stream")
    # Head size 32 (hidden 128): what vLLM's CPU attention needs; room for a prompt of two KV blocks.
    model = make_tiny_hf("qwen2", work / "qwen2", hidden_size=128, max_position_embeddings=256)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the helper process itself
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the CPU default would reserve far more
        "TORCH_COMPILE_DISABLE": "1",  # as the generation worker's eager engines (compat.vllm_eager_cpu)
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    helper = Path(__file__).with_name("_stream_scenarios.py")
    proc = subprocess.run(
        [sys.executable, str(helper), str(model), str(work / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stream helper failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads((work / "out.json").read_text())


def _lined_up(record) -> None:
    n = len(record["tokens"])
    assert len(record["versions"]) == n, record["id"]
    assert len(record["logprobs"]) == n, record["id"]


def test_slices_return_each_request_once_with_its_tokens_logprobs_and_versions(results):
    got = results["slices"]
    finished = [r for slice_ in got["per_slice"] for r in slice_]
    assert sorted(r["id"] for r in finished) == [f"s{i}" for i in range(len(got["max_tokens"]))]
    # A request finishes in the slice of its last token: after 1 prefill and max_tokens - 1 decode steps.
    for n, slice_ in enumerate(got["per_slice"]):
        assert all((got["max_tokens"][int(r["id"][1:])] - 1) // 2 == n for r in slice_), n
    assert got["failed"] == 0
    for record in finished:
        i = int(record["id"][1:])
        _lined_up(record)
        assert record["finish"] == "length" and len(record["tokens"]) == got["max_tokens"][i]
        # The same seeded samples as one LLM.generate call, token for token.
        assert record["tokens"] == got["reference"][i]["tokens"]
        assert record["logprobs"] == pytest.approx(got["reference"][i]["logprobs"], abs=1e-5)
        # Tokens sampled before the version bump carry 0, after it 1.
        k = got["at_bump"].get(record["id"], len(record["tokens"]))
        assert record["versions"] == [0] * k + [1] * (len(record["tokens"]) - k), record["id"]
    # In flight at the bump (after two slices, four tokens each): the requests of more than four tokens.
    assert got["at_bump"] == {f"s{i}": 4 for i, m in enumerate(got["max_tokens"]) if m > 4}


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_weights_swapped_between_slices_reach_the_requests_in_flight(results, kv):
    got = results[f"swap_{kv}"]
    assert got["early"] == []
    assert set(got["swapped"]) == set(got["at_swap"]) == set(got["old_weights"])
    changed = 0
    for rid, record in got["swapped"].items():
        k = got["at_swap"][rid]
        assert k == 4  # one prefill step and three decode steps, one token each
        _lined_up(record)
        assert len(record["tokens"]) == GREEDY_TOKENS
        assert record["versions"] == [0] * k + [1] * (GREEDY_TOKENS - k)
        old = got["old_weights"][rid]["tokens"]
        assert record["tokens"][:k] == old[:k]
        changed += record["tokens"][k:] != old[k:]
        if kv == "recompute":
            # The KV of the tokens so far computed again with the new weights: exactly the continuation
            # of the snapshot on the new weights.
            assert record["tokens"] == got["continued_on_new_weights"][rid]["tokens"]
    assert changed > 0  # the new weights changed what the requests in flight sampled


def test_the_two_kv_modes_differ(results):
    # Kept keys and values (old weights) and recomputed ones (new weights) give other samples.
    keep, recompute = results["swap_keep"]["swapped"], results["swap_recompute"]["swapped"]
    differ = [rid for rid in keep if keep[rid]["logprobs"] != recompute[f"wrecompute{rid[5:]}"]["logprobs"]]
    assert differ


def test_continuation_from_a_snapshot_and_swaps_that_change_nothing(results):
    got = results["pause"]
    for name in ("greedy", "seeded"):
        uninterrupted = got[f"{name}_uninterrupted"]
        assert len(uninterrupted) == 6
        for record in uninterrupted.values():
            _lined_up(record)
        variants = [f"{name}_same_weights_keep", f"{name}_same_weights_recompute"]
        if name == "greedy":
            variants.append("greedy_resumed")
        for variant in variants:
            assert set(got[variant]) == set(uninterrupted), variant
            for rid, record in got[variant].items():
                _lined_up(record)
                assert record["tokens"] == uninterrupted[rid]["tokens"], (variant, rid)
                assert record["logprobs"] == pytest.approx(uninterrupted[rid]["logprobs"], abs=1e-5)
        # A continuation keeps its first part and its versions.
        for rid, record in got[f"{name}_resumed"].items():
            assert record["tokens"][:3] == uninterrupted[rid]["tokens"][:3]
            assert record["versions"] == [0] * GREEDY_TOKENS
        # The same snapshot continues the same way (seeded: its own seed, from the request's).
        assert got[f"{name}_resumed"] == got[f"{name}_resumed_again"]
        for rid, record in got[f"{name}_same_weights_recompute"].items():
            assert record["versions"] == [0] * 3 + [1] * (GREEDY_TOKENS - 3), rid


def test_aborted_requests_never_finish(results):
    got = results["abort"]
    assert got["dropped"] == ["a1", "a5"]
    assert sorted(got["finished"]) == ["a0", "a2", "a3", "a4"]
    assert got["failed"] == []
    assert got["engine_unfinished"] == 0


def test_new_requests_never_reuse_kv_of_other_weights(results):
    got = results["prefix_salt"]
    fresh = got["v1_after_reset"]
    assert got["reset"] is True  # nothing in flight: vLLM empties its prefix cache
    # The same seed: the logprobs tell the KV apart.
    assert got["v1"]["tokens"] == fresh["tokens"]
    assert got["v1"]["logprobs"] == pytest.approx(fresh["logprobs"], abs=1e-6)
    # The same request labelled with the old version reuses the old weights' cached blocks: different
    # logprobs (the cache is real, the version salt is what keeps it apart).
    assert got["v0_label_on_new_weights"]["logprobs"] != pytest.approx(fresh["logprobs"], abs=1e-6)


def test_bad_requests_are_refused_with_the_request_named(results):
    got = results["errors"]
    assert "'e0'" in got["n2"] and "settings.n is 2" in got["n2"]
    assert "'e1'" in got["duplicate"] and "already in flight" in got["duplicate"]
    assert "'drop'" in got["kv"]
    assert "'e2'" in got["misaligned"] and "do not line up" in got["misaligned"]
    assert "max_steps" in got["steps"]
    assert got["left"] == 0


def test_a_continuation_that_ends_with_a_stop_token_samples_nothing_more(results):
    (record,) = results["stopped"]["finished"]
    assert record["tokens"] == [5, 9] and record["finish"] == "stop"
    assert record["logprobs"] == [-1.0, -2.0] and record["versions"] == [0, 0]
    assert results["stopped"]["left"] == 0


# ------------------------------------------------------------------------------- routed experts (MoE)

ROUTED_TOKENS, SWAP_AT, NORM_SCALE = 10, 4, 1.5  # as _stream_routing.py
MIN_ROUTER_GAP = 1e-5  # as test_vllm_moe.py: far above the ~1e-7 by which vLLM's kernels and torch's differ


@pytest.fixture(scope="module")
def routed(tmp_path_factory) -> tuple[dict, object, object]:
    """(``_stream_routing.py``'s results, the tiny MoE model in transformers, the same with the weights the
    engine was swapped to)."""
    import torch
    from transformers import AutoModelForCausalLM

    work = tmp_path_factory.mktemp("stream_routing")
    model_dir = make_tiny_hf("qwen3_moe", work / "qwen3_moe", initializer_range=0.1)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    helper = Path(__file__).with_name("_stream_routing.py")
    proc = subprocess.run(
        [sys.executable, str(helper), str(model_dir), str(old.config.num_experts), str(work / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"routing helper failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        new.model.layers[0].input_layernorm.weight.mul_(NORM_SCALE)
    return json.loads((work / "out.json").read_text()), old, new


def _routing(model, tokens):
    """transformers' top-k experts of every position of ``tokens``, sorted within a row."""
    from hf_models import router_topk

    want, gap = router_topk(model, tokens)
    assert gap > MIN_ROUTER_GAP, f"a near-tie in the reference routing of {tokens}"
    return want.sort(-1).values


def _sorted_rows(rows):
    import torch

    return torch.tensor(rows).long().sort(-1).values


@pytest.mark.parametrize("mode", ["keep", "recompute", "resumed"])
def test_routed_experts_keep_the_rows_of_every_version_per_token(routed, mode):
    """Each position keeps the row of its first forward: the old weights' for the positions forwarded
    before the swap (also after a "recompute" swap or a continuation forwarded them again with the new
    weights), the new weights' after it; a snapshot carries its rows into the continuation."""
    import torch

    results, old, new = routed
    got = results[mode]
    assert got["early"] == 0 and got["left"] == 0 and len(got["requests"]) == 3
    changed = 0
    for rid, record in got["requests"].items():
        prompt, tokens = record["prompt"], record["tokens"]
        before = len(prompt) + SWAP_AT - 1  # positions forwarded before the swap
        assert len(tokens) == ROUTED_TOKENS
        assert record["versions"] == [0] * SWAP_AT + [1] * (ROUTED_TOKENS - SWAP_AT)
        rows = _sorted_rows(record["rows"])
        sequence = prompt + tokens
        assert rows.shape[0] == len(sequence) - 1  # the last token is never forwarded
        want_old = _routing(old, sequence)[:-1]
        assert torch.equal(rows[:before], want_old[:before]), rid
        if mode == "resumed":
            assert torch.equal(_sorted_rows(got["partial_rows"][rid]), rows[:before]), rid
        if mode != "keep":  # the positions after the swap: forwarded over a prefix the new weights computed
            want_new = _routing(new, sequence)[:-1]
            assert torch.equal(rows[before:], want_new[before:]), rid
            changed += not torch.equal(want_new[:before], want_old[:before])
    if mode != "keep":
        # The swap changed the routing of the positions so far: keeping their first rows was a choice.
        assert changed > 0


def test_a_probe_beside_the_stream_gets_its_rows_and_leaves_the_streams(routed):
    import torch
    from _stream_routing import PROBE

    results, old, _ = routed
    got = results["probe"]
    assert torch.equal(_sorted_rows(got["probe_rows"]), _routing(old, PROBE))
    assert len(got["requests"]) == 3
    for rid, record in got["requests"].items():
        sequence = record["prompt"] + record["tokens"]
        rows = _sorted_rows(record["rows"])
        before = len(record["prompt"]) + SWAP_AT - 1
        assert rows.shape[0] == len(sequence) - 1
        assert torch.equal(rows[:before], _routing(old, sequence)[:before]), rid
