#!/usr/bin/env python3
"""Costs of fault tolerance: checkpoint manifests and their verification, and an engine restart.

    python benchmarks/fault_bench.py [--layers 6] [--hidden 1024] [--repeat 3] [--skip-engine]

Checkpoint part (one policy rank, Megatron's writers, fp32 model + Adam state, under
``results/tmp/fault_bench``), per repetition, alternating the order of ``save`` and ``plain``:

- ``save``: ``PolicyWorker.save`` (its writers digest every shard as they write it) + ``run.commit``
  (manifest: the remaining small files read back, ``manifest.json`` written, tree fsync'd, renamed);
- ``plain``: the same save with the writers' digests off, published without a manifest
  (``durable.publish``): what a checkpoint cost before manifests;
- ``raw``: the same files' bytes written by one process (``write`` + ``fsync`` per file, directories
  fsync'd): the raw write time of the same bytes;
- ``verify_warm`` / ``verify_cold``: ``manifest.verify`` of the checkpoint, its pages in the page
  cache / dropped first (``posix_fadvise(DONTNEED)`` of every file: the first read after a restart).

Every timed write starts after ``os.sync()`` (no other write's dirty pages left to write back);
ratios are taken within a repetition, then their median reported. Targets: (save - plain) / raw
and verify / raw <= 10%.

Engine part: the tiny GRPO run (``--prompts`` prompts x 8 per step), whose vLLM engine is SIGKILLed
inside a ``generate`` call of step ``--kill-step``; the time from the kill to the failure being seen,
to the replacement answering the probe, and to the lost prompts being answered (the run goes on),
and that step's time against the median of the others.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import threading
import time
from pathlib import Path

from common import RESULTS, TMP
from common.configs import make_config
from common.sampling import machine_info
from common.tables import md_table, write_results

# ------------------------------------------------------------------------------------ checkpoints


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _raw_write(files: dict[str, bytes], out: Path) -> float:
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


def _drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _checkpoint_rank(rank: int, world_size: int, cfg, root: str, repeat: int) -> list[dict]:
    from megagrpo.ckpt import manifest
    from megagrpo.ckpt import megatron as megatron_ckpt
    from megagrpo.ckpt import run as ckpt
    from megagrpo.ckpt.durable import publish
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.worker import PolicyWorker

    root = Path(root)
    worker = PolicyWorker(cfg)

    def save() -> tuple[float, Path]:
        shutil.rmtree(root / "save", ignore_errors=True)  # as plain(): the last one's removal is not timed
        os.sync()  # every timed write starts with no dirty pages of another one left to write back
        start = time.perf_counter()
        tmp = ckpt.begin(root / "save", 1)
        digests = worker.save(tmp)
        step = ckpt.commit(tmp, ckpt.DriverState.capture(1, 0), "run_name: bench\n", 1, digests)
        return time.perf_counter() - start, step

    def plain() -> float:
        final = root / "plain" / "step_1"
        shutil.rmtree(final, ignore_errors=True)
        tmp = root / "plain" / ".step_1.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        os.sync()
        start = time.perf_counter()
        with _writers_without_digests(megatron_ckpt):
            worker.save(tmp)
        publish(tmp, final)
        return time.perf_counter() - start

    rows = []
    try:
        for r in range(repeat):
            if r % 2 == 0:
                save_s, step = save()
                plain_s = plain()
            else:
                plain_s = plain()
                save_s, step = save()
            files = _files(step)
            raw_s = _raw_write(files, root / "raw")
            start = time.perf_counter()
            nbytes = manifest.verify(step)
            warm_s = time.perf_counter() - start
            _drop_cache(step)
            start = time.perf_counter()
            manifest.verify(step)
            cold_s = time.perf_counter() - start
            rows.append(
                dict(bytes=nbytes, files=len(files), save_s=save_s, plain_s=plain_s, raw_s=raw_s,
                     verify_warm_s=warm_s, verify_cold_s=cold_s)
            )  # fmt: skip
        return rows
    finally:
        destroy_parallel()


@contextlib.contextmanager
def _writers_without_digests(megatron_ckpt):
    before = megatron_ckpt._writers_digest_into
    megatron_ckpt._writers_digest_into = lambda digests: contextlib.nullcontext()
    try:
        yield
    finally:
        megatron_ckpt._writers_digest_into = before


def checkpoint_bench(args) -> dict:
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
    root = TMP / "fault_bench"
    shutil.rmtree(root, ignore_errors=True)
    (rows,) = run_local_ranks(_checkpoint_rank, 1, cfg, str(root), args.repeat, timeout_s=3600)
    shutil.rmtree(root, ignore_errors=True)
    for r in rows:  # ratios within a repetition: the disk's pace varies between them
        r |= {
            "manifest_s": r["save_s"] - r["plain_s"],
            "manifest_overhead": (r["save_s"] - r["plain_s"]) / r["raw_s"],
            "verify_warm_vs_raw": r["verify_warm_s"] / r["raw_s"],
            "verify_cold_vs_raw": r["verify_cold_s"] / r["raw_s"],
        }
    return {"rows": rows, "median": {k: statistics.median(r[k] for r in rows) for k in rows[0]}}


# ------------------------------------------------------------------------------------ engine kill


def engine_bench(args) -> dict:
    import json

    from megagrpo import cluster
    from megagrpo.driver import train
    from megagrpo.local_ray import session_processes

    root = TMP / "fault_bench_run"
    shutil.rmtree(root / "runs" / "engine" / "metrics.jsonl", ignore_errors=True)
    cfg = make_config(
        {
            "logging.dir": root / "runs",
            "run_name": "engine",
            "logging.tensorboard": False,
            "logging.progress_bar": False,
            "logging.val_every": 0,
            "warmup.steps": 20,
            "grpo.num_prompts_per_step": args.prompts,
            "grpo.num_steps": args.steps,
            "policy.mini_batch_size": args.prompts * 8 // 2,
            "checkpoint.dir": None,
            "checkpoint.save_every": 0,
            "checkpoint.export_hf_at_end": False,
        }
    )
    metrics = root / "runs" / "engine" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    marks: dict[str, float] = {}
    replace = cluster.EnginePool.replace

    def timed_replace(self, index, err):
        marks["seen"] = time.time()
        probe = replace(self, index, err)
        marks["probed"] = time.time()
        return probe

    call = cluster.EnginePool.call

    def timed_call(self, method, args_by_engine, timeout_s):
        out = call(self, method, args_by_engine, timeout_s)
        if "probed" in marks and "answered" not in marks:
            marks["answered"] = time.time()
        return out

    def killer():
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= args.kill_step - 1):
            time.sleep(0.1)
        (engine,) = [
            p
            for p in session_processes(cluster._local_session[0])
            if _cmdline(p).startswith("ray::GenerationWorker")
        ]
        while not _cmdline(engine).startswith("ray::GenerationWorker.generate"):
            time.sleep(0.002)
        os.kill(engine, signal.SIGKILL)
        marks["killed"] = time.time()
        marks["step"] = len(metrics.read_text().splitlines()) + 1  # the step being generated

    cluster.EnginePool.replace, cluster.EnginePool.call = timed_replace, timed_call
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        train(cfg)
    finally:
        cluster.EnginePool.replace, cluster.EnginePool.call = replace, call
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_s = {r["step"]: r["timing/step_s"] for r in rows}
    killed_step = int(marks["step"])
    others = [s for step, s in step_s.items() if step != killed_step]
    return {
        "kill_to_seen_s": marks["seen"] - marks["killed"],
        "kill_to_probed_s": marks["probed"] - marks["killed"],
        "kill_to_continuing_s": marks["answered"] - marks["killed"],
        "killed_in_step": killed_step,
        "disturbed_step_s": step_s[killed_step],
        "median_other_step_s": statistics.median(others),
        "steps": step_s,
    }


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------ report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--output", default="faults")
    args = parser.parse_args(argv)

    report = {
        "machine": machine_info("torch", "megatron.core", "vllm", "ray", "xxhash"),
        "args": vars(args),
    }
    report["checkpoint"] = ckpt = checkpoint_bench(args)
    m = ckpt["median"]
    lines = [
        "# Fault tolerance costs",
        "",
        f"Checkpoint of one fp32 policy rank ({args.layers} layers, hidden {args.hidden}, vocabulary 32000, "
        f"model + Adam state): {m['bytes'] / 1e6:.0f} MB in {m['files']:.0f} files; "
        f"medians of {args.repeat}.",
        "",
        *md_table(
            "what | seconds | vs raw write",
            [
                ("raw write of the same bytes (write + fsync)", f"{m['raw_s']:.3f}", "1.00"),
                (
                    "save without manifest (plain writers, publish)",
                    f"{m['plain_s']:.3f}",
                    f"{m['plain_s'] / m['raw_s']:.2f}",
                ),
                (
                    "save with manifest (writers digest, commit)",
                    f"{m['save_s']:.3f}",
                    f"{m['save_s'] / m['raw_s']:.2f}",
                ),
                (
                    "manifest overhead (with - without, per repetition)",
                    f"{m['manifest_s']:.3f}",
                    f"{m['manifest_overhead']:+.1%}",
                ),
                ("verify, pages cached", f"{m['verify_warm_s']:.3f}", f"{m['verify_warm_vs_raw']:.1%}"),
                (
                    "verify, pages dropped first",
                    f"{m['verify_cold_s']:.3f}",
                    f"{m['verify_cold_vs_raw']:.1%}",
                ),
            ],
        ),
    ]
    if not args.skip_engine:
        report["engine"] = eng = engine_bench(args)
        lines += [
            "",
            f"Engine killed (SIGKILL) inside a generate call of step {eng['killed_in_step']} of the tiny "
            f"GRPO run ({args.prompts} prompts x 8 per step, one vLLM CPU engine, TP=2 trainer):",
            "",
            *md_table(
                "from the kill to | seconds",
                [
                    ("the failure seen by the driver", f"{eng['kill_to_seen_s']:.2f}"),
                    ("the replacement started, re-synced and probed", f"{eng['kill_to_probed_s']:.2f}"),
                    ("the lost prompts answered: the run continuing", f"{eng['kill_to_continuing_s']:.2f}"),
                ],
            ),
            "",
            f"Step {eng['killed_in_step']} took {eng['disturbed_step_s']:.2f} s; "
            f"the median of the others {eng['median_other_step_s']:.2f} s.",
        ]
    write_results(RESULTS / f"{args.output}.json", report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
