"""A multi-step game whose reward needs several turns of feedback: guess the number.

The environment picks an integer in [``low``, ``high``] (from the task); each model turn is a guess, and
the environment answers higher / lower until the guess is right (reward 1) or the episode runs out of
turns (reward 0). A policy that halves the range wins in ceil(log2(high - low + 1)) turns; one that
ignores the hints rarely does.

``style`` "text" talks in English (for real tokenizers); "symbols" in the tiny model's arithmetic
vocabulary (digits, ``+ - * =``, space): the opening is ``"{low} {high}="``, hints are ``+`` (higher),
``-`` (lower) and ``*`` (not a number).
"""

from __future__ import annotations

import random
from typing import Literal

from megagrpo.envs.base import Environment, Step

__all__ = ["GuessNumber"]


class GuessNumber(Environment):
    def __init__(self, low: int = 0, high: int = 15, style: Literal["text", "symbols"] = "text"):
        if not low < high:
            raise ValueError(f"GuessNumber needs low < high, got {low}, {high}")
        if style not in ("text", "symbols"):
            raise ValueError(f"GuessNumber style is 'text' or 'symbols', got {style!r}")
        self.low, self.high, self.style = low, high, style
        self.target: int | None = None
        self.guesses = 0

    @classmethod
    def tasks(cls, count: int, seed: int, low: int = 0, high: int = 15, **_) -> list[dict]:
        rng = random.Random(seed)
        return [{"target": rng.randint(low, high)} for _ in range(count)]

    def reset(self, task: dict) -> list[dict]:
        target = int(task["target"])
        if not self.low <= target <= self.high:
            raise ValueError(f"task target {target} is outside [{self.low}, {self.high}]")
        self.target = target
        if self.style == "symbols":
            return [{"role": "user", "content": f"{self.low} {self.high}="}]
        text = (
            f"I am thinking of an integer from {self.low} to {self.high}. Guess it: answer with the number "
            "only. After each guess I say higher or lower."
        )
        return [{"role": "user", "content": text}]

    def step(self, turn: str) -> Step:
        self.guesses += 1
        try:
            guess = int(turn.strip())
        except ValueError:
            return self._hint("*", "That is not a number. Answer with the number only.")
        if guess == self.target:
            return Step(reward=1.0, done=True)
        if guess < self.target:
            return self._hint("+", "Higher.")
        return self._hint("-", "Lower.")

    def state_dict(self) -> dict:
        return {"target": self.target, "guesses": self.guesses}

    def load_state_dict(self, state: dict) -> None:
        self.target, self.guesses = int(state["target"]), int(state["guesses"])

    def _hint(self, symbol: str, text: str) -> Step:
        return Step(messages=[{"role": "user", "content": symbol if self.style == "symbols" else text}])
