"""A vLLM engine whose request stream is paced: each ``advance`` runs one engine step after a pause, so a
response takes longer to sample than a GRPO step of the tiny config takes to train, and every weight swap
lands in requests in flight. ``python tests/e2e/_paced_engine.py megagrpo-args...`` runs ``megagrpo`` with
it (a driver the test can kill -9).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import ray.cloudpickle

from megagrpo.generation.vllm import VLLMEngine

# Ray's workers cannot import the test modules by name: ship its classes and functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PAUSE_S = 0.03
"""Before each engine step: 48 tokens take at least 1.4 s, a tiny GRPO step about 1 s."""


class PacedEngine(VLLMEngine):
    def advance(self, seconds: float):
        time.sleep(PAUSE_S)
        return super().advance(0.0)  # one engine step: advance checks its budget after each step


def paced_spec():
    """``generation.engine: vllm``'s registry entry, starting ``PacedEngine``."""
    from megagrpo.generation import engine

    return dataclasses.replace(engine.ENGINES["vllm"], engine_class=f"{__name__}:PacedEngine")


if __name__ == "__main__":
    from megagrpo.cli import main
    from megagrpo.generation import engine

    engine.ENGINES["vllm"] = paced_spec()
    sys.exit(main(sys.argv[1:]))
