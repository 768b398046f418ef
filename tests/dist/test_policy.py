"""The Megatron policy worker: layout-independent numerics, on-policy first step, save/load at any layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import LARGE_BUDGET, SMALL_BUDGET, load_then_continue, policy_batch, policy_config

from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.dist

TORCH_LAYERS = "parallel.transformer_impl=torch"


def _one_step(rank: int, world_size: int, cfg) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()
        old = worker.logprobs(batch)
        metrics = worker.train(batch.replace(old_logprobs=old))
        new = worker.logprobs(batch)
        return {
            "old": old,
            "metrics": metrics,
            "new": new,
            "recompute": worker.engine.config.recompute_granularity,
            "packed": worker.packed,
        }
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("policy") / "qwen2"))


@pytest.fixture(scope="module")
def reference(hf_dir) -> dict:
    (res,) = run_local_ranks(_one_step, 1, policy_config(hf_dir), timeout_s=300)
    return res


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, budget=SMALL_BUDGET),
        dict(tp=2, budget=LARGE_BUDGET),
        dict(pp=2, budget=SMALL_BUDGET),
        dict(dp=2, budget=SMALL_BUDGET),
        dict(tp=2, extra=("policy.recompute=full", "policy.recompute_num_layers=2")),
        dict(pp=2, extra=("policy.recompute=core_attention",)),
        # The torch layers pack micro-batches (THD): packed == the padded local reference.
        dict(tp=2, budget=SMALL_BUDGET, extra=(TORCH_LAYERS, "parallel.sequence_parallel=true")),
        dict(pp=2, budget=SMALL_BUDGET, extra=(TORCH_LAYERS, "policy.recompute=core_attention")),
    ],
    ids=[
        "tp2-small",
        "tp2-large",
        "pp2-small",
        "dp2-small",
        "tp2-recompute-full",
        "pp2-recompute-attn",
        "tp2-sp-torch-packed",
        "pp2-torch-packed-recompute-attn",
    ],
)
def test_loss_and_grad_norm_do_not_depend_on_layout(layout, hf_dir, reference):
    results = run_local_ranks(_one_step, 2, policy_config(hf_dir, **layout), timeout_s=300)
    (want,) = reference["metrics"]
    granularity = {"policy.recompute=full": "full", "policy.recompute=core_attention": "selective"}
    want_recompute = next((granularity[e] for e in layout.get("extra", ()) if e in granularity), None)
    for res in results:
        assert res["recompute"] == want_recompute  # the knob reached Megatron
        assert res["packed"] == (TORCH_LAYERS in layout.get("extra", ()))
        (got,) = res["metrics"]
        assert _rel(got.loss, want.loss) <= 1e-5, (got.loss, want.loss)
        assert _rel(got.grad_norm, want.grad_norm) <= 1e-5, (got.grad_norm, want.grad_norm)
        assert got.tokens == want.tokens
        mask = policy_batch().response_mask()
        torch.testing.assert_close(res["old"][mask], reference["old"][mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["new"][mask], reference["new"][mask], atol=1e-4, rtol=1e-4)


def test_first_step_is_exactly_on_policy(reference):
    (metrics,) = reference["metrics"]
    assert metrics.ratio_mean == 1.0 and metrics.ratio_min == 1.0 and metrics.ratio_max == 1.0
    assert metrics.clip_low_frac == 0.0 and metrics.clip_high_frac == 0.0
    # and the step changed the policy
    mask = policy_batch().response_mask()
    assert (reference["new"][mask] - reference["old"][mask]).abs().max() > 1e-3


def _one_step_without_old_logprobs(rank: int, world_size: int, cfg) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()
        metrics = worker.train(batch)  # one optimizer step: the old logprobs are the forward's own
        return {"metrics": metrics, "new": worker.logprobs(batch)}
    finally:
        destroy_parallel()


@pytest.mark.parametrize("layout", [dict(), dict(tp=2, budget=SMALL_BUDGET)], ids=["tp1", "tp2-small"])
def test_one_optimizer_step_needs_no_old_logprob_pass(layout, hf_dir, reference):
    """The driver skips the old-logprob forward when a batch gets one optimizer step: the training
    forward's detached logprobs are then the old ones, so the step equals the one given them."""
    world = 2 if layout else 1
    results = run_local_ranks(
        _one_step_without_old_logprobs, world, policy_config(hf_dir, **layout), timeout_s=300
    )
    (want,) = reference["metrics"]
    mask = policy_batch().response_mask()
    for res in results:
        (got,) = res["metrics"]
        assert got.ratio_min == got.ratio_max == 1.0
        assert _rel(got.loss, want.loss) <= 1e-5, (got.loss, want.loss)
        assert _rel(got.grad_norm, want.grad_norm) <= 1e-5, (got.grad_norm, want.grad_norm)
        torch.testing.assert_close(res["new"][mask], reference["new"][mask], atol=1e-4, rtol=1e-4)


def _two_steps(rank: int, world_size: int, cfg, precompute: bool) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()
        if precompute:
            batch = batch.replace(old_logprobs=worker.logprobs(batch))
        return {"metrics": worker.train(batch), "new": worker.logprobs(policy_batch())}
    finally:
        destroy_parallel()


def test_later_mini_batches_are_scored_before_the_first_update(hf_dir):
    """Without old logprobs, train() takes the first mini-batch's from its own forward and scores the
    second before the first update: both optimizer steps equal those given precomputed old logprobs,
    and the second step's ratios are off 1 (its old logprobs are not the updated weights')."""
    cfg = policy_config(hf_dir, mini=4)
    (want,) = run_local_ranks(_two_steps, 1, cfg, True, timeout_s=300)
    (got,) = run_local_ranks(_two_steps, 1, cfg, False, timeout_s=300)
    assert len(got["metrics"]) == len(want["metrics"]) == 2
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert _rel(g.loss, w.loss) <= 1e-5, (g.loss, w.loss)
        assert _rel(g.grad_norm, w.grad_norm) <= 1e-5, (g.grad_norm, w.grad_norm)
        assert _rel(g.ratio_mean, w.ratio_mean) <= 1e-5, (g.ratio_mean, w.ratio_mean)
    first, second = got["metrics"]
    assert first.ratio_min == first.ratio_max == 1.0
    assert second.ratio_max - second.ratio_min > 1e-4
    mask = policy_batch().response_mask()
    torch.testing.assert_close(got["new"][mask], want["new"][mask], atol=1e-4, rtol=1e-4)


def _save_then_continue(rank: int, world_size: int, cfg, path: str) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()
        worker.train(batch.replace(old_logprobs=worker.logprobs(batch)))
        worker.save(path)
        saved_logprobs = worker.logprobs(batch)
        next_batch = policy_batch(seed=1)
        next_metrics = worker.train(next_batch.replace(old_logprobs=worker.logprobs(next_batch)))
        return {"saved": saved_logprobs, "next": next_metrics}
    finally:
        destroy_parallel()


def test_save_load_restores_logprobs_and_optimizer_at_any_layout(hf_dir, tmp_path):
    ckpt = str(tmp_path / "step")
    (saved,) = run_local_ranks(_save_then_continue, 1, policy_config(hf_dir), ckpt, timeout_s=300)
    mask = policy_batch().response_mask()
    for layout in (dict(), dict(tp=2), dict(pp=2)):
        world = 2 if layout else 1
        results = run_local_ranks(
            load_then_continue, world, policy_config(hf_dir, **layout), ckpt, timeout_s=300
        )
        for res in results:
            assert res["steps"] == 1
            torch.testing.assert_close(res["loaded"][mask], saved["saved"][mask], atol=1e-5, rtol=1e-5)
            # Same next step after the reload: Adam moments and LR schedule came back too.
            (got,), (want,) = res["next"], saved["next"]
            assert _rel(got.loss, want.loss) <= 1e-5
            assert _rel(got.grad_norm, want.grad_norm) <= 1e-4
    # The model part is a regular megagrpo checkpoint: it exports to HF.
    from megagrpo.ckpt.convert import megatron_to_hf

    out = megatron_to_hf(ckpt, tmp_path / "hf")
    assert (Path(out) / "model.safetensors").is_file()


def _reference_and_kl(rank: int, world_size: int, cfg) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()
        before = worker.logprobs(batch)
        ref = worker.reference_logprobs(batch)
        worker.train(batch.replace(old_logprobs=before, ref_logprobs=ref))
        return {
            "before": before,
            "ref_before": ref,
            "after": worker.logprobs(batch),
            "ref_after": worker.reference_logprobs(batch),
            "after_again": worker.logprobs(batch),
        }
    finally:
        destroy_parallel()


def test_reference_policy_stays_at_initial_weights(hf_dir):
    (res,) = run_local_ranks(_reference_and_kl, 1, policy_config(hf_dir, kl=0.1), timeout_s=300)
    mask = policy_batch().response_mask()
    assert torch.equal(res["ref_before"], res["before"])
    assert torch.equal(res["ref_after"], res["before"])  # reference did not move with training
    assert not torch.equal(res["after"], res["before"])
    assert torch.equal(res["after_again"], res["after"])  # swapping back restored the trained weights
    assert mask.any()


def _packed_vs_padded(rank: int, world_size: int, cfg) -> dict:
    """Logprobs of the packed (THD) micro-batch through the TP=2 model vs the padded path.

    Megatron's local attention takes no THD boundaries; here the same packed row goes through it with
    the block-diagonal causal mask that THD boundaries mean, which checks the packing (positions,
    targets, unpacking) apart from any attention kernel. RoPE scores depend only on relative
    positions, so each sequence sees what it sees alone. (The torch layers' own THD attention is
    checked through ``PolicyWorker.train`` above.)
    """
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()
        want = worker.logprobs(batch, 1.0)
        micro = worker._packed_micro_batch(batch)
        cu = micro["packed"].cu_seqlens
        total = micro["tokens"].shape[1]
        segment = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
        blocked = (segment[:, None] != segment[None, :]) | torch.ones(total, total, dtype=torch.bool).triu(1)
        worker.engine.model[0].eval()
        with torch.no_grad():
            logits = worker.engine.module(micro["tokens"], micro["position_ids"], blocked[None, None])
            got, _ = worker._token_logprobs(logits, micro, with_entropy=False, temperature=1.0)
        return {"want": want, "got": got, "total": total}
    finally:
        destroy_parallel()


def test_packed_micro_batch_gives_the_padded_logprobs(hf_dir):
    results = run_local_ranks(_packed_vs_padded, 2, policy_config(hf_dir, tp=2), timeout_s=300)
    mask = policy_batch().response_mask()
    assert mask.any()
    for res in results:
        assert res["total"] == int(policy_batch().lengths.sum())  # no padding at all
        torch.testing.assert_close(res["got"][mask], res["want"][mask], atol=1e-5, rtol=1e-5)


# Each loss of the family with the options it needs; the batch's old logprobs are pushed off the policy's
# so that ratios differ from 1 and some tokens (or sequences) clip.
LOSSES = {
    "grpo": (),
    # GSPO's sequence ratios spread less than token ratios: a range of the paper's order clips some.
    "gspo": ("grpo.loss=gspo", "grpo.loss_agg=sequence", "grpo.clip_eps_low=0.02", "grpo.clip_eps_high=0.02"),
    "gspo_token": (
        "grpo.loss=gspo_token",
        "grpo.loss_agg=sequence",
        "grpo.clip_eps_low=0.02",
        "grpo.clip_eps_high=0.02",
    ),
    "cispo": ("grpo.loss=cispo", "grpo.clip_eps_low=1.0", "grpo.clip_eps_high=0.1"),
}


def _one_off_policy_step_per_loss(rank: int, world_size: int, hf_dir: str, layout: dict) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    results = {}
    for name, extra in LOSSES.items():
        cfg = policy_config(hf_dir, **layout, extra=(*layout.get("extra", ()), *extra))
        worker = PolicyWorker(cfg)
        try:
            batch = policy_batch()
            shift = 0.15 * torch.randn(
                batch.input_ids.shape[0],
                batch.input_ids.shape[1] - 1,
                generator=torch.Generator().manual_seed(3),
            )
            results[name] = worker.train(batch.replace(old_logprobs=worker.logprobs(batch) + shift))
        finally:
            destroy_parallel(keep_world=True)
    return results


@pytest.fixture(scope="module")
def per_loss_reference(hf_dir) -> dict:
    (res,) = run_local_ranks(_one_off_policy_step_per_loss, 1, hf_dir, {}, timeout_s=300)
    return res


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2, budget=SMALL_BUDGET), dict(pp=2, budget=SMALL_BUDGET), dict(dp=2, budget=SMALL_BUDGET)],
    ids=["tp2-small", "pp2-small", "dp2-small"],
)
def test_every_loss_is_layout_invariant(layout, hf_dir, per_loss_reference):
    """GSPO, GSPO-token and CISPO (and GRPO beside them) give the same loss and grad norm at TP 2, PP 2 and
    DP 2 with many micro-batches as on one rank with one, off-policy (ratios != 1, some clipped)."""
    results = run_local_ranks(_one_off_policy_step_per_loss, 2, hf_dir, layout, timeout_s=300)
    ref = {name: m for name, (m,) in per_loss_reference.items()}
    assert len({ref[name].loss for name in ("grpo", "gspo", "cispo")}) == 3, ref  # three different losses
    # GSPO-token with one advantage per sequence: GSPO's value and gradient, on the real model too
    assert _rel(ref["gspo_token"].loss, ref["gspo"].loss) <= 1e-6
    assert _rel(ref["gspo_token"].grad_norm, ref["gspo"].grad_norm) <= 1e-5
    for name, (want,) in per_loss_reference.items():
        assert want.ratio_max - want.ratio_min > 0.1, name
        assert want.clip_low_frac + want.clip_high_frac > 0, name
        for res in results:
            (got,) = res[name]
            assert _rel(got.loss, want.loss) <= 1e-5, (name, got.loss, want.loss)
            assert _rel(got.grad_norm, want.grad_norm) <= 1e-5, (name, got.grad_norm, want.grad_norm)
            assert (
                _rel(got.clip_high_frac + got.clip_low_frac, want.clip_high_frac + want.clip_low_frac) <= 1e-9
            )


def _teacher_logprobs(rank: int, world_size: int, hf_dir: str) -> dict:
    from megagrpo.config import DistillConfig
    from megagrpo.config.teacher import teacher_config
    from megagrpo.policy.teacher import TeacherWorker

    # the student at TP 1, its teacher at TP 2 (its own layout)
    distill = DistillConfig(teacher_hf_dir=hf_dir, teacher_tensor_parallel_size=world_size)
    teacher = TeacherWorker(teacher_config(dataclasses.replace(policy_config(hf_dir), distill=distill)))
    try:
        frozen = teacher.engine.optimizer is None and teacher.scheduler is None
        frozen &= not any(p.requires_grad for p in teacher.engine.module.parameters())
        return {"logprobs": teacher.logprobs(policy_batch()), "frozen": frozen, "tp": teacher.ctx.sizes.tp}
    finally:
        destroy_parallel()


def test_teacher_scores_the_tokens_as_the_trainer_would(hf_dir, reference):
    """The teacher's frozen ranks (no gradients, no optimizer) at their own TP 2 give the logprobs the
    TP 1 trainer gives for the same model and tokens."""
    results = run_local_ranks(_teacher_logprobs, 2, hf_dir, timeout_s=300)
    mask = policy_batch().response_mask()
    for got in results:
        assert got["frozen"] and got["tp"] == 2
        torch.testing.assert_close(got["logprobs"][mask], reference["old"][mask], atol=1e-5, rtol=1e-5)
