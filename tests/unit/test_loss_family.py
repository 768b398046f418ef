"""GSPO, GSPO-token, CISPO and REINFORCE++ against their papers: hand-computed values and gradients in
float64, and the identities that must hold between them."""

import math

import pytest
import torch

from megagrpo.algorithms.grpo import LossConfig, group_advantages, grpo_loss
from megagrpo.algorithms.surrogates import sequence_log_ratio

pytestmark = pytest.mark.unit

LOG = math.log


def t(x):
    return torch.as_tensor(x, dtype=torch.float64)


def loss_and_grad(cfg, logprobs, old, adv, mask, **kw):
    lp = t(logprobs).requires_grad_()
    out = grpo_loss(lp, t(old), t(adv), t(mask), cfg, **kw)
    loss = out.loss_sum / out.count
    loss.backward()
    return loss.item(), lp.grad, out


# Two sequences: the first has 2 response tokens with ratios 1.2 and 1.5, the second 3 tokens (one masked
# position at the end of the row) with ratios 0.5, 0.8 and 1.0.
LP = [[LOG(1.2), LOG(1.5), 0.0, 0.0], [LOG(0.5), LOG(0.8), 0.0, 0.0]]
OLD = [[0.0] * 4, [0.0] * 4]
MASK = [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
S1 = math.sqrt(1.2 * 1.5)  # GSPO: geometric mean of the token ratios = 1.3416
S2 = (0.5 * 0.8 * 1.0) ** (1 / 3)  # 0.7368


def test_sequence_ratio_is_the_geometric_mean_over_valid_tokens():
    log_s = sequence_log_ratio(t(LP), t(OLD), t(MASK).bool())
    torch.testing.assert_close(log_s.exp(), t([S1, S2]))
    # a sequence without valid tokens: log-ratio 0 (it adds nothing to the loss anyway)
    assert sequence_log_ratio(t([[3.0]]), t([[0.0]]), t([[0.0]]).bool()).item() == 0.0


def test_gspo_values_and_gradients_by_hand():
    cfg = LossConfig(loss="gspo", clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="sequence")
    # A = +1 for sequence 1: s1 = 1.342 > 1.2 -> clipped, loss -1.2, no gradient.
    # A = -1 for sequence 2: s2 = 0.737 < 0.8 -> max(s2, 0.8) = 0.8 is the clipped branch, no gradient.
    loss, grad, out = loss_and_grad(cfg, LP, OLD, [1.0, -1.0], MASK)
    assert loss == pytest.approx((-1.2 + 0.8) / 2, rel=1e-12)
    assert grad.abs().sum().item() == 0.0
    assert out.metrics["clip_high_count"].item() == 2 and out.metrics["clip_low_count"].item() == 3

    # The other signs: sequence 1 with A = -1 keeps s1 (max(s1, 1.2) = s1): loss s1, d/d lp_t = s1 / 2.
    # Sequence 2 with A = +1: max(-s2, -0.8) = -s2 (unclipped): loss -s2, d/d lp_t = -s2 / 3.
    loss, grad, out = loss_and_grad(cfg, LP, OLD, [-1.0, 1.0], MASK)
    assert loss == pytest.approx((S1 - S2) / 2, rel=1e-12)
    # the loss is the mean over the 2 sequences: each gradient carries 1/2
    want = t([[S1 / 2, S1 / 2, 0, 0], [-S2 / 3, -S2 / 3, -S2 / 3, 0]]) / 2
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
    assert out.count.item() == 2
    assert out.metrics["clip_high_count"].item() == 0 and out.metrics["clip_low_count"].item() == 0
    # the ratio metrics report the sequence's ratio on each token
    assert out.metrics["ratio_max"].item() == pytest.approx(S1) and out.metrics[
        "ratio_min"
    ].item() == pytest.approx(S2)


def test_gspo_ratio_is_one_on_policy_and_its_gradient_the_sequence_mean_of_token_gradients():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    adv = t([0.7, -1.3, 0.4])
    cfg = LossConfig(loss="gspo", loss_agg="sequence")
    loss, grad, out = loss_and_grad(cfg, lp.tolist(), lp.tolist(), adv.tolist(), mask)
    assert out.metrics["ratio_min"].item() == 1.0 and out.metrics["ratio_max"].item() == 1.0
    # s = 1: the loss is -mean_i A_i and d/d lp_i,t = -A_i / (|y_i| * num_sequences)
    assert loss == pytest.approx(-adv.mean().item(), rel=1e-12)
    want = -adv[:, None] * mask / mask.sum(dim=1, keepdim=True) / 3
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)


def test_gspo_token_has_gspos_value_and_gradient_when_token_advantages_are_equal():
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float64)
    lp = old + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=gen) < 0.8).double()
    mask[:, 0] = 1
    adv = t([1.0, -0.5, 2.0, -1.5])
    results = {}
    for loss_name in ("gspo", "gspo_token"):
        cfg = LossConfig(loss=loss_name, clip_eps_low=0.1, clip_eps_high=0.1, loss_agg="sequence")
        results[loss_name] = loss_and_grad(cfg, lp.tolist(), old.tolist(), adv.tolist(), mask)
    (l_seq, g_seq, o_seq), (l_tok, g_tok, o_tok) = results["gspo"], results["gspo_token"]
    assert l_tok == pytest.approx(l_seq, rel=1e-12)
    torch.testing.assert_close(g_tok, g_seq, rtol=1e-12, atol=1e-15)
    assert g_seq.abs().sum() > 0  # some sequences are inside the clip range
    for key in ("clip_low_count", "clip_high_count", "ratio_sum"):
        assert o_tok.metrics[key].item() == pytest.approx(o_seq.metrics[key].item(), rel=1e-12)


def test_gspo_token_with_per_token_advantages_weights_each_token_by_its_own():
    """GSPO-token's point: token advantages A_t give d/d lp_t = -A_t s / |y| (unclipped), which GSPO's
    single sequence ratio cannot express."""
    from megagrpo.algorithms.surrogates import gspo_token

    lp = t([[LOG(1.05), LOG(0.98)]]).requires_grad_()
    s = math.sqrt(1.05 * 0.98)
    adv = t([[2.0, -1.0]])
    sur = gspo_token(lp, t([[0.0, 0.0]]), adv, t([[1, 1]]).bool(), clip_eps_low=0.2, clip_eps_high=0.2)
    (sur.pg_BT.sum() / 2).backward()
    torch.testing.assert_close(lp.grad, t([[-2.0 * s / 2, 1.0 * s / 2]]), rtol=1e-12, atol=0)


def test_cispo_values_and_gradients_by_hand():
    # One sequence, tokens with ratios 1.5 (above 1 + 0.2: weight 1.2), 0.9 (weight 0.9), 0.5 (below
    # 1 - 0.2: weight 0.8); A = 2. Per token: -A * w * lp; the gradient keeps flowing through every token
    # (the weight is a constant): d/d lp_t = -A * w_t / 3 tokens.
    lp = [[LOG(1.5) - 1.0, LOG(0.9) - 2.0, LOG(0.5) - 0.5]]
    old = [[-1.0, -2.0, -0.5]]
    cfg = LossConfig(loss="cispo", clip_eps_low=0.2, clip_eps_high=0.2)
    loss, grad, out = loss_and_grad(cfg, lp, old, [2.0], [[1.0, 1.0, 1.0]])
    w = [1.2, 0.9, 0.8]
    assert loss == pytest.approx(sum(-2.0 * wi * li for wi, li in zip(w, lp[0], strict=True)) / 3, rel=1e-12)
    torch.testing.assert_close(grad, t([[-2.0 * wi / 3 for wi in w]]), rtol=1e-12, atol=0)
    # clipped whatever the advantage's sign: one token above, one below
    assert out.metrics["clip_high_count"].item() == 1 and out.metrics["clip_low_count"].item() == 1
    # a negative advantage: PPO would zero the gradient of the 0.5-ratio token; CISPO keeps it, weighted 0.8
    _, grad_neg, _ = loss_and_grad(cfg, lp, old, [-2.0], [[1.0, 1.0, 1.0]])
    torch.testing.assert_close(grad_neg, -grad, rtol=1e-12, atol=0)
    _, grad_ppo, _ = loss_and_grad(LossConfig(), lp, old, [-2.0], [[1.0, 1.0, 1.0]])
    assert grad_ppo[0, 2].item() == 0.0 and grad_neg[0, 2].item() != 0.0


def test_cispo_with_an_infinite_clip_is_importance_weighted_reinforce():
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 2
    lp = old + 0.5 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = t([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    adv = t([1.5, -0.7, 0.3])
    cfg = LossConfig(loss="cispo", clip_eps_low=1.0, clip_eps_high=math.inf)
    _, grad, out = loss_and_grad(cfg, lp.tolist(), old.tolist(), adv.tolist(), mask)
    assert out.metrics["clip_low_count"].item() == 0 and out.metrics["clip_high_count"].item() == 0
    # plain importance-weighted REINFORCE: loss -A r per token, d/d lp = -A r (the gradient of r is r grad lp)
    x = lp.clone().requires_grad_()
    ratio = torch.exp(x - old)
    (torch.where(mask.bool(), -adv[:, None] * ratio, 0.0).sum() / mask.sum()).backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-15)
    # ... which is PPO's clipped surrogate with the clip out of reach
    _, grad_ppo, _ = loss_and_grad(
        LossConfig(clip_eps_low=0.999999, clip_eps_high=1e9), lp.tolist(), old.tolist(), adv.tolist(), mask
    )
    torch.testing.assert_close(grad, grad_ppo, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_name", ["gspo", "gspo_token", "cispo"])
def test_masked_positions_contribute_nothing_whatever_they_hold(loss_name):
    agg = "token" if loss_name == "cispo" else "sequence"
    cfg = LossConfig(loss=loss_name, loss_agg=agg)
    lp = [[LOG(1.1), -math.inf], [LOG(0.95), math.nan]]
    old = [[0.0, math.nan], [0.0, -math.inf]]
    loss, grad, _ = loss_and_grad(cfg, lp, old, [1.0, -1.0], [[1.0, 0.0], [1.0, 0.0]])
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[:, 1].abs().sum().item() == 0.0


@pytest.mark.parametrize("loss_name", ["gspo", "gspo_token", "cispo"])
def test_kl_term_adds_to_each_loss_as_for_grpo(loss_name):
    agg = "token" if loss_name == "cispo" else "sequence"
    lp, old, ref = [[-0.5, -1.0]], [[-0.5, -1.0]], [[-0.7, -0.6]]
    plain = loss_and_grad(LossConfig(loss=loss_name, loss_agg=agg), lp, old, [1.0], [[1.0, 1.0]])[0]
    cfg = LossConfig(loss=loss_name, loss_agg=agg, kl_coef=0.5, kl_estimator="k1")
    with_kl = loss_and_grad(cfg, lp, old, [1.0], [[1.0, 1.0]], ref_logprobs=t(ref))[0]
    # k1 = lp - ref per token: 0.2 and -0.4, mean -0.1; times 0.5
    assert with_kl - plain == pytest.approx(0.5 * -0.1, rel=1e-9)


# ---------------------------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_normalises_over_the_whole_batch():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)  # two groups of 2
    # batch mean 0.75; centred [0.25, -0.75, 0.25, 0.25]; unbiased std sqrt(0.75 / 3) = 0.5
    adv = group_advantages(rewards, 2, baseline="reinforce_pp", eps=0.0)
    torch.testing.assert_close(adv, t([0.5, -1.5, 0.5, 0.5]), rtol=1e-12, atol=0)
    # the flat second group keeps a signal: above the batch mean
    plain = group_advantages(rewards, 2, baseline="reinforce_pp", normalize_std=False)
    torch.testing.assert_close(plain, t([0.25, -0.75, 0.25, 0.25]), rtol=1e-12, atol=0)
    # a batch of equal rewards: no signal at all
    assert group_advantages(torch.full((4,), 0.3), 2, baseline="reinforce_pp").abs().sum().item() == 0.0


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_divides_by_the_batch_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)  # groups of 4
    # group 1: mean 1/4 -> [0.75, -0.25, -0.25, -0.25]; group 2 flat -> 0
    centred = t([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    assert centred.mean().item() == 0.0
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 7)  # unbiased, over the 8 responses
    adv = group_advantages(rewards, 4, baseline="reinforce_pp_baseline", eps=0.0)
    torch.testing.assert_close(adv, centred / std, rtol=1e-12, atol=0)
    assert adv[4:].abs().sum().item() == 0.0  # a flat group stays at exactly 0
    # GRPO divides group 1 by its own std (0.5) instead: the batch std is what differs
    grpo = group_advantages(rewards, 4, baseline="mean", eps=0.0)
    assert grpo[0].item() == pytest.approx(1.5) and adv[0].item() == pytest.approx(0.75 / std)
    unnormalised = group_advantages(rewards, 4, baseline="reinforce_pp_baseline", normalize_std=False)
    torch.testing.assert_close(
        unnormalised, group_advantages(rewards, 4, baseline="mean", normalize_std=False)
    )
