"""Dataset records for SFT and DPO: JSONL, JSON and Parquet files read into numbered rows, and the
bad-row policy (``data.on_bad_row``) that decides what a row that cannot be used does.

Rows are numbered from 1 as a person finds them: the line of a JSONL file, the element of a JSON array,
the row of a Parquet table. Every error names the file and the row; bytes that are not UTF-8 are a bad
row named with their byte offset (of the file; of the value for Parquet, whose files are compressed).
"""

from __future__ import annotations

import json
import re
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
        rows = _json_rows(path, bad)
    else:
        rows = _parquet_rows(path, bad)
    for row, record in rows:
        if not isinstance(record, dict):
            bad.bad(path, row, f"expected a JSON object, got {type(record).__name__}")
            continue
        yield row, record


def _jsonl_rows(path: Path, bad: BadRows) -> Iterator[tuple[int, Any]]:
    # Bytes, decoded line by line: an undecodable line is one bad row named with its byte offset, where
    # reading the file as text would stop at the first one with a message naming neither file nor row.
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad.bad(path, lineno, _not_utf8(raw, err.start, start + err.start))
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                bad.bad(path, lineno, f"not valid JSON ({err.msg})")
            except RecursionError:
                bad.bad(path, lineno, _TOO_DEEP)


_TOO_DEEP = "nested too deeply to read (thousands of brackets)"


def _not_utf8(raw: bytes, at: int, offset: int) -> str:
    return f"not valid UTF-8: byte 0x{raw[at]:02x} at byte offset {offset} of the file"


def _json_rows(path: Path, bad: BadRows) -> Iterator[tuple[int, Any]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        yield from _undecodable_json_rows(path, raw, err.start, bad)
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise DataError(f"{path}: {_TOO_DEEP}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {type(data).__name__}")
    yield from enumerate(data, 1)


# What surrogateescape decodes an undecodable byte to (U+DC80..U+DCFF): never in a valid UTF-8 text.
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _undecodable_json_rows(path: Path, raw: bytes, first_bad: int, bad: BadRows) -> Iterator[tuple[int, Any]]:
    """A JSON array with bytes that are not UTF-8: each element is parsed on its own, and those that hold
    such bytes are bad rows (named with the byte offset of the first); the others are read."""
    text = raw.decode("utf-8", "surrogateescape")
    where = f"{path}: " + _not_utf8(raw, first_bad, first_bad)
    decoder, row = json.JSONDecoder(), 0
    at = _skip_space(text, 0)
    if text[at : at + 1] != "[":
        raise DataError(f"{where} (and not a JSON array of records)")
    at = _skip_space(text, at + 1)
    while text[at : at + 1] != "]":
        try:
            element, end = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError) as err:
            raise DataError(f"{where} (and not valid JSON after row {row}: {err})") from None
        row += 1
        escaped = _ESCAPED_BYTE.search(text, at, end)
        if escaped is None:
            yield row, element
        else:
            offset = len(text[: escaped.start()].encode("utf-8", "surrogateescape"))
            bad.bad(path, row, _not_utf8(raw, offset, offset))
        at = _skip_space(text, end)
        if text[at : at + 1] == ",":
            at = _skip_space(text, at + 1)
        elif text[at : at + 1] != "]":
            raise DataError(f"{where} (and not valid JSON after row {row})")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


_PARQUET_CHUNK = 1024
"""Rows converted to Python at a time (a chunk with an undecodable string is then read row by row)."""


def _parquet_rows(path: Path, bad: BadRows) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable Parquet file ({err})") from err
    # Parquet does not check that a string column holds UTF-8 when it is written or read: a bad value
    # fails only when converted, so rows are converted in chunks and a failing chunk row by row.
    for first in range(0, table.num_rows, _PARQUET_CHUNK):
        chunk = table.slice(first, _PARQUET_CHUNK)
        try:
            records = chunk.to_pylist()
        except UnicodeDecodeError:
            records = None
        if records is not None:
            yield from enumerate(records, first + 1)
            continue
        for i in range(chunk.num_rows):
            try:
                yield first + i + 1, chunk.slice(i, 1).to_pylist()[0]
            except UnicodeDecodeError:
                bad.bad(path, first + i + 1, _undecodable_column(chunk.slice(i, 1)))


def _undecodable_column(row) -> str:
    for name in row.column_names:
        try:
            row.column(name).to_pylist()
        except UnicodeDecodeError as err:
            return (
                f"field {name!r} is not valid UTF-8: byte 0x{err.object[err.start]:02x} at byte offset "
                f"{err.start} of the value"
            )
    return "not valid UTF-8"
