"""Driver step helpers that run without Ray actors or engines (fakes stand in for them)."""

import pytest
import torch

from megagrpo.algorithms.grpo import LossConfig, grpo_loss, overlong_penalty
from megagrpo.config import load_config
from megagrpo.data.prompts import Prompt
from megagrpo.rewards import RewardScorer
from megagrpo.trainers import rollouts as rollouts_io
from megagrpo.types import Completion

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------------------------------
# Dynamic sampling, reward counts, overlong filtering and the soft overlong penalty
# ------------------------------------------------------------------------------------------------------------


class OddPromptsVary:
    """Prompt k = [k], answer "1"; its completion j reads "1" only for odd k and j = 0, so the groups of
    even prompts are all wrong (flat) and those of odd prompts have one right answer."""

    stop_token_ids = ()

    def __init__(self, texts=None):
        self.texts = texts or {}

    def batch(self, position, n):
        return [Prompt([position + i], "1") for i in range(n)]

    def decode(self, token_ids):
        k, j = token_ids
        return self.texts.get((k, j), "1" if k % 2 and j == 0 else "0")


STEP_OF_4x2 = ["grpo.num_prompts_per_step=4", "grpo.num_generations=2", "policy.mini_batch_size=8"]


def group_generate(prompts, settings, seeds):
    """``settings.n`` completions per prompt: completion j of prompt [k] is the tokens [k, j]."""
    return [
        Completion(i, [p.token_ids[0], j], [0.0, 0.0], "stop")
        for i, p in enumerate(prompts)
        for j in range(settings.n)
    ]


def _group_run(overrides, source, scorer_cfg=None):
    cfg = load_config(None, [*STEP_OF_4x2, *overrides])
    scorer = RewardScorer(scorer_cfg or cfg.reward)
    try:
        return rollouts_io.generate_groups(cfg, group_generate, source, scorer, position=0)
    finally:
        scorer.close()


def test_dynamic_sampling_replaces_flat_groups_with_fresh_prompts():
    rollouts, position, filtered = _group_run(["grpo.filter_zero_variance_groups=true"], OddPromptsVary())
    # round 1: prompts 0-3 (0, 2 flat); round 2: 4, 5 (4 flat); round 3: 6 (flat); round 4: 7
    assert [p.token_ids[0] for p in rollouts.prompts] == [1, 3, 5, 7]
    assert (position, filtered) == (8, 4)
    assert rollouts.rewards.tolist() == [1.0, 0.0] * 4
    assert [c.token_ids[0] for c in rollouts.completions] == [1, 1, 3, 3, 5, 5, 7, 7]


def test_dynamic_sampling_fills_up_with_flat_groups_after_three_extra_rounds():
    all_wrong = OddPromptsVary({(k, 0): "0" for k in range(100)})
    rollouts, position, filtered = _group_run(["grpo.filter_zero_variance_groups=true"], all_wrong)
    assert (position, filtered) == (16, 16)  # 4 rounds of 4 prompts, every group flat
    assert [p.token_ids[0] for p in rollouts.prompts] == [12, 13, 14, 15]  # the last round's
    assert rollouts.rewards.tolist() == [0.0] * 8
    # without dynamic sampling one round is all there is
    rollouts, position, filtered = _group_run([], OddPromptsVary())
    assert ([p.token_ids[0] for p in rollouts.prompts], position, filtered) == ([0, 1, 2, 3], 4, 0)


USER_REWARD = """
import time

def reward(response, answer):
    if response == "hang":
        time.sleep(3600)
    if response == "raise":
        raise RuntimeError("bad reward input")
    return float(response == answer)
"""


def test_reward_timeouts_and_errors_reach_the_step_metrics(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(USER_REWARD)
    keys = [f"reward.function={path}:reward", "reward.num_workers=2", "reward.timeout_s=2.5"]
    reward = load_config(None, ["reward.kind=python", *keys]).reward
    source = OddPromptsVary({(1, 0): "hang", (2, 1): "raise", (3, 1): "raise"})
    rollouts, _, _ = _group_run([], source, reward)
    assert (rollouts.reward_timeouts, rollouts.reward_errors) == (1, 2)
    assert rollouts.rewards.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    cfg = load_config(None, STEP_OF_4x2)
    metrics = rollouts_io.step_metrics(cfg, rollouts, None, {}, 1.0, 0)
    assert (metrics["reward/timeouts"], metrics["reward/errors"]) == (1, 2)


def _rollouts(lengths, finish, rewards, g=2):
    """P = len(lengths) / g groups; prompt p is [100 + p, 7] and response i has lengths[i] tokens."""
    prompts = [Prompt([100 + p, 7], "1") for p in range(len(lengths) // g)]
    comps = [
        Completion(i % g, [5 + i] * n, [-0.5] * n, reason)
        for i, (n, reason) in enumerate(zip(lengths, finish, strict=True))
    ]
    return rollouts_io.Rollouts(prompts, comps, torch.tensor(rewards))


def test_overlong_filtering_removes_truncated_responses_from_the_whole_loss():
    base = ["grpo.num_prompts_per_step=2", "grpo.num_generations=2", "policy.mini_batch_size=4"]
    base.append("grpo.baseline=mean")
    rollouts = _rollouts([3, 8, 8, 2], ["stop", "length", "length", "stop"], [1.0, 0.0, 0.0, 1.0])
    masked = rollouts_io.to_train_batch(load_config(None, [*base, "grpo.overlong_policy=mask"]), rollouts)
    plain = rollouts_io.to_train_batch(load_config(None, base), rollouts)
    assert masked.in_loss.tolist() == [True, False, False, True]
    # the truncated responses still count in their group's baseline: the advantages are unchanged
    torch.testing.assert_close(masked.advantages, plain.advantages)
    assert masked.advantages.tolist() == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-4)

    gen = torch.Generator().manual_seed(0)
    shape = masked.gen_logprobs.shape
    logprobs, old, ref = (-torch.rand(shape, generator=gen) for _ in range(3))
    loss_cfg = LossConfig(kl_coef=0.1, clip_eps_high=0.28)

    def loss(batch, rows=None):
        rows = list(range(batch.size)) if rows is None else rows
        sub = batch.select(rows)
        take = lambda x: x[rows][:, : sub.gen_logprobs.shape[1]]
        mask = sub.response_mask()
        return grpo_loss(take(logprobs), take(old), sub.advantages, mask, loss_cfg, ref_logprobs=take(ref))

    filtered, kept_only, unfiltered = loss(masked), loss(plain, [0, 3]), loss(plain)
    # loss sum, token count and KL term are those of the untruncated responses alone
    assert int(filtered.count) == int(kept_only.count) == 3 + 2
    assert int(unfiltered.count) == 3 + 8 + 8 + 2
    torch.testing.assert_close(filtered.loss_sum, kept_only.loss_sum)
    torch.testing.assert_close(filtered.metrics["kl_sum"], kept_only.metrics["kl_sum"])
    assert filtered.metrics["sequences"] == 2
    # a zero advantage alone (the old mask) would still carry the truncated responses' KL and tokens
    assert float(unfiltered.metrics["kl_sum"]) > float(filtered.metrics["kl_sum"])


def test_soft_overlong_penalty_by_hand():
    # max 10 tokens, the last 4 a ramp: lengths 6 or fewer are free, 10 pays the whole penalty
    lengths = torch.tensor([5, 6, 7, 8, 10])
    expected = [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == expected
    assert overlong_penalty(lengths, 10, 0, 0.5).tolist() == [0.0, 0.0, 0.0, 0.0, -0.5]
    # in the driver the penalty shapes the rewards before the advantages (max_new_tokens 8, buffer 4)
    cfg = load_config(
        None,
        [
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations=2",
            "policy.mini_batch_size=4",
            "grpo.baseline=mean",
            "grpo.normalize_adv_std=false",
            "grpo.overlong_policy=soft_penalty",
            "grpo.overlong_buffer_tokens=4",
            "grpo.overlong_penalty=1.0",
        ],
    )
    rollouts = _rollouts([3, 8, 6, 4], ["stop", "length", "stop", "stop"], [1.0, 1.0, 1.0, 1.0])
    batch = rollouts_io.to_train_batch(cfg, rollouts)
    # shaped rewards: [1, 0] and [1 - 0.5, 1]: group-mean advantages +-0.5 and -+0.25
    assert batch.advantages.tolist() == [0.5, -0.5, -0.25, 0.25]
    assert batch.in_loss is None
