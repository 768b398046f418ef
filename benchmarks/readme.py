"""README.md's "Measured" table, written from the suites' committed results.

    python -m benchmarks readme           # rewrite the block between the markers in README.md
    python -m benchmarks readme --check   # exit 1 (showing the difference) if README.md differs

Every headline measurement (``Measurement.headline``) of ``results/suite_cpu/`` and
``results/suite_gpu/``, one row each, in suite order: the benchmark (linked to its table), what was
measured with its settings, the median with the spread of its samples, the target and whether
every sample met it. Nothing here knows what a benchmark measures.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

from .common import REPO, RESULTS, record
from .suite import BENCHMARKS

README = REPO / "README.md"
SUITES = ("suite_cpu", "suite_gpu")
BEGIN = "<!-- measured:begin -->"
END = "<!-- measured:end -->"
_BLOCK = re.compile(r"<!-- measured:begin[^>]*-->.*?<!-- measured:end -->", re.DOTALL)


def render(results: Path = RESULTS) -> str:
    """The block: markers, one line per suite (machine, commit), the table of headline measurements."""
    lines, rows = [BEGIN], []
    for suite in SUITES:
        reports = [(b.name, results / suite / f"{b.name}.json") for b in BENCHMARKS]
        reports = [(name, record.read(path)) for name, path in reports if path.is_file()]
        if not reports:
            continue
        lines.append(f"`{suite}`: {record.describe_machine(reports[0][1]['machine'])}.  ")
        for name, report in reports:
            link = f"[{name}](benchmarks/results/{suite}/{name}.md)"
            for m in (m for m in report["measurements"] if m.headline):
                rows.append([link, m.label(), record.result_cell(m), record.target_cell(m)])
    lines += [
        "",
        *record.md_table(["benchmark", "measured", "result (median, spread, n)", "target"], rows),
        END,
    ]
    return "\n".join(lines)


def replace_block(text: str, block: str, where: str = "README.md") -> str:
    """``text`` with its measured block (markers included) replaced by ``block``."""
    if len(_BLOCK.findall(text)) != 1:
        raise ValueError(f"{where}: want exactly one block from {BEGIN!r} to {END!r}")
    return _BLOCK.sub(lambda _: block, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks readme", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if README.md differs")
    p.add_argument("--readme", type=Path, default=README)
    args = p.parse_args(argv)
    text = args.readme.read_text()
    new = replace_block(text, render(), str(args.readme))
    if new == text:
        print(f"{args.readme}: the Measured table is up to date")
        return 0
    if args.check:
        sys.stdout.writelines(
            difflib.unified_diff(text.splitlines(True), new.splitlines(True), "README.md", "generated")
        )
        print(f"{args.readme}: differs from the results; `make bench-readme` rewrites it", file=sys.stderr)
        return 1
    from megagrpo.ckpt.durable import atomic_write

    atomic_write(args.readme, new)
    print(f"{args.readme}: Measured table rewritten from {RESULTS}")
    return 0
