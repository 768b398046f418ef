"""math-verify reward: 1 when the response's final answer is mathematically equal to the reference.

Symbolic checking can hang on adversarial expressions, so ``RewardScorer`` runs it in a process
pool and a response that does not finish within ``reward.timeout_s`` scores 0.
"""

from __future__ import annotations


def math_verify_reward(response: str, answer: str) -> float:
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(response)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0
