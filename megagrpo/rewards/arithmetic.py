"""Reward of the synthetic arithmetic task: 1 for the exact integer, else 0."""

from __future__ import annotations


def arithmetic_reward(response: str, answer: str) -> float:
    """``response`` is the decoded completion (up to EOS); surrounding spaces are ignored."""
    text = response.strip()
    try:
        return 1.0 if int(text) == int(answer) else 0.0
    except ValueError:
        return 0.0
