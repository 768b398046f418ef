"""Shard-wise against gathered weight sync, trainer TP 2 -> one vLLM engine at TP 2 (CPU, gloo).

    python -m benchmarks.shard_sync [--size-mb 256] [--bucket-mb 32] [--rounds 2] [--repeat 5] [--quick]

``sync``'s random Qwen2-shaped fp32 checkpoint, one policy ``RankGroup`` at TP 2 and one engine at
TP 2 (two vLLM worker processes), and the two paths of ``WeightSync``
(``generation.weight_sync_path`` ``auto``, shard-wise for this layout, and ``gathered``) in
``--rounds`` rounds of alternating order; per path and round a new ``WeightSync``, an untimed sync,
the probe, then ``--repeat`` timed syncs. Measured per path: the bytes each vLLM worker received
per sync (the transfer engine counts them), the sync time at the controller and the CPU seconds
of every process involved. Shard-wise, each worker should receive its shard: half the bytes.
"""

from __future__ import annotations

import os
import statistics
import time

from .common import importable_by_workers, record
from .common.record import Measurement, ratio
from .common.timing import interleave, seconds
from .sync import BenchEngine, BenchPolicy, bench_config, source_model

QUICK = {"size_mb": 64.0, "rounds": 1}
PATHS = ("auto", "gathered")


def parse_args(argv=None):
    p = record.parser("shard_sync", __doc__, repeat=5)
    p.add_argument("--size-mb", type=float, default=256, help="model size in MB")
    p.add_argument("--bucket-mb", type=float, default=32, help="generation.sync_bucket_mb")
    p.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order of the paths")
    p.add_argument("--timeout", type=float, default=600, help="start-up and sync timeout, seconds")
    return record.parse(p, argv, QUICK)


def measure_path(args, cfg, policy, engine, pids: list[int]) -> dict:
    import ray

    from megagrpo.weight_sync.sync import WeightSync

    sync = WeightSync(cfg, policy, [engine], vocab_size=32000)
    sync.sync()  # untimed: fresh buffers on both sides
    probe = sync.probe()
    times = interleave({"sync": sync.sync}, args.repeat, pids=pids)["sync"]
    received = ray.get(engine.received_bytes.remote())
    print(
        f"[shard_sync] {sync.path.kind}: {received} bytes per worker, {min(seconds(times)):.3f}s", flush=True
    )
    return {"kind": sync.path.kind, "times": times, "received": received, "probe": probe.error}


def main(argv=None) -> dict:
    import ray

    from megagrpo.runtime.engines import start_engines
    from megagrpo.runtime.groups import RankGroup
    from megagrpo.runtime.ray_session import shutdown_ray, start_ray

    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    hf_dir = source_model(args.size_mb)
    layout = {
        "generation.engine_tensor_parallel_size": 2,
        "parallel.tensor_model_parallel_size": 2,
    }
    kw = {"engines": 1, "bucket_mb": args.bucket_mb, "timeout_s": args.timeout}
    cfgs = {p: bench_config(hf_dir, **kw, **layout, **{"generation.weight_sync_path": p}) for p in PATHS}
    importable_by_workers()
    start_ray(cfgs["auto"].cluster, num_cpus=4)  # two trainer ranks, the engine, its second worker
    try:
        start = time.perf_counter()
        policy = RankGroup(
            cfgs["auto"], BenchPolicy, name="shard-sync-bench", timeout_s=args.timeout, wait=False
        )
        (engine,) = start_engines(cfgs["auto"], str(hf_dir), engine_cls=BenchEngine, timeout_s=args.timeout)
        policy.ready()
        print(f"[shard_sync] policy and engine up in {time.perf_counter() - start:.0f}s", flush=True)
        pids = [
            *policy.call_all(BenchPolicy.pid),
            ray.get(engine.pid.remote()),
            *ray.get(engine.worker_pids.remote()),
        ]
        rounds: dict[str, list[dict]] = {p: [] for p in PATHS}
        for r in range(args.rounds):
            for p in PATHS if r % 2 == 0 else PATHS[::-1]:
                rounds[p].append(measure_path(args, cfgs[p], policy, engine, pids))
        policy.shutdown()
    finally:
        shutdown_ray()
    out = []
    for runs in rounds.values():
        s = {"path": runs[0]["kind"], "bucket_mb": args.bucket_mb, "size_mb": args.size_mb}
        probe = max(r["probe"] for r in runs)
        out += [
            *record.sync_times(runs, s),
            Measurement(
                "bytes received per vLLM worker (the most of any)", [max(runs[0]["received"])], "B", s
            ),
            Measurement("probe after a sync: exp |delta logprob| - 1", [probe - 1], "", s, target="<= 0.001"),
        ]
    medians = {p: [statistics.median(seconds(r["times"])) for r in runs] for p, runs in rounds.items()}
    s = {"bucket_mb": args.bucket_mb, "size_mb": args.size_mb}
    bytes_ratio = max(rounds["auto"][0]["received"]) / max(rounds["gathered"][0]["received"])
    out += [
        Measurement("bytes per vLLM worker, shard-wise / gathered", [bytes_ratio], "x", s, headline=True),
        ratio(
            "sync time, shard-wise / gathered",
            medians["auto"],
            medians["gathered"],
            settings=s,
            headline=True,
        ),
    ]
    what = "shard-wise against gathered weight sync, trainer TP 2 -> one vLLM engine at TP 2"
    return record.write(args, "shard_sync", what, out, packages=("torch", "vllm", "megatron.core", "ray"))


if __name__ == "__main__":
    main()
