"""The embedded synthetic task: integer arithmetic over a character vocabulary.

Prompts look like ``37+45=`` and the reference answer is ``82``. The vocabulary is one token per
character, so the tiny default model needs no tokenizer files and nothing is downloaded; token
ids go straight to vLLM (``skip_tokenizer_init``) and to Megatron.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_CHARS = "0123456789+-*= "
_FIRST_CHAR_ID = 3


class CharTokenizer:
    """One id per character of ``0-9 + - * = space``, after PAD/BOS/EOS."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    vocab_size = _FIRST_CHAR_ID + len(_CHARS)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        unknown = sorted(set(text) - set(_CHARS))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the arithmetic vocabulary {_CHARS!r}")
        ids = [_FIRST_CHAR_ID + _CHARS.index(ch) for ch in text]
        return [BOS_ID, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text up to the first EOS; PAD/BOS and ids outside the vocabulary are dropped."""
        out = []
        for tok in ids:
            if tok == EOS_ID:
                break
            if _FIRST_CHAR_ID <= tok < self.vocab_size:
                out.append(_CHARS[tok - _FIRST_CHAR_ID])
        return "".join(out)


@dataclass(frozen=True)
class Problem:
    prompt: str
    """Question text, e.g. ``37+45=``."""
    answer: str
    """Reference answer, e.g. ``82``."""


@dataclass(frozen=True)
class ArithmeticTask:
    """A reproducible stream of a+b / a-b problems with operands in [0, max_operand]."""

    max_operand: int = 99
    ops: str = "+-"

    def problems(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice(self.ops)
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(Problem(prompt=f"{a}{op}{b}=", answer=str(value)))
        return out
