"""Scaling: GRPO step time against prompts per step and against response length; weight sync time
against model size.

    python -m benchmarks.scaling [--prompts 16 64 128] [--lengths 16 64 224] [--sizes-mb 100 256 400]
        [--sync-from SYNC.json] [--only prompts lengths sync] [--repeat 3] [--quick]

- ``prompts``: ``make demo``'s config at TP 1 (its warmed-up model, at most 8 new tokens, two
  optimizer steps per batch) with ``--prompts`` prompts x 8 per step;
- ``lengths``: the same shape from random weights (its responses mostly run to the budget),
  16 prompts x 8, ``generation.max_new_tokens`` in ``--lengths`` (one context for all points);
- ``sync``: ``benchmarks.sync`` at each ``--sizes-mb`` (one engine, 512 MB buckets); with
  ``--sync-from`` (the suite: its ``sync`` results), the point of that run's size is read back.

A step-time point is a real ``megagrpo train`` run whose samples are its ``--repeat`` steps after
the first ``SKIP`` (``--extra`` overrides go to every run). Per point the time per unit of work:
per rollout, per generated token, per GB; growth is no worse than linear when the largest point's
time per unit is no higher than the smallest's (10% slack for tokens).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .common import TMP, record
from .common.record import Measurement, find, ratio
from .common.runs import metrics_rows, train_run
from .step import QUICK_RUN

SKIP = 2
G = 8
QUICK = {"only": ["prompts"], "prompts": [64], "repeat": 3, "extra": list(QUICK_RUN)}
"""The quick prompts point is the quick step's run (the same config and steps): in a suite, made once."""


def parse_args(argv=None):
    p = record.parser("scaling", __doc__, repeat=3)
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 224])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 256, 400])
    p.add_argument(
        "--only", nargs="+", choices=["prompts", "lengths", "sync"], default=["prompts", "lengths", "sync"]
    )
    p.add_argument("--extra", nargs="*", default=[], help="KEY=VALUE overrides for every step-time run")
    p.add_argument(
        "--sync-from", type=Path, help="a benchmarks.sync results file whose size's point is read back"
    )
    return record.parse(p, argv, QUICK)


def step_rows(
    root: Path, name: str, args, overrides: list[str], warmup: Path | None
) -> tuple[list[dict], Path]:
    run_dir = train_run(
        root, name, SKIP + args.repeat, ["logging.val_every=0", *overrides, *args.extra], warmup
    )
    return [r for r in metrics_rows(run_dir) if r["step"] > SKIP], run_dir


def prompts_curve(root: Path, args) -> list[Measurement]:
    out, warmup = [], None
    for n in args.prompts:
        over = ["parallel.tensor_model_parallel_size=1", f"grpo.num_prompts_per_step={n}"]
        over.append(f"policy.mini_batch_size={n * G // 2}")  # two optimizer steps per batch, as the demo
        rows, run_dir = step_rows(root, f"prompts_{n}", args, over, warmup)
        if warmup is None:
            warmup = shutil.copytree(run_dir / "warmup", root / "warmup_tiny")
        ms = [1e3 * r["timing/step_s"] / (n * G) for r in rows]
        out.append(Measurement("step time per rollout", ms, "ms", {"prompts": n, "rollouts": n * G}))
    return out


def lengths_curve(root: Path, args) -> list[Measurement]:
    out, warmup = [], None
    context = max(256, 32 + max(args.lengths))  # one shape for every point: they share the random model
    for n in args.lengths:
        over = [
            *("parallel.tensor_model_parallel_size=1", "warmup.steps=0", "grpo.num_prompts_per_step=16"),
            *(
                f"policy.mini_batch_size={16 * G}",
                f"generation.max_new_tokens={n}",
                f"model.seq_length={context}",
            ),
            *(f"model.tiny.max_position_embeddings={context}", "policy.micro_batch_max_tokens=4096"),
        ]
        rows, run_dir = step_rows(root, f"length_{n}", args, over, warmup)
        if warmup is None:
            warmup = shutil.copytree(run_dir / "warmup", root / "warmup_random")
        ms = [1e3 * r["timing/step_s"] / (r["response/length_mean"] * 16 * G) for r in rows]
        tokens = round(sum(r["response/length_mean"] for r in rows) / len(rows) * 16 * G)
        out.append(
            Measurement("step time per generated token", ms, "ms", {"max_new_tokens": n, "tokens": tokens})
        )
    return out


def sync_point(size: int, reuse: Path | None, root: Path) -> tuple[Measurement, Measurement]:
    """(sync, flat) at ``size`` MB, one engine, 512 MB buckets: from ``reuse`` when it measured them."""
    path = root / f"sync_{size}.json"
    if reuse is not None and reuse.is_file() and float(record.read(reuse)["args"]["size_mb"]) == size:
        path = reuse
    else:
        cmd = [sys.executable, "-m", "benchmarks.sync", "--size-mb", str(size), "--engines", "1"]
        cmd += ["--bucket-mb", "512", "--repeat", "3", "--out", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"benchmarks.sync --size-mb {size} failed:\n{done.stderr[-3000:]}")
    ms, at = record.read(path)["measurements"], {"engines": 1, "bucket_mb": 512}
    return find(ms, "sync", **at), find(ms, "flat broadcast of the same bytes", **at)


def sync_curve(root: Path, args) -> list[Measurement]:
    out = []
    for size in args.sizes_mb:
        sync, flat = sync_point(size, args.sync_from, root)
        gb = sync.settings["bytes"] / 1e9
        s = {"size_mb": size, "gb": round(gb, 3)}
        out.append(Measurement("sync time per GB", [x / gb for x in sync.samples], "s/GB", s))
        out.append(Measurement("flat broadcast time per GB", [x / gb for x in flat.samples], "s/GB", s))
    return out


def growth(curve: list[Measurement], name: str, key: str, target: str) -> list[Measurement]:
    """The largest point's time per unit over the smallest's: no worse than linear when <= 1."""
    points = [m for m in curve if m.name == name]
    if len(points) < 2:
        return []
    lo, hi = points[0], points[-1]
    s = {key: f"{lo.settings[key]} -> {hi.settings[key]}"}
    n = min(len(lo.samples), len(hi.samples))
    name = f"{name}: largest / smallest point"
    return [ratio(name, hi.samples[:n], lo.samples[:n], settings=s, target=target, headline=True)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = TMP / "scaling"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out = []
    if "prompts" in args.only:
        curve = prompts_curve(root, args)
        out += curve + growth(curve, "step time per rollout", "rollouts", "<= 1")
    if "lengths" in args.only:
        curve = lengths_curve(root, args)
        out += curve + growth(curve, "step time per generated token", "tokens", "<= 1.1")
    if "sync" in args.only:
        curve = sync_curve(root, args)
        out += curve + growth(curve, "sync time per GB", "size_mb", "<= 1")
    what = "step time against prompts per step and response length; sync time against model size"
    return record.write(args, "scaling", what, out, packages=("torch", "vllm", "megatron.core"))


if __name__ == "__main__":
    main()
