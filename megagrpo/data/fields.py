"""Checks of a record's text fields before anything is tokenized: a text is a string (a conversation a list
of ``{role: str, content: str}``), and no longer in characters than any text that fits its token budget.

The length bound exists because tokenizing is the expensive step: a 50 MB prompt held ~20 GB while it was
tokenized, only to be found too long afterwards. A text of more than ``tokens x chars_per_token(tok)``
characters cannot encode to ``tokens`` tokens or fewer, so it is refused without being tokenized.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from typing import Any

__all__ = ["NORMALIZATION_FACTOR", "chars_per_token", "check_messages", "string_field", "text_chars"]

NORMALIZATION_FACTOR = 2
"""Characters of input per character of a vocabulary entry that normalisation can fold: NFC (Qwen's
tokenizers) composes at most 4 characters into one of 3 UTF-8 bytes (Greek with three diacritics), and
the tokenizers of the supported families (Qwen2/3 and Llama-3 byte-level BPE, SentencePiece with byte
fallback, the built-in character and BPE tokenizers) drop no text. A tokenizer that deletes characters
(BERT's normaliser strips control characters; WordPiece maps a whole unknown word to one token) is not
covered: with it the bound can refuse a text that would fit in tokens."""

_PER_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SURROGATE = re.compile("[\ud800-\udfff]")


def chars_per_token(tok) -> int:
    """At most how many characters of text one token of ``tok`` stands for: its longest vocabulary entry
    (a byte-level BPE entry is written one character per byte it covers, and a character is at least one
    byte of UTF-8; a SentencePiece or character entry is its text; a byte-fallback entry ``<0xNN>`` is
    longer than its one byte), times :data:`NORMALIZATION_FACTOR`. Computed once per tokenizer."""
    try:
        return _PER_TOKEN[tok]
    except (KeyError, TypeError):
        pass
    longest = max((len(entry) for entry in tok.get_vocab()), default=1)
    per = max(longest, 1) * NORMALIZATION_FACTOR
    with contextlib.suppress(TypeError):  # not weakly referable: computed again next time
        _PER_TOKEN[tok] = per
    return per


def _check_text(text: str, key: str, limit: int | None, tokens: str) -> None:
    if limit is not None and len(text) > limit:
        raise ValueError(f"{key!r} has {len(text):,} characters, more than the {limit:,} {tokens}")
    surrogate = _SURROGATE.search(text)
    if surrogate is not None:
        raise ValueError(
            f"{key!r} holds a lone surrogate (U+{ord(surrogate.group()):04X}) at character "
            f"{surrogate.start()}: not encodable text"
        )


def string_field(record: dict, key: str, *, limit: int | None = None, tokens: str = "") -> str:
    """``record[key]``, which must be a non-empty string of at most ``limit`` characters; ValueError naming
    the key otherwise (``tokens`` ends the message of a longer one, saying where the limit comes from:
    "that the 48 prompt tokens can hold ...")."""
    if record.get(key) is None:
        raise ValueError(f"missing key {key!r} (keys: {sorted(record)})")
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    _check_text(value, key, limit, tokens)
    if not value.strip():
        raise ValueError(f"{key!r} is empty")
    return value


def check_messages(messages: list, key: str, *, limit: int | None = None, tokens: str = "") -> None:
    """A conversation: a non-empty list of ``{role: str, content: str}`` (content non-empty), its contents
    together at most ``limit`` characters; ValueError naming the message and field otherwise."""
    if not messages:
        raise ValueError(f"{key!r} is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{key}[{i}] must be an object with 'role' and 'content'")
        for field in ("role", "content"):
            if not isinstance(m[field], str):
                raise ValueError(f"{key}[{i}].{field} must be a string, got {type(m[field]).__name__}")
    total = text_chars(messages)
    if limit is not None and total > limit:
        raise ValueError(f"{key!r} has {total:,} characters of content, more than the {limit:,} {tokens}")
    for i, m in enumerate(messages):
        _check_text(m["content"], f"{key}[{i}].content", None, tokens)
        if not m["content"].strip():
            raise ValueError(f"{key}[{i}].content is empty")


def text_chars(value: Any) -> int:
    """Characters of a string, or of a conversation's contents."""
    if isinstance(value, str):
        return len(value)
    return sum(len(m["content"]) for m in value)
