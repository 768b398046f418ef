"""Dataset records for SFT and DPO: JSONL, JSON and Parquet files read into numbered rows, and the
bad-row policy (``data.on_bad_row``) that decides what a row that cannot be used does.

Rows are numbered from 1 as a person finds them: the line of a JSONL file, the element of a JSON array,
the row of a Parquet table. Every error names the file and the row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagrpo.data.errors import DataError

__all__ = ["BadRows", "read_records"]

FORMATS = (".jsonl", ".json", ".parquet")


@dataclass
class BadRows:
    """What to do with unusable rows: ``error`` raises DataError at the first one; ``skip`` counts them."""

    policy: str
    skipped: int = 0
    examples: list[str] = field(default_factory=list)
    """The first few skipped rows' messages (for the run's summary line)."""

    def bad(self, path: Path | str, row: int, reason: str) -> None:
        message = f"{path}: row {row}: {reason}"
        if self.policy == "error":
            raise DataError(message + " (data.on_bad_row=skip leaves such rows out)")
        self.skipped += 1
        if len(self.examples) < 3:
            self.examples.append(message)


def read_records(path: str | Path, bad: BadRows) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, record) of every usable row of a .jsonl, .json (an array of objects) or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    if path.suffix not in FORMATS:
        raise DataError(f"{path}: unsupported dataset format {path.suffix!r} (use {', '.join(FORMATS)})")
    if path.suffix == ".jsonl":
        rows = _jsonl_rows(path, bad)
    elif path.suffix == ".json":
        rows = _json_rows(path)
    else:
        rows = _parquet_rows(path)
    for row, record in rows:
        if not isinstance(record, dict):
            bad.bad(path, row, f"expected a JSON object, got {type(record).__name__}")
            continue
        yield row, record


def _jsonl_rows(path: Path, bad: BadRows) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                bad.bad(path, lineno, f"not valid JSON ({err.msg})")


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {type(data).__name__}")
    yield from enumerate(data, 1)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable Parquet file ({err})") from err
    yield from enumerate(table.to_pylist(), 1)
