#!/usr/bin/env python3
"""The end-to-end GRPO step, stage by stage, and the per-step overhead outside the stages' work.

    python benchmarks/step_bench.py [--steps 20] [--setups NAME ...] [--extra KEY=VALUE ...] [--out FILE.json]

Each setup is a real ``megagrpo train`` run (its own process; Ray, vLLM, Megatron) for ``--steps``
steps; the numbers are medians over the steps after the first ``SKIP_STEPS`` (start-up compilations),
read from its metrics.jsonl, whose timings the driver records every step:

- ``tiny_tp1`` / ``tiny_tp2``: ``make demo``'s config (64 prompts x 8, at most 8 new tokens, two
  optimizer steps per batch) at trainer TP = 1 (one rank, the size's best layout) and TP = 2 (the demo);
- ``m25_tp1`` / ``m25_tp2``: a ~25M-parameter model of the same family (8 layers, hidden 512, FFN 1536,
  8 heads over 4 KV groups, the character vocabulary) from random weights, 16 prompts x 8 per step
  and 128 new tokens (random weights rarely stop early), one optimizer step per batch.

Stages: generation (the engines' calls, rewards included), reward (decode + score), old and reference
logprobs, train, sync (bucketed broadcast, probe included) and probe, validation. Overhead:
``train - train inside the ranks`` is what a train call costs beyond the ranks' own work (Ray
scheduling, the batch's transfer through the object store, the results' return); ``step - the stages``
is the driver's own time between them (advantages, batch building, metrics, logging).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from common import RESULTS, TMP
from common.runs import metrics_rows, train_run
from common.sampling import machine_info
from common.tables import md_table, write_results

SKIP_STEPS = 3

M25 = [
    "model.tiny.num_layers=8",
    "model.tiny.hidden_size=512",
    "model.tiny.ffn_hidden_size=1536",
    "model.tiny.num_attention_heads=8",
    "model.tiny.num_query_groups=4",
    "warmup.steps=0",
    "grpo.num_prompts_per_step=16",
    "policy.mini_batch_size=128",
    "generation.max_new_tokens=128",
    "policy.micro_batch_max_tokens=4096",
]
SETUPS: dict[str, list[str]] = {
    "tiny_tp1": ["parallel.tensor_model_parallel_size=1"],
    "tiny_tp2": ["parallel.tensor_model_parallel_size=2"],
    "m25_tp1": [*M25, "parallel.tensor_model_parallel_size=1"],
    "m25_tp2": [*M25, "parallel.tensor_model_parallel_size=2"],
}
STAGES = ("generation_s", "logprobs_s", "train_s", "sync_s", "validation_s")
"""The stages a step is made of (reward_s is part of generation_s, probe_s part of sync_s)."""


def run(name: str, steps: int, root: Path, warmups: dict[str, Path], extra: list[str]) -> Path:
    family = name.split("_")[0]  # tiny or m25: the setups of a family share one warm-up
    overrides = ["logging.val_every=0", *SETUPS[name], *extra]
    run_dir = train_run(root, name, steps, overrides, warmups.get(family))
    if family not in warmups and (run_dir / "warmup").is_dir():
        warmups[family] = root / f"warmup_{family}"
        shutil.copytree(run_dir / "warmup", warmups[family])
    return run_dir


def summarize(run_dir: Path) -> dict:
    steps = [r for r in metrics_rows(run_dir) if r["step"] > SKIP_STEPS]

    def med(key: str) -> float:
        values = [r.get(f"timing/{key}", 0.0) for r in steps]
        return statistics.median(values) if values else 0.0

    out = {key: med(key) for key in (*STAGES, "reward_s", "probe_s", "train_rank_s", "step_s")}
    out["train_call_overhead_s"] = statistics.median(
        [r["timing/train_s"] - r["timing/train_rank_s"] for r in steps]
    )
    out["driver_overhead_s"] = statistics.median(
        [r["timing/step_s"] - sum(r.get(f"timing/{k}", 0.0) for k in STAGES) for r in steps]
    )
    out["tokens_per_s"] = statistics.median([r["throughput/tokens_per_s"] for r in steps])
    out["steps_measured"] = len(steps)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides for every setup")
    p.add_argument("--out", type=Path, default=RESULTS / "step.json")
    args = p.parse_args(argv)
    root = TMP / "step_bench"
    shutil.rmtree(root, ignore_errors=True)
    report = {
        "benchmark": "end-to-end GRPO step: stages and overhead",
        "command": " ".join(["python", *(sys.argv if argv is None else ["benchmarks/step_bench.py", *argv])]),
        "machine": machine_info("torch", "vllm", "megatron.core"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "setups": {},
    }
    warmups: dict[str, Path] = {}
    for name in args.setups:
        report["setups"][name] = summarize(run(name, args.steps, root, warmups, args.extra))
    rows = []
    for name, r in report["setups"].items():
        step = r["step_s"]

        def cell(seconds: float, step: float = step) -> str:
            return f"{seconds:.3f} ({seconds / step:.0%})"

        rows.append(
            [
                name,
                f"{step:.3f}",
                f"{r['tokens_per_s']:.0f}",
                cell(r["generation_s"]),
                cell(r["reward_s"]),
                cell(r["logprobs_s"]),
                cell(r["train_s"]),
                cell(r["train_call_overhead_s"]),
                cell(r["sync_s"]),
                cell(r["probe_s"]),
                cell(r["driver_overhead_s"]),
            ]
        )
    lines = [
        "# The GRPO step, stage by stage",
        "",
        f"Command: `{report['command']}`; machine: {report['machine']['cpu']}, "
        f"load average at start {report['machine'].get('loadavg_at_start')}.",
        f"Medians over steps {SKIP_STEPS + 1}..{args.steps}, seconds (and share of the step). Reward is "
        "part of generation, probe part of sync; train call overhead = train minus the time inside the "
        "ranks (Ray: scheduling, the batch through the object store); driver = step minus the stages.",
        "",
        *md_table(
            "setup | step s | tokens/s | generation | reward | old/ref logprobs | train | train call "
            "overhead | sync | probe | driver",
            rows,
        ),
    ]
    write_results(args.out, report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
