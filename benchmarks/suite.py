"""The benchmark suite: every benchmark of this folder run by its own script (its ``main(argv)``, in
a process of its own: Ray, vLLM and Megatron keep process-wide state), its results file read back,
and its headline numbers summarised as median / min / max over the repetitions the script recorded.

    python -m benchmarks run --suite cpu [--only NAME ...] [--quick] [--repeat N] [--out DIR]

Writes under ``--out`` (default ``benchmarks/results/suite_<suite>/``, ``suite_<suite>_quick/``
with ``--quick``): each benchmark's own ``<name>.json`` + ``.md``, and ``suite.json`` (the machine,
the commands, their wall time and exit status, the summaries), ``suite.md`` (the same as tables)
and ``suite.png`` (one panel per benchmark: medians with min-max bars).

A benchmark is a ``Bench``: its script, the arguments of a full and of a ``--quick`` run, the flag
that sets its repetitions, and ``metrics(report)``: the numbers to summarise, each a list of samples
(one per repetition where the script keeps them, else the one value it reports).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megagrpo.ckpt.durable import atomic_file, atomic_write

from .common import RESULTS, TMP
from .common.runs import SHARED_WARMUPS
from .common.sampling import machine_info
from .common.tables import md_table

HERE = Path(__file__).resolve().parent
SUITES = ("cpu", "gpu")

Samples = dict[str, tuple[list[float], str]]
"""metric name -> (samples, unit)"""


@dataclass(frozen=True)
class Bench:
    """One benchmark of the suite."""

    name: str
    """Name for ``--only`` and the results files (``<out>/<name>.json``)."""
    script: str
    """Its script in this folder."""
    what: str
    """One line: what it measures, against what."""
    suites: tuple[str, ...]
    """The suites it belongs to."""
    args: dict[str, list[str]]
    """Arguments per suite of a full run (besides output and repetitions); ``{out}`` stands for the
    suite's output directory (another benchmark's results, read back)."""
    quick_args: dict[str, list[str]]
    """Arguments per suite of a ``--quick`` run: the smallest sizes."""
    metrics: Callable[[dict], Samples]
    """Headline numbers of its report."""
    repeat_flag: str | None = "--repeat"
    """The flag that sets its repetitions (None: it has none)."""
    repeat_default: int | dict[str, int] = 3
    """Repetitions of a full run (per suite where they differ)."""
    output_flag: str = "--output"
    """``--output`` takes a path without ``.json``; ``--out`` a ``.json`` path."""
    extra: dict = field(default_factory=dict)

    def command(self, suite: str, quick: bool, repeat: int | None, out_dir: Path) -> list[str]:
        """The command line of this benchmark in ``suite``, writing ``out_dir/<name>.json``."""
        args = [a.replace("{out}", str(out_dir)) for a in (self.quick_args if quick else self.args)[suite]]
        if self.repeat_flag is not None:
            default = self.repeat_default
            default = default[suite] if isinstance(default, dict) else default
            n = 1 if quick and repeat is None else (repeat or default)
            args += [self.repeat_flag, str(n)]
        target = out_dir / self.name
        args += [self.output_flag, str(target) if self.output_flag == "--output" else f"{target}.json"]
        return [sys.executable, str(HERE / self.script), *args]


# ------------------------------------------------------------------------------ metric extractors


def _train_metrics(report: dict) -> Samples:
    out: Samples = {}
    for run in report["runs"]:
        tp, tokens = run["tp"], run["tokens_per_step"]
        for step in ("train", "bare"):
            if step in run:
                out[f"tp{tp} {step} tokens/s"] = ([tokens / s for s in run[step]["step_s_all"]], "tokens/s")
        if "ratio_train_over_bare" in run:
            out[f"tp{tp} train/bare"] = ([run["ratio_train_over_bare"]], "ratio")
    return out


def _step_metrics(report: dict) -> Samples:
    out: Samples = {}
    for name, r in report["setups"].items():
        out[f"{name} step s"] = ([r["step_s"]], "s")
        out[f"{name} overhead share"] = (
            [(r["train_call_overhead_s"] + r["driver_overhead_s"]) / r["step_s"]],
            "ratio",
        )
        if "bound" in r:
            out[f"{name} step/bound"] = ([r["bound"]["ratio"]], "ratio")
    return out


def _peer_metrics(report: dict) -> Samples:
    out: Samples = {}
    for size, setups in report["sizes"].items():
        for name, r in setups.items():
            out[f"{size} {name} step s"] = (r["step_s_rounds"], "s")
    return out


def _scaling_metrics(report: dict) -> Samples:
    curves, out = report["curves"], {}
    for p in curves.get("prompts", []):
        out[f"step s at {p['prompts']} prompts"] = ([p["step_s"]], "s")
    for p in curves.get("lengths", []):
        out[f"step s at {p['max_new_tokens']} new tokens"] = ([p["step_s"]], "s")
    for p in curves.get("sync", []):
        out[f"sync s at {p['bytes'] / 1e9:.2f} GB"] = ([p["sync_s"]], "s")
    return out


def _rollout_metrics(report: dict) -> Samples:
    out: Samples = {
        f"{kind} tokens/s": ([r["tokens_per_s"] for r in runs], "tokens/s")
        for kind, runs in report["runs"].items()
    }
    out["ours/raw (paired)"] = (list(report["summary"]["paired_ratios"]), "ratio")
    return out


def _sync_metrics(report: dict) -> Samples:
    out: Samples = {}
    for variant, v in report["variants"].items():
        for row in v["results"]:
            key = f"{variant} {row['engines']} eng {row['bucket_mb']:g} MiB"
            out[f"{key} sync s"] = ([r["seconds"] for r in row["runs"]["sync"]], "s")
            out[f"{key} sync/flat"] = ([row["fraction_of_flat"]], "ratio")
    return out


def _shard_sync_metrics(report: dict) -> Samples:
    out: Samples = {}
    for path, r in report["results"].items():
        out[f"{path} sync s (round medians)"] = (list(r["sync_s_by_round"]), "s")
        out[f"{path} CPU s"] = ([r["cpu_s"]], "s")
    out["shard/gathered bytes per worker"] = ([report["ratios"]["bytes_per_worker"]], "ratio")
    out["shard/gathered sync time"] = ([report["ratios"]["sync_s"]], "ratio")
    return out


def _convert_metrics(report: dict) -> Samples:
    out: Samples = {}
    for name, r in report["results"].items():
        out[f"{name} s"] = ([run["wall_s"] for run in r["runs"]], "s")
        if "fraction_of_io_bound" in r:
            out[f"{name} of I/O bound"] = ([r["fraction_of_io_bound"]], "fraction")
    return out


def _logprob_metrics(report: dict) -> Samples:
    out: Samples = {}
    for row in report["summary"]:
        for variant, mb in row["peak_extra_mb"].items():
            out[f"{row['tokens']} tok {variant} peak MB"] = ([mb], "MB")
    return out


def _sft_dpo_metrics(report: dict) -> Samples:
    out: Samples = {}
    for run in report["runs"]:
        for part in ("sft", "dpo"):
            for step, r in run[part].items():
                if isinstance(r, dict) and "wall" in r:  # each part has its own bare step
                    out[f"tp{run['tp']} {part}: {step} s"] = (list(r["wall"]), "s")
                    if "ratio_over_bare" in r:
                        out[f"tp{run['tp']} {part}: {step}/bare"] = ([r["ratio_over_bare"]], "ratio")
    return out


def _fault_metrics(report: dict) -> Samples:
    rows = report["checkpoint"]["rows"]
    out: Samples = {
        f"checkpoint {k}": ([r[k] for r in rows], "s")
        for k in ("save_s", "plain_s", "raw_s", "verify_warm_s", "verify_cold_s")
    }
    out["manifest overhead"] = ([r["manifest_overhead"] for r in rows], "fraction")
    if "engine" in report:
        out["engine kill -> probed s"] = ([report["engine"]["kill_to_probed_s"]], "s")
    return out


def _reward_metrics(report: dict) -> Samples:
    batch = report["args"]["batch"]
    out: Samples = {}
    for reward, by_mode in report["results"].items():
        for mode, r in by_mode.items():
            out[f"{reward} {mode} samples/s"] = ([batch / s for s in r["wall_s"]], "samples/s")
    out["worker replacement s"] = ([report["replace"]["per_replacement_s"]], "s")
    return out


QUICK_RUN = (
    "warmup.steps=10",
    "policy.micro_batch_max_tokens=8192",
    "grpo.baseline=mean",
    "generation.num_engines=2",
    "logging.val_every=5",
)
"""``--extra`` of the quick step and scaling runs: with them, the demo's config at TP 1 (5 steps from
a 10-step warm-up) is the quick peer's megagrpo run as peer_bench.py sets it (TRL's group-mean
advantage, one micro-batch per optimizer step, two engines, validation before and after), so the
three benchmarks read one run, made once."""

BENCHMARKS: tuple[Bench, ...] = (
    Bench(
        "reward",
        "reward_bench.py",
        "reward samples/s: in process and through the scorer's worker pool",
        ("cpu",),
        {"cpu": ["--workers", "1", "2", "4", "--batch", "256"]},
        {"cpu": ["--workers", "1", "--batch", "32", "--hangs", "1"]},
        _reward_metrics,
    ),
    Bench(
        "logprob_memory",
        "logprob_memory.py",
        "peak memory of chunked vocab-parallel logprobs vs full log-softmax (fwd+bwd)",
        ("cpu", "gpu"),
        {"cpu": ["--tokens", "2048"], "gpu": ["--device", "cuda", "--tokens", "8192", "16384"]},
        {
            "cpu": ["--tokens", "256", "--vocab", "4096", "--chunk", "128"],
            "gpu": ["--device", "cuda", "--tokens", "512", "--vocab", "4096", "--chunk", "256"],
        },
        _logprob_metrics,
        repeat_flag="--repeats",
        # A peak is one number per fresh process; the timed repeats matter on CUDA.
        repeat_default={"cpu": 1, "gpu": 3},
        output_flag="--out",
    ),
    Bench(
        "train",
        "train_bench.py",
        "PolicyWorker.train() vs bare Megatron forward+backward+optimizer step",
        ("cpu", "gpu"),
        {
            # Half the default batch and sequence (8 sequences of 128-256 tokens, still two
            # micro-batches): the ratio, not the size.
            "cpu": ["--threads", "1", "--batch", "8", "--seq", "256", "--budget", "1024", "--warmup", "1"],
            "gpu": [
                "--preset",
                "qwen2-1.5b",
                "--dtype",
                "bfloat16",
                "--tp",
                "1",
                "--seq",
                "4096",
                "--batch",
                "8",
                "--budget",
                "16384",
                "--min-len-frac",
                "1.0",
                "--peak-tflops",
                "989",
            ],
        },
        {
            "cpu": ["--tp", "1", "--batch", "2", "--seq", "64", "--warmup", "1", "--threads", "1"],
            "gpu": ["--preset", "smoke", "--dtype", "bfloat16", "--tp", "1", "--warmup", "1"],
        },
        _train_metrics,
        repeat_flag="--iters",
        repeat_default={"cpu": 3, "gpu": 6},
        output_flag="--out",
    ),
    Bench(
        "sft_dpo",
        "sft_dpo_bench.py",
        "SFT and DPO train steps vs bare Megatron step",
        ("cpu",),
        {"cpu": ["--seq", "128", "--threads", "1", "--batch", "8", "--pairs", "4"]},
        {
            "cpu": [
                "--tp",
                "1",
                "--seq",
                "64",
                "--batch",
                "2",
                "--pairs",
                "2",
                "--warmup",
                "0",
                "--threads",
                "1",
            ]
        },
        _sft_dpo_metrics,
        repeat_flag="--iters",
        repeat_default=2,
        output_flag="--out",
    ),
    Bench(
        "convert",
        "convert_bench.py",
        "HF <-> Megatron conversion vs the safetensors read+write bound",
        ("cpu",),
        {"cpu": []},
        {"cpu": ["--size-mb", "100", "--tp", "1", "--no-phases", "--quiet-wait", "0", "--no-retry"]},
        _convert_metrics,
        repeat_default=2,  # the fastest run is reported; disturbed runs are retried
    ),
    Bench(
        "faults",
        "fault_bench.py",
        "checkpoint manifest + verification vs raw write; engine kill and recovery",
        ("cpu",),
        {"cpu": ["--layers", "6"]},
        {"cpu": ["--layers", "1", "--hidden", "256", "--skip-engine"]},
        _fault_metrics,
    ),
    Bench(
        "rollout",
        "rollout_bench.py",
        "rollouts through the GenerationWorker actor vs a bare vllm.LLM",
        ("cpu",),
        {"cpu": []},
        {
            "cpu": [
                "--prompts",
                "8",
                "--n",
                "2",
                "--new-tokens",
                "8",
                "--layers",
                "1",
                "--hidden",
                "64",
                "--vocab",
                "1024",
                "--seq-length",
                "64",
            ]
        },
        _rollout_metrics,
    ),
    Bench(
        "step",
        "step_bench.py",
        "the end-to-end GRPO step by stage, the overhead outside the stages, the ~25M step vs its bound",
        ("cpu",),
        # The ~25M model at its best layout (TP 1), two steps (the second measured: the first
        # allocates) and its bound; peer reads this run back as its megagrpo ~25M run.
        {
            "cpu": [
                *("--setups", "tiny_tp1", "tiny_tp2", "m25_tp1"),
                *("--steps", "tiny=10", "m25=2", "--bound-iters", "1"),
            ]
        },
        {"cpu": ["--steps", "5", "--setups", "tiny_tp1", "--extra", *QUICK_RUN]},
        _step_metrics,
        repeat_flag=None,
        output_flag="--out",
    ),
    Bench(
        "sync",
        "sync_bench.py",
        "WeightSync.sync() vs one flat broadcast of the same bytes",
        ("cpu",),
        # The default allocator and bucket size only (sync_bench.py's defaults add glibc's heap
        # settings, a second Ray session and set of engines, and 32 MB buckets), five repeats: on
        # two shared cores a sync and the reload it is compared with move by +-30% between repeats.
        {"cpu": ["--engines", "1", "2", "--bucket-mb", "512", "--variants", "default"]},
        {"cpu": ["--size-mb", "64", "--engines", "1", "--bucket-mb", "512", "--variants", "default"]},
        _sync_metrics,
        repeat_default=5,
    ),
    Bench(
        "shard_sync",
        "shard_sync_bench.py",
        "shard-wise vs gathered weight sync, trainer TP 2 -> one engine at TP 2",
        ("cpu",),
        {"cpu": []},
        {"cpu": ["--size-mb", "64", "--rounds", "1"]},
        _shard_sync_metrics,
    ),
    Bench(
        "scaling",
        "scaling_bench.py",
        "step time vs prompts per step and vs response length; sync time vs model size",
        ("cpu",),
        {
            "cpu": [
                *("--steps", "4", "--prompts", "16", "64", "128", "--lengths", "16", "64", "224"),
                # The 256 MB point is the sync benchmark's one-engine 512 MB row (the same run).
                *("--sizes-mb", "100", "256", "400", "--sync-from", "{out}/sync.json"),
            ]
        },
        # The random model's curve: no warm-up to run first.
        # The quick step run's config and steps: its run, read back (the suite makes it once).
        {"cpu": ["--only", "prompts", "--prompts", "64", "--steps", "5", "--extra", *QUICK_RUN]},
        _scaling_metrics,
        repeat_flag=None,
        output_flag="--out",
    ),
    Bench(
        "peer",
        "peer_bench.py",
        "megagrpo beside TRL's GRPOTrainer: same model, prompts, group, tokens and optimizer (bench extra)",
        ("cpu",),
        # TRL's faster mode and our best layout; peer_bench.py's defaults add TRL's paged mode and TP 2.
        # ~25M: two steps each, the second timed (the first allocates); 1.4-1.8x apart in earlier
        # runs. megagrpo's ~25M run is step's m25_tp1, read back.
        {"cpu": ["--steps", "tiny=10", "m25=2", "--trl-generation", "generate", "--tp", "1"]},
        # The quick step run (QUICK_RUN): its warm-up and run, read back.
        {
            "cpu": [
                *("--sizes", "tiny", "--steps", "tiny=5", "--trl-generation", "generate", "--tp", "1"),
                *("--warmup-steps", "10"),
            ]
        },
        _peer_metrics,
        repeat_flag="--rounds",
        repeat_default=1,
        output_flag="--out",
    ),
)
"""The suite, cheapest first (a failing set-up shows early)."""

BY_NAME = {b.name: b for b in BENCHMARKS}


# ---------------------------------------------------------------------------------- pure parts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``run`` options; ``--only`` names are checked against the suite."""
    p = argparse.ArgumentParser(prog="python -m benchmarks run", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, required=True)
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these ({', '.join(BY_NAME)})")
    p.add_argument("--quick", action="store_true", help="smoke run: smallest sizes, 1 repetition")
    p.add_argument(
        "--repeat", type=int, help="repetitions of each benchmark (default: its own; 1 with --quick)"
    )
    p.add_argument(
        "--out", type=Path, help="output folder (default benchmarks/results/suite_<suite>[_quick])"
    )
    args = p.parse_args(argv)
    args.benchmarks = select(args.suite, args.only)
    if args.repeat is not None and args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be >= 1")
    if args.out is None:
        args.out = RESULTS / f"suite_{args.suite}{'_quick' if args.quick else ''}"
    return args


def select(suite: str, only: list[str] | None) -> list[Bench]:
    """The benchmarks of ``suite``, in suite order, restricted to ``only`` (each must be in the suite)."""
    in_suite = [b for b in BENCHMARKS if suite in b.suites]
    if not only:
        return in_suite
    names = {b.name for b in in_suite}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: not in the {suite} suite ({', '.join(sorted(names))})")
    return [b for b in in_suite if b.name in only]


def summarize(samples: list[float]) -> dict:
    """``median``, ``min``, ``max`` and ``n`` of one metric's samples."""
    if not samples:
        raise ValueError("no samples to summarise")
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def fmt(value: float) -> str:
    """Three significant digits, no exponent below a million."""
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return f"{value:.3g}"


def render_markdown(suite: dict) -> str:
    """``suite.md``: the machine, then per benchmark its command, wall time, status and metrics."""
    m = suite["machine"]
    lines = [
        f"# Benchmark suite `{suite['suite']}`{' (quick)' if suite['quick'] else ''}",
        "",
        f"{m.get('date')} on {m.get('host')}: {m.get('cpu')}, {m.get('cpus_usable')} usable CPUs, "
        f"{m.get('memory_bytes', 0) / 2**30:.1f} GiB, load {m.get('loadavg_at_start')}, "
        f"commit {m.get('git_commit')}, CUDA {m.get('cuda')}. Total {suite['wall_s']:.0f} s.",
        "",
    ]
    for name, b in suite["benchmarks"].items():
        lines += [f"## {name}: {b['what']}", "", f"`{' '.join(b['command'])}`", ""]
        lines.append(
            f"{b['wall_s']:.1f} s, exit status {b['returncode']}"
            + (f": {b['error']}" if b.get("error") else "")
        )
        lines.append("")
        if b.get("metrics"):
            rows = [
                [k, v["unit"], fmt(v["median"]), fmt(v["min"]), fmt(v["max"]), v["n"]]
                for k, v in b["metrics"].items()
            ]
            lines += [*md_table("metric | unit | median | min | max | n", rows, align="llrrrr"), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- running


def run_one(bench: Bench, suite: str, quick: bool, repeat: int | None, out_dir: Path) -> dict:
    """Run one benchmark's script; its summary (the metrics, or the error that stopped it)."""
    command = bench.command(suite, quick, repeat, out_dir)
    print(f"=== {bench.name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    rc = subprocess.run(command, cwd=HERE.parent).returncode
    shown = [c.replace(f"{HERE.parent}/", "") for c in command]  # paths relative to the repository
    entry = {"what": bench.what, "command": shown, "wall_s": time.perf_counter() - start, "returncode": rc}
    result = out_dir / f"{bench.name}.json"
    if rc != 0:
        entry["error"] = f"{bench.script} exited with {rc}"
    elif not result.is_file():
        entry["error"] = f"{bench.script} wrote no {result}"
    else:
        try:
            samples = bench.metrics(json.loads(result.read_text()))
            entry["metrics"] = {k: {**summarize(v), "unit": unit} for k, (v, unit) in samples.items()}
        except (KeyError, TypeError, ValueError) as exc:
            entry["error"] = f"{result}: unexpected report ({type(exc).__name__}: {exc})"
    print(f"=== {bench.name}: {entry['wall_s']:.1f} s, exit status {rc}", flush=True)
    return entry


def plot(suite: dict, path: Path) -> None:
    """One horizontal bar panel per benchmark: each metric's median, min-max as error bars, scaled
    to the largest median of its unit so that seconds, ratios and rates share a panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {n: b for n, b in suite["benchmarks"].items() if b.get("metrics")}
    if not done:
        return
    heights = [max(1.5, 0.28 * len(b["metrics"]) + 0.8) for b in done.values()]
    fig, axes = plt.subplots(len(done), 1, figsize=(9, sum(heights)), gridspec_kw={"height_ratios": heights})
    axes = [axes] if len(done) == 1 else list(axes)
    for ax, (name, b) in zip(axes, done.items(), strict=True):
        items = list(b["metrics"].items())
        scale = {}
        for _, v in items:
            scale[v["unit"]] = max(scale.get(v["unit"], 0.0), abs(v["max"])) or 1.0
        med = [v["median"] / scale[v["unit"]] for _, v in items]
        lo = [(v["median"] - v["min"]) / scale[v["unit"]] for _, v in items]
        hi = [(v["max"] - v["median"]) / scale[v["unit"]] for _, v in items]
        ax.barh(range(len(items)), med, xerr=[lo, hi], color="tab:blue", capsize=2)
        ax.set_yticks(
            range(len(items)), [f"{k} = {fmt(v['median'])} {v['unit']}" for k, v in items], fontsize=7
        )
        ax.invert_yaxis()
        ax.set_title(f"{name}: {b['what']}", fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("median / largest value of its unit (bars: min-max)", fontsize=7)
    fig.tight_layout()
    with atomic_file(path, "wb") as fh:
        fig.savefig(fh, dpi=100, format="png")
    plt.close(fig)


def run(argv: list[str] | None = None) -> dict:
    """``python -m benchmarks run``: every selected benchmark, then ``suite.{json,md,png}``."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    packages = ["torch"] + (["megatron.core", "vllm", "ray"] if not args.quick or args.suite == "cpu" else [])
    suite = {
        "suite": args.suite,
        "quick": args.quick,
        "repeat": args.repeat,
        "machine": machine_info(*packages),
        "benchmarks": {},
    }
    start = time.perf_counter()
    # The whole-run benchmarks (step, scaling, peer) train each tiny warm-up once for the suite.
    TMP.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="warmups-", dir=TMP) as warmups:
        os.environ[SHARED_WARMUPS] = warmups
        try:
            for bench in args.benchmarks:
                suite["benchmarks"][bench.name] = run_one(
                    bench, args.suite, args.quick, args.repeat, args.out
                )
        finally:
            del os.environ[SHARED_WARMUPS]
    suite["wall_s"] = time.perf_counter() - start
    atomic_write(args.out / "suite.json", json.dumps(suite, indent=2) + "\n")
    atomic_write(args.out / "suite.md", render_markdown(suite))
    plot(suite, args.out / "suite.png")
    failed = [n for n, b in suite["benchmarks"].items() if "error" in b]
    print(
        f"suite {args.suite}: {suite['wall_s']:.0f} s, results in {args.out}"
        + (f"; failed: {failed}" if failed else "")
    )
    return suite
