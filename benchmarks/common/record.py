"""The one record every benchmark writes, its command line, and its Markdown.

A benchmark is a module ``benchmarks/<name>.py`` with ``parse_args(argv)`` and ``main(argv)``; it
measures, builds a list of ``Measurement``s and writes them with ``write`` to ``--out`` (a ``.json``
with the machine, the command and the arguments, and a ``.md`` beside it: one generic table). The
suite, the README table and the tests read nothing else.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import REPO, TMP

_TARGET = re.compile(r"^(>=|<=|>|<)\s*(-?[\d.]+)$|^(-?[\d.]+)\s*\.\.\s*(-?[\d.]+)$")
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def target_test(target: str):
    """``">= 0.85"``, ``"<= 1.1"``, ``"> 1"``, ``"< 1"`` or ``"0.85..1.15"`` (inclusive) as a test of
    one value; anything else is a ValueError naming it."""
    match = _TARGET.match(target.strip())
    if match is None:
        raise ValueError(f"target {target!r}: want '>= X', '<= X', '> X', '< X' or 'LO..HI'")
    op, bound, lo, hi = match.groups()
    if op is not None:
        return lambda v: _OPS[op](v, float(bound))
    return lambda v: float(lo) <= v <= float(hi)


@dataclass(frozen=True)
class Measurement:
    """One measured quantity of one benchmark, with every sample taken."""

    name: str
    """What was measured, against what (``"train step / bare Megatron step, tokens/s"``)."""
    samples: tuple[float, ...]
    """One value per repetition (round, step, run) in the order taken, or the one value measured."""
    unit: str
    """``s``, ``tokens/s``, ``MB``, ``x`` (a ratio), ``fraction``, ``CPUs``, ..."""
    settings: dict = field(default_factory=dict)
    """What tells it from its siblings of the same name (``{"tp": 2}``); plain JSON values."""
    target: str | None = None
    """The figure it should reach (``target_test``); met only when every sample meets it."""
    headline: bool = False
    """Shown in README.md's Measured table."""

    def __post_init__(self):
        samples = tuple(float(v) for v in self.samples)
        if not samples:
            raise ValueError(f"measurement {self.name!r}: no samples")
        object.__setattr__(self, "samples", samples)
        if self.target is not None:
            target_test(self.target)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def verdict(self) -> str:
        """``met`` (every sample), ``missed`` (none), ``missed in k of n``; ``""`` without a target."""
        if self.target is None:
            return ""
        test = target_test(self.target)
        misses = sum(not test(v) for v in self.samples)
        if misses == 0:
            return "met"
        return "missed" if misses == len(self.samples) else f"missed in {misses} of {len(self.samples)}"

    def label(self) -> str:
        """The name with its settings: ``train / bare (tp=2)``."""
        extra = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return f"{self.name} ({extra})" if extra else self.name


def ratio(name: str, num: Sequence[float], den: Sequence[float], **kw) -> Measurement:
    """Per-repetition ratios ``num[i] / den[i]`` of two interleaved series (same repetitions)."""
    if len(num) != len(den):
        raise ValueError(f"{name}: {len(num)} against {len(den)} samples")
    return Measurement(name, tuple(a / b for a, b in zip(num, den, strict=True)), "x", **kw)


# ----------------------------------------------------------------------------------- command line


def sync_times(runs: Sequence[dict], settings: dict) -> list[Measurement]:
    """A weight-sync path's wall and all-process CPU seconds per sync, from rounds that each hold
    ``times`` (a ``timing.Timed`` per sync)."""
    return [
        Measurement("sync", [t.seconds for r in runs for t in r["times"]], "s", settings),
        Measurement(
            "CPU seconds of all the processes per sync",
            [t.cpu_s for r in runs for t in r["times"]],
            "s",
            settings,
        ),
    ]


def parser(name: str, doc: str, *, repeat: int | None = 3) -> argparse.ArgumentParser:
    """The options of benchmark ``name``: its own, plus ``--repeat`` (unless None: the benchmark
    adds its own), ``--out`` and ``--quick``, the same in every benchmark."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc.split("\n\n")[0])
    if repeat is not None:
        p.add_argument("--repeat", type=int, default=repeat, help="timed repetitions (1 with --quick)")
    p.add_argument(
        "--out", type=Path, default=TMP / f"{name}.json", help="results .json (a .md is written beside it)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: the smallest sizes, one repetition")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None, quick: dict) -> argparse.Namespace:
    """``p.parse_args(argv)``; with ``--quick``, ``quick`` (option -> value) replaces the defaults
    (options given on the command line still win)."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**({"repeat": 1} if isinstance(getattr(args, "repeat", None), int) else {}) | quick)
        args = p.parse_args(argv)
    if isinstance(getattr(args, "repeat", None), int) and args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be >= 1")
    shown = [relative(a) for a in (sys.argv[1:] if argv is None else argv)]
    args.command = " ".join(["python", "-m", p.prog.split()[-1], *shown])
    return args


# --------------------------------------------------------------------------------- results files


def write(
    args: argparse.Namespace,
    name: str,
    what: str,
    measurements: Iterable[Measurement],
    *,
    packages: Sequence[str] = ("torch",),
    notes: Sequence[str] = (),
) -> dict:
    """Write benchmark ``name``'s report to ``args.out`` (JSON) and its Markdown beside it."""
    from megagrpo.ckpt.durable import atomic_write

    from .machine import machine_info

    report = {
        "benchmark": name,
        "what": what,
        "command": args.command,
        "machine": machine_info(*packages),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "command"},
        "measurements": [asdict(m) for m in measurements],
        "notes": list(notes),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(report, indent=1) + "\n")
    atomic_write(args.out.with_suffix(".md"), markdown(report))
    print(f"[{name}] wrote {args.out} and its .md", flush=True)
    return report


def read(path: Path) -> dict:
    """A results file, its measurements as ``Measurement``s; a file in another format is an error
    naming it."""
    try:
        report = json.loads(path.read_text())
        report["measurements"] = [Measurement(**m) for m in report["measurements"]]
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a benchmark results file ({type(exc).__name__}: {exc})") from exc
    return report


def find(measurements: Iterable[Measurement], name: str, **settings) -> Measurement:
    """The one measurement called ``name`` whose settings include ``settings``."""
    found = [m for m in measurements if m.name == name and settings.items() <= m.settings.items()]
    if len(found) != 1:
        raise KeyError(f"{len(found)} measurements {name!r} with {settings}")
    return found[0]


# --------------------------------------------------------------------------------------- Markdown


def fmt(value: float) -> str:
    """Four significant digits from 0.001 to 1000, whole numbers up to a million, else an exponent."""
    size = abs(value)
    if value == 0 or 1e-3 <= size < 1000:
        return f"{value:.4g}"
    return f"{value:.0f}" if 1000 <= size < 1e6 else f"{value:.3g}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"
    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows)]


def result_cell(m: Measurement) -> str:
    """``0.89 x`` for one sample, else ``0.89 x (0.85-0.93, n=3)``: the median and the spread."""
    text = f"{fmt(m.median)} {m.unit}".strip()
    if len(m.samples) > 1:
        text += f" ({fmt(min(m.samples))}-{fmt(max(m.samples))}, n={len(m.samples)})"
    return text


def target_cell(m: Measurement) -> str:
    return f"{m.target}: {m.verdict()}" if m.target else ""


def describe_machine(machine: dict) -> str:
    return (
        f"{machine.get('date')}, {machine.get('cuda') or machine.get('cpu')}, {machine.get('cpus_usable')} "
        f"usable CPUs, load average {[round(x, 1) for x in machine.get('loadavg_at_start', [])]} at start, "
        f"commit {str(machine.get('git_commit'))[:10]}"
    )


def measurement_table(ms: Iterable[Measurement]) -> list[str]:
    rows = [
        [m.name, ", ".join(f"{k}={v}" for k, v in m.settings.items()), result_cell(m), target_cell(m)]
        for m in ms
    ]
    return md_table(["measurement", "settings", "result", "target"], rows)


def markdown(report: dict) -> str:
    """A results file as Markdown: what, command, machine, every measurement, the notes."""
    ms = [m if isinstance(m, Measurement) else Measurement(**m) for m in report["measurements"]]
    lines = [
        f"# {report['benchmark']}: {report['what']}",
        "",
        f"`{report['command']}`",
        "",
        describe_machine(report["machine"]) + ". Results: median (min-max over the n samples).",
        "",
        *measurement_table(ms),
    ]
    if report.get("notes"):
        lines += ["", *(f"- {n}" for n in report["notes"])]
    return "\n".join(lines) + "\n"


def relative(path: Path | str) -> str:
    """``path`` relative to the repository when inside it (for commands shown in reports)."""
    text = str(path)
    return text.replace(f"{REPO}/", "")
