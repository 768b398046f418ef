"""Costs of fault tolerance: checkpoint manifests and their verification, and an engine's restart.

    python -m benchmarks.faults [--layers 6] [--hidden 1024] [--repeat 3] [--skip-engine] [--quick]

Checkpoint (one policy rank, Megatron's writers, fp32 model + Adam state, under ``results/tmp/``),
interleaved rounds of

- ``save``: ``PolicyWorker.save`` (its writers digest every shard as they write it) + ``run.commit``
  (the manifest written, the tree fsync'd and renamed into place);
- ``plain``: the same save with the writers' digests off, published without a manifest;

then per round ``raw``: the same files' bytes written by one process (write + fsync per file), and
``verify`` of the checkpoint with its pages cached and dropped first (the first read after a
restart). Every timed write starts after ``os.sync()``. Targets: (save - plain) / raw and verify /
raw <= 10%.

Engine: the tiny GRPO run (``--prompts`` x 8 per step) whose vLLM engine is SIGKILLed inside a
``generate`` call of step ``--kill-step``: from the kill to the failure seen, to the replacement
re-synced and probed, and to the lost prompts answered (the run goes on).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from .common import TMP, record
from .common.configs import make_config
from .common.record import Measurement, ratio
from .common.timing import interleave, seconds

QUICK = {"layers": 1, "hidden": 256, "skip_engine": True}


def parse_args(argv=None):
    p = record.parser("faults", __doc__)
    p.add_argument("--layers", type=int, default=6, help="layers of the checkpointed model")
    p.add_argument("--hidden", type=int, default=1024, help="its hidden size (vocabulary 32000)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step of the engine run")
    p.add_argument("--steps", type=int, default=6, help="steps of the engine run")
    p.add_argument("--kill-step", type=int, default=3, help="the step whose generation is killed")
    p.add_argument("--skip-engine", action="store_true", help="checkpoint part only")
    return record.parse(p, argv, QUICK)


def raw_write(files: dict[str, bytes], out: Path) -> float:
    from megagrpo.ckpt.durable import fsync_dir

    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    dirs = {out}
    for rel, data in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        dirs.add(path.parent)
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    for d in sorted(dirs, key=lambda d: -len(d.parts)):
        fsync_dir(d)
    return time.perf_counter() - start


def drop_cache(root: Path) -> None:
    for path in (p for p in root.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint_rank(rank: int, world_size: int, cfg, root: str, repeat: int) -> dict:
    from megagrpo.ckpt import manifest
    from megagrpo.ckpt import megatron as megatron_ckpt
    from megagrpo.ckpt import run as ckpt
    from megagrpo.ckpt.durable import publish
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.worker import PolicyWorker

    root = Path(root)
    worker = PolicyWorker(cfg)

    def save():
        tmp = ckpt.begin(root / "save", 1)
        digests = worker.save(tmp)
        return ckpt.commit(tmp, ckpt.DriverState.capture(1, 0), "run_name: bench\n", 1, digests)

    def plain():
        tmp, final = root / "plain" / ".step_1.tmp", root / "plain" / "step_1"
        tmp.mkdir(parents=True)
        before = megatron_ckpt._writers_digest_into
        megatron_ckpt._writers_digest_into = lambda digests: contextlib.nullcontext()
        try:
            worker.save(tmp)
        finally:
            megatron_ckpt._writers_digest_into = before
        publish(tmp, final)

    def clean(name: str):  # untimed: the last such save removed, no dirty pages of another write left
        shutil.rmtree(root / name, ignore_errors=True)
        os.sync()

    try:
        times = interleave({"save": save, "plain": plain}, repeat, before=clean)
        step = times["save"][-1].value
        files = {
            p.relative_to(step).as_posix(): p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()
        }
        out = {k: seconds(v) for k, v in times.items()} | {"raw": [], "warm": [], "cold": []}
        for _ in range(repeat):
            out["raw"].append(raw_write(files, root / "raw"))
            start = time.perf_counter()
            out["bytes"] = manifest.verify(step)
            out["warm"].append(time.perf_counter() - start)
            drop_cache(step)
            start = time.perf_counter()
            manifest.verify(step)
            out["cold"].append(time.perf_counter() - start)
        out["load"] = [t.other_cpus for v in times.values() for t in v]
        return out
    finally:
        destroy_parallel()


def checkpoint_costs(args) -> list[Measurement]:
    from megagrpo.parallel.local import run_local_ranks

    cfg = make_config(
        {
            "model.tiny.num_layers": args.layers,
            "model.tiny.hidden_size": args.hidden,
            "model.tiny.ffn_hidden_size": args.hidden * 11 // 4,
            "model.tiny.num_attention_heads": args.hidden // 64,
            "model.tiny.num_query_groups": 2,
            "model.tiny.vocab_size": 32000,
            "parallel.tensor_model_parallel_size": 1,
        }
    )
    root = TMP / "faults"
    shutil.rmtree(root, ignore_errors=True)
    (r,) = run_local_ranks(checkpoint_rank, 1, cfg, str(root), args.repeat, timeout_s=3600)
    shutil.rmtree(root, ignore_errors=True)
    s = {"bytes": r["bytes"]}
    manifest = [a - b for a, b in zip(r["save"], r["plain"], strict=True)]
    kw = {"settings": s, "target": "<= 0.1", "headline": True}
    return [
        Measurement("raw write of the checkpoint's bytes (write + fsync)", r["raw"], "s", s),
        Measurement("save with manifest", r["save"], "s", s),
        Measurement("save without manifest", r["plain"], "s", s),
        Measurement("verify, pages cached", r["warm"], "s", s),
        Measurement("verify, pages dropped first", r["cold"], "s", s),
        ratio("manifest's cost at save / raw write", manifest, r["raw"], **kw),
        ratio("verify, pages cached / raw write", r["warm"], r["raw"], **kw),
        ratio("verify, pages dropped / raw write", r["cold"], r["raw"], **kw),
        Measurement("other jobs' load during the saves", r["load"], "CPUs", s),
    ]


def engine_restart(args) -> list[Measurement]:
    from megagrpo.runtime import engines
    from megagrpo.runtime.ray_session import local_session_dir
    from megagrpo.runtime.watchdog import session_processes
    from megagrpo.trainers.grpo import train

    root = TMP / "faults_run"
    metrics = root / "runs" / "engine" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    run = {"logging.dir": root / "runs", "run_name": "engine", "logging.tensorboard": False}
    run |= {
        "logging.progress_bar": False,
        "logging.val_every": 0,
        "warmup.steps": 20,
        "grpo.num_steps": args.steps,
    }
    run |= {"grpo.num_prompts_per_step": args.prompts, "policy.mini_batch_size": args.prompts * 8 // 2}
    run |= {"checkpoint.dir": None, "checkpoint.save_every": 0, "checkpoint.export_hf_at_end": False}
    cfg = make_config(run)
    marks: dict[str, float] = {}
    replace, call = engines.EnginePool.replace, engines.EnginePool.call

    def timed_replace(self, *a, **kw):
        marks["seen"] = time.time()
        out = replace(self, *a, **kw)
        marks["probed"] = time.time()
        return out

    def timed_call(self, *a, **kw):
        out = call(self, *a, **kw)
        if "probed" in marks and "answered" not in marks:
            marks["answered"] = time.time()
        return out

    def killer():
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= args.kill_step - 1):
            time.sleep(0.1)
        (engine,) = [
            p for p in session_processes(local_session_dir()) if cmdline(p).startswith("ray::VLLMEngine")
        ]
        while not cmdline(engine).startswith("ray::VLLMEngine.generate"):
            time.sleep(0.002)
        os.kill(engine, signal.SIGKILL)
        marks["killed"] = time.time()
        marks["step"] = len(metrics.read_text().splitlines()) + 1  # the step being generated

    engines.EnginePool.replace, engines.EnginePool.call = timed_replace, timed_call
    threading.Thread(target=killer, daemon=True).start()
    try:
        train(cfg)
    finally:
        engines.EnginePool.replace, engines.EnginePool.call = replace, call
    steps = {r["step"]: r["timing/step_s"] for r in map(json.loads, metrics.read_text().splitlines())}
    killed = int(marks["step"])
    others = [s for step, s in steps.items() if step != killed]
    s = {"prompts": args.prompts, "killed_in_step": killed}
    return [
        Measurement("engine killed -> failure seen by the driver", [marks["seen"] - marks["killed"]], "s", s),
        Measurement(
            "engine killed -> replacement started, re-synced and probed",
            [marks["probed"] - marks["killed"]],
            "s",
            s,
            headline=True,
        ),
        Measurement("engine killed -> lost prompts answered", [marks["answered"] - marks["killed"]], "s", s),
        Measurement("the step with the kill", [steps[killed]], "s", s),
        Measurement("the other steps", others, "s", s),
    ]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = checkpoint_costs(args) + ([] if args.skip_engine else engine_restart(args))
    what = "checkpoint manifests and verification against a raw write; an engine killed and replaced"
    notes = [f"checkpointed model: {args.layers} layers, hidden {args.hidden}, vocabulary 32000, fp32 + Adam"]
    return record.write(
        args, "faults", what, out, packages=("torch", "megatron.core", "vllm", "ray"), notes=notes
    )


if __name__ == "__main__":
    main()
