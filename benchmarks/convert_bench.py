#!/usr/bin/env python3
"""Conversion benchmark: HF <-> Megatron throughput and peak memory against the plain-I/O bound.

    python benchmarks/convert_bench.py [--size-mb 600] [--repeat 1] [--tp 1 2] [--small-shard-mb 200]
                                       [--quiet-wait 60] [--no-phases] [--output convert]

Builds a random Qwen2-shaped bf16 HF checkpoint of ``--size-mb`` MB (cached under
benchmarks/results/tmp/), then runs each command below as its own process tree and records wall
time, GB/s (model bytes / wall seconds) and peak memory:

- ``idle``: python importing megagrpo.ckpt.convert and megatron.core (as a converter rank
  does), then exiting; its RSS is the per-process constant in the memory bound;
- ``io_bound``: read every source shard with safetensors ``load_file`` and write it back with
  ``save_file`` (same sharding): the time to simply move the bytes. Its GB/s is measured inside
  the script (interpreter start-up excluded), which makes the bound strict;
- ``io_bound_durable``: the same, fsyncing each written file: what a write costs that is on disk
  when it reports done, as both converters' outputs are;
- ``hf_to_megatron`` at each ``--tp`` (PP=1) through tools/convert_hf/hf_to_megatron.py;
- ``megatron_to_hf`` with the default 5GB shards and with ``--small-shard-mb`` shards.

Targets (from the converter issue): conversion GB/s >= 50% of the I/O bound, and peak RSS below
model size + largest HF shard file + the idle constant. Peak memory is taken three ways because
the converters spawn rank processes: the kernel's exact maximum RSS of any single process in the
tree (``wait4`` rusage), and, sampled every 20 ms, the sum over all live processes of RSS and of
anonymous RSS (RSS counts memory-mapped file pages, which safetensors reads go through; anonymous
RSS is what the process itself allocated), and, sampled every second (reading it walks page tables),
the sum of PSS, which counts a page shared with a forked checkpoint writer once in all: the tree's
target compares that sum. Every exported checkpoint is compared tensor by tensor
with the source, so a fast but wrong conversion does not pass.

Times mean little on a shared machine, so every run first waits (up to ``--quiet-wait`` s) for the
CPUs to go idle and records how many CPUs other processes used meanwhile; a run above
``CONTENDED_CPUS`` is "disturbed" and retried, and the reported time is the fastest undisturbed
run. Then (unless ``--no-phases``) benchmarks/convert_phases.py times each phase of one rank.

Results: benchmarks/results/<output>.json (every number and the machine) and <output>.md (table).
Caches and outputs live under benchmarks/results/tmp/ (git-ignored); outputs are removed at the
end, the source model is kept and reused while its shape matches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import GB, MB, REPO, TMP
from common.models import (
    QWEN2_SHAPE,
    cached_model,
    layers_for,
    qwen2_params,
    qwen2_tensor_shapes,
    write_random_shards,
)
from common.sampling import children_cpu_s, machine_busy_s, machine_info, proc_pss, proc_status
from common.tables import md_table, results_json, write_results

# The plain-I/O commands each conversion is compared with: page cache only, and synced to disk.
BOUNDS = ("io_bound", "io_bound_durable")
POLL_S = 0.02
PSS_POLL_S = 1.0  # smaps_rollup walks page tables: ~34 ms for a 3 GB process
STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
# A run during which other processes kept this many CPUs busy is "disturbed": its time is not used
# when an undisturbed repeat exists.
CONTENDED_CPUS = 0.3
# A converter rank imports Megatron the way it does (torch.compile decorations deferred, GC paused).
IDLE_SCRIPT = (
    "import megagrpo.ckpt.convert\nfrom megagrpo.compat.startup import weights_only_process\n"
    "with weights_only_process(): pass"
)
# A fork inherits its parent's RSS as the start of its ru_maxrss, so the command is started by a
# bare interpreter (~10 MB) rather than by this process (torch imported); it reports the
# command's rusage (which covers the rank processes the command joined) on its stdout.
LAUNCHER = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.dup2(int(sys.argv[1]), 1); os.dup2(int(sys.argv[1]), 2); os.execv(sys.argv[2], sys.argv[2:])\n"
    "_, status, ru = os.wait4(pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status), ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime)\n"
)

# Qwen2-style shape; the layer count is chosen to reach --size-mb.
SHAPE = {**QWEN2_SHAPE, "max_position_embeddings": 4096}
SOURCE_SHARDS = 5


# --- the source model -------------------------------------------------------------------------------


def qwen2_config(num_layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        **SHAPE,
        num_hidden_layers=num_layers,
        tie_word_embeddings=False,
        dtype="bfloat16",
        architectures=["Qwen2ForCausalLM"],
    )


def model_bytes(num_layers: int) -> int:
    return 2 * qwen2_params(SHAPE, num_layers, tied=False)  # bf16


def source_model(num_layers: int) -> Path:
    """Random bf16 weights in ``SOURCE_SHARDS`` shards, with transformers' ``Qwen2Config``."""

    def write(out: Path) -> None:
        import torch

        shapes = qwen2_tensor_shapes(SHAPE, num_layers, tied=False)
        write_random_shards(out, shapes, SOURCE_SHARDS, torch.bfloat16)
        qwen2_config(num_layers).to_json_file(str(out / "config.json"))

    marker = {"shape": SHAPE, "num_layers": num_layers}
    what = f"{model_bytes(num_layers) / MB:.0f} MB"
    return cached_model(TMP / f"qwen2-L{num_layers}-bf16", marker, write, what)


def shard_files(hf_dir: Path) -> list[Path]:
    return sorted(hf_dir.glob("*.safetensors"))


# --- measuring a process tree -----------------------------------------------------------------------


@dataclass
class Run:
    """One command's wall time and peak memory (bytes)."""

    name: str
    cmd: list[str]
    wall_s: float = 0.0
    max_process_rss: int = 0
    """Exact: the largest ru_maxrss of any process in the tree (rusage from wait4)."""
    max_tree_rss: int = 0
    """Sampled: the largest sum of RSS over all live processes of the tree."""
    max_tree_anon: int = 0
    """Sampled: the largest sum of anonymous RSS (RssAnon) over all live processes."""
    max_tree_file: int = 0
    """Sampled: the largest sum of file-backed RSS (RssFile: mmapped weights, libraries)."""
    max_tree_pss: int = 0
    """Sampled every ``PSS_POLL_S``: the largest sum of PSS, where a page shared by n processes
    (a forked checkpoint writer and its parent) counts 1/n in each: the tree's real footprint."""
    max_processes: int = 0
    cpu_s: float = 0.0
    """CPU seconds of the command's processes (user + system)."""
    other_cpus: float = 0.0
    """CPUs kept busy by everything else on the machine during the run (contention)."""
    waited_for_quiet_s: float = 0.0
    samples: int = 0
    stdout: str = ""
    extra: dict = field(default_factory=dict)


def wait_for_quiet(max_wait_s: float, busy_cpus: float = 0.3) -> float:
    """Wait (up to ``max_wait_s``) until other processes use < ``busy_cpus`` CPUs; return the wait."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s:
        before = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - before < busy_cpus:
            break
    return time.perf_counter() - start


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")[:160].strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def measure(name: str, cmd: list[str], timeout_s: float = 3600) -> Run:
    """Run ``cmd`` (cwd = repo root) and sample its whole process tree until it exits."""
    import psutil

    run = Run(name=name, cmd=cmd)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log_r, log_w = os.pipe()
    busy_start, own_start = machine_busy_s(), time.process_time()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-S", "-c", LAUNCHER, str(log_w), *cmd],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        pass_fds=(log_w,),
    )
    os.close(log_w)
    output: list[bytes] = []

    def read_log() -> None:
        with os.fdopen(log_r, "rb") as fh:
            output.append(fh.read())

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    launcher = psutil.Process(proc.pid)
    hwm = 0
    seen: dict[int, list] = {}  # pid -> [peak VmHWM, command line, first seen s, last seen s]
    next_pss = 0.0
    while proc.poll() is None:
        try:
            pids = [c.pid for c in launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            pids = []
        live = {pid: stat for pid in pids if (stat := proc_status(pid, STATUS_KEYS))}
        stats = list(live.values())
        now = time.perf_counter() - start
        for pid, stat in live.items():
            entry = seen.setdefault(pid, [0, "", now, now])
            if not entry[1] or " -S -c " in entry[1]:  # first seen between the launcher's fork and exec
                entry[1] = _cmd(pid)
            entry[0], entry[3] = max(entry[0], stat.get("VmHWM", 0)), now
        run.max_tree_rss = max(run.max_tree_rss, sum(s.get("VmRSS", 0) for s in stats))
        run.max_tree_anon = max(run.max_tree_anon, sum(s.get("RssAnon", 0) for s in stats))
        run.max_tree_file = max(run.max_tree_file, sum(s.get("RssFile", 0) for s in stats))
        hwm = max([hwm, *(s.get("VmHWM", 0) for s in stats)])
        run.max_processes = max(run.max_processes, len(stats))
        if now >= next_pss:
            run.max_tree_pss = max(run.max_tree_pss, sum(proc_pss(pid) for pid in live))
            next_pss = now + PSS_POLL_S
        run.samples += 1
        if time.perf_counter() - start > timeout_s:
            for child in launcher.children(recursive=True):
                child.kill()
            raise RuntimeError(f"{name}: timed out after {timeout_s:.0f}s")
        time.sleep(POLL_S)
    run.wall_s = time.perf_counter() - start
    code, maxrss, cpu_s = proc.stdout.read().split()
    code, maxrss = int(code), int(maxrss)
    busy_s = machine_busy_s() - busy_start
    run.cpu_s = float(cpu_s)
    run.other_cpus = max(0.0, busy_s - run.cpu_s - (time.process_time() - own_start)) / run.wall_s
    reader.join()
    run.stdout = b"".join(output).decode(errors="replace")
    # The exact peak (rusage) and the sampled VmHWM of each process agree up to the last sample.
    run.max_process_rss = max(hwm, maxrss)
    run.extra["sampled_max_vmhwm"] = hwm
    run.extra["processes"] = [
        {"cmd": cmd, "vmhwm": peak, "first_seen_s": first, "last_seen_s": last}
        for peak, cmd, first, last in seen.values()
    ]
    if code != 0:
        raise RuntimeError(f"{name}: exit code {code}:\n{run.stdout[-4000:]}")
    return run


# --- the commands -----------------------------------------------------------------------------------


def io_copy(src: Path, dst: Path, durable: bool) -> None:
    """Child mode: read + write every shard with plain safetensors; print the timed seconds as JSON.

    ``durable``: fsync each file once written, and the directory at the end, as a write must that
    is on disk when it says it is done (both converters' outputs are).
    """
    from safetensors.torch import load_file, save_file

    def sync(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    dst.mkdir(parents=True)
    start = time.perf_counter()
    for path in shard_files(src):
        tensors = load_file(str(path))
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
        del tensors
        if durable:
            sync(dst / path.name)
    shutil.copy2(src / "model.safetensors.index.json", dst)
    if durable:
        sync(dst / "model.safetensors.index.json")
        sync(dst)
    print(json.dumps({"io_seconds": time.perf_counter() - start}))


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def check_same_tensors(src: Path, out: Path) -> int:
    """Compare every tensor of the exported directory with the source; return the tensor count."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        names = {}
        for path in shard_files(d):
            with safe_open(str(path), framework="pt") as fh:
                names.update(dict.fromkeys(fh.keys(), path))
        return names

    want, got = index(src), index(out)
    if set(want) != set(got):
        raise RuntimeError(f"{out}: tensor names differ from the source: {sorted(set(want) ^ set(got))[:5]}")
    for name in want:
        with safe_open(str(want[name]), framework="pt") as a, safe_open(str(got[name]), framework="pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):  # torch.equal alone ignores dtypes
                raise RuntimeError(f"{out}: tensor {name} differs from the source ({x.dtype}, {y.dtype})")
    return len(want)


def best(runs: list[Run]) -> dict:
    """The fastest undisturbed repeat's time; the worst repeat's memory; every repeat kept."""
    clean = [r for r in runs if r.other_cpus < CONTENDED_CPUS] or runs
    fastest = min(clean, key=lambda r: r.wall_s)
    return {
        "wall_s": fastest.wall_s,
        "max_process_rss": max(r.max_process_rss for r in runs),
        "max_tree_rss": max(r.max_tree_rss for r in runs),
        "max_tree_anon": max(r.max_tree_anon for r in runs),
        "max_tree_file": max(r.max_tree_file for r in runs),
        "max_tree_pss": max(r.max_tree_pss for r in runs),
        "max_processes": max(r.max_processes for r in runs),
        "cpu_s": fastest.cpu_s,
        "other_cpus": fastest.other_cpus,
        "disturbed": fastest.other_cpus >= CONTENDED_CPUS,
        "extra": fastest.extra,
        "runs": [{k: v for k, v in asdict(r).items() if k != "stdout"} for r in runs],
    }


def settle(inputs: Path) -> None:
    """The same start for every command: its input in the page cache, no dirty pages.

    A command that starts while earlier runs' gigabytes are still being written back is throttled
    by the kernel (writers wait once dirty pages pass ``vm.dirty_ratio``): a plain 3 GB write
    measured 6.7 s that way against 0.6 s from a clean start. And the input must be read just
    before: this machine's kernel pages out file data unused for about a minute (DAMON
    ``pageout``), so the checkpoint an export reads, written by import runs minutes earlier, was
    read from disk otherwise (3.5 s more for 3 GB).
    """
    os.sync()
    for path in sorted(p for p in inputs.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as fh:
            while fh.read(64 * MB):
                pass


def measure_repeats(
    name: str, cmd_for, args: argparse.Namespace, after=None, inputs: Path | None = None
) -> dict:
    """Run ``cmd_for()`` until ``--repeat`` undisturbed runs exist (3x ``--repeat`` runs at most).

    ``inputs``: what the command reads (default: the HF source), brought into the page cache first.
    """
    runs: list[Run] = []
    most = (3 if args.retry else 1) * args.repeat
    while sum(r.other_cpus < CONTENDED_CPUS for r in runs) < args.repeat and len(runs) < most:
        cmd = cmd_for()  # removes the previous run's output first
        settle(inputs or args.source)
        waited = wait_for_quiet(args.quiet_wait)
        run = measure(name, cmd)
        run.waited_for_quiet_s = waited
        if after is not None:
            run.extra.update(after(run))
        print(
            f"  {name} [{len(runs) + 1}]: {run.wall_s:.2f} s, "
            f"max process RSS {run.max_process_rss / MB:.0f} MB, "
            f"tree RSS {run.max_tree_rss / MB:.0f} MB, other processes used {run.other_cpus:.2f} CPUs"
        )
        runs.append(run)
    return best(runs)


def run_benchmarks(args: argparse.Namespace) -> dict:
    import torch

    py = sys.executable
    layers = layers_for(args.size_mb, model_bytes)
    src = source_model(layers)
    args.source = src
    size = sum(p.stat().st_size for p in shard_files(src))
    largest_src = max(p.stat().st_size for p in shard_files(src))
    results: dict[str, dict] = {}

    def repeat(name: str, cmd_for, after=None, inputs: Path | None = None) -> None:
        results[name] = measure_repeats(name, cmd_for, args, after, inputs)

    repeat("idle", lambda: [py, "-c", IDLE_SCRIPT])

    io_out = TMP / "io-copy"
    for name, flag in (("io_bound", "--io-copy"), ("io_bound_durable", "--io-copy-durable")):
        repeat(
            name,
            lambda flag=flag: [py, __file__, flag, str(src), str(fresh(io_out))],
            after=lambda run: json.loads(run.stdout.strip().splitlines()[-1]),
        )
        results[name]["largest_shard_bytes"] = largest_src
    shutil.rmtree(io_out)  # outputs go once measured: a 3 GB model's would fill small disks

    ckpts = {}
    for tp in args.tp:
        ckpts[tp] = TMP / f"megatron-tp{tp}"
        repeat(
            f"hf_to_megatron_tp{tp}",
            lambda tp=tp: [
                py,
                "tools/convert_hf/hf_to_megatron.py",
                "--hf-dir",
                str(src),
                "--out",
                str(fresh(ckpts[tp])),
                "--tp",
                str(tp),
            ],
        )
        results[f"hf_to_megatron_tp{tp}"]["largest_shard_bytes"] = largest_src

    ckpt = ckpts[min(args.tp)]
    for label, shard_arg in (("5GB", "5GB"), (f"{args.small_shard_mb}MB", f"{args.small_shard_mb}MB")):
        name = f"megatron_to_hf_{label}"
        out = TMP / f"hf-export-{label}"
        repeat(
            name,
            lambda out=out, shard_arg=shard_arg: [
                py,
                "tools/convert_hf/megatron_to_hf.py",
                "--ckpt",
                str(ckpt),
                "--out",
                str(fresh(out)),
                "--max-shard-size",
                shard_arg,
            ],
            after=lambda run, out=out: {
                "tensors_checked": check_same_tensors(src, out),
                "output_shards": len(shard_files(out)),
            },
            inputs=ckpt,
        )
        results[name]["largest_shard_bytes"] = max(p.stat().st_size for p in shard_files(out))
        shutil.rmtree(out)

    summarize(results, size)
    phases = profile_phases(src, ckpt, args) if args.phases else {}
    # Outputs are rewritten by every run; only the source model is worth keeping between runs.
    for path in TMP.iterdir():
        if path.name.startswith(("io-copy", "megatron-tp", "hf-export-", "phases-")):
            shutil.rmtree(path, ignore_errors=True)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            **machine_info("torch", "megatron.core", "safetensors"),
            "torch_threads": torch.get_num_threads(),
        },
        "model": {
            "architecture": "Qwen2ForCausalLM",
            "dtype": "bfloat16",
            "num_layers": layers,
            **SHAPE,
            "bytes": size,
            "source_shards": len(shard_files(src)),
            "largest_source_shard_bytes": largest_src,
            "path": str(src.relative_to(REPO)),
        },
        "repeat": args.repeat,
        "targets": {
            "min_fraction_of_io_bound": 0.5,
            "peak_rss_bound": "model + largest HF shard + idle RSS",
        },
        "results": results,
        "phases": phases,
    }


def profile_phases(src: Path, ckpt: Path, args: argparse.Namespace) -> dict:
    """One in-process rank per direction under benchmarks/convert_phases.py (time and memory per call)."""
    script = str(REPO / "benchmarks" / "convert_phases.py")
    jobs = {
        "import_tp1": ["import", "--hf-dir", str(src), "--out", str(fresh(TMP / "phases-import"))],
        "export_5GB": ["export", "--ckpt", str(ckpt), "--out", str(fresh(TMP / "phases-export-5GB"))],
        f"export_{args.small_shard_mb}MB": [
            "export",
            "--ckpt",
            str(ckpt),
            "--out",
            str(fresh(TMP / f"phases-export-{args.small_shard_mb}MB")),
            "--max-shard-bytes",
            str(args.small_shard_mb * MB),
        ],
    }
    out = {}
    for name, job in jobs.items():
        # Up to three tries: keep the one least disturbed by other processes.
        for _ in range(3):
            settle(src if job[0] == "import" else ckpt)
            wait_for_quiet(args.quiet_wait)
            busy, children = machine_busy_s(), children_cpu_s()
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, script, *job], cwd=REPO, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(f"phases {name}: exit code {proc.returncode}:\n{proc.stderr[-4000:]}")
            own = children_cpu_s() - children
            shutil.rmtree(Path(job[job.index("--out") + 1]), ignore_errors=True)  # disk, not needed
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            result["other_cpus"] = max(0.0, machine_busy_s() - busy - own) / wall
            if name not in out or result["other_cpus"] < out[name]["other_cpus"]:
                out[name] = result
            if result["other_cpus"] < CONTENDED_CPUS:
                break
        best_try = out[name]
        print(f"  phases {name}: {best_try['total_seconds']:.2f} s, other CPUs {best_try['other_cpus']:.2f}")
    return out


def summarize(results: dict[str, dict], size: int) -> None:
    """Add GB/s, the fraction of the I/O bound and the memory bound to every conversion result."""
    idle = results["idle"]["max_process_rss"]
    for bound in BOUNDS:
        io = results[bound]
        io["gb_per_s"] = size / GB / io["extra"]["io_seconds"]
        io["gb_per_s_wall"] = size / GB / io["wall_s"]
    io, durable = (results[bound] for bound in BOUNDS)
    for name, res in results.items():
        if name == "idle" or name in BOUNDS:
            continue
        res["gb_per_s"] = size / GB / res["wall_s"]
        res["fraction_of_io_bound"] = res["gb_per_s"] / io["gb_per_s"]
        res["fraction_of_io_bound_wall"] = res["gb_per_s"] / io["gb_per_s_wall"]
        res["fraction_of_durable_io_bound"] = res["gb_per_s"] / durable["gb_per_s"]
        # One idle constant per python process: the tree holds the CLI parent and its rank(s).
        res["rss_bound"] = size + res["largest_shard_bytes"] + idle
        res["tree_rss_bound"] = size + res["largest_shard_bytes"] + idle * res["max_processes"]
        res["meets_speed_target"] = res["fraction_of_io_bound"] >= 0.5
        res["meets_speed_target_durable"] = res["fraction_of_durable_io_bound"] >= 0.5
        res["meets_rss_target"] = res["max_process_rss"] < res["rss_bound"]
        res["meets_tree_rss_target"] = res["max_tree_pss"] < res["tree_rss_bound"]


# --- report -----------------------------------------------------------------------------------------


def table(report: dict) -> str:
    res, model = report["results"], report["model"]
    lines = [
        f"Model: Qwen2-shaped bf16, {model['num_layers']} layers, {model['bytes'] / MB:.0f} MB in "
        f"{model['source_shards']} shards (largest {model['largest_source_shard_bytes'] / MB:.0f} MB). "
        f"Machine: {report['machine']['cpu_count']} CPUs, torch {report['machine']['torch']}, "
        f"{report['date']}. Times: fastest undisturbed run of {report['repeat']} wanted; "
        "memory: worst run.",
        "",
    ]
    header = (
        "command | wall s | GB/s | % of I/O bound | % of durable I/O bound | max process RSS MB "
        "| RSS bound MB | tree PSS MB (RSS sum) | tree bound MB | procs | other CPUs busy"
    )
    rows = []
    for name, r in res.items():
        tree = f"{r['max_tree_pss'] / MB:.0f} ({r['max_tree_rss'] / MB:.0f})"
        if name == "idle":
            cells = [f"{r['wall_s']:.2f}", "", "", "", f"{r['max_process_rss'] / MB:.0f}", "", tree, ""]
        elif name in BOUNDS:
            wall = f"{r['extra']['io_seconds']:.2f} ({r['wall_s']:.2f} with start-up)"
            ratios = ["100", ""] if name == "io_bound" else ["", "100"]
            cells = [wall, f"{r['gb_per_s']:.2f}", *ratios, f"{r['max_process_rss'] / MB:.0f}", "", tree, ""]
        else:
            cells = [
                f"{r['wall_s']:.2f}",
                f"{r['gb_per_s']:.3f}",
                f"{100 * r['fraction_of_io_bound']:.1f} {'ok' if r['meets_speed_target'] else 'MISS'}",
                f"{100 * r['fraction_of_durable_io_bound']:.1f} "
                f"{'ok' if r['meets_speed_target_durable'] else 'MISS'}",
                f"{r['max_process_rss'] / MB:.0f}",
                f"{r['rss_bound'] / MB:.0f} {'ok' if r['meets_rss_target'] else 'MISS'}",
                tree,
                f"{r['tree_rss_bound'] / MB:.0f} {'ok' if r['meets_tree_rss_target'] else 'MISS'}",
            ]
        disturbed = " DISTURBED" if r["disturbed"] else ""
        rows.append([name, *cells, r["max_processes"], f"{r['other_cpus']:.2f}{disturbed}"])
    lines += md_table(header, rows, "l" + "r" * 10)
    lines += [
        "",
        "GB/s = model bytes / wall seconds of the whole command (interpreter start-up included); the I/O",
        "bound is plain safetensors load_file + save_file per shard, timed inside its script; the durable",
        "I/O bound also fsyncs each file once written (both converters' outputs are synced before they are",
        "renamed into place, as output must be that survives a crash). RSS bound =",
        "model + largest HF shard (input for import, output for export) + idle RSS; the tree bound adds",
        "one idle RSS per process seen. Tree PSS: the sum of proportional set sizes over the tree's live",
        "processes, sampled each second (a page that a forked checkpoint writer shares with its parent",
        "counts once in all); the RSS sum in brackets, sampled every 20 ms, counts it once per process.",
        "Every command starts with the source in the page cache",
        "and no dirty pages (`sync` first). 'other CPUs busy': CPUs used by other processes on the",
        f"machine during the chosen run (> {CONTENDED_CPUS} marks it disturbed).",
    ]
    for name, ph in report.get("phases", {}).items():
        lines += [
            "",
            f"Phases of one in-process rank, {name} (benchmarks/convert_phases.py; "
            f"{ph['total_seconds']:.2f} s in all, other processes used {ph['other_cpus']:.2f} CPUs):",
            "",
        ]
        header = "call | first start s | calls | seconds | RssAnon MB after | RssFile MB after | VmHWM MB"
        rows = [
            [
                call,
                f"{c['first_start']:.2f}",
                c["calls"],
                f"{c['seconds']:.2f}",
                f"{c['rss_anon_after_last'] / MB:.0f}",
                f"{c['rss_file_after_last'] / MB:.0f}",
                f"{c['max_vmhwm'] / MB:.0f}",
            ]
            for call, c in ph["calls"].items()
        ]
        lines += md_table(header, rows, "l" + "r" * 6)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=600, help="source model size in MB (>= 500)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per command; the fastest is reported")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes for hf_to_megatron")
    parser.add_argument("--small-shard-mb", type=int, default=200, help="the smaller export shard size")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=60,
        help="seconds to wait, before each run, for other processes to leave the CPUs idle",
    )
    parser.add_argument(
        "--no-retry",
        dest="retry",
        action="store_false",
        help="run each command --repeat times even when disturbed (a smoke run on a busy machine)",
    )
    parser.add_argument(
        "--no-phases",
        dest="phases",
        action="store_false",
        help="skip the per-phase profile (benchmarks/convert_phases.py)",
    )
    parser.add_argument("--output", default="convert", help="results/<output>.json and .md (default convert)")
    parser.add_argument("--io-copy", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--io-copy-durable", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.io_copy or args.io_copy_durable:
        io_copy(*map(Path, args.io_copy or args.io_copy_durable), durable=bool(args.io_copy_durable))
        return 0
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.size_mb < 500:
        print(f"note: --size-mb {args.size_mb} is below the 500 MB the issue asks for", file=sys.stderr)

    TMP.mkdir(parents=True, exist_ok=True)
    report = run_benchmarks(args)
    report["model"]["meets_size_requirement"] = report["model"]["bytes"] >= 500 * MB
    text = table(report)
    write_results(results_json(args.output), report, "# Conversion benchmark\n\n" + text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
