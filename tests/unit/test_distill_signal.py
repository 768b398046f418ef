"""On-policy distillation's signal and config: per-token reverse-KL advantages by hand, the loss taking
them token by token, the teacher's checks at load."""

import math

import pytest
import torch

from megagrpo.algorithms.distill import reverse_kl_advantages
from megagrpo.algorithms.grpo import LossConfig, grpo_loss
from megagrpo.config import ConfigError, load_config
from megagrpo.types import TrainBatch

pytestmark = pytest.mark.unit


def t(x):
    return torch.as_tensor(x, dtype=torch.float64)


def test_reverse_kl_advantages_by_hand():
    student = t([[0.0, -0.5, -1.0], [-0.2, -0.1, 0.0]])
    teacher = t([[-9.0, -0.7, -0.4], [-1.2, -0.1, -5.0]])
    response = t([[0, 1, 1], [1, 1, 0]]).bool()  # position 0 of row 0 and 2 of row 1: not sampled
    sig = reverse_kl_advantages(student, teacher, response, reverse_kl_coef=2.0)
    # A_t = 2 * (teacher - student) on sampled positions: row 0: 2 * (-0.2), 2 * 0.6; row 1: 2 * (-1.0), 0
    torch.testing.assert_close(sig.advantages_BT, torch.tensor([[0.0, -0.4, 1.2], [-2.0, 0.0, 0.0]]))
    # reverse KL per sampled token: 0.2, -0.6, 1.0, 0.0 -> mean 0.15
    assert sig.reverse_kl_mean == pytest.approx(0.15)
    assert sig.teacher_logprob_mean == pytest.approx((-0.7 - 0.4 - 1.2 - 0.1) / 4)

    task = t([1.5, -0.5])
    mixed = reverse_kl_advantages(
        student, teacher, response, reverse_kl_coef=2.0, task_advantages_B=task, task_reward_weight=0.5
    )
    want = sig.advantages_BT + torch.tensor([[0.0, 0.75, 0.75], [-0.25, -0.25, 0.0]])
    torch.testing.assert_close(mixed.advantages_BT, want)


def test_reverse_kl_advantages_centered_and_standardized_by_hand():
    student = t([[0.0, -0.5, -1.0], [-0.2, -0.1, 0.0]])
    teacher = t([[-9.0, -0.7, -0.4], [-1.2, -0.1, -5.0]])
    response = t([[0, 1, 1], [1, 1, 0]]).bool()
    # coef 2: sampled advantages -0.4, 1.2, -2.0, 0.0 -> mean -0.3; less it: -0.1, 1.5, -1.7, 0.3
    centered = reverse_kl_advantages(student, teacher, response, reverse_kl_coef=2.0, norm="center")
    torch.testing.assert_close(centered.advantages_BT, torch.tensor([[0.0, -0.1, 1.5], [-1.7, 0.3, 0.0]]))
    # population std: sqrt((0.01 + 2.25 + 2.89 + 0.09) / 4) = sqrt(1.31)
    std = math.sqrt(1.31)
    standard = reverse_kl_advantages(student, teacher, response, reverse_kl_coef=2.0, norm="standardize")
    want = torch.tensor([[0.0, -0.1 / std, 1.5 / std], [-1.7 / std, 0.3 / std, 0.0]])
    torch.testing.assert_close(standard.advantages_BT, want)
    assert standard.reverse_kl_mean == pytest.approx(0.15)  # the metric stays the raw reverse KL
    # the task term is added after the normalisation, unscaled by it
    task = t([1.5, -0.5])
    mixed = reverse_kl_advantages(
        student,
        teacher,
        response,
        reverse_kl_coef=2.0,
        task_advantages_B=task,
        task_reward_weight=0.5,
        norm="standardize",
    )
    torch.testing.assert_close(
        mixed.advantages_BT, want + torch.tensor([[0.0, 0.75, 0.75], [-0.25, -0.25, 0.0]])
    )
    # equal advantages: centred to 0, not divided by a zero std
    flat = reverse_kl_advantages(
        t([[-1.0, -1.0]]), t([[-2.0, -2.0]]), t([[1, 1]]).bool(), reverse_kl_coef=1.0, norm="standardize"
    )
    torch.testing.assert_close(flat.advantages_BT, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="norm must be"):
        reverse_kl_advantages(student, teacher, response, reverse_kl_coef=1.0, norm="std")


def test_distill_normalisation_and_teacher_temperature_keys_are_checked(tmp_path):
    for bad, match in (
        ("distill.advantage_norm=std", "distill.advantage_norm"),
        ("distill.teacher_temperature=0", "distill.teacher_temperature"),
        ("distill.teacher_temperature=-1.0", "distill.teacher_temperature"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad])
    from megagrpo.config.teacher import teacher_temperature

    cfg = load_config(None, ["distill.advantage_norm=center", "distill.teacher_temperature=0.5"])
    assert (cfg.distill.advantage_norm, teacher_temperature(cfg)) == ("center", 0.5)
    assert teacher_temperature(load_config(None, ["generation.temperature=0.7"])) == 0.7  # the student's


def test_garbage_off_the_response_stays_out():
    student = t([[math.nan, -0.5]])
    teacher = t([[-math.inf, -0.5]])
    sig = reverse_kl_advantages(student, teacher, t([[0, 1]]).bool(), reverse_kl_coef=1.0)
    assert torch.isfinite(sig.advantages_BT).all() and sig.reverse_kl_mean == 0.0


def test_loss_takes_per_token_advantages_token_by_token():
    """With per-token advantages, each token's term is the single-token loss with its own advantage."""
    lp = t([[math.log(1.1), math.log(0.9), 0.0]]).requires_grad_()
    adv = t([[0.5, -2.0, 7.0]])  # the last position is masked: its advantage must not matter
    mask = t([[1, 1, 0]])
    cfg = LossConfig()
    out = grpo_loss(lp, t([[0.0, 0.0, 0.0]]), adv, mask, cfg)
    (out.loss_sum / out.count).backward()
    # PPO per token: A = 0.5, r = 1.1 -> -0.55 (inside 1 + 0.2); A = -2, r = 0.9 -> 1.8; mean over 2
    assert (out.loss_sum / out.count).item() == pytest.approx((-0.55 + 1.8) / 2)
    torch.testing.assert_close(lp.grad, t([[-0.5 * 1.1 / 2, 2.0 * 0.9 / 2, 0.0]]))
    with pytest.raises(ValueError, match="one advantage per sequence"):
        grpo_loss(lp, t([[0.0] * 3]), adv, mask, LossConfig(loss="gspo", loss_agg="sequence"))


def test_train_batch_selects_and_trims_per_token_advantages():
    batch = TrainBatch.from_sequences([[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1])
    adv = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    batch = batch.replace(advantages=adv)
    assert batch.token_advantages
    sub = batch.select([1])
    torch.testing.assert_close(sub.advantages, adv[1:, :2])  # trimmed like the logprobs: [1, 3 - 1]
    with pytest.raises(ValueError, match=r"advantages must be \[2\] or \[2, 4\]"):
        batch.replace(advantages=torch.zeros(2, 5))


def test_distill_needs_a_teacher_and_train_refuses_one(tmp_path):
    with pytest.raises(ConfigError, match=r"distill.teacher_hf_dir.*required"):
        load_config(None, [], trainer="distill")
    with pytest.raises(ConfigError, match="megagrpo distill"):
        load_config(None, [f"distill.teacher_hf_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"cannot read .*config.json"):
        load_config(None, [f"distill.teacher_hf_dir={tmp_path}"], trainer="distill")


def test_distill_refuses_gspo_naming_the_keys(tmp_path):
    overrides = [
        "grpo.loss=gspo",
        "grpo.loss_agg=sequence",
        "grpo.off_policy_correction=none",
        "grpo.behav_weight_cap=null",
        f"distill.teacher_hf_dir={tmp_path}",
    ]
    with pytest.raises(ConfigError, match=r"grpo.loss, distill.teacher_hf_dir.*gspo_token"):
        load_config(None, overrides, trainer="distill")


def test_teacher_tokenizer_must_be_the_students_naming_both(tmp_path):
    from hf_models import make_tiny_teacher

    from megagrpo.data.tokenizer import check_same_tokenizer, math_bpe_tokenizer

    same = make_tiny_teacher(tmp_path / "same")
    cfg = load_config(None, [f"distill.teacher_hf_dir={same}"], trainer="distill")
    check_same_tokenizer(cfg)  # passes

    other = make_tiny_teacher(tmp_path / "other", tokenizer=math_bpe_tokenizer(512, num_records=200))
    cfg = load_config(None, [f"distill.teacher_hf_dir={other}"], trainer="distill")
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(cfg)
    msg = str(err.value)
    assert "distill.teacher_hf_dir, model.tiny" in msg and str(other) in msg and "built-in tokenizer" in msg


def test_teacher_layout_is_checked_against_its_own_shape(tmp_path):
    from hf_models import make_tiny_teacher

    teacher = make_tiny_teacher(tmp_path / "t", num_layers=3)
    overrides = [f"distill.teacher_hf_dir={teacher}", "distill.teacher_pipeline_parallel_size=2"]
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size 2 must divide num_layers 3"):
        load_config(None, overrides, trainer="distill")


def test_teacher_vocabulary_must_cover_the_students_token_ids(tmp_path):
    from hf_models import make_tiny_hf

    from megagrpo.data.tokenizer import char_tokenizer, check_same_tokenizer, save_tokenizer

    small = make_tiny_hf(
        "qwen2", tmp_path / "small", vocab_size=16, hidden_size=128, max_position_embeddings=256
    )
    save_tokenizer(char_tokenizer(), small)
    cfg = load_config(None, [f"distill.teacher_hf_dir={small}"], trainer="distill")
    with pytest.raises(ConfigError, match=r"config.json vocab_size 16 is smaller than the tokenizer's"):
        check_same_tokenizer(cfg)
