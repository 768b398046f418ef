"""pass@k: the unbiased estimator against hand-computed values, and the report of ``evaluate``."""

from __future__ import annotations

import json
import math

import pytest

from megagrpo.data.prompts import Prompt
from megagrpo.evaluate import evaluate, pass_at_k, pass_ks
from megagrpo.types import Completion, SamplingSettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (4, 1, 1, 1 / 4),
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (4, 1, 4, 1.0),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (16, 0, 16, 0.0),
        (16, 16, 1, 1.0),
        (16, 3, 4, 1 - 1820 / 1820 * 715 / 1820),  # 1 - C(13,4)/C(16,4) = 1 - 715/1820
        (30, 5, 8, 1 - math.comb(25, 8) / math.comb(30, 8)),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_pass_at_1_is_the_fraction_correct():
    for c in range(17):
        assert pass_at_k(16, c, 1) == pytest.approx(c / 16)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_ks_are_powers_of_two_up_to_n():
    assert pass_ks(16) == [1, 2, 4, 8, 16]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(1) == [1]


def _generator(correct_by_problem):
    """A generator whose i-th sample of problem p reads '\\boxed{answer}' for i < correct[p]."""
    calls = []

    def generate(prompts, settings, seeds):
        calls.append(seeds)
        out = []
        for i, p in enumerate(prompts):
            problem = p.token_ids[0]
            for s in range(settings.n):
                token = 1 if s < correct_by_problem[problem] else 0
                out.append(Completion(i, [token], [0.0], "stop"))
        return out

    return generate, calls


def test_evaluate_reports_each_problem_and_the_means():
    correct = [0, 4, 1, 2, 3, 4, 0, 1, 2, 3]  # of 4 samples, for 10 problems (two generate chunks)
    prompts = [Prompt([p], "7") for p in range(10)]
    generate, calls = _generator(correct)
    report = evaluate(
        generate,
        prompts,
        SamplingSettings(max_tokens=4, n=4),
        scorer=lambda texts, answers: [1.0 if t == "right" else 0.0 for t in texts],
        decode=lambda ids: "right" if ids == [1] else "wrong",
        seed=3,
    )
    assert [p.correct for p in report.problems] == correct
    assert report.pass_at[1] == pytest.approx(sum(c / 4 for c in correct) / 10)
    assert report.pass_at[2] == pytest.approx(sum(pass_at_k(4, c, 2) for c in correct) / 10)
    assert report.pass_at[4] == pytest.approx(sum(c > 0 for c in correct) / 10)
    assert report.metrics("val") == {f"val/pass@{k}": v for k, v in report.pass_at.items()}
    # one seed per problem, the same however the problems are chunked
    assert [s for chunk in calls for s in chunk] == [3 * 1_000_003 + i for i in range(10)]
    data = json.loads(report.to_json())
    assert data["summary"]["pass@4"] == pytest.approx(0.8)
    assert [row["correct"] for row in data["problems"]] == correct
    md = report.to_markdown("t")
    assert "| pass@1 | pass@2 | pass@4 |" in md
    assert "| 1 | 7 | 4 / 4 | 1.000 | right |" in md
