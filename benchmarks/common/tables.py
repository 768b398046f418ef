"""Markdown tables and the results files every benchmark writes: ``<name>.json`` (every number, the
machine) and ``<name>.md`` beside it (the tables)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from . import RESULTS


def md_row(cells: Iterable[object]) -> str:
    """``| a | b | c |``; a None cell is written ``| |`` (an empty string keeps the padding, ``|  |``)."""
    return "|" + "|".join(" " if c is None else f" {c} " for c in cells) + "|"


def md_table(header: str, rows: Iterable[Iterable[object]], align: str | None = None) -> list[str]:
    """A Markdown table's lines: ``header`` (column names separated by `` | ``), the separator, one
    line per row of cells (formatted already, or ``str()``'d).

    ``align``: one letter per column, ``l`` (``|---|``) or ``r`` (``|---:|``); None: ``| --- |``.
    """
    columns = header.split(" | ")
    if align is None:
        separator = md_row(["---"] * len(columns))
    else:
        if len(align) != len(columns):
            raise ValueError(f"align {align!r} has {len(align)} letters for {len(columns)} columns")
        separator = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return [md_row(columns), separator, *(md_row(r) for r in rows)]


def results_json(output: str) -> Path:
    """``benchmarks/results/<output>.json``"""
    return RESULTS / f"{output}.json"


def write_results(json_path: Path, report: dict, markdown: str) -> None:
    """``report`` as indented JSON at ``json_path`` and ``markdown`` in the ``.md`` beside it."""
    from megagrpo.ckpt.durable import atomic_write

    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(json_path, json.dumps(report, indent=2) + "\n")
    atomic_write(json_path.with_suffix(".md"), markdown)


def read_results(json_path: Path) -> dict:
    return json.loads(json_path.read_text())
