#!/usr/bin/env python3
"""megagrpo beside TRL's ``GRPOTrainer``: the same HF model, prompts, group size, response budget and
optimizer settings, run alternately on the same machine.

    python benchmarks/peer_bench.py [--sizes tiny m25] [--rounds tiny=2 m25=1] [--steps tiny=20 m25=4]
        [--trl-generation generate paged] [--tp 1 2] [--warmup-steps N] [--out FILE.json]

Needs the ``bench`` extra (TRL). Two sizes, as step_bench's setups:

- ``tiny``: ``make demo``'s model after its warm-up (exported to HF with its character tokenizer),
  64 prompts x 8 per step, at most 8 new tokens, 256 completions per optimizer step (two per batch);
- ``m25``: the ~25M-parameter model from (nearly) random weights, 16 prompts x 8, 128 new tokens, one
  optimizer step per batch. megagrpo's run is step_bench's ``m25_tp<N>`` setup as it is (in a suite,
  the same run: made once): every response runs to 128 tokens (``generation.ignore_eos``) where TRL's
  stop at EOS, so megagrpo does at least TRL's work; no validation (the random model's accuracy is 0).

Each round runs, one after the other, megagrpo at TP = 1 (the size's best layout on one machine;
at tiny with two engines, ``BEST_TINY``),
TRL in each ``--trl-generation`` mode (``generate``: ``transformers``' ``generate``; ``paged``: its
continuous batching), and megagrpo at TP = 2 (the demo's layout); ``--tp`` changes the layouts.
The first megagrpo run makes the model (its warm-up) and every later run, TRL's included, starts
from it. At tiny, megagrpo runs with ``grpo.baseline: mean`` (TRL's group-mean advantage), everything
else as its config.

A run's step time is the median over its steps after the first ``SKIP`` (start-up compilations);
the report gives, per setup, the median over the rounds, the ratio TRL / megagrpo (above 1: megagrpo
is faster), and greedy validation accuracy on the same 64 held-out problems before and after the same
number of steps (at m25 the random model's accuracy is 0 and says nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import RESULTS, TMP
from common.runs import export_warmup, metrics_rows, per_family, run_report, train_run
from common.tables import md_table, write_results
from step_bench import setup_overrides

HERE = Path(__file__).resolve().parent
SKIP = {"tiny": 3, "m25": 1}
STEPS = {"tiny": 20, "m25": 4}
TRL_ARGS = {
    "tiny": ["--prompts", "64", "--mini-batch", "256", "--max-new-tokens", "8"],
    "m25": ["--prompts", "16", "--mini-batch", "128", "--max-new-tokens", "128"],
}
# The tiny config's micro-batch budget (1024 tokens, the demo's) splits an optimizer step's 256
# sequences into several micro-batches; TRL runs each optimizer step's 256 completions as one.
# Both sides here run one micro-batch per optimizer step (megagrpo's default budget).
TINY = ["policy.micro_batch_max_tokens=8192", "grpo.baseline=mean"]
BEST_TINY = ["generation.num_engines=2"]
"""The tiny model's best layout on two cores besides TP 1: two engines of one thread each. At this
size vLLM's time is its per-request Python (scheduling, output processing), which two engine
processes run side by side; one engine of two threads only shares the matmuls (A/B at 12 steps:
generation 0.167 -> 0.118 s, step 0.532 -> 0.462 s)."""


def ours_overrides(size: str, tp: int, steps: int, warmup_steps: int | None = None) -> list[str]:
    """megagrpo's run at ``size``: at tiny, the demo's config with TRL's group-mean advantage, one
    micro-batch per optimizer step and validation before and after; at m25, step_bench's setup."""
    if size == "m25":
        return setup_overrides(f"m25_tp{tp}")
    return [
        *TINY,
        *(BEST_TINY if tp == 1 else []),
        *([f"warmup.steps={warmup_steps}"] if warmup_steps is not None else []),
        f"parallel.tensor_model_parallel_size={tp}",
        f"logging.val_every={steps}",
    ]


def ours(
    root: Path, size: str, tp: int, steps: int, tag: str, warmup: Path | None, warmup_steps: int | None = None
) -> dict:
    overrides = ours_overrides(size, tp, steps, warmup_steps)
    run_dir = train_run(root, f"{size}_tp{tp}_{tag}", steps, overrides, warmup)
    rows = metrics_rows(run_dir)
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    # The last step validates (val_every = steps): its validation is left out of the step time, as
    # TRL's runs validate outside training.
    timed = [r for r in rows if r["step"] > SKIP[size]]
    times = [r["timing/step_s"] - r.get("timing/validation_s", 0.0) for r in timed]
    return {
        "run_dir": str(run_dir),
        "overrides": overrides,
        "step_s": statistics.median(times),
        "val_before": val[0] if val else None,
        "val_after": val[-1] if len(val) > 1 else None,
        "response_tokens": statistics.median(r["response/length_mean"] for r in timed),
        "parts_s": {
            k: statistics.median(r.get(f"timing/{k}", 0.0) for r in timed)
            for k in ("generation_s", "logprobs_s", "train_s", "sync_s")
        },
    }


def trl(root: Path, size: str, model: Path, steps: int, mode: str, tag: str) -> dict:
    out = root / f"trl_{size}_{mode}_{tag}.json"
    cmd = [sys.executable, str(HERE / "peer_trl.py"), "--model", str(model), "--steps", str(steps)]
    cmd += [*TRL_ARGS[size], "--generation", mode, "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL {size} {mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)
    report = json.loads(out.read_text())
    return {
        "step_s": statistics.median(report["step_s"][SKIP[size] :]),
        "val_before": report["val_accuracy_before"],
        "val_after": report["val_accuracy_after"],
        "torch_threads": report["torch_threads"],
        "trl": report["trl"],
        "response_tokens": statistics.median(report["response_length_mean"]),
        "parts_s": {k.removeprefix("GRPOTrainer."): v for k, v in report.get("parts_s", {}).items()},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "m25"], choices=list(STEPS))
    p.add_argument(
        "--rounds",
        nargs="+",
        default=["tiny=2", "m25=1"],
        help="N, or SIZE=N: rounds per size (tiny=2 m25=1)",
    )
    p.add_argument("--steps", nargs="*", default=[], help="SIZE=N: GRPO steps per run (tiny=20 m25=4)")
    modes = ["generate", "paged"]
    p.add_argument("--trl-generation", nargs="+", default=modes, choices=modes)
    p.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=[1, 2],
        help="megagrpo's trainer TP sizes: the first runs before TRL",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="the tiny model's warm-up steps (default: the demo's); TRL starts from the same model",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "peer.json")
    args = p.parse_args(argv)
    if importlib.util.find_spec("trl") is None:  # the peer runs in processes of its own
        raise SystemExit("peer_bench needs TRL: pip install -e '.[bench]' (or make bench-deps)")
    steps, rounds = STEPS | per_family(args.steps, STEPS), per_family(args.rounds, STEPS)
    root = TMP / "peer_bench"
    shutil.rmtree(root, ignore_errors=True)
    what = "megagrpo vs TRL GRPOTrainer, same model and settings"
    report = run_report(what, "peer_bench.py", argv, args, "trl", "transformers", steps=steps, rounds=rounds)
    report |= {"sizes": {}, "provenance": {}}
    for size in args.sizes:
        runs: dict[str, list[dict]] = {}
        warmup = model = None
        for rnd in range(rounds.get(size, 1)):
            tag = f"r{rnd}"
            r = ours(root, size, args.tp[0], steps[size], tag, warmup, args.warmup_steps)
            if warmup is None:
                warmup = root / f"warmup_{size}"
                shutil.copytree(Path(r["run_dir"]) / "warmup", warmup)
                model = export_warmup(Path(r["run_dir"]), root / f"{size}_hf")
            runs.setdefault(f"megagrpo TP{args.tp[0]}", []).append(r)
            for mode in args.trl_generation:
                runs.setdefault(f"TRL {mode}", []).append(trl(root, size, model, steps[size], mode, tag))
            for tp in args.tp[1:]:
                again = ours(root, size, tp, steps[size], tag, warmup, args.warmup_steps)
                runs.setdefault(f"megagrpo TP{tp}", []).append(again)
        report["sizes"][size] = {
            name: {
                "step_s": statistics.median(r["step_s"] for r in rs),
                "step_s_rounds": [r["step_s"] for r in rs],
                "val_before": rs[-1]["val_before"],
                "val_after": [r["val_after"] for r in rs],
                "response_tokens": statistics.median(r["response_tokens"] for r in rs),
                "parts_s": rs[-1].get("parts_s", {}),
                **({"overrides": rs[-1]["overrides"]} if "overrides" in rs[-1] else {}),
            }
            for name, rs in runs.items()
        }
        report["provenance"][size] = {"command": report["command"], "machine": report["machine"]}
    keep_earlier(report, args.out, args.sizes)
    write_results(args.out, report, markdown(report))
    print(markdown(report))
    return report


def keep_earlier(report: dict, out: Path, measured: list[str]) -> None:
    """Sizes not measured by this run keep the results ``out`` holds for them, with the command and
    machine that measured them (``provenance``), so one size can be re-measured alone."""
    if not out.is_file():
        return
    earlier = json.loads(out.read_text())
    for size, setups in earlier.get("sizes", {}).items():
        if size not in measured:
            report["sizes"][size] = setups
            report["provenance"][size] = earlier.get("provenance", {}).get(size) or {
                "command": earlier["command"],
                "machine": earlier["machine"],
            }


def markdown(report: dict) -> str:
    rows = []
    for size, setups in report["sizes"].items():
        trl_best = min((s["step_s"] for n, s in setups.items() if n.startswith("TRL")), default=None)
        for name, s in setups.items():
            ratio = f"{trl_best / s['step_s']:.2f}" if trl_best and name.startswith("megagrpo") else ""
            after = ", ".join("-" if v is None else f"{v:.3f}" for v in s["val_after"])
            before = "-" if s["val_before"] is None else f"{s['val_before']:.3f}"
            rounds = ", ".join(f"{v:.3f}" for v in s["step_s_rounds"])
            tokens = s.get("response_tokens")
            tokens = "-" if tokens is None else f"{tokens:.1f}"
            rows.append([size, name, f"{s['step_s']:.3f}", rounds, ratio, tokens, before, after])
    steps = report["args"]["steps"]
    parts = [
        f"- {size} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in s["parts_s"].items())
        for size, setups in report["sizes"].items()
        for name, s in setups.items()
        if s.get("parts_s")
    ]
    if parts:
        parts = [
            "",
            "Where a step goes (seconds, medians over the last round's steps): megagrpo's stages; the "
            "parts TRL times itself (its `profiling_context`; nested parts are also counted in their "
            "parents: `_prepare_inputs` holds generation and the old-logprob pass, "
            "`_get_per_token_logps_and_entropies` the old-logprob pass and the training forwards, "
            "`compute_loss` the training forwards; the backward passes and optimizer steps are outside "
            "all of them).",
            "",
            *parts,
        ]
    return (
        "\n".join(
            [
                "# megagrpo beside TRL's GRPOTrainer",
                "",
                f"Command: `{report['command']}`; machine: {report['machine']['cpu']}, "
                f"{report['machine']['cpus_usable']} CPUs, load average at start "
                f"{report['machine'].get('loadavg_at_start')}; TRL {report['machine'].get('trl')}, "
                f"transformers {report['machine'].get('transformers')}.",
                f"Steps per run: {steps}; step time = median over each run's steps after the first "
                f"{SKIP}, then the median over rounds. speed-up = best TRL mode's step time / this setup's "
                "(above 1: megagrpo faster). Validation: greedy accuracy on the same 64 held-out problems "
                "before training and after the run's steps (one value per round). Response tokens: the "
                "median over steps of the mean response length.",
                *(
                    f"Size {size} kept from an earlier run: `{p['command']}` ({p['machine'].get('date')})."
                    for size, p in report.get("provenance", {}).items()
                    if p["command"] != report["command"]
                ),
                "",
                *md_table(
                    "size | setup | step s (median) | step s per round | speed-up vs TRL | response tokens | "
                    "val. before | val. after",
                    rows,
                ),
                *parts,
            ]
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
