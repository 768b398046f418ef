"""The Megatron policy worker: layout-independent numerics, on-policy first step, save/load at any layout.

Every case runs in one of two spawned worlds (``one_rank``, ``two_ranks``; ``rank_cases``): two spawns for
the module instead of one per case.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import LARGE_BUDGET, SMALL_BUDGET, load_then_continue, policy_batch, policy_config
from rank_cases import case, run_cases

from megagrpo.parallel import destroy_parallel

pytestmark = pytest.mark.dist

TORCH_LAYERS = "parallel.transformer_impl=torch"


def _one_step(cfg) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
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


def _one_step_without_old_logprobs(cfg) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    batch = policy_batch()
    metrics = worker.train(batch)  # one optimizer step: the old logprobs are the forward's own
    return {"metrics": metrics, "new": worker.logprobs(batch)}


def _two_steps(cfg, precompute: bool) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    batch = policy_batch()
    if precompute:
        batch = batch.replace(old_logprobs=worker.logprobs(batch))
    return {"metrics": worker.train(batch), "new": worker.logprobs(policy_batch())}


def _save_then_continue(cfg, path: str) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    batch = policy_batch()
    worker.train(batch.replace(old_logprobs=worker.logprobs(batch)))
    worker.save(path)
    saved_logprobs = worker.logprobs(batch)
    next_batch = policy_batch(seed=1)
    next_metrics = worker.train(next_batch.replace(old_logprobs=worker.logprobs(next_batch)))
    return {"saved": saved_logprobs, "next": next_metrics}


def _load_then_continue(cfg, path: str) -> dict:
    return load_then_continue(0, 1, cfg, path, keep_world=True)


def _reference_and_kl(cfg) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
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


def _packed_vs_padded(cfg) -> dict:
    """Logprobs of the packed (THD) micro-batch through the TP=2 model vs the padded path.

    Megatron's local attention takes no THD boundaries; here the same packed row goes through it with
    the block-diagonal causal mask that THD boundaries mean, which checks the packing (positions,
    targets, unpacking) apart from any attention kernel. RoPE scores depend only on relative
    positions, so each sequence sees what it sees alone. (The torch layers' own THD attention is
    checked through ``PolicyWorker.train`` above.)
    """
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
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
    # The behaviour weight pi_old / pi_gen per token, masked outside [0.8, 1.25] (IcePop's band).
    "grpo_mis": (
        "grpo.off_policy_correction=mis",
        "grpo.behav_weight_cap=1.25",
        "grpo.behav_weight_floor=0.8",
    ),
}


def _one_off_policy_step_per_loss(hf_dir: str, layout: dict) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    results = {}
    for name, extra in LOSSES.items():
        cfg = policy_config(hf_dir, **layout, extra=(*layout.get("extra", ()), *extra))
        worker = PolicyWorker(cfg)
        try:
            batch = policy_batch()
            shape = (batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
            shift = 0.15 * torch.randn(*shape, generator=torch.Generator().manual_seed(3))
            # the engine's logprobs, off the old ones too: behaviour weights spread around 1
            gen_shift = 0.3 * torch.randn(*shape, generator=torch.Generator().manual_seed(4))
            old = worker.logprobs(batch)
            results[name] = worker.train(
                batch.replace(old_logprobs=old + shift, gen_logprobs=old + gen_shift)
            )
        finally:
            destroy_parallel(keep_world=True)
    return results


def _teacher_logprobs(hf_dir: str, tp: int) -> dict:
    from megagrpo.config import DistillConfig
    from megagrpo.config.teacher import teacher_config
    from megagrpo.policy.teacher import TeacherWorker

    # the student at TP 1, its teacher at TP 2 (its own layout)
    distill = DistillConfig(teacher_hf_dir=hf_dir, teacher_tensor_parallel_size=tp)
    teacher = TeacherWorker(teacher_config(dataclasses.replace(policy_config(hf_dir), distill=distill)))
    frozen = teacher.engine.optimizer is None and teacher.scheduler is None
    frozen &= not any(p.requires_grad for p in teacher.engine.module.parameters())
    return {"logprobs": teacher.logprobs(policy_batch()), "frozen": frozen, "tp": teacher.ctx.sizes.tp}


LAYOUTS = {
    "tp2-small": dict(tp=2, budget=SMALL_BUDGET),
    "tp2-large": dict(tp=2, budget=LARGE_BUDGET),
    "pp2-small": dict(pp=2, budget=SMALL_BUDGET),
    "dp2-small": dict(dp=2, budget=SMALL_BUDGET),
    "tp2-recompute-full": dict(tp=2, extra=("policy.recompute=full", "policy.recompute_num_layers=2")),
    "pp2-recompute-attn": dict(pp=2, extra=("policy.recompute=core_attention",)),
    # The torch layers pack micro-batches (THD): packed == the padded local reference.
    "tp2-sp-torch-packed": dict(
        tp=2, budget=SMALL_BUDGET, extra=(TORCH_LAYERS, "parallel.sequence_parallel=true")
    ),
    "pp2-torch-packed-recompute-attn": dict(
        pp=2, budget=SMALL_BUDGET, extra=(TORCH_LAYERS, "policy.recompute=core_attention")
    ),
}
LOSS_LAYOUTS = {
    "tp2-small": dict(tp=2, budget=SMALL_BUDGET),
    "pp2-small": dict(pp=2, budget=SMALL_BUDGET),
    "dp2-small": dict(dp=2, budget=SMALL_BUDGET),
}
RELOAD_LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2)}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("policy") / "qwen2"))


@pytest.fixture(scope="module")
def saved_ckpt(tmp_path_factory) -> Path:
    """Where the ``save`` case of ``one_rank`` writes (and the load cases read)."""
    return tmp_path_factory.mktemp("policy_ckpt") / "step"


@pytest.fixture(scope="module")
def one_rank(hf_dir, saved_ckpt) -> list[dict]:
    ckpt = str(saved_ckpt)
    cases = {
        "reference": (_one_step, policy_config(hf_dir)),
        "no_old_logprobs/tp1": (_one_step_without_old_logprobs, policy_config(hf_dir)),
        "two_steps/precomputed": (_two_steps, policy_config(hf_dir, mini=4), True),
        "two_steps/own": (_two_steps, policy_config(hf_dir, mini=4), False),
        "save": (_save_then_continue, policy_config(hf_dir), ckpt),
        "load/tp1": (_load_then_continue, policy_config(hf_dir), ckpt),
        "reference_kl": (_reference_and_kl, policy_config(hf_dir, kl=0.1)),
        "per_loss": (_one_off_policy_step_per_loss, hf_dir, {}),
    }
    return run_cases(1, cases)


@pytest.fixture(scope="module")
def two_ranks(hf_dir, saved_ckpt, one_rank) -> list[dict]:
    """Runs after ``one_rank``, whose ``save`` case wrote the checkpoint the ``load/*`` cases read."""
    ckpt = str(saved_ckpt)
    cases = {
        f"layout/{name}": (_one_step, policy_config(hf_dir, **layout)) for name, layout in LAYOUTS.items()
    }
    cases["no_old_logprobs/tp2-small"] = (
        _one_step_without_old_logprobs,
        policy_config(hf_dir, tp=2, budget=SMALL_BUDGET),
    )
    for name, layout in RELOAD_LAYOUTS.items():
        cases[f"load/{name}"] = (_load_then_continue, policy_config(hf_dir, **layout), ckpt)
    cases["packed"] = (_packed_vs_padded, policy_config(hf_dir, tp=2))
    for name, layout in LOSS_LAYOUTS.items():
        cases[f"per_loss/{name}"] = (_one_off_policy_step_per_loss, hf_dir, layout)
    cases["teacher"] = (_teacher_logprobs, hf_dir, 2)
    return run_cases(2, cases)


@pytest.fixture(scope="module")
def reference(one_rank) -> dict:
    (res,) = case(one_rank, "reference")
    return res


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_grad_norm_do_not_depend_on_layout(layout, two_ranks, reference):
    (want,) = reference["metrics"]
    extra = LAYOUTS[layout].get("extra", ())
    granularity = {"policy.recompute=full": "full", "policy.recompute=core_attention": "selective"}
    want_recompute = next((granularity[e] for e in extra if e in granularity), None)
    for res in case(two_ranks, f"layout/{layout}"):
        assert res["recompute"] == want_recompute  # the knob reached Megatron
        assert res["packed"] == (TORCH_LAYERS in extra)
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


@pytest.mark.parametrize("layout", ["tp1", "tp2-small"])
def test_one_optimizer_step_needs_no_old_logprob_pass(layout, one_rank, two_ranks, reference):
    """The driver skips the old-logprob forward when a batch gets one optimizer step: the training
    forward's detached logprobs are then the old ones, so the step equals the one given them."""
    results = case(one_rank if layout == "tp1" else two_ranks, f"no_old_logprobs/{layout}")
    (want,) = reference["metrics"]
    mask = policy_batch().response_mask()
    for res in results:
        (got,) = res["metrics"]
        assert got.ratio_min == got.ratio_max == 1.0
        assert _rel(got.loss, want.loss) <= 1e-5, (got.loss, want.loss)
        assert _rel(got.grad_norm, want.grad_norm) <= 1e-5, (got.grad_norm, want.grad_norm)
        torch.testing.assert_close(res["new"][mask], reference["new"][mask], atol=1e-4, rtol=1e-4)


def test_later_mini_batches_are_scored_before_the_first_update(one_rank):
    """Without old logprobs, train() takes the first mini-batch's from its own forward and scores the
    second before the first update: both optimizer steps equal those given precomputed old logprobs,
    and the second step's ratios are off 1 (its old logprobs are not the updated weights')."""
    (want,) = case(one_rank, "two_steps/precomputed")
    (got,) = case(one_rank, "two_steps/own")
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


@pytest.mark.parametrize("layout", ["tp1", *RELOAD_LAYOUTS])
def test_save_load_restores_logprobs_and_optimizer_at_any_layout(layout, one_rank, two_ranks, saved_ckpt):
    """Saved at TP 1 after one step, loaded at TP 1, TP 2 and PP 2: the same logprobs, and the same next
    step (Adam moments and LR schedule came back too)."""
    (saved,) = case(one_rank, "save")
    mask = policy_batch().response_mask()
    for res in case(one_rank if layout == "tp1" else two_ranks, f"load/{layout}"):
        assert res["steps"] == 1
        torch.testing.assert_close(res["loaded"][mask], saved["saved"][mask], atol=1e-5, rtol=1e-5)
        (got,), (want,) = res["next"], saved["next"]
        assert _rel(got.loss, want.loss) <= 1e-5
        assert _rel(got.grad_norm, want.grad_norm) <= 1e-4


def test_a_saved_policy_exports_to_hf(one_rank, saved_ckpt, tmp_path):
    """The model part is a regular megagrpo checkpoint: it exports to HF."""
    from megagrpo.ckpt.convert import megatron_to_hf

    case(one_rank, "save")
    out = megatron_to_hf(str(saved_ckpt), tmp_path / "hf")
    assert (Path(out) / "model.safetensors").is_file()


def test_reference_policy_stays_at_initial_weights(one_rank):
    (res,) = case(one_rank, "reference_kl")
    mask = policy_batch().response_mask()
    assert torch.equal(res["ref_before"], res["before"])
    assert torch.equal(res["ref_after"], res["before"])  # reference did not move with training
    assert not torch.equal(res["after"], res["before"])
    assert torch.equal(res["after_again"], res["after"])  # swapping back restored the trained weights
    assert mask.any()


def test_packed_micro_batch_gives_the_padded_logprobs(two_ranks):
    mask = policy_batch().response_mask()
    assert mask.any()
    for res in case(two_ranks, "packed"):
        assert res["total"] == int(policy_batch().lengths.sum())  # no padding at all
        torch.testing.assert_close(res["got"][mask], res["want"][mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", list(LOSS_LAYOUTS))
def test_every_loss_is_layout_invariant(layout, one_rank, two_ranks):
    """GSPO, GSPO-token and CISPO (and GRPO beside them, and GRPO with MIS's behaviour weights) give the same
    loss and grad norm at TP 2, PP 2 and DP 2 with many micro-batches as on one rank with one, off-policy
    (ratios != 1, some clipped; some behaviour weights masked)."""
    (per_loss_reference,) = case(one_rank, "per_loss")
    results = case(two_ranks, f"per_loss/{layout}")
    ref = {name: m for name, (m,) in per_loss_reference.items()}
    assert len({ref[name].loss for name in ("grpo", "gspo", "cispo")}) == 3, ref  # three different losses
    # GSPO-token with one advantage per sequence: GSPO's value and gradient, on the real model too
    assert _rel(ref["gspo_token"].loss, ref["gspo"].loss) <= 1e-6
    assert _rel(ref["gspo_token"].grad_norm, ref["gspo"].grad_norm) <= 1e-5
    assert 0 < ref["grpo_mis"].behav_masked_frac < 1 and _rel(ref["grpo_mis"].loss, ref["grpo"].loss) > 1e-3
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
            assert got.behav_masked_frac == want.behav_masked_frac, name


def test_teacher_scores_the_tokens_as_the_trainer_would(two_ranks, reference):
    """The teacher's frozen ranks (no gradients, no optimizer) at their own TP 2 give the logprobs the
    TP 1 trainer gives for the same model and tokens."""
    mask = policy_batch().response_mask()
    for got in case(two_ranks, "teacher"):
        assert got["frozen"] and got["tp"] == 2
        torch.testing.assert_close(got["logprobs"][mask], reference["old"][mask], atol=1e-5, rtol=1e-5)
