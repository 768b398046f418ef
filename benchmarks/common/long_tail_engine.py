"""A vLLM engine whose prompts ask for response lengths with a long tail, for ``benchmarks.long_tail``.

One prompt in :data:`LONG_EVERY` (chosen by a hash of its token ids, so the same prompt asks for the same
length in every mode, on every engine) asks for ``generation.max_new_tokens`` tokens; every other prompt
asks for 1/:data:`LONG_FACTOR` of that. With ``generation.ignore_eos`` every response is exactly as long as
its prompt asks: the lengths are the workload's, not the model's. The budget is applied where vLLM takes
its requests (``VLLMEngine._run`` for a step's batch, ``submit`` for the request stream of
``grpo.async_mode: partial``), so each mode runs its own code unchanged around it.

The engine also appends, per call that makes vLLM step (``generate``, ``prompt_logprobs``, ``advance``),
its start and end (``time.time()``) to ``<run dir>/engine_busy_<index>.jsonl``: the benchmark's engine
busy fraction, measured the same way in every mode.

``python -m benchmarks.common.long_tail_engine megagrpo-args...`` runs ``megagrpo`` with this engine in
place of ``generation.engine: vllm``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
import zlib
from array import array
from pathlib import Path

from megagrpo.generation.vllm import VLLMEngine

MODULE = "benchmarks.common.long_tail_engine"
"""This module by the name the engines' Ray workers import it under (run as ``__main__`` by the driver)."""
LONG_EVERY = 10
"""One prompt in this many (by hash) asks for the whole ``generation.max_new_tokens``."""
LONG_FACTOR = 8
"""A long prompt asks for this many times the tokens of the others."""


def is_long(prompt) -> bool:
    """Whether ``prompt`` (token ids) is one of the long-answer prompts."""
    return zlib.crc32(array("q", prompt).tobytes()) % LONG_EVERY == 0


def budget(prompt, max_tokens: int) -> int:
    """The tokens ``prompt`` asks for out of a request's ``max_tokens`` (the probe's one token stays one)."""
    return max_tokens if is_long(prompt) else max(1, -(-max_tokens // LONG_FACTOR))


class LongTailEngine(VLLMEngine):
    """``VLLMEngine`` with each request's ``max_tokens`` cut to its prompt's :func:`budget`."""

    def __init__(self, cfg, model_dir: str, engine_index: int = 0, **kw):
        super().__init__(cfg, model_dir, engine_index, **kw)
        self._busy_log = Path(cfg.logging.dir) / cfg.run_name / f"engine_busy_{engine_index}.jsonl"

    def _timed(self, call: str, fn, *args):
        start = time.time()
        try:
            return fn(*args)
        finally:
            with open(self._busy_log, "a") as f:
                f.write(json.dumps({"call": call, "start": start, "end": time.time()}) + "\n")

    def _run(self, prompts, params):
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        cut = []
        for prompt, p in zip(prompts, per, strict=True):
            p = p.clone()
            p.max_tokens = budget(prompt, p.max_tokens)
            cut.append(p)
        return super()._run(prompts, cut)

    def generate(self, prompts, settings, seeds=None):
        return self._timed("generate", super().generate, prompts, settings, seeds)

    def prompt_logprobs(self, sequences, *, routed: bool = False):
        return self._timed(
            "prompt_logprobs", functools.partial(super().prompt_logprobs, routed=routed), sequences
        )

    def submit(self, requests) -> None:
        def cut(r):
            tokens = budget(r.prompt_ids, r.settings.max_tokens)
            return dataclasses.replace(r, settings=dataclasses.replace(r.settings, max_tokens=tokens))

        super().submit([cut(r) for r in requests])

    def advance(self, seconds: float):
        return self._timed("advance", super().advance, seconds)


def long_tail_spec():
    """``generation.engine: vllm``'s registry entry, starting :class:`LongTailEngine`."""
    from megagrpo.generation import engine

    return dataclasses.replace(engine.ENGINES["vllm"], engine_class=f"{MODULE}:LongTailEngine")


if __name__ == "__main__":
    from megagrpo.cli import main
    from megagrpo.generation import engine

    engine.ENGINES["vllm"] = long_tail_spec()
    sys.exit(main(sys.argv[1:]))
