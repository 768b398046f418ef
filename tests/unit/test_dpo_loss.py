"""DPO / IPO losses: hand-computed values, the published formulas evaluated independently, step 0."""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.algorithms.dpo import (
    PreferenceLossConfig,
    preference_loss,
    preference_metrics,
    sequence_logps,
)

pytestmark = pytest.mark.unit


def _loss(pc, pr, rc, rr, **cfg) -> torch.Tensor:
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    out = preference_loss(t(pc), t(pr), t(rc), t(rr), PreferenceLossConfig(**cfg))
    return out


def test_sigmoid_and_ipo_by_hand():
    # One pair: policy logps chosen -3, rejected -5; reference -4, -4 -> h = (1) - (-1) = 2.
    out = _loss([-3.0], [-5.0], [-4.0], [-4.0], beta=0.5)
    # -log sigmoid(0.5 * 2) = log(1 + e^-1)
    assert float(out.loss_sum) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-12)
    assert int(out.count) == 1
    smoothed = _loss([-3.0], [-5.0], [-4.0], [-4.0], beta=0.5, label_smoothing=0.25)
    want = 0.75 * math.log(1 + math.exp(-1)) + 0.25 * math.log(1 + math.exp(1))
    assert float(smoothed.loss_sum) == pytest.approx(want, abs=1e-12)
    ipo = _loss([-3.0], [-5.0], [-4.0], [-4.0], beta=0.5, loss="ipo")
    assert float(ipo.loss_sum) == pytest.approx((2 - 1) ** 2, abs=1e-12)  # (h - 1/(2*0.5))^2
    m = preference_metrics({k: float(v) for k, v in out.metrics.items()})
    assert m["chosen_reward_mean"] == pytest.approx(0.5) and m["rejected_reward_mean"] == pytest.approx(-0.5)
    assert m["margin_mean"] == pytest.approx(1.0) and m["accuracy"] == 1.0
    assert m["chosen_logp_mean"] == -3.0 and m["rejected_logp_mean"] == -5.0


def _published_dpo(pc, pr, rc, rr, beta, eps):
    """Rafailov et al. eq. 7 with conservative label smoothing, element by element in Python floats."""
    out = []
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True):
        z = beta * ((a - c) - (b - d))
        sig = 1 / (1 + math.exp(-z))
        out.append(-(1 - eps) * math.log(sig) - eps * math.log(1 - sig))
    return sum(out)


def _published_ipo(pc, pr, rc, rr, tau):
    """Azar et al. eq. 17: (h - 1/(2 tau))^2 per pair."""
    return sum(
        (((a - c) - (b - d)) - 1 / (2 * tau)) ** 2
        for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_losses_match_the_published_formulas_on_random_pairs(seed):
    gen = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-10 * torch.rand(16, generator=gen, dtype=torch.float64) for _ in range(4))
    for beta, eps in ((0.1, 0.0), (0.5, 0.1), (2.0, 0.3)):
        cfg = PreferenceLossConfig(beta=beta, label_smoothing=eps)
        got = float(preference_loss(pc, pr, rc, rr, cfg).loss_sum)
        assert got == pytest.approx(_published_dpo(pc, pr, rc, rr, beta, eps), rel=1e-8, abs=1e-8)
        ipo = float(preference_loss(pc, pr, rc, rr, PreferenceLossConfig(loss="ipo", beta=beta)).loss_sum)
        assert ipo == pytest.approx(_published_ipo(pc, pr, rc, rr, beta), rel=1e-8, abs=1e-8)


def test_gradient_of_the_sigmoid_loss_is_the_published_one():
    # d/d logp_chosen of -log sigmoid(beta h) = -beta sigmoid(-beta h)
    pc = torch.tensor([-2.0, -1.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-3.0, -0.5], dtype=torch.float64, requires_grad=True)
    rc, rr = torch.tensor([-2.5, -1.5], dtype=torch.float64), torch.tensor([-2.0, -1.0], dtype=torch.float64)
    preference_loss(pc, pr, rc, rr, PreferenceLossConfig(beta=0.3)).loss_sum.backward()
    h = (pc - rc) - (pr - rr)
    want = -0.3 * torch.sigmoid(-0.3 * h.detach())
    torch.testing.assert_close(pc.grad, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pr.grad, -want, rtol=1e-12, atol=1e-12)


def test_step_zero_margin_is_zero_and_sigmoid_loss_is_log2():
    gen = torch.Generator().manual_seed(3)
    pc, pr = -5 * torch.rand(8, generator=gen), -5 * torch.rand(8, generator=gen)
    out = preference_loss(pc, pr, pc.clone(), pr.clone(), PreferenceLossConfig(beta=0.2))
    assert torch.equal(out.metrics["margin_sum"], torch.zeros((), dtype=torch.float64))
    assert float(out.loss_sum) / int(out.count) == pytest.approx(math.log(2), rel=1e-7)
    assert float(out.metrics["accuracy_sum"]) == 0.0  # a tie is not a right preference


def test_sequence_logps_sum_and_length_normalised():
    lp = torch.tensor([[-1.0, -2.0, float("nan"), -4.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False, True], [False, False, False, False]])
    torch.testing.assert_close(sequence_logps(lp, mask, length_normalize=False), torch.tensor([-7.0, 0.0]))
    torch.testing.assert_close(sequence_logps(lp, mask, length_normalize=True), torch.tensor([-7.0 / 3, 0.0]))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"\[P\]"):
        preference_loss(
            torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2), PreferenceLossConfig()
        )
    with pytest.raises(ValueError, match="label_smoothing"):
        PreferenceLossConfig(label_smoothing=0.5)


def test_nll_term_adds_the_chosen_mean_nll():
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    nll = t([0.5, 2.0]).requires_grad_()
    args = (t([-3.0, -1.0]), t([-5.0, -2.0]), t([-4.0, -1.0]), t([-4.0, -2.0]))
    plain = preference_loss(*args, PreferenceLossConfig(beta=0.5), chosen_nll=nll)
    with_nll = preference_loss(*args, PreferenceLossConfig(beta=0.5, nll_weight=0.3), chosen_nll=nll)
    assert float(with_nll.loss_sum) == pytest.approx(float(plain.loss_sum) + 0.3 * 2.5, abs=1e-12)
    assert float(with_nll.metrics["chosen_nll_sum"]) == 2.5
    with_nll.loss_sum.backward()
    torch.testing.assert_close(nll.grad, t([0.3, 0.3]))
    with pytest.raises(ValueError, match="chosen_nll"):
        preference_loss(*args, PreferenceLossConfig(nll_weight=0.3))
