"""Summarise a `make twin` run into benchmarks/results/twin.{json,md}.

Reads what `make twin` leaves under runs/: the pass@k reports of the made model and of stage 3's export
(`runs/cpu-twin-eval/{before,after}/eval.json`), the wall time of each stage
(`runs/cpu-twin-eval/stage_times.txt`) and each stage's metrics.jsonl (rewards, validation, and the
reward pool's timeouts and errors per step).

    make twin
    python benchmarks/twin_report.py [--sft-log FILE] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from megagrpo.ckpt.durable import atomic_write

ROOT = Path(__file__).resolve().parents[1]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _family(problem: str) -> str:
    """The generator family of a validation problem (megagrpo.data.math_problems), from its text."""
    if problem.startswith("Solve"):
        return "linear"
    if problem.startswith("What is"):
        return "percentage"
    return "fractions" if "\\frac" in problem else "arithmetic"


def _by_family(report: dict, problems: list[str]) -> dict[str, float]:
    """pass@1 per problem family, and the share of first samples that box their answer."""
    sums: dict[str, list[float]] = {}
    for p in report["problems"]:
        sums.setdefault(_family(problems[p["index"]]), []).append(p["pass_at"]["1"])
    out = {f: sum(v) / len(v) for f, v in sorted(sums.items())}
    out["first samples boxed"] = sum("\\boxed" in p["example"] for p in report["problems"]) / len(
        report["problems"]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=str(ROOT / "runs"))
    parser.add_argument("--sft-log", default=None, help="the output of the made model's SFT, if made apart")
    parser.add_argument("--note", default="", help="a line on the machine's state (load average)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "twin"))
    args = parser.parse_args()
    runs = Path(args.runs)
    before = json.loads((runs / "cpu-twin-eval" / "before" / "eval.json").read_text())
    after = json.loads((runs / "cpu-twin-eval" / "after" / "eval.json").read_text())
    times = dict(
        re.findall(r"stage (\d): (\d+) s wall", (runs / "cpu-twin-eval" / "stage_times.txt").read_text())
    )
    stages = []
    for i in (1, 2, 3):
        m = _metrics(runs / f"cpu-twin-{i}")
        steps = [r for r in m if "reward/mean" in r]
        vals = [r for r in m if "val/accuracy" in r]
        stages.append(
            {
                "stage": i,
                "wall_s": int(times[str(i)]),
                "steps": len(steps),
                "reward_first_5": sum(r["reward/mean"] for r in steps[:5]) / 5,
                "reward_last_5": sum(r["reward/mean"] for r in steps[-5:]) / 5,
                "val_greedy_first": vals[0]["val/accuracy"],
                "val_greedy_last": vals[-1]["val/accuracy"],
                "val_pass1_first": vals[0].get("val/pass@1"),
                "val_pass1_last": vals[-1].get("val/pass@1"),
                "truncated_frac_last_5": sum(r["response/truncated_frac"] for r in steps[-5:]) / 5,
                "reward_timeouts": sum(r["reward/timeouts"] for r in steps),
                "reward_errors": sum(r["reward/errors"] for r in steps),
            }
        )
    val_file = runs / "cpu-twin-data" / "val.jsonl"
    problems = [json.loads(line)["problem"] for line in val_file.read_text().splitlines()]
    families = {"before": _by_family(before, problems), "after": _by_family(after, problems)}
    sft = None
    if args.sft_log:
        found = re.search(r"real\s+(\d+)m([\d.]+)s", Path(args.sft_log).read_text())
        sft = int(found.group(1)) * 60 + float(found.group(2)) if found else None
    result = {
        "before": before["summary"],
        "after": after["summary"],
        "settings": after["settings"],
        "stages": stages,
        "by_family": families,
        "sft_wall_s": sft,
        "note": args.note,
    }
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    ks = list(before["summary"])
    lines = [
        "# make twin: the CPU twin of the DeepScaleR recipe",
        "",
        f"`make twin` on the 2-core machine. {args.note}",
        "",
        f"pass@k on {after['settings']['problems']} problems, {after['settings']['samples']} samples each "
        f"(temperature {after['settings']['temperature']}, top_p {after['settings']['top_p']}, "
        f"{after['settings']['max_tokens']} new tokens at most):",
        "",
        "| model | " + " | ".join(ks) + " |",
        "|---|" + "---:|" * len(ks),
        "| made model (before stage 1) | " + " | ".join(f"{before['summary'][k]:.3f}" for k in ks) + " |",
        "| stage 3's export (after) | " + " | ".join(f"{after['summary'][k]:.3f}" for k in ks) + " |",
        "",
        "| stage | context | wall s | steps | reward first 5 -> last 5 | greedy val first -> last | "
        "val pass@1 first -> last | truncated (last 5) | reward timeouts | reward errors |",
        "|---:|---:|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for s, ctx in zip(stages, (96, 160, 256), strict=True):
        lines.append(
            f"| {s['stage']} | {ctx} | {s['wall_s']} | {s['steps']} | {s['reward_first_5']:.3f} -> "
            f"{s['reward_last_5']:.3f} | {s['val_greedy_first']:.3f} -> {s['val_greedy_last']:.3f} | "
            f"{s['val_pass1_first']:.3f} -> {s['val_pass1_last']:.3f} | {s['truncated_frac_last_5']:.3f} | "
            f"{s['reward_timeouts']} | {s['reward_errors']} |"
        )
    lines += [
        "",
        "pass@1 by problem family, and the share of first samples (one per problem) that box their answer:",
        "",
        "| model | " + " | ".join(families["before"]) + " |",
        "|---|" + "---:|" * len(families["before"]),
        *(
            f"| {name} | " + " | ".join(f"{v:.3f}" for v in families[key].values()) + " |"
            for key, name in (("before", "made model"), ("after", "stage 3's export"))
        ),
    ]
    if sft is not None:
        lines += ["", f"Model making (BPE + SFT, cpu_twin_model.yaml): {sft:.0f} s wall."]
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
