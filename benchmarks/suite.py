"""The benchmark suite: every benchmark of a suite, each in a process of its own (Ray, vLLM and
Megatron keep process-wide state), and one summary of what they measured.

    python -m benchmarks run --suite cpu|gpu [--only NAME ...] [--quick] [--repeat N] [--out DIR]

``--only`` into a folder holding the same suite's results replaces those benchmarks' entries of its
suite.json (the suite's time is then the sum of its benchmarks').

A benchmark's full run is its module's defaults (plus the suite's ``args``), its ``--quick`` run
the module's smallest sizes; every benchmark writes ``<out>/<name>.json`` (``common.record``) and
its ``.md``. The suite adds ``suite.json`` (the machine, each command, its wall time and exit
status) and ``suite.md`` (every benchmark's measurements in one table). Default ``--out``:
``benchmarks/results/suite_<suite>/`` (``suite_<suite>_quick/`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .common import REPO, RESULTS, TMP, record
from .common.machine import machine_info
from .common.runs import SHARED_WARMUPS

SUITES = ("cpu", "gpu")
H200 = ["--preset", "qwen2-1.5b", "--dtype", "bfloat16", "--tp", "1", "--peak-tflops", "989"]
SMOKE = ["--preset", "smoke", "--dtype", "bfloat16", "--peak-tflops", "989"]
"""The gpu suite's ``--quick`` model: qwen2-1.5b's code path at toy size."""
GPU_TRAIN = [
    *("--seq", "4096", "8192", "--batch", "8", "--budget", "16384", "--min-len-frac", "1.0"),
    *("--recompute", "core_attention", "--warmup", "2", "--sync-bucket-mb", "512", "--offload"),
]

MOE_H200 = [
    *("--preset", "qwen3-30b-a3b-4l", "--dtype", "bfloat16", "--ep", "1", "--seq", "4096", "--batch", "8"),
    *("--budget", "8192", "--min-len-frac", "1.0", "--skip", "sync", "capture"),
]
MOE_H200_QUICK = ["--dtype", "bfloat16", "--ep", "1", "--skip", "sync", "capture"]


@dataclass(frozen=True)
class Bench:
    """One benchmark of the suite: the module ``benchmarks.<module or name>``, its results ``<name>.json``."""

    name: str
    suites: tuple[str, ...]
    args: dict[str, list[str]] = field(default_factory=dict)
    """Arguments of a full run per suite, besides the module's defaults; ``{out}`` stands for the
    suite's output folder (another benchmark's results, read back)."""
    quick_args: dict[str, list[str]] = field(default_factory=dict)
    """Arguments of a ``--quick`` run per suite, besides the module's quick sizes."""
    repeat: dict[str, int] = field(default_factory=dict)
    """``--repeat`` of a full run per suite where it is not the module's default."""
    module: str = ""
    """The benchmark's module when it is not ``name`` (one module run twice with other settings)."""
    unset_env: tuple[str, ...] = ()
    """Environment variables the benchmark's process runs without (set for the rest of the suite)."""

    def command(self, suite: str, quick: bool, repeat: int | None, out: Path) -> list[str]:
        """The command line of this benchmark in ``suite``, writing ``out/<name>.json``."""
        args = (self.quick_args if quick else self.args).get(suite, [])
        args = [a.replace("{out}", str(out)) for a in args] + (["--quick"] if quick else [])
        n = repeat if repeat is not None else None if quick else self.repeat.get(suite)
        if n is not None:
            args += ["--repeat", str(n)]
        module = f"benchmarks.{self.module or self.name}"
        return [sys.executable, "-m", module, *args, "--out", str(out / f"{self.name}.json")]


LOSS_STEPS = ["--steps", "train", "gspo", "gspo_token", "cispo"]
BENCHMARKS: tuple[Bench, ...] = (
    Bench("reward", ("cpu",)),
    Bench("agents", ("cpu",)),
    Bench(
        "logprob_memory",
        ("cpu", "gpu"),
        args={"gpu": ["--device", "cuda", "--tokens", "8192", "16384"]},
        quick_args={"gpu": ["--device", "cuda"]},
        repeat={"gpu": 3},  # a peak is one number per fresh process; the timed repeats matter on CUDA
    ),
    Bench(
        "train",
        ("cpu", "gpu"),
        # Qwen2-1.5B's shape, every sequence exactly 4096 or 8192 tokens, 32768 a step; the local
        # layers' unfused attention keeps fp32 [b, heads, s, s]: recomputed.
        args={"gpu": [*H200, *GPU_TRAIN]},
        quick_args={"gpu": [*SMOKE, "--offload"]},
        repeat={"gpu": 5},
    ),
    Bench(  # PyTorch's SDPA / varlen attention on packed sequences: nothing to recompute
        "train_torch",
        ("gpu",),
        args={"gpu": [*H200, "--impl", "torch", *GPU_TRAIN[:9], "--warmup", "2"]},
        quick_args={"gpu": [*SMOKE, "--impl", "torch"]},
        repeat={"gpu": 5},
        module="train",
    ),
    Bench(  # each grpo.loss beside GRPO's on the same batch, in the same rounds
        "losses",
        ("cpu",),
        args={"cpu": LOSS_STEPS},
        quick_args={"cpu": LOSS_STEPS},
        module="train",
    ),
    Bench("sft_dpo", ("cpu",)),
    Bench("convert", ("cpu",)),
    Bench("faults", ("cpu",)),
    Bench("rollout", ("cpu",)),
    Bench("step", ("cpu",)),
    # Long-tailed response lengths: partial rollouts against one-step-off and sync, same samples.
    Bench("long_tail", ("cpu",)),
    Bench("sync", ("cpu",)),
    Bench("shard_sync", ("cpu",)),
    # The colocated handoff: on cpu through /dev/shm, on the lent GPU through CUDA IPC handles. Without
    # the allocator's expandable segments (gpu_h200.sh sets them for the train steps): CUDA IPC exports
    # those as file descriptors the receiver takes with pidfd_getfd, refused (EPERM) between sibling
    # processes in an unprivileged container, and the sender refuses them (weight_sync.ipc).
    Bench(
        "ipc_handoff",
        ("cpu", "gpu"),
        args={"gpu": ["--device", "cuda"]},
        quick_args={"gpu": ["--device", "cuda"]},
        unset_env=("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
    ),
    # The probe's error in bf16 (generation.probe_max_error's bound): vLLM's CPU kernels against Megatron's
    # in real GRPO runs on cpu; on the lent GPU (no vLLM) transformers' against Megatron's at Qwen2-1.5B.
    Bench(
        "probe_bf16",
        ("cpu", "gpu"),
        args={"gpu": ["--against", "hf", "--preset", "qwen2-1.5b"]},
        quick_args={"gpu": ["--against", "hf"]},
    ),
    # The MoE train step on one GPU (EP 1; vLLM is not on the lent device: no sync, no capture).
    Bench("moe", ("cpu", "gpu"), args={"gpu": MOE_H200}, quick_args={"gpu": MOE_H200_QUICK}),
    # The 256 MB sync point is the sync benchmark's one-engine row (the same run).
    Bench("scaling", ("cpu",), args={"cpu": ["--sync-from", "{out}/sync.json"]}),
    Bench("peer", ("cpu",)),
)
"""The suite, cheapest first (a failing set-up shows early)."""
BY_NAME = {b.name: b for b in BENCHMARKS}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks run", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, required=True)
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these ({', '.join(BY_NAME)})")
    p.add_argument("--quick", action="store_true", help="smoke run: smallest sizes, 1 repetition")
    p.add_argument("--repeat", type=int, help="repetitions of every benchmark (default: each its own)")
    p.add_argument(
        "--out", type=Path, help="output folder (default benchmarks/results/suite_<suite>[_quick])"
    )
    args = p.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be >= 1")
    args.benchmarks = select(args.suite, args.only)
    args.out = args.out or RESULTS / f"suite_{args.suite}{'_quick' if args.quick else ''}"
    return args


def select(suite: str, only: list[str] | None) -> list[Bench]:
    """The benchmarks of ``suite`` in suite order, restricted to ``only`` (each must be in the suite)."""
    in_suite = [b for b in BENCHMARKS if suite in b.suites]
    unknown = sorted(set(only or ()) - {b.name for b in in_suite})
    if unknown:
        raise SystemExit(
            f"--only {' '.join(unknown)}: not in the {suite} suite ({', '.join(b.name for b in in_suite)})"
        )
    return [b for b in in_suite if not only or b.name in only]


def run_one(bench: Bench, args) -> dict:
    """Run one benchmark; its entry of suite.json (an error when it failed or wrote no results)."""
    command = bench.command(args.suite, args.quick, args.repeat, args.out)
    print(f"=== {bench.name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in bench.unset_env}
    rc = subprocess.run(command, cwd=REPO, env=env).returncode
    entry = {
        "command": " ".join(record.relative(c) for c in command[1:]),
        "wall_s": time.perf_counter() - start,
    }
    entry["returncode"] = rc
    try:
        if rc != 0:
            raise ValueError(f"exited with {rc}")
        record.read(args.out / f"{bench.name}.json")
    except ValueError as err:
        entry["error"] = str(err)
    print(f"=== {bench.name}: {entry['wall_s']:.0f} s, exit status {rc}", flush=True)
    return entry


def summary_markdown(suite: dict, out: Path) -> str:
    """suite.md: the machine, then per benchmark its command, time and every measurement."""
    quick = " (quick)" if suite["quick"] else ""
    lines = [
        f"# Benchmark suite `{suite['suite']}`{quick}: {suite['wall_s']:.0f} s",
        "",
        record.describe_machine(suite["machine"]) + ". Results: median (min-max over the n samples).",
    ]
    for name, b in suite["benchmarks"].items():
        lines += [
            "",
            f"## {name}: {b['wall_s']:.0f} s" + (f", failed: {b['error']}" if "error" in b else ""),
            "",
        ]
        lines.append(f"`python {b['command']}`")
        if "error" not in b:
            ms = record.read(out / f"{name}.json")["measurements"]
            lines += ["", *record.measurement_table(ms)]
    return "\n".join(lines) + "\n"


def earlier_entries(args) -> dict:
    """With ``--only``, the entries of the same suite's suite.json already in ``--out`` (the others keep
    theirs: a failed or changed benchmark is re-run alone); else none."""
    path = args.out / "suite.json"
    if not args.only or not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if (old.get("suite"), old.get("quick")) != (args.suite, args.quick):
        return {}
    return old.get("benchmarks", {})


def merged(earlier: dict, ran: dict) -> dict:
    """suite.json's entries: those just ``ran`` replacing the ``earlier`` ones, in suite order."""
    order = [b.name for b in BENCHMARKS if b.name in earlier or b.name in ran]
    return {name: ran[name] if name in ran else earlier[name] for name in order}


def run(argv: list[str] | None = None) -> dict:
    """``python -m benchmarks run``: every selected benchmark, then suite.json and suite.md."""
    from megagrpo.ckpt.durable import atomic_write

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    suite = {"suite": args.suite, "quick": args.quick, "machine": machine_info("torch"), "benchmarks": {}}
    earlier = earlier_entries(args)
    start = time.perf_counter()
    TMP.mkdir(parents=True, exist_ok=True)
    # The whole-run benchmarks (step, scaling, peer) make each warm-up and each run config once.
    with tempfile.TemporaryDirectory(prefix="warmups-", dir=TMP) as warmups:
        os.environ[SHARED_WARMUPS] = warmups
        try:
            for bench in args.benchmarks:
                suite["benchmarks"][bench.name] = run_one(bench, args)
        finally:
            del os.environ[SHARED_WARMUPS]
    suite["wall_s"] = time.perf_counter() - start
    if earlier:  # --only into a suite's folder: the re-run benchmarks replace their entries
        suite["benchmarks"] = merged(earlier, suite["benchmarks"])
        suite["wall_s"] = sum(b["wall_s"] for b in suite["benchmarks"].values())
    atomic_write(args.out / "suite.json", json.dumps(suite, indent=1) + "\n")
    atomic_write(args.out / "suite.md", summary_markdown(suite, args.out))
    failed = [n for n, b in suite["benchmarks"].items() if "error" in b]
    print(
        f"suite {args.suite}: {suite['wall_s']:.0f} s, results in {args.out}"
        + (f"; failed: {failed}" if failed else "")
    )
    return suite
