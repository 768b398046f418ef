"""Long-tailed response lengths: partial rollouts against one-step-off and synchronous GRPO, same samples.

    python -m benchmarks.long_tail [--modes sync one_step_off partial] [--partial-staleness 1 4] [--steps 6]
        [--repeat 1] [--quick]

Each mode is a real ``megagrpo train`` run (Ray, two vLLM CPU engines, Megatron at TP 1) of the tiny
demo model, the same config but for the mode, for the same number of GRPO steps (so the same number of
trained samples: ``--prompts`` x ``--generations`` a step):

- ``sync``: ``grpo.async_mode: batch``, ``grpo.max_staleness`` 0 (generate, train, sync in turns; the
  node's cores shared by the engines while they generate);
- ``one_step_off``: ``batch`` with ``max_staleness`` 1 (the next batch generated while the trainer
  trains; ``cluster.cpu_threads`` 1, as the step benchmark's overlapped run);
- ``partial``: ``grpo.async_mode: partial`` (engines never stop; weights swapped into requests in
  flight; a step takes the first finished groups), a run at each ``--partial-staleness``: at 1, the
  bound of one-step-off; a long response spans several steps, and a group older than the bound is
  dropped whole (counted); a larger bound lets more groups in flight and drops fewer of them only if
  the steps do not come faster meanwhile.

The workload (``common.long_tail_engine``): one prompt in 10 (by a hash of its token ids) asks for
``--max-new-tokens`` tokens, the others for 1/8 of that, every response exactly that long
(``generation.ignore_eos``). The budget is set in a subclass of the vLLM engine, patched into the
engine registry for these runs only, where vLLM takes the requests: each mode's own driver code runs
unchanged around it. A batch waits for its longest response; partial rollouts keep the engines busy
with other groups meanwhile.

Measured per run, over the steps after the first ``SKIP`` (start-up): samples/s (samples trained / wall
time between the metrics records of the step before the first measured one and the last one); the
engine busy fraction (seconds inside the engines' calls that make vLLM step, ``generate``,
``prompt_logprobs`` and ``advance``, recorded by the engines themselves, within that window, / (window x
engines)); the share of long responses among the trained samples (from the mean response length), and
for ``partial`` the groups dropped as too stale (their tokens are generated and not trained); the mean
weight sync per step and, for ``partial``, the pause before it (the engines' current slices ending at a
token boundary): the in-flight swap's pause / load / resume, resume being the pump going on. Target:
partial / one-step-off samples/s >= 1.5.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from .common import TMP, importable_by_workers, record
from .common.long_tail_engine import LONG_FACTOR, MODULE
from .common.record import Measurement, ratio
from .common.runs import metrics_rows, train_run

SKIP = 2
"""Start-up steps left out: the first allocates; partial's engines start filling their queues."""
MODES = {
    "sync": ["grpo.async_mode=batch", "grpo.max_staleness=0"],
    "one_step_off": ["grpo.async_mode=batch", "grpo.max_staleness=1", "cluster.cpu_threads=1"],
    "partial": ["grpo.async_mode=partial", "grpo.max_staleness=1", "cluster.cpu_threads=1"],
}
"""Each mode's overrides (``peer`` runs megagrpo in these modes too)."""
QUICK = {"steps": 2, "max_new_tokens": 32, "prompts": 8}
TARGET = ">= 1.5"


def parse_args(argv=None):
    p = record.parser("long_tail", __doc__, repeat=1)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=6, help="measured GRPO steps per run (after the start-up)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the long prompts' response length")
    p.add_argument("--prompts", type=int, default=16, help="grpo.num_prompts_per_step")
    p.add_argument("--generations", type=int, default=4, help="grpo.num_generations")
    p.add_argument(
        "--partial-staleness",
        type=int,
        nargs="+",
        default=[1, 4],
        help="partial's grpo.max_staleness, a run each",
    )
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides for every run")
    return record.parse(p, argv, QUICK)


def workload(args) -> list[str]:
    """The overrides every mode shares (the demo's config at TP 1, two engines, the long-tailed budget)."""
    samples = args.prompts * args.generations
    return [
        "parallel.tensor_model_parallel_size=1",
        "generation.num_engines=2",
        f"generation.max_new_tokens={args.max_new_tokens}",
        "generation.ignore_eos=true",
        f"grpo.num_prompts_per_step={args.prompts}",
        f"grpo.num_generations={args.generations}",
        f"policy.mini_batch_size={samples}",  # one optimizer step per batch
        "policy.micro_batch_max_tokens=4096",
        "logging.val_every=0",
        "warmup.steps=10",
        *args.extra,
    ]


def setups(args) -> dict[str, tuple[dict, list[str]]]:
    """Each run of a round: its name, its settings and its overrides (partial: one per staleness bound)."""
    out = {}
    for mode in args.modes:
        if mode != "partial":
            out[mode] = ({"mode": mode}, [*workload(args), *MODES[mode]])
            continue
        for k in args.partial_staleness:  # the later of two overrides of a key wins
            bound = [*workload(args), *MODES[mode], f"grpo.max_staleness={k}"]
            out[f"partial_s{k}"] = ({"mode": mode, "max_staleness": k}, bound)
    return out


def busy_seconds(run_dir: Path, start: float, end: float) -> tuple[float, int]:
    """Seconds the engines spent in calls that step vLLM within [start, end], summed; and the engines."""
    logs = sorted(run_dir.glob("engine_busy_*.jsonl"))
    total = 0.0
    for log in logs:
        for line in log.read_text().splitlines():
            call = json.loads(line)
            total += max(0.0, min(end, call["end"]) - max(start, call["start"]))
    return total, len(logs)


def run_measurements(mode: str, run_dir: Path, args) -> dict[str, float]:
    rows = metrics_rows(run_dir)
    if len(rows) != SKIP + args.steps:
        raise SystemExit(f"{run_dir}: {len(rows)} metrics records, expected {SKIP + args.steps}")
    start, end = rows[SKIP - 1]["time"], rows[-1]["time"]
    measured = rows[SKIP:]
    busy, engines = busy_seconds(run_dir, start, end)
    short = -(-args.max_new_tokens // LONG_FACTOR)
    length = statistics.mean(r["response/length_mean"] for r in measured)
    out: dict[str, float] = {
        "samples/s": args.steps * args.prompts * args.generations / (end - start),
        "response tokens/s": args.steps * args.prompts * args.generations * length / (end - start),
        "engine busy fraction": busy / (engines * (end - start)),
        "step": statistics.mean(r["timing/step_s"] for r in measured),
        "long responses among the trained samples": (length - short) / (args.max_new_tokens - short),
    }
    out["weight sync (partial: into the requests in flight)"] = statistics.mean(
        r.get("timing/sync_s", 0.0) for r in measured
    )
    if mode == "partial":
        out["pause to a token boundary"] = statistics.mean(r["timing/pause_s"] for r in measured)
        out["stale groups dropped"] = sum(r.get("async/stale_groups", 0) for r in measured)
        out["engine busy fraction, the driver's"] = statistics.mean(
            r["async/engine_busy_frac"] for r in measured
        )
    return out


UNITS = {
    "samples/s": "samples/s",
    "response tokens/s": "tokens/s",
    "step": "s",
    "weight sync (partial: into the requests in flight)": "s",
    "pause to a token boundary": "s",
    "stale groups dropped": "groups",
}


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = TMP / "long_tail"
    shutil.rmtree(root, ignore_errors=True)
    importable_by_workers()  # the engines' Ray workers import the long-tail engine's module
    runs = setups(args)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    warmup = None
    for r in range(args.repeat):
        for name in runs if r % 2 == 0 else reversed(runs):  # A, B, C, then C, B, A
            settings, overrides = runs[name]
            run_dir = train_run(
                root, f"{name}_r{r}", SKIP + args.steps, overrides, warmup, shared=False, entry=MODULE
            )
            warmup = warmup or run_dir / "warmup"  # every later run starts from the first run's warm-up
            results[name].append(run_measurements(settings["mode"], run_dir, args))
    out = []
    for name, got in results.items():
        s = runs[name][0]
        for key in got[0]:
            unit = UNITS.get(key, "fraction")
            out.append(Measurement(key, [x[key] for x in got], unit, s))
    rate = {name: [x["samples/s"] for x in got] for name, got in results.items()}
    for name in (n for n in runs if n.startswith("partial")):
        s = runs[name][0]
        if "one_step_off" in rate:
            label = "partial / one-step-off, samples/s"
            out.append(ratio(label, rate[name], rate["one_step_off"], settings=s, target=TARGET))
        if "sync" in rate:
            out.append(ratio("partial / sync, samples/s", rate[name], rate["sync"], settings=s))
    what = "samples/s and engine busy fraction: partial rollouts, one-step-off, sync; long-tailed lengths"
    notes = [
        f"{args.steps} measured steps per run after {SKIP} start-up steps; {args.prompts} prompts x "
        f"{args.generations} samples a step; 1 prompt in 10 asks for {args.max_new_tokens} tokens, "
        f"the others for {-(-args.max_new_tokens // LONG_FACTOR)}; "
        f"partial max_staleness {args.partial_staleness}",
        "overrides of every run: " + " ".join(workload(args)),
    ]
    return record.write(
        args, "long_tail", what, out, packages=("torch", "vllm", "megatron.core", "ray"), notes=notes
    )


if __name__ == "__main__":
    main()
