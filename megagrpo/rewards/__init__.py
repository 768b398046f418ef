"""Reward functions: exact arithmetic for the embedded task, math-verify for math datasets."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from megagrpo.config import RewardConfig
from megagrpo.rewards.arithmetic import arithmetic_reward
from megagrpo.rewards.math import math_verify_reward

REWARDS: dict[str, Callable[[str, str], float]] = {
    "arithmetic": arithmetic_reward,
    "math_verify": math_verify_reward,
}


def _exit_with_parent() -> None:
    """In a pool worker: end when the driver that started it is gone (killed, so it could not
    shut the pool down), instead of waiting forever for work."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class RewardScorer:
    """Scores (response text, reference answer) pairs; slow scorers run in a process pool with a timeout."""

    def __init__(self, cfg: RewardConfig):
        self.fn = REWARDS[cfg.kind]
        self.timeout_s = cfg.timeout_s
        # Exact integer matching is microseconds per response: a pool would only add overhead.
        pool = cfg.kind != "arithmetic"
        self.pool = ProcessPoolExecutor(cfg.num_workers, initializer=_exit_with_parent) if pool else None
        self.timeouts = 0

    def __call__(self, responses: list[str], answers: list[str]) -> list[float]:
        if self.pool is None:
            return [self.fn(r, a) for r, a in zip(responses, answers, strict=True)]
        futures = [self.pool.submit(self.fn, r, a) for r, a in zip(responses, answers, strict=True)]
        scores = []
        for future in futures:
            try:
                scores.append(float(future.result(timeout=self.timeout_s)))
            except FutureTimeout:
                self.timeouts += 1
                future.cancel()
                scores.append(0.0)
        return scores

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
