#!/usr/bin/env python3
"""Scaling curves: GRPO step time against prompts per step and against response length, and weight
sync time against model size.

    python benchmarks/scaling_bench.py [--steps 6] [--prompts 16 32 64 128] [--lengths 16 32 64 128 224]
        [--sizes-mb 150 400 800] [--sync-from SYNC.json] [--only prompts lengths sync] [--extra KEY=VALUE ...]
        [--out FILE.json]

- ``prompts``: ``make demo``'s config at TP = 1 (its model after its warm-up, at most 8 new tokens,
  two optimizer steps per batch: the old-logprob forward of the second is inside train), with
  ``--prompts`` prompts x 8 per step; the 64-prompt point is step_bench's ``tiny_tp1`` setup;
- ``lengths``: the same model shape from random weights (its responses mostly run to the budget),
  16 prompts x 8, ``generation.max_new_tokens`` in ``--lengths`` (the context widened to hold the
  longest, the same at every point);
- ``sync``: ``sync_bench.py`` at each ``--sizes-mb`` (one engine, 512 MB buckets, the sync and the
  flat broadcast of the same bytes, 3 repeats); with ``--sync-from`` (the suite: its ``sync`` run),
  the point of that report's size is its one-engine 512 MB row, not measured again.

Each step-time point is a real ``megagrpo train`` run (its own process; in a suite, a run that
step_bench made already with the same config and steps is read back, not made again); ``--extra``
overrides go to every one. Its time is the median over the steps after the first ``SKIP``, split
into the stages step_bench reports. For each curve the
report gives the time per unit of work (per rollout, per generated token, per GB) at every point:
flat means linear growth, rising means worse than linear. Writes JSON, Markdown and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import GB, RESULTS, TMP
from common.runs import metrics_rows, run_report, train_run
from common.tables import md_table, write_results

HERE = Path(__file__).resolve().parent
SKIP = 2
STAGES = ("generation_s", "logprobs_s", "train_s", "sync_s")
G = 8


def step_point(
    root: Path, name: str, steps: int, overrides: list[str], warmup: Path | None, extra: list[str]
) -> dict:
    run_dir = train_run(root, name, steps, ["logging.val_every=0", *overrides, *extra], warmup)
    rows = [r for r in metrics_rows(run_dir) if r["step"] > SKIP]
    out = {k: statistics.median(r.get(f"timing/{k}", 0.0) for r in rows) for k in (*STAGES, "step_s")}
    out["response_tokens"] = statistics.median(r["response/length_mean"] for r in rows)
    out["run_dir"] = str(run_dir)
    return out


def prompts_curve(root: Path, counts: list[int], steps: int, extra: list[str]) -> list[dict]:
    points, warmup = [], None
    for n in counts:
        over = ["parallel.tensor_model_parallel_size=1", f"grpo.num_prompts_per_step={n}"]
        # Two optimizer steps per batch, as the demo (at 64 prompts: its config).
        over.append(f"policy.mini_batch_size={n * G // 2}")
        p = step_point(root, f"prompts_{n}", steps, over, warmup, extra)
        if warmup is None:
            warmup = root / "warmup_tiny"
            shutil.copytree(Path(p["run_dir"]) / "warmup", warmup)
        points.append(
            {
                "prompts": n,
                "rollouts": n * G,
                "optimizer_steps": 2,
                **p,
                "s_per_rollout": p["step_s"] / (n * G),
            }
        )
    return points


def lengths_curve(root: Path, lengths: list[int], steps: int, extra: list[str]) -> list[dict]:
    points, warmup = [], None
    context = max(256, 32 + max(lengths))  # one shape for all points: they share the (random) model
    for n in lengths:
        over = [
            "parallel.tensor_model_parallel_size=1",
            "warmup.steps=0",
            "grpo.num_prompts_per_step=16",
            f"policy.mini_batch_size={16 * G}",
            f"generation.max_new_tokens={n}",
            f"model.seq_length={context}",
            f"model.tiny.max_position_embeddings={context}",
            "policy.micro_batch_max_tokens=4096",
        ]
        p = step_point(root, f"length_{n}", steps, over, warmup, extra)
        if warmup is None:
            warmup = root / "warmup_random"
            shutil.copytree(Path(p["run_dir"]) / "warmup", warmup)
        tokens = p["response_tokens"] * 16 * G
        points.append(
            {"max_new_tokens": n, **p, "generated_tokens": tokens, "ms_per_token": 1e3 * p["step_s"] / tokens}
        )
    return points


def measured_sync_row(report_path: Path | None, size: int) -> dict | None:
    """The row of an earlier sync_bench report (``--sync-from``) this curve's point at ``size``
    would measure again: the same model size, one engine, 512 MB buckets, default allocator."""
    if report_path is None or not report_path.is_file():
        return None
    report = json.loads(report_path.read_text())
    if report["args"]["size_mb"] != size or "default" not in report["variants"]:
        return None
    rows = report["variants"]["default"]["results"]
    return next((r for r in rows if r["engines"] == 1 and r["bucket_mb"] == 512), None)


def measure_sync_row(size: int) -> dict:
    """sync_bench.py at ``size`` (one engine, 512 MB buckets, default allocator): its one row."""
    name = f"tmp/scaling_sync_{size}"
    cmd = [sys.executable, str(HERE / "sync_bench.py"), "--size-mb", str(size), "--engines", "1"]
    cmd += ["--bucket-mb", "512", "--variants", "default", "--repeat", "3", "--output", name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"sync_bench --size-mb {size} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    (row,) = json.loads((RESULTS / f"{name}.json").read_text())["variants"]["default"]["results"]
    return row


def sync_curve(root: Path, sizes: list[int], reuse: Path | None = None) -> list[dict]:
    points = []
    for size in sizes:
        r = measured_sync_row(reuse, size)
        source = None if r is None else str(reuse)
        if r is None:
            r = measure_sync_row(size)
        gb = r["total_bytes"] / GB
        points.append(
            {
                "size_mb": size,
                "bytes": r["total_bytes"],
                "sync_s": r["sync_s"],
                "flat_s": r["flat_s"],
                "s_per_gb": r["sync_s"] / gb,
                "flat_s_per_gb": r["flat_s"] / gb,
                "from": source,
            }
        )
        print(f"[scaling_bench] sync {gb:.2f} GB: {r['sync_s']:.2f} s (flat {r['flat_s']:.2f} s)", flush=True)
    return points


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = report["curves"]
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (name, points) in zip(axes[0], curves.items(), strict=True):
        if name == "sync":
            x = [p["bytes"] / GB for p in points]
            ax.plot(x, [p["sync_s"] for p in points], "o-", label="sync")
            ax.plot(x, [p["flat_s"] for p in points], "s--", label="flat broadcast")
            ax.set(xlabel="model size (GB, fp32)", ylabel="seconds", title="weight sync, 1 engine")
        else:
            key = "rollouts" if name == "prompts" else "generated_tokens"
            x = [p[key] for p in points]
            bottom = [0.0] * len(points)
            for stage in STAGES:
                values = [p[stage] for p in points]
                ax.bar(range(len(x)), values, bottom=bottom, label=stage.removesuffix("_s"))
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.plot(range(len(x)), [p["step_s"] for p in points], "k.-", label="step")
            ax.set_xticks(range(len(x)), [f"{v:.0f}" for v in x])
            label = "rollouts per step" if name == "prompts" else "generated tokens per step"
            ax.set(xlabel=label, ylabel="seconds", title=f"GRPO step vs {name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    c = report["curves"]
    lines = [
        "# Scaling curves",
        "",
        f"Command: `{report['command']}`; machine: {report['machine']['cpu']}, "
        f"{report['machine']['cpus_usable']} CPUs, load average at start "
        f"{report['machine']['loadavg_at_start']}. "
        f"Step times: medians over each run's steps after the first {SKIP}. Chart: `scaling.png`.",
    ]
    if "prompts" in c:
        rows = [
            [
                p["prompts"],
                p["rollouts"],
                f"{p['step_s']:.3f}",
                *(f"{p[s]:.3f}" for s in STAGES),
                f"{1e3 * p['s_per_rollout']:.2f}",
            ]
            for p in c["prompts"]
        ]
        lines += [
            "",
            "## Step time vs prompts per step (tiny model, TP 1, 8 new tokens at most, two optimizer "
            "steps per batch)",
            "",
        ]
        lines += md_table(
            "prompts | rollouts | step s | generation | old logprobs | train | sync | ms per rollout", rows
        )
    if "lengths" in c:
        rows = [
            [
                p["max_new_tokens"],
                f"{p['response_tokens']:.1f}",
                f"{p['step_s']:.3f}",
                *(f"{p[s]:.3f}" for s in STAGES),
                f"{p['ms_per_token']:.3f}",
            ]
            for p in c["lengths"]
        ]
        lines += ["", "## Step time vs response length (random tiny model, TP 1, 16 x 8 rollouts)", ""]
        lines += md_table(
            "max new tokens | mean response tokens | step s | generation | old logprobs | train | sync | "
            "ms per generated token",
            rows,
        )
    if "sync" in c:
        rows = [
            [
                f"{p['size_mb']} (from {Path(p['from']).name})" if p.get("from") else p["size_mb"],
                f"{p['bytes'] / GB:.3f}",
                f"{p['sync_s']:.3f}",
                f"{p['flat_s']:.3f}",
                f"{p['s_per_gb']:.2f}",
                f"{p['flat_s_per_gb']:.2f}",
            ]
            for p in c["sync"]
        ]
        lines += ["", "## Weight sync vs model size (one engine, 512 MB buckets, fp32)", ""]
        lines += md_table("--size-mb | GB | sync s | flat broadcast s | sync s per GB | flat s per GB", rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 224])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[150, 400, 800])
    p.add_argument(
        "--only", nargs="+", choices=["prompts", "lengths", "sync"], default=["prompts", "lengths", "sync"]
    )
    p.add_argument("--extra", nargs="*", default=[], help="KEY=VALUE overrides for every step-time run")
    p.add_argument(
        "--sync-from",
        type=Path,
        help="a sync_bench report (the suite's sync.json): its one-engine 512 MB row is the sync point "
        "of its --size-mb, not measured again",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    args = p.parse_args(argv)
    if args.steps <= SKIP:
        p.error(f"--steps must be above {SKIP} (the first {SKIP} steps are not timed)")
    root = TMP / "scaling_bench"
    shutil.rmtree(root, ignore_errors=True)
    what = "scaling: step time vs prompts and response length, sync time vs model size"
    report = run_report(what, "scaling_bench.py", argv, args)
    report["curves"] = {}
    if "prompts" in args.only:
        report["curves"]["prompts"] = prompts_curve(root, args.prompts, args.steps, args.extra)
    if "lengths" in args.only:
        report["curves"]["lengths"] = lengths_curve(root, args.lengths, args.steps, args.extra)
    if "sync" in args.only:
        report["curves"]["sync"] = sync_curve(root, args.sizes_mb, args.sync_from)
    plot(report, args.out.with_suffix(".png"))
    write_results(args.out, report, markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
