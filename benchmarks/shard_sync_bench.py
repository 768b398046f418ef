#!/usr/bin/env python3
"""Shard-wise vs gathered weight sync at trainer TP 2 and engine TP 2, on CPU (gloo).

    .venv/bin/python benchmarks/shard_sync_bench.py [--size-mb 256] [--bucket-mb 32] [--repeat 5]
                                                    [--rounds 2] [--output shard_sync]

Builds (or reuses) the random Qwen2-shaped fp32 checkpoint of ``sync_bench.py`` (hidden 1024, FFN
2816, 16 heads, 4 KV heads, vocabulary 32000, tied embeddings; layers added until ``--size-mb``),
starts a local Ray with one policy ``RankGroup`` at TP 2 (two Megatron ranks loading it) and one vLLM
engine at TP 2 (two vLLM worker processes; CPU backend, eager, 1 GiB KV cache, dummy weights), and
measures the two paths of ``WeightSync`` (``generation.weight_sync_path`` ``auto``, which is
shard-wise for this layout, and ``gathered``), in ``--rounds`` rounds that alternate the order
(shard, gathered, then gathered, shard) so drift on a shared machine hits both alike. Per path and
round: a new ``WeightSync`` (its groups), one untimed sync, the probe, then ``--repeat`` timed syncs.

Reported per path: the bytes each vLLM worker received in a sync (the transfer engine counts the
buckets it took), the median sync seconds as the controller measures them (``WeightSync.sync()``),
the CPU seconds of every benchmark process in a sync (policy ranks, engine actor, its two worker
processes, the Ray daemons, this driver), what other processes kept busy meanwhile, the probe's
error, and the medians of ``sync_bench.py``'s timers (trainer ranks' send and broadcast waits; the
engine's vLLM calls and, per worker, its broadcast waits and ``load_weights``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

from common import MB, REPO
from common.configs import cpu_engine_overrides, make_config
from common.models import layers_for
from common.sampling import child_pids, machine_info, timed_call
from common.tables import md_table, results_json, write_results
from sync_bench import SEQ_LENGTH, SHAPE, TimedEngine, TimedPolicyWorker, model_bytes, source_model

PATHS = ("auto", "gathered")


def bench_config(hf_dir, *, path: str, bucket_mb: float, timeout_s: float):
    return make_config(
        {
            **cpu_engine_overrides(hf_dir, seq_length=SEQ_LENGTH),
            "generation.max_new_tokens": 16,
            "generation.num_engines": 1,
            "generation.engine_tensor_parallel_size": 2,
            "generation.sync_bucket_mb": bucket_mb,
            "generation.sync_timeout_s": timeout_s,
            "generation.weight_sync_path": path,
            "parallel.tensor_model_parallel_size": 2,
            "parallel.pipeline_model_parallel_size": 1,
            "parallel.data_parallel_size": 1,
            "parallel.backend": "gloo",
            "parallel.transformer_impl": "local",
            "policy.micro_batch_max_tokens": SEQ_LENGTH,
            "policy.mini_batch_size": 8,
            "grpo.num_prompts_per_step": 2,
            "grpo.num_generations": 4,
            "grpo.kl_coef": 0.0,
        }
    )


def _pid(worker) -> int:
    return os.getpid()


class ShardBenchEngine(TimedEngine):
    def worker_pids(self) -> list[int]:
        return self._plain_rpc(_pid)

    def take_worker_timings(self) -> list[dict]:
        from sync_bench import _take_receiver_timings

        return self._plain_rpc(_take_receiver_timings)


def measure_path(args, cfg, policy, engine, pids: list[int]) -> dict:
    import ray

    from megagrpo.weight_sync.sync import WeightSync

    sync = WeightSync(cfg, policy, [engine], vocab_size=SHAPE["vocab_size"])
    sync.sync()  # untimed: fresh buffers on both sides
    probe = sync.probe()
    received = ray.get(engine.received_bytes.remote())
    runs = []
    for _ in range(args.repeat):
        ray.get(engine.take_worker_timings.remote())
        _, wall, c = timed_call(sync.sync, [*pids, *child_pids(), os.getpid()])
        runs.append(
            {
                "seconds": wall,
                "ours_cpu_s": c.ours_cpu_s,
                "other_cpus": c.other_cpus,
                "received_bytes": ray.get(engine.received_bytes.remote()),
                "trainer": policy.call_all(TimedPolicyWorker.take_sync_timings),
                # the workers' timers first: take_sync_timings reads worker 0's and clears them all
                "workers": ray.get(engine.take_worker_timings.remote()),
                "engine": ray.get(engine.take_sync_timings.remote()),
            }
        )
    return {
        "path": sync.path.kind,
        "reason": sync.path.reason,
        "buckets": len(sync.plan),
        "links": [list(k) for k in sync.keys],
        "plan_worker_bytes": sync.worker_bytes,
        "received_bytes": received,
        "probe_error": probe.error,
        "probe_max_abs_delta": probe.max_abs_delta,
        "runs": runs,
    }


def _median(values) -> float:
    return statistics.median(values)


def _median_timings(dicts: list[dict]) -> dict:
    keys = sorted({k for d in dicts for k in d})
    return {k: _median([d.get(k, 0.0) for d in dicts]) for k in keys}


def summarize(per_round: list[dict]) -> dict:
    runs = [r for m in per_round for r in m["runs"]]
    first = per_round[0]
    return {
        "path": first["path"],
        "reason": first["reason"],
        "buckets": first["buckets"],
        "links": first["links"],
        "received_bytes_per_worker": first["received_bytes"],
        "received_always_the_same": all(r["received_bytes"] == first["received_bytes"] for r in runs),
        "plan_worker_bytes": first["plan_worker_bytes"],
        "sync_s": _median([r["seconds"] for r in runs]),
        "sync_s_min": min(r["seconds"] for r in runs),
        "sync_s_by_round": [_median([r["seconds"] for r in m["runs"]]) for m in per_round],
        "cpu_s": _median([r["ours_cpu_s"] for r in runs]),
        "other_cpus_median": _median([r["other_cpus"] for r in runs]),
        "probe_error_max": max(m["probe_error"] for m in per_round),
        "trainer_timings_by_rank": [
            _median_timings([r["trainer"][rank] for r in runs]) for rank in range(len(runs[0]["trainer"]))
        ],
        "engine_timings": _median_timings([r["engine"] for r in runs]),
        "worker_timings": [
            _median_timings([r["workers"][w] for r in runs]) for w in range(len(runs[0]["workers"]))
        ],
    }


def render(report: dict) -> str:
    res = report["results"]
    shard, gathered = res["shard"], res["gathered"]
    model = report["model"]
    lines = [
        "# Shard-wise vs gathered weight sync: trainer TP 2 -> one vLLM engine at TP 2 (CPU, gloo)",
        "",
        f"Command: `{report['command']}`; commit {report['machine']['git_commit']}; "
        f"{report['machine']['cpu']}, {report['machine']['cpus_usable']} CPUs usable, load average at "
        f"start {report['machine']['loadavg_at_start'][0]:.1f}.",
        f"Model: Qwen2-shaped fp32, {model['num_layers']} layers, {model['bytes'] / MB:.0f} MB "
        f"({model['hf_bytes']} bytes of HF tensors); buckets of {report['args']['bucket_mb']:g} MiB; "
        f"{report['args']['rounds']} rounds x {report['args']['repeat']} timed syncs per path.",
        "",
    ]
    rows = []
    for name, r in (("shard-wise", shard), ("gathered", gathered)):
        w = r["received_bytes_per_worker"]
        rows.append(
            [
                name,
                f"{w[0]:,} / {w[1]:,}",
                f"{w[0] / model['hf_bytes']:.3f} / {w[1] / model['hf_bytes']:.3f}",
                f"{r['sync_s']:.3f}",
                f"{r['sync_s_min']:.3f}",
                " / ".join(f"{s:.3f}" for s in r["sync_s_by_round"]),
                f"{r['cpu_s']:.2f}",
                f"{r['other_cpus_median']:.2f}",
                f"{r['probe_error_max']:.7f}",
            ]
        )
    lines += md_table(
        "path | bytes received, worker 0 / 1 | of the model | sync s (median) | min | median by round | "
        "CPU-s per sync | other CPUs busy | probe error",
        rows,
        "llrrrrrrr",
    )
    lines += [
        "",
        f"Shard-wise / gathered: bytes per worker {report['ratios']['bytes_per_worker']:.3f}, "
        f"sync time {report['ratios']['sync_s']:.3f}, CPU seconds {report['ratios']['cpu_s']:.3f}.",
        "",
        f"Paths as chosen: shard-wise: {shard['reason']}; gathered: {gathered['reason']}.",
        "",
        "Where the time goes (medians, seconds): trainer ranks' `send_weights` / broadcast waits; "
        "vLLM workers' broadcast waits / `load_weights` (the gathered path's loader; shard-wise blocks "
        "are loaded by `load_block`); the engine's `update_weights` and `finish_weight_update` RPCs.",
        "",
    ]
    rows = []
    for name, r in (("shard-wise", shard), ("gathered", gathered)):
        tr = r["trainer_timings_by_rank"]
        wk = r["worker_timings"]
        rows.append(
            [
                name,
                " / ".join(f"{t.get('send_total_s', 0):.3f}" for t in tr),
                " / ".join(f"{t.get('send_wait_s', 0):.3f}" for t in tr),
                " / ".join(f"{t.get('recv_wait_s', 0):.3f}" for t in wk),
                " / ".join(f"{t.get('load_weights_s', 0):.3f}" for t in wk),
                f"{r['engine_timings'].get('rpc_update_weights_s', 0):.3f}",
                f"{r['engine_timings'].get('rpc_finish_weight_update_s', 0):.3f}",
            ]
        )
    lines += md_table(
        "path | send, rank 0 / 1 | send waits | worker recv waits, 0 / 1 | load_weights, 0 / 1 | "
        "update RPC | finish RPC",
        rows,
        "lrrrrrr",
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256, help="model size in MB")
    parser.add_argument("--bucket-mb", type=float, default=32, help="generation.sync_bucket_mb")
    parser.add_argument("--repeat", type=int, default=5, help="timed syncs per path and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order of the paths")
    parser.add_argument("--timeout", type=float, default=600, help="start-up and sync timeout, seconds")
    parser.add_argument("--output", default="shard_sync", help="results/<output>.json and .md")
    args = parser.parse_args(argv)

    import ray

    from megagrpo.cluster import RankGroup, start_engines, start_ray
    from megagrpo.models.mapping import hf_tensor_shapes
    from megagrpo.models.registry import load_hf_config, shape_from_hf_config

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    layers = layers_for(args.size_mb, model_bytes)
    hf_dir = source_model(layers)
    _, shape = shape_from_hf_config(load_hf_config(hf_dir))
    hf_bytes = 4 * sum(math.prod(s) for s in hf_tensor_shapes(shape).values())
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/shard_sync_bench.py", *(argv or sys.argv[1:])]),
        "args": vars(args),
        "machine": machine_info("torch", "vllm", "megatron.core"),
        "model": {"dir": str(hf_dir), "shape": SHAPE, "num_layers": layers, "bytes": model_bytes(layers)},
    }
    report["model"]["hf_bytes"] = hf_bytes
    cfgs = {p: bench_config(hf_dir, path=p, bucket_mb=args.bucket_mb, timeout_s=args.timeout) for p in PATHS}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")) if p
    )
    start_ray(cfgs["auto"].cluster, num_cpus=4)  # two trainer ranks, the engine, its second worker
    try:
        t0 = time.perf_counter()
        policy = RankGroup(
            cfgs["auto"], TimedPolicyWorker, name="shard-sync-bench", timeout_s=args.timeout, wait=False
        )
        (engine,) = start_engines(
            cfgs["auto"], str(hf_dir), engine_cls=ShardBenchEngine, timeout_s=args.timeout
        )
        policy.ready()  # the ranks set up while the engine started
        report["startup_s"] = time.perf_counter() - t0
        pids = [
            *policy.call_all(TimedPolicyWorker.pid),
            ray.get(engine.pid.remote()),
            *ray.get(engine.worker_pids.remote()),
        ]
        per_path: dict[str, list] = {p: [] for p in PATHS}
        for r in range(args.rounds):
            for p in PATHS if r % 2 == 0 else PATHS[::-1]:
                m = measure_path(args, cfgs[p], policy, engine, pids)
                print(
                    f"round {r} {m['path']}: received {m['received_bytes']} bytes per worker, sync "
                    f"{_median([x['seconds'] for x in m['runs']]):.3f}s, probe {m['probe_error']:.7f}",
                    flush=True,
                )
                per_path[p].append(m)
        policy.shutdown()
    finally:
        ray.shutdown()
    shard, gathered = summarize(per_path["auto"]), summarize(per_path["gathered"])
    report["results"] = {"shard": shard, "gathered": gathered}
    report["ratios"] = {
        "bytes_per_worker": max(shard["received_bytes_per_worker"])
        / max(gathered["received_bytes_per_worker"]),
        "sync_s": shard["sync_s"] / gathered["sync_s"],
        "cpu_s": shard["cpu_s"] / gathered["cpu_s"],
    }
    write_results(results_json(args.output), report, render(report))
    print(render(report))
    return report


if __name__ == "__main__":
    main()
