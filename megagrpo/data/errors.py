"""The error every dataset reader raises: its own module, below the readers (``records``) and the
sources built on them (``prompts``, ``supervised``), so none of them imports another for it."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A dataset file is missing or malformed; the message names the file, row and key."""
