"""Reward functions (math-verify pool, synthetic tasks)."""
