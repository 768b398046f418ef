"""Reward functions and the scorer the driver and ``eval`` call.

``reward.kind``: ``arithmetic`` (exact integer match, in process: microseconds a response),
``math_verify`` (the last boxed answer against the reference, :mod:`megagrpo.rewards.math`) or
``python`` (``reward.function``, a user function loaded by import path or file path,
:mod:`megagrpo.rewards.user`). The last two run in a :class:`~megagrpo.rewards.pool.DeadlinePool`:
a response whose scoring passes ``reward.timeout_s`` scores 0 and its worker is killed and replaced;
one whose scoring raises (or whose worker dies) scores 0 and counts as an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megagrpo.rewards.arithmetic import arithmetic_reward
from megagrpo.rewards.math import last_boxed, math_verify_reward
from megagrpo.rewards.pool import DeadlinePool
from megagrpo.rewards.user import resolve_spec

if TYPE_CHECKING:
    from megagrpo.config import RewardConfig

__all__ = ["REWARDS", "RewardResult", "RewardScorer"]

REWARDS: dict[str, Callable[[str, str], float]] = {
    "arithmetic": arithmetic_reward,
    "math_verify": math_verify_reward,
}

# The import paths the pool's workers load for the built-in kinds.
_SPECS = {
    "arithmetic": "megagrpo.rewards.arithmetic:arithmetic_reward",
    "math_verify": "megagrpo.rewards.math:math_verify_reward",
}


@dataclass(frozen=True)
class RewardResult:
    """Scores of one batch of responses and what went wrong while computing them."""

    scores: list[float]
    """One reward per response, in order (format reward included)."""
    timeouts: int
    """Responses cut at reward.timeout_s (scored 0)."""
    errors: int
    """Responses whose scoring raised, returned no finite number, or whose worker died (scored 0)."""


class RewardScorer:
    """``scorer(responses, answers) -> list[float]``; :meth:`score` also returns the timeout and error
    counts. Pool-backed kinds hold worker processes until :meth:`close`."""

    def __init__(self, cfg: RewardConfig):
        self.kind, self.format_reward = cfg.kind, cfg.format_reward
        # Exact integer matching is microseconds per response: a pool would only add overhead.
        self.fn = REWARDS.get(cfg.kind)
        self.pool = None
        if cfg.kind != "arithmetic":
            spec = _SPECS.get(cfg.kind) or resolve_spec(cfg.function)
            self.pool = DeadlinePool(spec, cfg.num_workers, cfg.timeout_s)
        self.timeouts = 0
        """Responses cut at their deadline over the scorer's life."""
        self.errors = 0
        """Responses whose scoring failed over the scorer's life."""

    def __call__(self, responses: list[str], answers: list[str]) -> list[float]:
        return self.score(responses, answers).scores

    def score(self, responses: list[str], answers: list[str]) -> RewardResult:
        pairs = list(zip(responses, answers, strict=True))
        if self.pool is None:
            result = RewardResult([self.fn(r, a) for r, a in pairs], 0, 0)
        else:
            out = self.pool.map(pairs)
            if out.error_messages:
                print(f"reward: {out.errors} scoring error(s), e.g. {out.error_messages[0]}", flush=True)
            pairs_out = zip(out.values, responses, strict=True)
            scores = [0.0 if v is None else self._with_format(v, r) for v, r in pairs_out]
            result = RewardResult(scores, out.timeouts, out.errors)
        self.timeouts += result.timeouts
        self.errors += result.errors
        return result

    def _with_format(self, score: float, response: str) -> float:
        """reward.format_reward: a wrong answer given in a complete final box earns it (a correct one
        keeps 1, so ``score >= 1`` still means correct); not for responses that timed out or failed."""
        if not self.format_reward or score >= 1.0 or last_boxed(response) is None:
            return score
        return max(score, self.format_reward)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
