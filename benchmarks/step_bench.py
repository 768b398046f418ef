#!/usr/bin/env python3
"""The end-to-end GRPO step, stage by stage, and the per-step overhead outside the stages' work.

    python benchmarks/step_bench.py [--steps tiny=20 m25=4] [--setups NAME ...] [--extra KEY=VALUE ...]
                                    [--out FILE.json]

Each setup is a real ``megagrpo train`` run (its own process; Ray, vLLM, Megatron) for ``--steps``
steps of its family (a bare N: every family); the numbers are medians over the steps after its
family's ``SKIP_STEPS`` (start-up allocations), read from its metrics.jsonl, whose timings the driver records
every step:

- ``tiny_tp1`` / ``tiny_tp2``: ``make demo``'s config (64 prompts x 8, at most 8 new tokens, two
  optimizer steps per batch) at trainer TP = 1 (one rank, the size's best layout) and TP = 2 (the demo);
- ``m25_tp1`` / ``m25_tp2``: a ~25M-parameter model of the same family (8 layers, hidden 512, FFN 1536,
  8 heads over 4 KV groups, the character vocabulary) from random weights, 16 prompts x 8 per step
  and 128 new tokens (``generation.ignore_eos``: every response runs to 128), one optimizer step per
  batch.

Stages: generation (the engines' calls, rewards included), reward (decode + score), reference
logprobs (with a KL term), train (with the old-logprob forward of a batch's later mini-batches), sync
(bucketed broadcast, probe included) and probe, validation. Overhead:
``train - train inside the ranks`` is what a train call costs beyond the ranks' own work (Ray
scheduling, the batch's transfer through the object store, the results' return); ``step - the stages``
is the driver's own time between them (advantages, batch building, metrics, logging).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

from common import RESULTS, TMP
from common.runs import metrics_rows, per_family, run_report, train_run
from common.tables import md_table, write_results

SKIP_STEPS = {"tiny": 2, "m25": 1}
"""Start-up steps left out of the medians, by family: the first step allocates (Megatron's buffers,
vLLM's first batches; ~25M: 29.6 s against 23 s after it), the tiny model's second wobbles too."""

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
FIXED_WORK = ["generation.ignore_eos=true"]
"""Every response runs to 128 tokens: each step does the same work, and the compute bound
(bound_bench.py) replays exactly the step's requests. (peer_bench.py leaves it out: TRL stops at EOS.)"""
SETUPS: dict[str, list[str]] = {
    "tiny_tp1": ["parallel.tensor_model_parallel_size=1"],
    "tiny_tp2": ["parallel.tensor_model_parallel_size=2"],
    "m25_tp1": [*M25, *FIXED_WORK, "parallel.tensor_model_parallel_size=1"],
    "m25_tp2": [*M25, *FIXED_WORK, "parallel.tensor_model_parallel_size=2"],
}
STEPS = {"tiny": 20, "m25": 4}
"""GRPO steps per run by family: medians over the steps after SKIP_STEPS."""
STAGES = ("generation_s", "logprobs_s", "train_s", "sync_s", "validation_s")
"""The stages a step is made of (reward_s is part of generation_s, probe_s part of sync_s)."""


def family(name: str) -> str:
    """A setup's family (``tiny_tp2`` -> ``tiny``): its model, and the warm-up its setups share."""
    return name.split("_")[0]


def setup_overrides(name: str, extra: list[str] = ()) -> list[str]:
    """The ``megagrpo train`` overrides of setup ``name`` (no validation: the step alone)."""
    return ["logging.val_every=0", *SETUPS[name], *extra]


def run(
    name: str, steps: int, root: Path, warmups: dict[str, Path], extra: list[str], profile: Path | None = None
) -> Path:
    run_dir = train_run(root, name, steps, setup_overrides(name, extra), warmups.get(family(name)), profile)
    kind = family(name)
    if kind not in warmups and (run_dir / "warmup").is_dir():
        warmups[kind] = root / f"warmup_{kind}"
        shutil.copytree(run_dir / "warmup", warmups[kind])
    return run_dir


def measured_rows(run_dir: Path, name: str) -> list[dict]:
    """The metrics rows of setup ``name``'s run that its medians take (after its start-up steps)."""
    return [r for r in metrics_rows(run_dir) if r["step"] > SKIP_STEPS[family(name)]]


def summarize(run_dir: Path, name: str) -> dict:
    steps = measured_rows(run_dir, name)

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


def driver_profile(name: str, root: Path, warmups: dict[str, Path], extra: list[str], steps: tuple[int, int]):
    """Where the driver process's time goes per step: setup ``name`` run twice under cProfile, for
    ``steps[0]`` and ``steps[1]`` steps; each function's own time (cProfile's tottime, wall clock)
    in the longer run minus the shorter, divided by the extra steps, so start-up and shutdown cancel.
    Time the driver spends waiting on the actors (Ray's get, inside ``ray/_private/worker.py``) is
    the stages' work seen from the driver; the rest is the driver's own overhead."""
    import pstats

    own = []
    for n in steps:
        prof = root / f"profile_{n}" / "driver.prof"
        prof.parent.mkdir(parents=True, exist_ok=True)
        run(name, n, prof.parent, warmups, extra, profile=prof)
        own.append({f: row[2] for f, row in pstats.Stats(str(prof)).stats.items()})
    extra_steps = steps[1] - steps[0]
    per_step = {f: (own[1].get(f, 0.0) - own[0].get(f, 0.0)) / extra_steps for f in own[1]}
    by_group: dict[str, float] = {}
    for func, seconds in per_step.items():
        by_group[profile_group(func)] = by_group.get(profile_group(func), 0.0) + seconds
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:15]
    return {
        "setup": name,
        "steps": list(steps),
        "per_step_s_by_group": dict(sorted(by_group.items(), key=lambda kv: -kv[1])),
        "top_functions": [{"function": f"{f[0]}:{f[1]}({f[2]})", "per_step_s": s} for f, s in top],
    }


def profile_group(func: tuple[str, int, str]) -> str:
    """A profiled function's group: the package its file is in, or for a C function what it does."""
    filename, _, name = func
    if filename == "~":
        waits = ("acquire", "select", "poll", "sleep", "wait", "recv", "get_objects")
        if any(w in name for w in waits):
            return "C: waits (locks, sockets, Ray object fetch)"
        if any(w in name for w in ("pickle", "dumps", "loads")):
            return "C: serialization"
        return "C: other builtins"
    if "ray/_private/worker.py" in filename:
        return "ray: get/wait (the actors' work)"
    for package in ("megagrpo", "ray", "torch", "numpy", "transformers", "vllm", "yaml", "tqdm", "rich"):
        if f"/{package}/" in filename:
            return package
    return "other Python"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", nargs="+", default=[], help="FAMILY=N (tiny=20 m25=6) or N: GRPO steps per run")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides for every setup")
    p.add_argument(
        "--profile",
        choices=list(SETUPS),
        help="also profile this setup's driver process (two runs under cProfile: its --steps and 3 x that)",
    )
    p.add_argument(
        "--bound",
        nargs="*",
        choices=list(SETUPS),
        help="setups whose step is also compared with its compute bound (bound_bench.py; "
        "default: the m25 setups run)",
    )
    p.add_argument("--bound-iters", type=int, default=3, help="timed bare Megatron steps of a bound")
    p.add_argument("--out", type=Path, default=RESULTS / "step.json")
    args = p.parse_args(argv)
    root = TMP / "step_bench"
    shutil.rmtree(root, ignore_errors=True)
    report = run_report("end-to-end GRPO step: stages and overhead", "step_bench.py", argv, args)
    report["setups"] = {}
    warmups: dict[str, Path] = {}
    steps = STEPS | per_family(args.steps, STEPS)
    report["args"]["steps"] = steps
    bounds = [n for n in args.setups if n.startswith("m25")] if args.bound is None else args.bound
    for name in args.setups:
        run_dir = run(name, steps[family(name)], root, warmups, args.extra)
        report["setups"][name] = summarize(run_dir, name)
        if name in bounds:
            from bound_bench import measure as measure_bound

            report["setups"][name]["bound"] = measure_bound(
                name,
                steps[family(name)],
                run_dir,
                report["setups"][name],
                args.bound_iters,
                root / name,
                args.extra,
            )
    if args.profile:
        n = steps[family(args.profile)]
        steps = (n, 3 * n)
        report["profile"] = driver_profile(args.profile, root / "profile", warmups, args.extra, steps)
    runs_text = ", ".join(
        f"the first {SKIP_STEPS[f]} of {n} for {f}" for f, n in report["args"]["steps"].items()
    )
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
        f"Medians over the steps after {runs_text}, seconds (and share of "
        "the step). Reward is "
        "part of generation, probe part of sync; train call overhead = train minus the time inside the "
        "ranks (Ray: scheduling, the batch through the object store); driver = step minus the stages.",
        "",
        *md_table(
            "setup | step s | tokens/s | generation | reward | ref logprobs | train | train call "
            "overhead | sync | probe | driver",
            rows,
        ),
    ]
    with_bound = {n: r["bound"] for n, r in report["setups"].items() if "bound" in r}
    if with_bound:
        from bound_bench import markdown_lines

        lines += ["", *markdown_lines(with_bound)]
    if "profile" in report:
        lines += profile_markdown(report["profile"])
    write_results(args.out, report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


def profile_markdown(prof: dict) -> list[str]:
    a, b = prof["steps"]
    groups = [[g, f"{1e3 * s:.1f}"] for g, s in prof["per_step_s_by_group"].items() if abs(s) >= 5e-4]
    top = [[f"`{t['function']}`", f"{1e3 * t['per_step_s']:.1f}"] for t in prof["top_functions"]]
    return [
        "",
        f"## The driver process of {prof['setup']}, profiled",
        "",
        f"cProfile over the whole driver process, runs of {a} and {b} steps; per step = own time "
        f"(tottime, wall clock) in the {b}-step run minus the {a}-step run, over {b - a} steps.",
        "",
        *md_table("group | ms per step", groups),
        "",
        *md_table("function (own time) | ms per step", top),
    ]


if __name__ == "__main__":
    main()
