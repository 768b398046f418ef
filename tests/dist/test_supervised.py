"""SFT and DPO workers: loss and grad norm independent of the layout and the micro-batch budget, pairs
never split, DPO's first step exactly at the reference (margin 0, loss log 2)."""

from __future__ import annotations

import math

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import LARGE_BUDGET, SMALL_BUDGET
from rank_cases import case, run_cases
from supervised_cases import dpo_batch, sft_batch, supervised_config


pytestmark = pytest.mark.dist


def _steps(cfg, kind: str) -> dict:
    """Two SFT steps and a validation pass, or two DPO steps with their reference logprobs."""
    from megagrpo.policy.supervised import DPOWorker, SFTWorker

    out = {}
    if kind == "sft":
        worker = SFTWorker(cfg)
        out["steps"] = [worker.train_step(sft_batch(0)), worker.train_step(sft_batch(1))]
        out["val"] = worker.evaluate(sft_batch(2))
        return out
    worker = DPOWorker(cfg)
    batch, nxt = dpo_batch(0), dpo_batch(1)
    out["pair_rows"] = [rows for rows, _ in worker.pair_micro_batches(batch)]
    out["ref"] = worker.reference_logps(batch)
    out["steps"] = [worker.train_step(batch.replace(ref_logps=out["ref"]))]
    out["ref_again"] = worker.reference_logps(batch)
    out["steps"].append(worker.train_step(nxt.replace(ref_logps=worker.reference_logps(nxt))))
    out["val"] = worker.evaluate(batch.replace(ref_logps=out["ref"]))
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("supervised") / "qwen2"))


KINDS = ("sft", "dpo")
LAYOUTS = {
    "tp2-small": dict(tp=2, budget=SMALL_BUDGET),
    "pp2-small": dict(pp=2, budget=SMALL_BUDGET),
    "dp2-large": dict(dp=2, budget=LARGE_BUDGET),
}


@pytest.fixture(scope="module")
def reference(hf_dir) -> dict:
    """One rank, one micro-batch per step: each kind's steps (one spawn for both)."""
    (res,) = run_cases(1, {kind: (_steps, supervised_config(hf_dir), kind) for kind in KINDS})
    return {kind: case([res], kind)[0] for kind in KINDS}


@pytest.fixture(scope="module")
def two_ranks(hf_dir) -> list[dict]:
    """Every layout and kind on one spawn of two ranks."""
    cases = {
        f"{layout}/{kind}": (_steps, supervised_config(hf_dir, **LAYOUTS[layout]), kind)
        for layout in LAYOUTS
        for kind in KINDS
    }
    return run_cases(2, cases)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_loss_and_grad_norm_do_not_depend_on_layout_or_budget(kind, layout_id, two_ranks, reference):
    want, layout = reference[kind], LAYOUTS[layout_id]
    results = case(two_ranks, f"{layout_id}/{kind}")
    for res in results:
        for got, exp in zip(res["steps"], want["steps"], strict=True):
            assert _rel(got.loss, exp.loss) <= 1e-5, (got.loss, exp.loss)
            assert _rel(got.grad_norm, exp.grad_norm) <= 1e-5, (got.grad_norm, exp.grad_norm)
        assert _rel(res["val"].loss, want["val"].loss) <= 1e-5
        if kind == "sft":
            assert [m.tokens for m in res["steps"]] == [m.tokens for m in want["steps"]]
            continue
        for got, exp in zip(res["steps"], want["steps"], strict=True):
            assert got.pairs == exp.pairs == 6 and got.accuracy == exp.accuracy
        torch.testing.assert_close(res["ref"], want["ref"], rtol=1e-5, atol=1e-5)
        # A pair is never split: every micro-batch holds whole pairs.
        for rows in res["pair_rows"]:
            assert sorted(rows) == sorted({2 * (r // 2) + k for r in rows for k in (0, 1)})
    if kind == "dpo":
        # Each pair is on exactly one data-parallel rank (DP=2: the two ranks split the pairs).
        per_rank = [sorted(r for rows in res["pair_rows"] for r in rows) for res in results]
        if layout.get("dp", 1) == 2:
            assert sorted(per_rank[0] + per_rank[1]) == list(range(12)) and per_rank[0] != per_rank[1]
        else:
            assert per_rank[0] == per_rank[1] == list(range(12))
        if layout.get("budget") == SMALL_BUDGET:
            assert len(results[0]["pair_rows"]) > 1  # the small budget did split the batch into micro-batches


def test_dpo_first_step_is_at_the_reference(reference):
    first, second = reference["dpo"]["steps"]
    # Policy == reference: every implicit reward is exactly 0, the sigmoid loss log 2 (with label
    # smoothing eps: -(1 - eps) log 1/2 - eps log 1/2 = log 2 as well).
    assert first.margin_mean == 0.0 and first.chosen_reward_mean == 0.0 and first.rejected_reward_mean == 0.0
    assert first.accuracy == 0.0
    assert first.loss == pytest.approx(math.log(2), rel=1e-6)
    # The step moved the policy, not the reference: the reference logprobs did not change.
    assert torch.equal(reference["dpo"]["ref_again"], reference["dpo"]["ref"])
    assert second.margin_mean != 0.0
