"""Rewards: the math-verify table, final-answer extraction, the deadline pool (hangs, crashes, errors),
user reward functions loaded by path, and their config checks."""

from pathlib import Path

import pytest

from megagrpo.config import ConfigError, load_config
from megagrpo.rewards import RewardScorer
from megagrpo.rewards.math import last_boxed, math_verify_reward

pytestmark = pytest.mark.unit

# (response, reference answer, expected score)
MATH_TABLE = [
    # fractions vs decimals, both ways; a bare LaTeX reference parses as math (it used to parse to nothing)
    ("The answer is \\boxed{0.5}.", "\\frac12", 1.0),
    ("so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{0.75}", "\\dfrac{3}{4}", 1.0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{-\\frac{7}{3}}", "-7/3", 1.0),
    # 2\pi is 2*pi, not 2
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{2}", "2\\pi", 0.0),
    # text and units around and inside the box
    ("We add them: 7 + 5 = 12, so the total is \\boxed{12} apples.", "12", 1.0),
    ("\\boxed{12 \\text{ cm}}", "12", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{x = 4}", "4", 1.0),
    # nested braces
    ("\\boxed{\\frac{3}{\\sqrt{4}}}", "\\frac{3}{2}", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    # several boxes: the last one is the answer (math-verify alone reads {3, 5})
    ("First \\boxed{3}. Wait, recheck: \\boxed{5}", "5", 1.0),
    ("First \\boxed{5}. Wait, recheck: \\boxed{3}", "5", 0.0),
    ("\\boxed{3} \\fbox{5}", "5", 1.0),
    # no box: 0 even when the number is in the text
    ("The answer is 5.", "5", 0.0),
    ("", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    # malformed LaTeX: an unclosed box, an empty fraction, a stray closing brace
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),
    ("\\boxed{\\frac{1}{}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{5}}", "5", 1.0),
]


@pytest.mark.parametrize(("response", "answer", "expected"), MATH_TABLE)
def test_math_verify_table(response, answer, expected):
    assert math_verify_reward(response, answer) == expected


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("a \\boxed{3} b \\boxed{5} c", "5"),
        ("\\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("\\boxed {4}", "4"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}", None),  # the last box never closes
        ("\\boxedx{3}", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_a_reference_that_does_not_parse_is_an_error_scored_zero():
    with pytest.raises(ValueError, match="does not parse"):
        math_verify_reward("\\boxed{5}", "\\text{}")
    scorer = RewardScorer(load_config(None, ["reward.kind=math_verify", "reward.num_workers=1"]).reward)
    try:
        result = scorer.score(["\\boxed{5}", "\\boxed{5}"], ["", "5"])
    finally:
        scorer.close()
    assert (result.scores, result.timeouts, result.errors) == ([0.0, 1.0], 0, 1)


def test_pool_scores_the_table_like_the_function_and_format_reward():
    overrides = ["reward.kind=math_verify", "reward.num_workers=2", "reward.timeout_s=60"]
    scorer = RewardScorer(load_config(None, overrides).reward)
    try:
        result = scorer.score([r for r, _, _ in MATH_TABLE], [a for _, a, _ in MATH_TABLE])
    finally:
        scorer.close()
    assert result.scores == [e for _, _, e in MATH_TABLE]
    assert (result.timeouts, result.errors) == (0, 0)

    shaped = RewardScorer(load_config(None, [*overrides, "reward.format_reward=0.1"]).reward)
    try:
        # correct; wrong but boxed; no box; unclosed box
        scores = shaped(["\\boxed{5}", "\\boxed{4}", "5", "\\boxed{5"], ["5"] * 4)
    finally:
        shaped.close()
    assert scores == [1.0, 0.1, 0.0, 0.0]


USER_REWARD = """
import os, time

def reward(response, answer):
    if response == "hang":
        time.sleep(3600)
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("boom")
    if response == "nan":
        return float("nan")
    if response == "pid":
        return float(os.getpid())
    return float(response.strip() == answer)

NOT_CALLABLE = 3

def one_argument(response):
    return 0.0
"""


@pytest.fixture
def user_reward(tmp_path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def _python_scorer(spec: str, workers: int = 2, timeout_s: float = 30.0) -> RewardScorer:
    cfg = load_config(
        None,
        [
            "reward.kind=python",
            f"reward.function={spec}",
            f"reward.num_workers={workers}",
            f"reward.timeout_s={timeout_s}",
        ],
    )
    return RewardScorer(cfg.reward)


def test_user_reward_loaded_by_file_path_scores_a_batch(user_reward):
    scorer = _python_scorer(f"{user_reward}:reward")
    try:
        result = scorer.score(["4", " 7 ", "x", "12"], ["4", "7", "y", "13"])
    finally:
        scorer.close()
    assert (result.scores, result.timeouts, result.errors) == ([1.0, 1.0, 0.0, 0.0], 0, 0)


def test_user_reward_loaded_by_module_path_scores_a_batch():
    scorer = _python_scorer("megagrpo.rewards.arithmetic:arithmetic_reward")
    try:
        assert scorer(["12", "13", "x"], ["12", "12", "12"]) == [1.0, 0.0, 0.0]
    finally:
        scorer.close()


def test_hanging_scoring_is_cut_each_time_and_the_pool_keeps_its_capacity(user_reward):
    workers = 2
    scorer = _python_scorer(f"{user_reward}:reward", workers=workers, timeout_s=2.5)
    pool = scorer.pool
    try:
        first = set(pool.pids)
        hangs = workers + 1  # more hanging responses than workers
        result = scorer.score(["hang"] * hangs, ["1"] * hangs)
        assert result.scores == [0.0] * hangs
        assert (result.timeouts, result.errors) == (hangs, 0)
        # each hanging worker was killed and replaced: none of the first processes is left
        assert pool.replaced == hangs
        assert not first & set(pool.pids)
        assert all(not Path(f"/proc/{pid}").exists() for pid in first)
        assert pool.alive() == workers
        # the replacements start (load the function) and the next batch runs on each of them
        assert pool.wait_ready() == workers
        after = scorer.score(["pid", "pid", "3", "4"], ["0", "0", "3", "5"])
        assert (after.timeouts, after.errors) == (0, 0)
        assert after.scores[2:] == [1.0, 0.0]
        assert {int(s) for s in after.scores[:2]} == set(pool.pids)
        assert (scorer.timeouts, scorer.errors) == (hangs, 0)
    finally:
        scorer.close()
    assert pool.alive() == 0


def test_crashes_exceptions_and_non_finite_rewards_score_zero_and_count_as_errors(user_reward):
    scorer = _python_scorer(f"{user_reward}:reward")
    try:
        result = scorer.score(["crash", "raise", "nan", "1"], ["1"] * 4)
        assert result.scores == [0.0, 0.0, 0.0, 1.0]
        assert (result.timeouts, result.errors) == (0, 3)
        assert scorer.pool.replaced == 1  # the crashed worker
        assert scorer.pool.alive() == 2
        assert scorer(["2", "2"], ["2", "3"]) == [1.0, 0.0]
    finally:
        scorer.close()


@pytest.mark.parametrize(
    ("overrides", "keys", "message"),
    [
        (["reward.function=missing_file.py:reward"], "reward.function", "does not exist"),
        (["reward.function=megagrpo_no_such_module:reward"], "reward.function", "cannot be imported"),
        (["reward.function=megagrpo.rewards.math:no_such_name"], "reward.function", "no attribute"),
        (["reward.function={path}:NOT_CALLABLE"], "reward.function", "not callable"),
        (["reward.function={path}:one_argument"], "reward.function", "must accept"),
        (["reward.function=no_colon"], "reward.function", "is not 'package.module:function'"),
        ([], "reward.function, reward.kind", "needs a function"),
    ],
)
def test_a_missing_or_unusable_user_reward_is_a_config_error(user_reward, overrides, keys, message):
    overrides = [o.replace("{path}", str(user_reward)) for o in overrides]
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, ["reward.kind=python", *overrides])
    assert str(err.value).split(": ")[1] == keys


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.function=megagrpo.rewards.math:math_verify_reward"], "with kind 'python' only"),
        (["reward.format_reward=0.1"], "applies to kind 'math_verify' only"),
        (["reward.kind=math_verify", "reward.format_reward=1.0"], "in \\[0, 1\\)"),
        (["reward.timeout_s=0"], "finite and > 0"),
    ],
)
def test_reward_keys_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
