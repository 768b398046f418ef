"""Off-policy correction (``megagrpo.algorithms.off_policy``): the behaviour weight of tokens sampled by
several policy versions, worked out by hand; per-sample staleness and the group drop rule; per-token
versions on completions (and checkpoints written before they existed); the config's checks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megagrpo.algorithms.grpo import LossConfig, grpo_loss
from megagrpo.algorithms.off_policy import behaviour_weight, judge_staleness
from megagrpo.ckpt import CheckpointError
from megagrpo.config import ConfigError, load_config
from megagrpo.data.prompts import Prompt
from megagrpo.trainers.rollouts import Pending, Rollouts, staleness_metrics
from megagrpo.types import Completion

pytestmark = pytest.mark.unit

LOG = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float64)


# One response of three tokens, sampled while the engine's weights moved from version 3 to 5 (weights
# swapped into the running request at token boundaries); the trainer is at version 5 (its logprobs
# before the step are the proximal policy's) and takes a step.
#   token                    0      1      2
#   sampled by version       3      4      5
#   p_behav (engine)         0.2    0.5    0.4
#   p_prox  (trainer, v5)    0.4    0.4    0.4    -> w = p_prox / p_behav = 2.0, 0.8, 1.0
#   p_theta (being trained)  0.5    0.3    0.44   -> r = p_theta / p_prox = 1.25, 0.75, 1.1
# Advantage +1, clip 0.2: PPO's term max(-A r, -A clip(r, 0.8, 1.2)) = -1.2 (clipped), -0.75, -1.1.
BEHAV = t([[LOG(0.2), LOG(0.5), LOG(0.4)]])
PROX = t([[LOG(0.4), LOG(0.4), LOG(0.4)]])
THETA = t([[LOG(0.5), LOG(0.3), LOG(0.44)]])
PPO_TERMS = [-1.2, -0.75, -1.1]


@pytest.mark.parametrize(
    ("correction", "cap", "floor", "weights"),
    [
        ("none", None, None, [1.0, 1.0, 1.0]),
        ("decoupled_ppo", None, None, [2.0, 0.8, 1.0]),  # Hilton et al. / AReaL: w as is
        ("tis", 1.5, None, [1.5, 0.8, 1.0]),  # min(w, 1.5)
        ("mis", 1.5, None, [0.0, 0.8, 1.0]),  # w > 1.5 masked
        ("mis", 1.5, 0.9, [0.0, 0.0, 1.0]),  # IcePop's band [0.9, 1.5]: 0.8 masked too
    ],
)
def test_mixed_version_response_by_hand(correction, cap, floor, weights):
    cfg = LossConfig(off_policy_correction=correction, behav_weight_cap=cap, behav_weight_floor=floor)
    theta = THETA.clone().requires_grad_()
    out = grpo_loss(theta, PROX, t([1.0]), torch.ones(1, 3), cfg, gen_logprobs=BEHAV)
    want = sum(w * term for w, term in zip(weights, PPO_TERMS, strict=True))
    assert out.loss_sum.item() == pytest.approx(want)
    assert out.count.item() == 3  # masked tokens stay in the normalizer
    assert (out.loss_sum / out.count).item() == pytest.approx(want / 3)
    # d/d log p_theta of w * (-A r) is -w A r where the clip is not active; token 0 is clipped (r > 1.2)
    (out.loss_sum / out.count).backward()
    want_grad = [0.0, -weights[1] * 0.75 / 3, -weights[2] * 1.1 / 3]
    torch.testing.assert_close(theta.grad, t([want_grad]))
    assert out.metrics["behav_ratio_min"].item() == pytest.approx(0.8)
    assert out.metrics["behav_ratio_max"].item() == pytest.approx(2.0)
    if correction != "none":
        assert out.metrics["behav_weight_sum"].item() == pytest.approx(sum(weights))


def test_a_masked_token_keeps_its_kl_term():
    # mis with cap 1.5 masks token 0 (w = 2); the k1 KL estimate theta - ref is log 2 on every token
    cfg = LossConfig(off_policy_correction="mis", behav_weight_cap=1.5, kl_coef=0.5, kl_estimator="k1")
    ref = THETA - LOG(2.0)
    out = grpo_loss(THETA, PROX, t([1.0]), torch.ones(1, 3), cfg, ref_logprobs=ref, gen_logprobs=BEHAV)
    pg = 0.8 * PPO_TERMS[1] + 1.0 * PPO_TERMS[2]
    assert out.loss_sum.item() == pytest.approx(pg + 3 * 0.5 * LOG(2.0))
    assert out.metrics["kl_sum"].item() == pytest.approx(3 * LOG(2.0))


def test_two_token_decoupled_ppo_with_a_negative_advantage_by_hand():
    # p_behav 0.25, 0.5; p_prox 0.5, 0.5 (w = 2, 1); p_theta 0.35, 0.6 (r = 0.7, 1.2); A = -2.
    # PPO's term max(-A r, -A clip(r)) = max(1.4, 1.6) = 1.6 (clipped below) and max(2.4, 2.4) = 2.4.
    # Weighted: 2 * 1.6 + 1 * 2.4 = 5.6 over 2 tokens.
    cfg = LossConfig(off_policy_correction="decoupled_ppo")
    out = grpo_loss(
        t([[LOG(0.35), LOG(0.6)]]),
        t([[LOG(0.5), LOG(0.5)]]),
        t([-2.0]),
        torch.ones(1, 2),
        cfg,
        gen_logprobs=t([[LOG(0.25), LOG(0.5)]]),
    )
    assert (out.loss_sum / out.count).item() == pytest.approx(5.6 / 2)


def test_weights_are_per_token_so_any_split_of_the_batch_reduces_the_same():
    g = torch.Generator().manual_seed(0)
    prox = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    behav = prox + 0.6 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    whole = behaviour_weight(prox, behav, "mis", cap=1.5, floor=0.7)
    rows = [behaviour_weight(prox[i : i + 1], behav[i : i + 1], "mis", cap=1.5, floor=0.7) for i in range(4)]
    assert torch.equal(torch.cat([r.weight_BT for r in rows]), whole.weight_BT)
    assert 0 < int(whole.masked_BT.sum()) < whole.masked_BT.numel()  # both kinds of token occur
    assert torch.equal(whole.weight_BT == 0, whole.masked_BT)


def test_a_huge_log_ratio_gives_a_finite_weight():
    w = behaviour_weight(t([[0.0]]), t([[-1e4]]), "decoupled_ppo")
    assert torch.isfinite(w.weight_BT).all() and w.weight_BT.item() == pytest.approx(math.exp(20))


# ------------------------------------------------------------------------------------------ staleness


def test_staleness_is_measured_from_the_oldest_token_and_groups_drop_whole():
    # trainer at version 10, G = 2; oldest token versions per sample:
    #   group 0: 10, 9   -> staleness 0, 1: kept with max_staleness 1
    #   group 1: 9, 8    -> 1, 2: one member too old, the whole group goes
    #   group 2: 7, 10   -> 3, 0: goes
    verdict = judge_staleness([10, 9, 9, 8, 7, 10], 10, max_staleness=1, num_generations=2)
    assert verdict.staleness.tolist() == [0, 1, 1, 2, 3, 0]
    assert verdict.keep.tolist() == [True, False, False]
    assert verdict.dropped_groups == 2
    assert verdict.metrics() == {
        "staleness/mean": pytest.approx(7 / 6),
        "staleness/max": 3.0,
        "staleness/dropped_groups": 2.0,
    }
    assert judge_staleness([10, 9, 9, 8, 7, 10], 10, 3, 2).keep.all()
    with pytest.raises(ValueError, match="version 11, newer than the trainer's 10"):
        judge_staleness([11, 10], 10, 1, 2)
    with pytest.raises(ValueError, match="num_generations=2"):
        judge_staleness([10, 10, 10], 10, 1, 2)


def _completion(versions, n=3):
    return Completion(0, list(range(1, n + 1)), [-0.5] * n, "stop", versions=versions)


def test_staleness_metrics_count_each_sample_from_its_oldest_token():
    # version 5 trains; the batch was started at version 3 (completions without versions: all v3)
    comps = [_completion([(3, 1), (4, 1), (5, 1)]), _completion([(5, 3)]), _completion(None, n=2)]
    rollouts = Rollouts([Prompt([1], "x")], comps, torch.zeros(3))
    assert staleness_metrics(rollouts, 3, trained_version=5) == {
        "staleness/generator_version": 3.0,
        "staleness/mean": pytest.approx((2 + 0 + 2) / 3),
        "staleness/max": 2.0,
        "staleness/off_policy_token_frac": pytest.approx(4 / 8),  # v3, v4 of the first; both of the last
    }


# ------------------------------------------------------------------------------- per-token versions


def test_completion_versions_and_their_helpers():
    c = _completion([(3, 1), (4, 1), (5, 1)])
    assert c.oldest_version(default=9) == 3
    assert c.token_versions(default=9) == [3, 4, 5]
    whole = _completion(None)
    assert whole.oldest_version(default=9) == 9 and whole.token_versions(default=9) == [9, 9, 9]
    for bad in ([(3, 2)], [(3, 2), (4, 2)], [(3, 0), (4, 3)], [(3, 1.5), (4, 1.5)]):
        with pytest.raises(ValueError, match=r"Completion\.versions"):
            _completion(bad)


def test_versions_survive_a_checkpoint_and_old_checkpoints_load_without_them(tmp_path):
    comps = [_completion([(2, 2), (3, 1)]), _completion(None)]
    pending = Pending(Rollouts([Prompt([7, 8], "3")], comps, torch.tensor([1.0, 0.0])), 12, 0, 3, 0.5)
    pending.save(tmp_path)
    back = Pending.load(tmp_path)
    assert back.rollouts.completions == comps
    assert back.rollouts.completions[0].oldest_version(back.version) == 2
    # A checkpoint written before Completion had versions: its completions' dicts lack the key.
    data = torch.load(tmp_path / Pending.FILE, weights_only=True)
    for c in data["completions"]:
        del c["versions"]
    torch.save(data, tmp_path / Pending.FILE)
    old = Pending.load(tmp_path)
    assert [c.versions for c in old.rollouts.completions] == [None, None]
    # ... and every token of them is the batch's version
    assert staleness_metrics(old.rollouts, old.version, trained_version=4)["staleness/max"] == 1.0
    assert dataclasses.replace(comps[0], versions=None) == old.rollouts.completions[0]
    data["completions"][0]["versions"] = [(2, 5)]  # 5 tokens' worth of versions for 3 tokens
    torch.save(data, tmp_path / Pending.FILE)
    with pytest.raises(CheckpointError, match=r"rollouts_ahead\.pt: not the rollouts.*Completion\.versions"):
        Pending.load(tmp_path)


# ------------------------------------------------------------------------------------------- config


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    ("overrides", "keys", "words"),
    [
        (["grpo.off_policy_correction=tis", "grpo.behav_weight_cap=null"], ["behav_weight_cap"], "needs"),
        (["grpo.off_policy_correction=mis", "grpo.behav_weight_cap=null"], ["behav_weight_cap"], "needs"),
        (["grpo.off_policy_correction=decoupled_ppo"], ["behav_weight_cap"], "takes no"),
        (["grpo.off_policy_correction=none"], ["behav_weight_cap"], "takes no"),
        (["grpo.behav_weight_cap=0.9"], ["grpo.behav_weight_cap"], ">= 1"),
        (["grpo.behav_weight_cap=.inf"], ["grpo.behav_weight_cap"], "finite"),
        (["grpo.behav_weight_floor=0.5"], ["behav_weight_floor", "off_policy_correction"], "mis"),
        (["grpo.off_policy_correction=mis", "grpo.behav_weight_floor=0"], ["behav_weight_floor"], "(0, 1]"),
        (["grpo.off_policy_correction=mis", "grpo.behav_weight_floor=1.5"], ["behav_weight_floor"], "(0, 1]"),
        (["grpo.off_policy_correction=is"], ["grpo.off_policy_correction"], "decoupled_ppo"),
        (
            [
                "grpo.loss=gspo",
                "grpo.loss_agg=sequence",
                "grpo.off_policy_correction=decoupled_ppo",
                "grpo.behav_weight_cap=null",
            ],
            ["grpo.off_policy_correction", "grpo.loss"],
            "sequence-level ratio",
        ),
    ],
)
def test_off_policy_keys_are_checked_at_load(overrides, keys, words):
    msg = _error(overrides)
    assert all(k in msg for k in keys) and words in msg, msg


@pytest.mark.parametrize(("key", "value"), [("tis_cap", "2.0"), ("tis_mode", "truncate")])
def test_the_replaced_tis_keys_say_what_replaces_them(key, value, tmp_path):
    msg = _error([f"grpo.{key}={value}"])
    assert f"grpo.{key}: no longer a key" in msg and "off_policy_correction tis" in msg
    path = tmp_path / "old.yaml"
    path.write_text(f"grpo:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"grpo\.{key}: no longer a key.*behav_weight_cap"):
        load_config(path)


def test_mis_with_a_band_loads():
    cfg = load_config(
        None,
        ["grpo.off_policy_correction=mis", "grpo.behav_weight_cap=5", "grpo.behav_weight_floor=0.5"],
    )
    assert (cfg.grpo.behav_weight_floor, cfg.grpo.behav_weight_cap) == (0.5, 5.0)
