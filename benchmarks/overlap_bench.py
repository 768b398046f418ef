#!/usr/bin/env python3
"""Generation overlapped with training: the demo's GRPO run at grpo.max_staleness 0 and 1.

    python benchmarks/overlap_bench.py [--steps 300] [--tp 1] [--staleness 0 1] [--out FILE.json]

The embedded tiny config (``make demo``'s: 64 prompts x 8 per step, validation every 50 steps) from
one shared warm-up, once per staleness, one after the other; with ``--tp 1`` the trainer is one rank
of one thread and the engine one process, so on the 2-core machine each side has a core of its own
(the OS places the two busy processes on the two cores; nothing is pinned explicitly). From each
run's metrics.jsonl (steps after the first 5, medians): step time and tokens/s, and each side's busy
and idle time per step (``timing/engine_idle_s``, ``timing/trainer_idle_s``). The bound for the
overlapped run is max(generation, logprobs + train + sync) of the sequential run: the step time if
the two sides overlapped perfectly. Targets: staleness-1 step <= 1.15x that bound; validation
accuracy at the last step within 5 points of the sequential run's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from common import RESULTS, TMP
from common.runs import metrics_rows, run_report, train_run
from common.tables import md_table, write_results

SKIP_STEPS = 5  # start-up steps (first compilations, the first overlapped batch) left out of medians


def run(args, staleness: int, root: Path, warmup: Path | None) -> Path:
    overrides = [
        f"grpo.max_staleness={staleness}",
        f"parallel.tensor_model_parallel_size={args.tp}",
        "cluster.cpu_threads=1",  # one core each side: the sequential run's rank would take both
    ]
    return train_run(root, f"staleness_{staleness}", args.steps, overrides, warmup)


def summarize(run_dir: Path) -> dict:
    rows = metrics_rows(run_dir)
    steps = [r for r in rows if r["step"] > SKIP_STEPS]

    def med(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else 0.0

    val = [r for r in rows if "val/accuracy" in r]
    return {
        "steps": len(rows) - 1,
        "step_s": med("timing/step_s"),
        "tokens_per_s": med("throughput/tokens_per_s"),
        "generation_s": med("timing/generation_s"),
        "generation_ahead_s": med("timing/generation_ahead_s"),
        "wait_generation_s": med("timing/wait_generation_s"),
        "logprobs_s": med("timing/logprobs_s"),
        "train_s": med("timing/train_s"),
        "sync_s": med("timing/sync_s"),
        "engine_idle_s": med("timing/engine_idle_s"),
        "trainer_idle_s": med("timing/trainer_idle_s"),
        "staleness_max": max((r.get("staleness/max", 0.0) for r in rows if r["step"] > 0), default=0.0),
        "val_accuracy": {r["step"]: r["val/accuracy"] for r in val},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tp", type=int, default=1, help="trainer tensor parallel size")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", type=Path, default=RESULTS / "overlap.json")
    args = p.parse_args(argv)
    root = TMP / "overlap_bench"
    shutil.rmtree(root, ignore_errors=True)
    what = "GRPO step, generation overlapped with training (grpo.max_staleness) vs sequential"
    report = run_report(what, "overlap_bench.py", argv, args)
    report["runs"] = {}
    warmup = None
    for k in args.staleness:
        run_dir = run(args, k, root, warmup)
        if warmup is None:  # the first run's warm-up is every later run's
            warmup = root / "warmup"
            shutil.copytree(run_dir / "warmup", warmup)
        report["runs"][k] = summarize(run_dir)
    rows = []
    seq = report["runs"].get(0)
    for k, r in report["runs"].items():
        bound = max(seq["generation_s"], seq["logprobs_s"] + seq["train_s"] + seq["sync_s"]) if seq else None
        last = max(r["val_accuracy"]) if r["val_accuracy"] else None
        r["step_over_bound"] = r["step_s"] / bound if bound else None
        rows.append(
            [
                k,
                f"{r['step_s']:.3f}",
                f"{r['tokens_per_s']:.0f}",
                f"{r['generation_s'] or r['generation_ahead_s']:.3f}",
                f"{r['logprobs_s'] + r['train_s']:.3f}",
                f"{r['sync_s']:.3f}",
                f"{r['engine_idle_s']:.3f}",
                f"{r['trainer_idle_s']:.3f}",
                f"{r['step_over_bound']:.2f}" if bound else "-",
                f"{r['val_accuracy'][last]:.1%} (step {last})" if last is not None else "-",
            ]
        )
    lines = [
        "# Generation overlapped with training (grpo.max_staleness)",
        "",
        f"Command: `{report['command']}`; machine: {report['machine']['cpu']}, "
        f"load average at start {report['machine'].get('loadavg_at_start')}.",
        f"Medians over steps {SKIP_STEPS + 1}..{args.steps}, seconds per step. The bound is max(generation, "
        "logprobs + train + sync) of the staleness-0 run. Targets: staleness 1 <= 1.15x the bound; "
        "validation accuracy within 5 points of staleness 0.",
        "",
        *md_table(
            "staleness | step s | tokens/s | generation s | logprobs + train s | sync s | engine idle s "
            "| trainer idle s | step / bound | val. accuracy",
            rows,
        ),
    ]
    write_results(args.out, report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
