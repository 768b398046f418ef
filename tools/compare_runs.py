"""One metric of several runs side by side, by step, from their ``metrics.jsonl``.

    python tools/compare_runs.py RUN_DIR [RUN_DIR ...] [--metric M] [--reach X | --reach-fraction F]
                                 [--common-steps]

Prints a Markdown table (a row per step that any run logged the metric at; blank where a run did not) and,
with ``--reach``, the first step at which each run's metric was >= X (``--reach-fraction F``: X = F times
the last run's final value); both take several values. With ``--common-steps`` a level is judged only at
the steps every run logged, up to the shortest run's last step (past it, at each run's own steps): a run
validated more often has more draws of a noisy metric, so its first step over a level comes earlier by
chance alone. ``make distill-demo`` uses it to set the distilled student beside the GRPO demo that trained
its teacher.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_metric(run_dir: Path, metric: str) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: not found (has the run been made?)")
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"{path}:{n}: not JSON: {err}") from None
        value = row.get(metric)
        if isinstance(value, int | float) and math.isfinite(value):
            out[int(row["step"])] = float(value)
    return out


def table(runs: dict[str, dict[int, float]], metric: str) -> str:
    steps = sorted({s for values in runs.values() for s in values})
    lines = [f"| step | {' | '.join(f'{name} {metric}' for name in runs)} |", "|---" * (len(runs) + 1) + "|"]
    for step in steps:
        cells = [f"{v[step]:.3f}" if step in v else "" for v in runs.values()]
        lines.append(f"| {step} | {' | '.join(cells)} |")
    return "\n".join(lines)


def first_reaching(values: dict[int, float], level: float) -> int | None:
    return next((step for step in sorted(values) if values[step] >= level), None)


def common_steps(runs: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Each run's values at the steps that every run either logged or had not reached (its last step is
    below them): no run gets a draw that another, still running, did not."""

    def shared(step: int) -> bool:
        return all(step in values or step > max(values, default=0) for values in runs.values())

    return {name: {s: v for s, v in values.items() if shared(s)} for name, values in runs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (each holding metrics.jsonl)")
    p.add_argument("--metric", default="val/accuracy")
    p.add_argument(
        "--reach", type=float, nargs="+", default=[], help="print the first step each run reached these"
    )
    p.add_argument(
        "--reach-fraction",
        type=float,
        nargs="+",
        default=[],
        help="--reach these fractions of the last run's final value",
    )
    p.add_argument(
        "--common-steps",
        action="store_true",
        help="judge the levels only at the steps every run logged the metric at",
    )
    args = p.parse_args(argv)
    runs = {run.name: read_metric(run, args.metric) for run in args.runs}
    print(table(runs, args.metric))
    judged = runs
    if args.common_steps:
        judged = common_steps(runs)
        shortest = min(max(values, default=0) for values in runs.values())
        listed = ", ".join(str(s) for s in sorted(next(iter(judged.values()))) if s <= shortest)
        print(f"\nlevels judged at the steps every run logged (to step {shortest}): {listed}")
    levels = [(f"{x:.3f}", x) for x in args.reach]
    if args.reach_fraction:
        last = runs[args.runs[-1].name]
        if not last:
            raise SystemExit(f"{args.runs[-1]}: no {args.metric} logged")
        final = last[max(last)]
        levels += [(f"{f:g} x {final:.3f} = {f * final:.3f}", f * final) for f in args.reach_fraction]
        print(f"\nlevels: fractions of {args.runs[-1].name}'s final {args.metric} ({final:.3f})")
    for label, level in levels:
        print(f"\n{args.metric} >= {label}:")
        for name, values in judged.items():
            step = first_reaching(values, level)
            last = max(runs[name], default=0)
            reached = f"step {step}" if step is not None else f"not within its {last} steps"
            print(f"  {name}: {reached}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
