"""math-verify reward: 1 when the response's final boxed answer is mathematically equal to the reference.

- The final answer is the content of the response's **last** ``\\boxed{...}`` (or ``\\fbox{...}``), braces
  matched (nested and escaped ones included): a response that boxes 3 and then, finally, 5 answers 5.
  A response without a complete box scores 0 (math-verify alone would read every box as one set, or
  fall back to the last number anywhere in the text).
- The reference is parsed as math: without ``$`` delimiters math-verify reads ``\\frac12`` as nothing and
  ``2\\pi`` as 2, so a bare reference is wrapped in ``$...$``.
- math-verify's own ``signal.alarm`` timeouts are off: ``RewardScorer`` runs this in worker processes
  whose deadline kills a verification that does not finish, so there is one timeout and it is counted.
- A reference that does not parse raises (the pool scores 0 and counts an error: the data is wrong);
  a response that does not parse scores 0 (the model's answer is wrong).
"""

from __future__ import annotations

import logging
import re

__all__ = ["last_boxed", "math_verify_reward", "parse_reference"]

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed x``) in ``text``; None when
    there is none or the last one never closes."""
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        # "\boxed 5": the argument is the next token (TeX takes one; models write a number or letter).
        token = re.match(r"[^\s$]+", rest[1:]) if rest[:1] == " " else None
        return token.group(0) if token else None
    depth, i, start = 0, 0, len(rest) - len(stripped)
    while start + i < len(rest):
        ch = rest[start + i]
        if ch == "\\":
            i += 2  # \{ and \} are literal braces, not grouping
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[start + 1 : start + i]
        i += 1
    return None


class _DropTimeoutNotice(logging.Filter):
    """math-verify logs that its timeout is off (once per process): here that is on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


def parse_reference(answer: str) -> list:
    """math-verify's parse of a reference answer, with ``$`` delimiters added when it has none."""
    from math_verify import parse

    text = answer.strip()
    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"
    return parse(text, parsing_timeout=None)


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when the last boxed answer of ``response`` equals ``answer`` (math-verify), else 0.0."""
    from math_verify import parse, verify

    final = last_boxed(response)
    if final is None or not final.strip():
        return 0.0
    gold = parse_reference(answer)
    if not gold:
        raise ValueError(f"reference answer {answer!r} does not parse as math")
    pred = parse(f"$\\boxed{{{final}}}$", parsing_timeout=None)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0
