"""SFT and DPO workers: loss and grad norm independent of the layout and the micro-batch budget, pairs
never split, DPO's first step exactly at the reference (margin 0, loss log 2)."""

from __future__ import annotations

import math

import pytest
from hf_models import make_tiny_hf
from policy_cases import LARGE_BUDGET, SMALL_BUDGET
from supervised_cases import dpo_batch, sft_batch, supervised_config

from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.dist


def _steps(rank: int, world_size: int, cfg) -> dict:
    """Two SFT steps, then (a fresh job on the same ranks) two DPO steps with their reference logprobs."""
    from megagrpo.policy.supervised import DPOWorker, SFTWorker

    out = {}
    worker = SFTWorker(cfg)
    try:
        out["sft"] = [worker.train_step(sft_batch(0)), worker.train_step(sft_batch(1))]
        out["sft_val"] = worker.evaluate(sft_batch(2))
    finally:
        destroy_parallel()
    worker = DPOWorker(cfg)
    try:
        batch = dpo_batch(0)
        out["pair_rows"] = [rows for rows, _ in worker.pair_micro_batches(batch)]
        ref = worker.reference_logps(batch)
        out["dpo"] = [worker.train_step(batch.replace(ref_logps=ref))]
        nxt = dpo_batch(1)
        out["ref_again"] = worker.reference_logps(batch)
        out["dpo"].append(worker.train_step(nxt.replace(ref_logps=worker.reference_logps(nxt))))
        out["ref"] = ref
    finally:
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("supervised") / "qwen2"))


@pytest.fixture(scope="module")
def reference(hf_dir) -> dict:
    (res,) = run_local_ranks(_steps, 1, supervised_config(hf_dir), timeout_s=600)
    return res


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2, budget=SMALL_BUDGET), dict(pp=2, budget=SMALL_BUDGET), dict(dp=2, budget=LARGE_BUDGET)],
    ids=["tp2-small", "pp2-small", "dp2-large"],
)
def test_sft_and_dpo_do_not_depend_on_layout_or_budget(layout, hf_dir, reference):
    results = run_local_ranks(_steps, 2, supervised_config(hf_dir, **layout), timeout_s=600)
    for res in results:
        for kind in ("sft", "dpo"):
            for got, want in zip(res[kind], reference[kind], strict=True):
                assert _rel(got.loss, want.loss) <= 1e-5, (kind, got.loss, want.loss)
                assert _rel(got.grad_norm, want.grad_norm) <= 1e-5, (kind, got.grad_norm, want.grad_norm)
        assert [m.tokens for m in res["sft"]] == [m.tokens for m in reference["sft"]]
        assert _rel(res["sft_val"].loss, reference["sft_val"].loss) <= 1e-5
        for got, want in zip(res["dpo"], reference["dpo"], strict=True):
            assert got.pairs == want.pairs == 6
            assert _rel(got.margin_mean, want.margin_mean) <= 1e-4 or abs(got.margin_mean) < 1e-9
            assert got.accuracy == want.accuracy
    # A pair is never split: every micro-batch holds whole pairs, and each pair is on exactly one DP rank.
    rows = [r for res in results for group in res["pair_rows"] for r in group]
    for res in results:
        for group in res["pair_rows"]:
            assert sorted(group) == sorted({2 * (r // 2) for r in group} | {2 * (r // 2) + 1 for r in group})
    if layout.get("dp", 1) == 2:
        assert sorted(rows) == list(range(12))  # the two DP ranks split the pairs between them
    if layout.get("budget") == SMALL_BUDGET:
        assert max(len(g) for g in results[0]["pair_rows"]) < 12  # the small budget did split the batch


def test_dpo_first_step_is_at_the_reference(reference):
    first = reference["dpo"][0]
    # Policy == reference: every implicit reward is exactly 0, the sigmoid loss log 2 (with label
    # smoothing eps: -(1 - eps) log 1/2 - eps log 1/2 = log 2 as well).
    assert first.margin_mean == 0.0 and first.chosen_reward_mean == 0.0 and first.rejected_reward_mean == 0.0
    assert first.accuracy == 0.0
    assert first.loss == pytest.approx(math.log(2), rel=1e-6)
    # The step moved the policy, not the reference: the next step's reference logprobs are the same.
    assert reference["ref_again"].equal(reference["ref"])
    second = reference["dpo"][1]
    assert second.margin_mean != 0.0
