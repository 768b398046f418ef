import dataclasses
import itertools
import math

import pytest
import torch

from megagrpo.algorithms.grpo import (
    METRIC_REDUCTIONS,
    LossConfig,
    combine_metrics,
    group_advantages,
    grpo_loss,
    kl_estimate,
    reduce_metrics,
    zero_variance_groups,
)

pytestmark = pytest.mark.unit

LOG = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def final(out):
    return out.loss_sum / out.count


def one_token(ratio, adv, cfg, **kw):
    """Loss and d loss / d logprob of a single token with old logprob 0."""
    lp = t([[LOG(ratio)]]).requires_grad_()
    out = grpo_loss(lp, t([[0.0]]), t(adv), t([[1.0]]), cfg, **kw)
    final(out).backward()
    return final(out).item(), lp.grad.item(), out.metrics


# ---------------------------------------------------------------------------------------------- advantages


def test_group_mean_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # group 1: mean 1/4, A = 3/4 or -1/4; group 2: mean 1/2, A = +-1/2 (Dr. GRPO: no std)
    plain = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    dr_grpo = group_advantages(rewards, 4, baseline="mean", normalize_std=False)
    torch.testing.assert_close(dr_grpo, torch.tensor(plain))
    # unbiased stds: [1,0,0,0] -> sqrt(0.75 / 3) = 0.5; [1,1,0,0] -> sqrt(1 / 3)
    std = torch.tensor([0.5] * 4 + [math.sqrt(1 / 3)] * 4)
    grpo = group_advantages(rewards, 4, eps=0.0)  # the default baseline is the group mean (GRPO)
    torch.testing.assert_close(grpo, torch.tensor(plain) / std)
    # group 1 by hand: (1 - 0.25) / 0.5 = 1.5 and (0 - 0.25) / 0.5 = -0.5
    assert grpo[:4].tolist() == [1.5, -0.5, -0.5, -0.5]
    torch.testing.assert_close(group_advantages(rewards, 4, eps=0.5), torch.tensor(plain) / (std + 0.5))


def test_leave_one_out_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # group 1: A_0 = 1 - 0, A_j = 0 - 1/3; group 2: A = 1 - 1/3 = 2/3 or 0 - 2/3
    plain = [1, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3]
    rloo = group_advantages(rewards, 4, baseline="leave_one_out", normalize_std=False)
    torch.testing.assert_close(rloo, torch.tensor(plain))
    std = torch.tensor([0.5] * 4 + [math.sqrt(1 / 3)] * 4)
    normalized = group_advantages(rewards, 4, baseline="leave_one_out", eps=0.0)
    torch.testing.assert_close(normalized, torch.tensor(plain) / std)
    with_eps = group_advantages(rewards, 4, baseline="leave_one_out", eps=0.5)
    torch.testing.assert_close(with_eps, torch.tensor(plain) / (std + 0.5))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_leave_one_out_is_g_over_g_minus_one_times_group_mean(normalize_std):
    g = 5
    rewards = torch.rand(3 * g, generator=torch.Generator().manual_seed(0))
    mean = group_advantages(rewards, g, baseline="mean", normalize_std=normalize_std)
    loo = group_advantages(rewards, g, baseline="leave_one_out", normalize_std=normalize_std)
    torch.testing.assert_close(loo, g / (g - 1) * mean)
    assert not torch.allclose(loo, mean)


def test_zero_variance_group_gives_exact_zeros():
    # 0.1 * 3 is not exactly 0.3 in floating point: the residue must not be amplified by 1 / eps
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.25, 7.0, 7.0, 7.0])
    for baseline, normalize_std in itertools.product(("mean", "leave_one_out"), (True, False)):
        adv = group_advantages(rewards, 3, baseline=baseline, normalize_std=normalize_std)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:3], torch.zeros(3)) and torch.equal(adv[6:], torch.zeros(3))
        assert (adv[3:6] != 0).all()
    assert zero_variance_groups(rewards, 3).tolist() == [True, False, True]


def test_advantage_input_errors():
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="num_generations=3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="baseline must be"):
        group_advantages(torch.zeros(4), 2, baseline="median")


# ---------------------------------------------------------------------------------------------- clipping


def test_on_policy_loss_is_minus_advantage_and_nothing_is_clipped():
    torch.manual_seed(0)
    old = -torch.rand(2, 5, dtype=torch.float64) * 3
    lp = old.clone().requires_grad_()
    out = grpo_loss(lp, old, t([1.0, -2.0]), torch.ones(2, 5), LossConfig())
    assert out.count.item() == 10 and out.count.dtype == torch.int64
    torch.testing.assert_close(out.loss_sum, t(-1.0 * 5 + 2.0 * 5))
    m = out.metrics
    assert m["clip_low_count"] == 0 and m["clip_high_count"] == 0 and m["dual_clip_count"] == 0
    assert m["ratio_sum"] == 10 and m["ratio_min"] == 1 and m["ratio_max"] == 1


def test_asymmetric_clip_high():
    # ratio 1.25, A > 0: clipped at 1 + 0.2 (loss -1.2, no gradient), not at 1 + 0.28
    loss, grad, m = one_token(1.25, [1.0], LossConfig(clip_eps_high=0.2))
    assert loss == pytest.approx(-1.2) and grad == 0 and m["clip_high_count"] == 1
    loss, grad, m = one_token(1.25, [1.0], LossConfig(clip_eps_high=0.28))
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25) and m["clip_high_count"] == 0
    # the high bound never clips a negative advantage: loss A r = 1.25 (pessimistic max)
    loss, grad, m = one_token(1.25, [-1.0], LossConfig(clip_eps_high=0.2))
    assert loss == pytest.approx(1.25) and grad == pytest.approx(1.25) and m["clip_high_count"] == 0


def test_clip_low():
    # ratio 0.75, A < 0: max(0.75, 0.8) = 0.8, clipped; with eps_low 0.3 it is not
    loss, grad, m = one_token(0.75, [-1.0], LossConfig(clip_eps_low=0.2))
    assert loss == pytest.approx(0.8) and grad == 0 and m["clip_low_count"] == 1
    loss, grad, m = one_token(0.75, [-1.0], LossConfig(clip_eps_low=0.3))
    assert loss == pytest.approx(0.75) and grad == pytest.approx(0.75) and m["clip_low_count"] == 0
    # A > 0 below the low bound is not clipped
    loss, grad, m = one_token(0.75, [1.0], LossConfig(clip_eps_low=0.2))
    assert loss == pytest.approx(-0.75) and grad == pytest.approx(-0.75) and m["clip_low_count"] == 0


def test_dual_clip_bounds_negative_advantage_loss():
    cfg = LossConfig(dual_clip=3.0)
    loss, grad, m = one_token(4.0, [-1.0], cfg)  # unbounded loss would be 4
    assert loss == pytest.approx(3.0) and grad == 0 and m["dual_clip_count"] == 1
    loss, grad, m = one_token(2.0, [-1.0], cfg)  # below c: plain -A r
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and m["dual_clip_count"] == 0
    loss, _, m = one_token(4.0, [1.0], cfg)  # positive advantages are untouched: clipped at 1.2
    assert loss == pytest.approx(-1.2) and m["dual_clip_count"] == 0
    loss, _, _ = one_token(4.0, [-1.0], LossConfig())
    assert loss == pytest.approx(4.0)


# ---------------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    d = t([LOG(2), -LOG(2), 0.0])
    ref = torch.zeros(3, dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(d, ref, "k1", 10.0), d)
    torch.testing.assert_close(kl_estimate(d, ref, "k2", 10.0), 0.5 * d**2)
    # exp(-d) - 1 + d: 1/2 - 1 + log 2 and 2 - 1 - log 2
    torch.testing.assert_close(kl_estimate(d, ref, "k3", 10.0), t([LOG(2) - 0.5, 1 - LOG(2), 0.0]))


def test_kl_clamp_and_no_nan_gradient_far_off_policy():
    d = t([5.0, -5.0, -200.0]).requires_grad_()
    ref = torch.zeros(3, dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(d, ref, "k1", 2.0), t([2.0, -2.0, -2.0]))
    torch.testing.assert_close(kl_estimate(d, ref, "k2", 2.0), t([2.0, 2.0, 2.0]))
    k3 = kl_estimate(d.float(), ref.float(), "k3", 2.0)  # exp(200) overflows fp32 without care
    torch.testing.assert_close(k3, torch.tensor([2.0, 2.0, 2.0]))
    k3.sum().backward()
    assert torch.equal(d.grad, torch.zeros(3, dtype=torch.float64))


def test_kl_penalty_in_loss():
    cfg = LossConfig(kl_coef=0.5, kl_estimator="k3")
    old = t([[-1.0, -2.0]])
    out = grpo_loss(old, old, t([1.0]), torch.ones(1, 2), cfg, ref_logprobs=old - LOG(2))
    k3 = LOG(2) - 0.5
    torch.testing.assert_close(final(out), t(-1.0 + 0.5 * k3))
    assert out.metrics["kl_sum"].item() == pytest.approx(2 * k3)
    with pytest.raises(ValueError, match="kl_coef"):
        grpo_loss(old, old, t([1.0]), torch.ones(1, 2), cfg)


# ---------------------------------------------------------------------------------------------- TIS


@pytest.mark.parametrize(
    ("correction", "weights", "counted"),
    [
        ("tis", [2.0, 1.25], "behav_truncated_count"),
        ("mis", [0.0, 1.25], "behav_masked_count"),
        ("decoupled_ppo", [4.0, 1.25], None),
        ("none", [1.0, 1.0], None),
    ],
)
def test_behaviour_weight_corrections(correction, weights, counted):
    # w = exp(old - gen): 4 (over the cap of 2) and 1.25
    old = t([[0.0, 0.0]])
    gen = t([[LOG(0.25), LOG(0.8)]])
    cap = 2.0 if correction in ("tis", "mis") else None
    cfg = LossConfig(off_policy_correction=correction, behav_weight_cap=cap)
    out = grpo_loss(old, old, t([1.0]), torch.ones(1, 2), cfg, gen_logprobs=gen)
    torch.testing.assert_close(out.loss_sum, t(-sum(weights)))
    assert out.count.item() == 2  # a masked-out token still counts in the normalizer
    if counted is not None:
        assert out.metrics[counted] == 1
    if correction != "none":
        assert out.metrics["behav_weight_sum"].item() == pytest.approx(sum(weights))
    assert out.metrics["behav_ratio_min"].item() == pytest.approx(1.25)
    assert out.metrics["behav_ratio_max"].item() == pytest.approx(4.0)
    assert out.metrics["token_mult_prob_error_sum"].item() == pytest.approx(4 + 1.25)
    if correction != "none":
        with pytest.raises(ValueError, match="gen_logprobs"):
            grpo_loss(old, old, t([1.0]), torch.ones(1, 2), cfg)


# ---------------------------------------------------------------------------------------------- aggregation


def test_token_and_sequence_aggregation_by_hand():
    old = torch.zeros(3, 3, dtype=torch.float64)
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # per-token losses -1 x3, +2 x1; last row empty
    adv = t([1.0, -2.0, 5.0])
    tok = grpo_loss(old, old, adv, mask, LossConfig(loss_agg="token"))
    assert tok.loss_sum.item() == pytest.approx(-1.0) and tok.count.item() == 4
    seq = grpo_loss(old, old, adv, mask, LossConfig(loss_agg="sequence"))
    assert seq.loss_sum.item() == pytest.approx(-1.0 + 2.0) and seq.count.item() == 2
    assert seq.metrics["sequences"] == 2 and seq.metrics["tokens"] == 4


def random_batch(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    lp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some tokens get clipped
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    mask[2] = 0  # a sequence without valid tokens
    return dict(
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.randn(B, generator=g, dtype=torch.float64),
        mask=mask,
        ref_logprobs=old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        gen_logprobs=old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64),
        entropy=torch.rand(B, T, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_micro_batch_split_gives_the_same_loss_grads_and_metrics(loss_agg):
    cfg = LossConfig(
        loss_agg=loss_agg,
        clip_eps_high=0.28,
        dual_clip=3.0,
        kl_coef=0.1,
        off_policy_correction="tis",
        behav_weight_cap=1.5,
    )
    batch = random_batch(0)
    lp = batch.pop("logprobs").requires_grad_()

    whole = grpo_loss(lp, cfg=cfg, **batch)
    final(whole).backward()
    grad_whole, lp.grad = lp.grad, None

    parts = [
        grpo_loss(lp[s], cfg=cfg, **{k: v[s] for k, v in batch.items()}) for s in (slice(0, 2), slice(2, 5))
    ]
    loss_split = sum(p.loss_sum for p in parts) / sum(p.count for p in parts)
    loss_split.backward()

    torch.testing.assert_close(loss_split, final(whole))
    torch.testing.assert_close(lp.grad, grad_whole)
    combined = combine_metrics([p.metrics for p in parts])
    assert combined.keys() == whole.metrics.keys()
    for key in combined:
        torch.testing.assert_close(combined[key], whole.metrics[key])


def test_masked_garbage_gives_finite_loss_and_zero_grads():
    batch = random_batch(1)
    masked = batch["mask"] == 0
    lp = batch.pop("logprobs").masked_fill(masked, -math.inf).requires_grad_()
    batch["old_logprobs"] = batch["old_logprobs"].masked_fill(masked, math.nan)
    for key in ("ref_logprobs", "gen_logprobs", "entropy"):
        batch[key] = batch[key].masked_fill(masked, -math.inf)
    cfg = LossConfig(kl_coef=0.1, dual_clip=2.0, off_policy_correction="mis", behav_weight_cap=1.5)
    for loss_agg in ("token", "sequence"):
        out = grpo_loss(lp, cfg=dataclasses.replace(cfg, loss_agg=loss_agg), **batch)
        final(out).backward()
        assert torch.isfinite(out.loss_sum) and torch.isfinite(lp.grad).all()
        assert torch.equal(lp.grad[masked], torch.zeros(int(masked.sum()), dtype=torch.float64))
        assert (lp.grad[~masked] != 0).any()
        assert all(torch.isfinite(v) for v in out.metrics.values())
        lp.grad = None


def test_gradient_matches_hand_derivation():
    delta = t([[0.1, -0.1, 0.05, 0.0]])  # ratios inside [0.8, 1.2]: nothing clipped
    old = t([[-1.0, -2.0, -0.5, -3.0]])
    mask = t([[1, 1, 1, 0]])
    lp = (old + delta).requires_grad_()
    A, c = 2.0, 0.3
    cfg = LossConfig(kl_coef=c, kl_estimator="k3")
    ref = old  # d = delta; d k3 / d lp = 1 - exp(-d)
    final(grpo_loss(lp, old, t([A]), mask, cfg, ref_logprobs=ref)).backward()
    expected = (-A * delta.exp() + c * (1 - torch.exp(-delta))) / 3 * mask
    torch.testing.assert_close(lp.grad, expected)

    lp.grad = None
    two = torch.stack([lp.squeeze(0), old.squeeze(0)])  # second sequence: 2 tokens, on policy
    out = grpo_loss(
        two,
        torch.cat([old, old]),
        t([A, -1.0]),
        t([[1, 1, 1, 0], [1, 1, 0, 0]]),
        LossConfig(loss_agg="sequence"),
    )
    final(out).backward()  # sequence mode: -A r_t / (tokens of its sequence) / sequences
    torch.testing.assert_close(lp.grad, -A * delta.exp() / 3 / 2 * mask)


# ---------------------------------------------------------------------------------------------- metrics


def test_metric_sums_and_extremes():
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = t([[LOG(0.5), 0.0, LOG(1.5), LOG(100.0)]])  # the last token is masked: ignored by min/max/sums
    entropy = t([[0.1, 0.2, 0.3, 50.0]])
    out = grpo_loss(lp, old, t([-1.0]), t([[1, 1, 1, 0]]), LossConfig(), entropy=entropy)
    m = out.metrics
    assert m["tokens"] == 3 and m["sequences"] == 1
    assert m["ratio_sum"].item() == pytest.approx(3.0)
    assert m["ratio_min"].item() == pytest.approx(0.5) and m["ratio_max"].item() == pytest.approx(1.5)
    assert m["clip_low_count"] == 1 and m["clip_high_count"] == 0  # 0.5 < 0.8 with A < 0
    assert m["pg_loss_sum"].item() == pytest.approx(0.8 + 1.0 + 1.5)
    assert m["entropy_sum"].item() == pytest.approx(0.6)
    assert all(v.dtype == torch.float64 and v.dim() == 0 and not v.requires_grad for v in m.values())
    assert set(m) <= set(METRIC_REDUCTIONS)
    keys = set()
    for correction in ("tis", "mis"):
        cfg = LossConfig(off_policy_correction=correction, behav_weight_cap=2.0)
        keys |= set(grpo_loss(lp, old, t([-1.0]), t([[1, 1, 1, 0]]), cfg, **random_batch_extras()).metrics)
    assert keys == set(METRIC_REDUCTIONS)


def random_batch_extras():
    z = torch.zeros(1, 4, dtype=torch.float64)
    return dict(ref_logprobs=z, gen_logprobs=z, entropy=z)


def test_reduce_metrics():
    a = {"tokens": 2.0, "pg_loss_sum": 1.0, "clip_low_count": 1.0, "ratio_min": 0.5, "ratio_max": 1.2}
    b = {"tokens": 6.0, "pg_loss_sum": 3.0, "clip_low_count": 1.0, "ratio_min": 0.9, "ratio_max": 2.0}
    b = {k: torch.tensor(v, dtype=torch.float64) for k, v in b.items()}
    assert reduce_metrics([a, b]) == {
        "tokens": 8.0,
        "pg_loss_mean": 0.5,
        "clip_low_frac": 0.25,
        "ratio_min": 0.5,
        "ratio_max": 2.0,
    }
    assert math.isnan(reduce_metrics([{"tokens": 0.0, "kl_sum": 0.0}])["kl_mean"])
    with pytest.raises(ValueError, match="unknown metric 'loss'"):
        reduce_metrics([{"loss": 1.0}])


# ---------------------------------------------------------------------------------------------- validation
# The knobs a run sets are grpo.* config keys, checked at load: tests/unit/test_config.py
# (test_loss_knobs_are_checked_at_load). LossConfig checks kl_clamp again for direct callers.


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kl_clamp", 0.0),
        ("kl_clamp", math.inf),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"LossConfig\.{field} must be"):
        LossConfig(**{field: value})


def test_shape_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(x, x, torch.zeros(3), x, LossConfig())
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(x, x, torch.zeros(2), torch.zeros(2, 4), LossConfig())
