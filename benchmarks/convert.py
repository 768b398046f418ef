"""HF <-> Megatron conversion: time against the plain safetensors read+write of the same shards, and
peak memory against model + largest shard + an idle process.

    python -m benchmarks.convert [--size-mb 600] [--tp 1 2] [--small-shard-mb 200] [--repeat 2] [--quick]

A random Qwen2-shaped bf16 HF checkpoint of ``--size-mb`` MB (cached under ``results/tmp/``), then
each command as its own process tree, with its wall time and peak memory:

- ``idle``: python importing megagrpo.ckpt.convert and Megatron as a converter rank does: its RSS
  is the per-process constant of the memory bound, its time the start-up every command pays;
- ``io_bound``: ``load_file`` + ``save_file`` of every source shard (timed inside: start-up excluded,
  which makes the bound strict); ``io_bound_durable``: the same with each file fsync'd, as both
  converters' outputs are before they are renamed into place;
- ``hf_to_megatron`` at each ``--tp`` and ``megatron_to_hf`` with 5 GB and ``--small-shard-mb``
  shards (every export compared tensor by tensor with the source).

Peak memory: the exact largest RSS of any process of the tree (``wait4``'s rusage) and, sampled,
the tree's summed PSS (a page a forked checkpoint writer shares with its parent counts once).
Every command starts with its input in the page cache and no dirty pages. A run during which
other processes kept ``CONTENDED_CPUS`` busy is disturbed and retried (up to 3 x ``--repeat``
runs); the samples are the undisturbed runs. Targets: conversion >= 50% of the I/O bound's speed,
peak RSS below its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import MB, REPO, TMP, models, record
from .common.machine import machine_busy_s, proc_pss, proc_status
from .common.record import Measurement

CONTENDED_CPUS = 0.3
SHAPE = {**models.QWEN2_SHAPE, "max_position_embeddings": 4096}
IDLE = (  # a converter rank's imports
    "import megagrpo.ckpt.convert\nfrom megagrpo.compat.startup import weights_only_process\n"
    "with weights_only_process(): pass"
)
# A fork inherits its parent's RSS as the start of its ru_maxrss, so commands are started by a bare
# interpreter, which reports the command's rusage (covering the ranks it joined) on its stdout.
LAUNCHER = (
    "import os, sys\npid = os.fork()\nif pid == 0:\n"
    "    os.dup2(int(sys.argv[1]), 1); os.dup2(int(sys.argv[1]), 2); os.execv(sys.argv[2], sys.argv[2:])\n"
    "_, status, ru = os.wait4(pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status), ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime)\n"
)
QUICK = {"size_mb": 100.0, "tp": [1], "quiet_wait": 0.0, "retry": False}


def parse_args(argv=None):
    p = record.parser("convert", __doc__, repeat=2)
    p.add_argument("--size-mb", type=float, default=600, help="source model size")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes of hf_to_megatron")
    p.add_argument("--small-shard-mb", type=int, default=200, help="the smaller export shard size")
    p.add_argument("--quiet-wait", type=float, default=60, help="seconds to wait for idle CPUs before a run")
    p.add_argument("--no-retry", dest="retry", action="store_false", help="do not rerun disturbed runs")
    p.add_argument("--io-copy", nargs=3, metavar=("SRC", "DST", "DURABLE"), help=argparse.SUPPRESS)
    return record.parse(p, argv, QUICK)


def model_bytes(num_layers: int) -> int:
    return 2 * models.qwen2_params(SHAPE, num_layers, tied=False)  # bf16


def source_model(num_layers: int) -> Path:
    """Random bf16 weights in 5 shards, with transformers' ``Qwen2Config``."""

    def write(out: Path) -> None:
        import torch
        from transformers import Qwen2Config

        shapes = models.qwen2_tensor_shapes(SHAPE, num_layers, tied=False)
        models.write_random_shards(out, shapes, 5, torch.bfloat16)
        kw = {"tie_word_embeddings": False, "dtype": "bfloat16", "architectures": ["Qwen2ForCausalLM"]}
        Qwen2Config(**SHAPE, num_hidden_layers=num_layers, **kw).to_json_file(str(out / "config.json"))

    marker, what = {"shape": SHAPE, "num_layers": num_layers}, f"{model_bytes(num_layers) / MB:.0f} MB"
    return models.cached_model(TMP / f"qwen2-L{num_layers}-bf16", marker, write, what)


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def io_copy(src: Path, dst: Path, durable: bool) -> None:
    """Child mode: read + write every shard with plain safetensors; print the timed seconds."""
    from safetensors.torch import load_file, save_file

    def sync(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    dst.mkdir(parents=True)
    start = time.perf_counter()
    for path in shards(src):
        save_file(load_file(str(path)), str(dst / path.name), metadata={"format": "pt"})
        if durable:
            sync(dst / path.name)
    shutil.copy2(src / "model.safetensors.index.json", dst)
    if durable:
        sync(dst / "model.safetensors.index.json")
        sync(dst)
    print(json.dumps({"io_seconds": time.perf_counter() - start}))


def run_tree(cmd: list[str], timeout_s: float = 3600) -> dict:
    """Run ``cmd`` (from the repository) and sample its process tree until it exits."""
    import psutil

    log_r, log_w = os.pipe()
    busy0, own0, start = machine_busy_s(), time.process_time(), time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-S", "-c", LAUNCHER, str(log_w), *cmd],
        cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        pass_fds=(log_w,),
    )
    os.close(log_w)
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.append(os.fdopen(log_r, "rb").read()), daemon=True)
    reader.start()
    launcher = psutil.Process(proc.pid)
    hwm = pss = procs = 0
    next_pss = 0.0
    while proc.poll() is None:
        try:
            pids = [c.pid for c in launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            pids = []
        live = [pid for pid in pids if proc_status(pid, ("VmHWM",))]
        hwm = max([hwm, *(proc_status(pid, ("VmHWM",)).get("VmHWM", 0) for pid in live)])
        procs = max(procs, len(live))
        if time.perf_counter() - start >= next_pss:  # PSS walks page tables: ~34 ms for 3 GB
            pss, next_pss = max(pss, sum(proc_pss(pid) for pid in live)), time.perf_counter() - start + 1.0
        if time.perf_counter() - start > timeout_s:
            for child in launcher.children(recursive=True):
                child.kill()
            raise RuntimeError(f"{cmd}: timed out after {timeout_s:.0f}s")
        time.sleep(0.02)
    wall = time.perf_counter() - start
    code, maxrss, cpu = proc.stdout.read().split()
    code, maxrss = int(code), int(maxrss)
    other = max(0.0, machine_busy_s() - busy0 - float(cpu) - (time.process_time() - own0)) / wall
    reader.join()
    text = b"".join(output).decode(errors="replace")
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit code {code}:\n{text[-4000:]}")
    return {
        "wall_s": wall,
        "rss": max(hwm, maxrss),
        "pss": pss,
        "procs": procs,
        "other_cpus": other,
        "out": text,
    }


def settle(inputs: Path) -> None:
    """The same start for every command: no dirty pages (a writer throttled by an earlier run's
    write-back measured 6.7 s for a 3 GB write against 0.6 s), and its input just read (this
    machine's kernel pages out file data unused for about a minute)."""
    os.sync()
    for path in sorted(p for p in inputs.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as fh:
            while fh.read(64 * MB):
                pass


def wait_for_quiet(max_wait_s: float) -> None:
    """Until other processes use < ``CONTENDED_CPUS`` CPUs over a second, for at most ``max_wait_s``."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s:
        before = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - before < CONTENDED_CPUS:
            return


def runs_of(name: str, cmd_for, args, inputs: Path, after=None) -> list[dict]:
    """Runs of ``cmd_for()`` until ``--repeat`` undisturbed ones (3 x ``--repeat`` runs at most);
    the undisturbed ones, or all when none was."""
    runs: list[dict] = []
    most = (3 if args.retry else 1) * args.repeat
    while sum(r["other_cpus"] < CONTENDED_CPUS for r in runs) < args.repeat and len(runs) < most:
        cmd = cmd_for()
        settle(inputs)
        wait_for_quiet(args.quiet_wait)
        run = run_tree(cmd)
        if after is not None:
            run |= after(run)
        print(
            f"  {name}: {run['wall_s']:.2f} s, RSS {run['rss'] / MB:.0f} MB, others {run['other_cpus']:.2f}"
        )
        runs.append(run)
    return [r for r in runs if r["other_cpus"] < CONTENDED_CPUS] or runs


def same_tensors(src: Path, out: Path) -> dict:
    """Every tensor of an exported directory equals the source's (names, dtypes, values)."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        names = {}
        for path in shards(d):
            with safe_open(str(path), framework="pt") as fh:
                names.update(dict.fromkeys(fh.keys(), path))
        return names

    want, got = index(src), index(out)
    if set(want) != set(got):
        raise RuntimeError(f"{out}: tensor names differ from the source: {sorted(set(want) ^ set(got))[:5]}")
    for name, path in want.items():
        with safe_open(str(path), framework="pt") as a, safe_open(str(got[name]), framework="pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                raise RuntimeError(f"{out}: tensor {name} differs from the source ({x.dtype}, {y.dtype})")
    return {"largest_shard": max(p.stat().st_size for p in shards(out))}


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.io_copy:
        io_copy(Path(args.io_copy[0]), Path(args.io_copy[1]), args.io_copy[2] == "durable")
        return None
    py, tools = sys.executable, REPO / "tools" / "convert_hf"
    src = source_model(models.layers_for(args.size_mb, model_bytes))
    size, largest = sum(p.stat().st_size for p in shards(src)), max(p.stat().st_size for p in shards(src))
    runs: dict[str, list[dict]] = {"idle": runs_of("idle", lambda: [py, "-c", IDLE], args, src)}
    copy = [py, "-m", "benchmarks.convert", "--io-copy", str(src)]
    for kind in ("cached", "durable"):
        cmd = lambda k=kind: [*copy, str(fresh(TMP / "io")), k]
        runs[kind] = runs_of(kind, cmd, args, src, lambda r: json.loads(r["out"].strip().splitlines()[-1]))
        shutil.rmtree(TMP / "io")  # a 3 GB model's copies would fill small disks
    for tp in args.tp:
        out = TMP / f"megatron-tp{tp}"
        convert = [py, str(tools / "hf_to_megatron.py"), "--hf-dir", str(src), "--tp", str(tp)]
        rs = runs_of(f"tp{tp}", lambda o=out, c=convert: [*c, "--out", str(fresh(o))], args, src)
        runs[f"hf_to_megatron tp{tp}"] = [r | {"largest_shard": largest} for r in rs]
    ckpt = TMP / f"megatron-tp{min(args.tp)}"
    for label in ("5GB", f"{args.small_shard_mb}MB"):
        out = TMP / f"hf-export-{label}"
        export = [py, str(tools / "megatron_to_hf.py"), "--ckpt", str(ckpt), "--max-shard-size", label]
        cmd = lambda o=out, export=export: [*export, "--out", str(fresh(o))]
        check = lambda r, o=out: same_tensors(src, o)
        runs[f"megatron_to_hf {label} shards"] = runs_of(label, cmd, args, ckpt, check)
    for path in TMP.iterdir():
        if path.name.startswith(("megatron-tp", "hf-export-")):
            shutil.rmtree(path, ignore_errors=True)
    notes = [f"bf16 source: {size / MB:.0f} MB, {len(shards(src))} shards, largest {largest / MB:.0f} MB"]
    what = "HF <-> Megatron conversion against the safetensors read+write bound and a memory bound"
    packages = ("torch", "megatron.core", "safetensors")
    return record.write(args, "convert", what, measurements(runs, size), packages=packages, notes=notes)


def measurements(runs: dict[str, list[dict]], size: int) -> list[Measurement]:
    idle = max(r["rss"] for r in runs["idle"])
    out = [Measurement("start-up of a converter rank (imports)", [r["wall_s"] for r in runs["idle"]], "s")]
    bound = {k: min(r["io_seconds"] for r in runs[k]) for k in ("cached", "durable")}
    for k in bound:
        name = f"safetensors read + write{', fsync' if k == 'durable' else ''}, timed inside"
        out.append(Measurement(name, [r["io_seconds"] for r in runs[k]], "s", {"bytes": size}))
    for command, rs in runs.items():
        if command in ("idle", "cached", "durable"):
            continue
        s, top = {"command": command}, command in ("hf_to_megatron tp1", "megatron_to_hf 5GB shards")
        memory = size + max(r["largest_shard"] for r in rs)
        rss, pss, procs = (max(r[k] for r in rs) for k in ("rss", "pss", "procs"))
        speed = {k: [bound[k] / r["wall_s"] for r in rs] for k in bound}

        def add(name: str, samples, unit: str, s=s, **kw) -> None:
            out.append(Measurement(name, samples, unit, s, **kw))

        add("wall time", [r["wall_s"] for r in rs], "s")
        add("speed / safetensors read+write", speed["cached"], "fraction", target=">= 0.5", headline=top)
        add("speed / safetensors read+write+fsync", speed["durable"], "fraction", target=">= 0.5")
        rss_bound, pss_bound = memory + idle, memory + idle * procs
        add(
            "peak RSS / (model + largest shard + idle process)",
            [rss / rss_bound],
            "x",
            target="< 1",
            headline=command == "hf_to_megatron tp1",
        )
        add(
            "tree's peak PSS / (model + largest shard + idle processes)", [pss / pss_bound], "x", target="< 1"
        )
        add("peak process RSS", [rss / MB], "MB")
    load = [r["other_cpus"] for rs in runs.values() for r in rs]
    return [*out, Measurement("other jobs' load during the runs", load, "CPUs")]


if __name__ == "__main__":
    main()
