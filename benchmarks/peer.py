"""megagrpo beside TRL's ``GRPOTrainer``: the same HF model, prompts, group size, response budget and
optimizer settings, run alternately on the same machine (the ``bench`` extra installs TRL).

    python -m benchmarks.peer [--sizes tiny m25] [--repeat tiny=3 m25=1] [--steps tiny=10 m25=2]
        [--trl generate vllm] [--tp 1] [--quick]

- ``tiny``: ``make demo``'s model after its warm-up (exported to HF with its tokenizer), 64 prompts
  x 8, at most 8 new tokens, 256 completions per optimizer step; megagrpo at TP 1 with two engines
  (at this size vLLM's time is its per-request Python, which two processes run side by side), TRL's
  group-mean advantage (``grpo.baseline: mean``), one micro-batch per optimizer step, greedy
  validation on the same 64 held-out problems before and after;
- ``m25``: the ~25M model from random weights, 16 x 8, 128 new tokens, one optimizer step per batch;
  megagrpo's run is ``step``'s ``m25_tp1`` (in a suite the same run, made once): its responses all
  run to 128 tokens (``ignore_eos``) where TRL's stop at EOS, so megagrpo does at least TRL's work.

Each round (``--repeat`` per size) runs megagrpo, then TRL in each ``--trl`` mode (``generate``:
transformers' generate; ``paged``: its continuous batching; ``vllm``: vLLM colocated in TRL's
process), then megagrpo in any further ``--modes`` (``long_tail.MODES``: ``sync``, the sequential
loop; ``one_step_off``, ``grpo.max_staleness`` 1; ``partial``, ``grpo.async_mode: partial``) and at any
further ``--tp``; every run starts from the first run's warm-up. A run's step time is its median after
the first ``SKIP`` steps. The speed-up is per round, against TRL's fastest mode at that size: megagrpo
is faster only when it is in every round; the headline is megagrpo's fastest setup (by median).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from .common import TMP, record
from .common.record import Measurement, ratio
from .common.runs import export_warmup, metrics_rows, per_family, train_run
from .long_tail import MODES
from .step import setup_overrides

SKIP = {"tiny": 3, "m25": 1}
TRL_ARGS = {
    "tiny": ["--prompts", "64", "--mini-batch", "256", "--max-new-tokens", "8"],
    "m25": ["--prompts", "16", "--mini-batch", "128", "--max-new-tokens", "128"],
}
TARGETS = {"tiny": "> 1", "m25": ">= 1.25"}
QUICK = {"sizes": ["tiny"], "steps": ["tiny=5"], "warmup_steps": 10, "repeat": ["1"]}


def parse_args(argv=None):
    p = record.parser("peer", __doc__, repeat=None)
    p.add_argument("--sizes", nargs="+", default=["tiny", "m25"], choices=list(SKIP))
    p.add_argument("--repeat", nargs="+", default=["tiny=3", "m25=1"], help="SIZE=N or N: rounds per size")
    p.add_argument("--steps", nargs="+", default=["tiny=10", "m25=2"], help="SIZE=N or N: GRPO steps a run")
    p.add_argument("--trl", nargs="+", default=["generate", "vllm"], choices=["generate", "paged", "vllm"])
    p.add_argument(
        "--tp", type=int, nargs="+", default=[1], help="megagrpo's trainer TP sizes (the first leads)"
    )
    p.add_argument(
        "--modes", nargs="+", default=["sync"], choices=MODES, help="megagrpo's modes at the first --tp"
    )
    p.add_argument("--warmup-steps", type=int, help="the tiny model's warm-up steps (default: the demo's)")
    args = record.parse(p, argv, QUICK)
    args.rounds = {"tiny": 3, "m25": 1} | per_family(args.repeat, SKIP)
    args.run_steps = {"tiny": 10, "m25": 2} | per_family(args.steps, SKIP)
    return args


def ours_overrides(
    size: str, tp: int, steps: int, warmup_steps: int | None = None, mode: str = "sync"
) -> list[str]:
    """megagrpo's run at ``size``: at tiny, the demo's config with TRL's advantage, one micro-batch per
    optimizer step, two engines at TP 1 and validation before and after; at m25, step's setup; in
    ``mode`` (``long_tail.MODES``; sync adds nothing: the run a suite shares with ``step``)."""
    modal = [] if mode == "sync" else MODES[mode]
    if size == "m25":
        return [*setup_overrides(f"m25_tp{tp}"), *modal]
    return [
        *modal,
        *("policy.micro_batch_max_tokens=8192", "grpo.baseline=mean"),
        *(["generation.num_engines=2"] if tp == 1 else []),
        *([f"warmup.steps={warmup_steps}"] if warmup_steps is not None else []),
        f"parallel.tensor_model_parallel_size={tp}",
        f"logging.val_every={steps}",
    ]


def ours(
    root: Path, size: str, tp: int, steps: int, rnd: int, warmup: Path | None, args, mode: str = "sync"
) -> dict:
    overrides = ours_overrides(size, tp, steps, args.warmup_steps, mode)
    name = f"{size}_tp{tp}_r{rnd}" + ("" if mode == "sync" else f"_{mode}")
    run_dir = train_run(root, name, steps, overrides, warmup, shared=rnd == 0)
    rows = metrics_rows(run_dir)
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    timed = [r for r in rows if r["step"] > SKIP[size]]
    # The last step validates: its validation is left out, as TRL's runs validate outside training.
    step = statistics.median(r["timing/step_s"] - r.get("timing/validation_s", 0.0) for r in timed)
    tokens = statistics.median(r["response/length_mean"] for r in timed)
    return {"step_s": step, "run_dir": run_dir, "val": val, "tokens": tokens}


def trl(root: Path, size: str, model: Path, steps: int, mode: str, rnd: int) -> dict:
    out = root / f"trl_{size}_{mode}_r{rnd}.json"
    cmd = [sys.executable, "-m", "benchmarks.peer_trl", "--model", str(model), "--steps", str(steps)]
    cmd += [*TRL_ARGS[size], "--generation", mode, "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL {size} {mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)
    r = json.loads(out.read_text())
    step, tokens = statistics.median(r["step_s"][SKIP[size] :]), statistics.median(r["response_length_mean"])
    return {"step_s": step, "val": [r["val_accuracy_before"], r["val_accuracy_after"]], "tokens": tokens}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("benchmarks.peer needs TRL: pip install -e '.[bench]' (or make bench-deps)")
    root = TMP / "peer"
    shutil.rmtree(root, ignore_errors=True)
    out = []
    for size in args.sizes:
        steps = args.run_steps[size]
        runs: dict[str, list[dict]] = {}
        warmup = model = None
        for rnd in range(args.rounds[size]):
            lead = ours(root, size, args.tp[0], steps, rnd, warmup, args, args.modes[0])
            runs.setdefault(setup_name(args.tp[0], args.modes[0]), []).append(lead)
            if warmup is None:
                warmup = root / f"warmup_{size}"
                shutil.copytree(lead["run_dir"] / "warmup", warmup)
                model = export_warmup(lead["run_dir"], root / f"{size}_hf")
            for mode in args.trl:
                runs.setdefault(f"TRL {mode}", []).append(trl(root, size, model, steps, mode, rnd))
            for mode in args.modes[1:]:
                run = ours(root, size, args.tp[0], steps, rnd, warmup, args, mode)
                runs.setdefault(setup_name(args.tp[0], mode), []).append(run)
            for tp in args.tp[1:]:
                runs.setdefault(f"megagrpo TP{tp}", []).append(ours(root, size, tp, steps, rnd, warmup, args))
        out += measurements(size, steps, runs)
    what = "megagrpo beside TRL's GRPOTrainer: same model, prompts, group, tokens and optimizer"
    notes = [f"steps a run {args.run_steps}, rounds {args.rounds}, step time after the first {SKIP} steps"]
    return record.write(
        args, "peer", what, out, packages=("torch", "vllm", "trl", "transformers"), notes=notes
    )


def setup_name(tp: int, mode: str) -> str:
    return f"megagrpo TP{tp}" + ("" if mode == "sync" else f" {mode}")


def measurements(size: str, steps: int, runs: dict[str, list[dict]]) -> list[Measurement]:
    out = []
    for setup, rs in runs.items():
        s = {"size": size, "setup": setup, "steps": steps}
        out.append(Measurement("step", [r["step_s"] for r in rs], "s", s))
        out.append(Measurement("mean response tokens", [r["tokens"] for r in rs], "tokens", s))
        if size == "tiny":
            out.append(
                Measurement(
                    "greedy validation accuracy after the run", [r["val"][-1] for r in rs], "fraction", s
                )
            )
    trl_modes = {k: v for k, v in runs.items() if k.startswith("TRL")}
    fastest = min(trl_modes, key=lambda k: statistics.median(r["step_s"] for r in trl_modes[k]))
    ours_setups = {k: v for k, v in runs.items() if k.startswith("megagrpo")}
    ours_fastest = min(ours_setups, key=lambda k: statistics.median(r["step_s"] for r in ours_setups[k]))
    for setup, rs in ours_setups.items():
        s = {"size": size, "setup": setup, "against": fastest}
        theirs, mine = [r["step_s"] for r in trl_modes[fastest]], [r["step_s"] for r in rs]
        name = "speed-up over TRL's fastest mode, per round"
        head = setup == ours_fastest
        out.append(ratio(name, theirs, mine, settings=s, target=TARGETS[size], headline=head))
    if size == "tiny":
        before = next(iter(runs.values()))[0]["val"][0]
        out.append(
            Measurement("greedy validation accuracy before training", [before], "fraction", {"size": size})
        )
    return out


if __name__ == "__main__":
    main()
