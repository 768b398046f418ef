"""Weight sync Megatron -> vLLM: ``WeightSync.sync()`` against what any sync must pay.

    python -m benchmarks.sync [--size-mb 256] [--engines 1 2] [--bucket-mb 512] [--repeat 5] [--quick]

A random Qwen2-shaped fp32 checkpoint of ``--size-mb`` MB (hidden 1024, FFN 2816, 16 heads, 4 KV
heads, vocabulary 32000, tied; layers added to reach the size; cached under ``results/tmp/``), one
policy rank loading it and ``max(--engines)`` vLLM CPU engines (dummy weights: the first sync
delivers the real ones). For every bucket size and engine count N, after an untimed sync and the
probe, interleaved rounds of

- ``sync``: ``WeightSync(cfg, policy, engines[:N]).sync()`` as the driver calls it;
- ``flat``: the transport bound: 1 + N light actors (same reservation) broadcast one preallocated
  tensor of the same bytes over the same backend;
- ``reload``: vLLM's own reload of the same tensors from memory in every engine at once (layerwise
  reload, ``load_weights``, post-processing): what any weight update pays besides moving bytes.

Bounds: flat / sync (target >= 0.8) and (flat + reload) / sync (target >= 0.9); the sync time from
the fewest to the most engines (target <= 1.2x); the probe (exp |delta logprob|, target <= 1.001).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megagrpo.generation.vllm import VLLMEngine
from megagrpo.policy.worker import PolicyWorker

from .common import MB, TMP, importable_by_workers, record
from .common.configs import cpu_engine_overrides, make_config
from .common.models import QWEN2_SHAPE, cached_model, layers_for, qwen2_params, save_random_model
from .common.record import Measurement, ratio
from .common.timing import interleave, other_load, seconds

SEQ_LENGTH = 256
"""vLLM's max_model_len (and the trainer's): only the probe generates, so the KV cache stays small."""
QUICK = {"size_mb": 64.0, "engines": [1]}


def parse_args(argv=None):
    p = record.parser("sync", __doc__, repeat=5)
    p.add_argument("--size-mb", type=float, default=256, help="model size in MB")
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="receiving engine counts")
    p.add_argument(
        "--bucket-mb", type=float, nargs="+", default=[512], help="generation.sync_bucket_mb values"
    )
    p.add_argument("--timeout", type=float, default=600, help="start-up and sync timeout, seconds")
    return record.parse(p, argv, QUICK)


def model_bytes(num_layers: int) -> int:
    return 4 * qwen2_params(QWEN2_SHAPE, num_layers, tied=True)  # fp32, tied


def source_model(size_mb: float) -> Path:
    """A random fp32 Qwen2 checkpoint of at least ``size_mb``; norms and biases not ones and zeros."""
    layers = layers_for(size_mb, model_bytes)

    def write(out: Path) -> None:
        from transformers import Qwen2Config

        config = Qwen2Config(
            **QWEN2_SHAPE,
            num_hidden_layers=layers,
            max_position_embeddings=SEQ_LENGTH,
            rope_theta=1e6,
            tie_word_embeddings=True,
        )
        save_random_model(out, config, vary_norms_and_biases=True)

    marker = {"shape": QWEN2_SHAPE, "num_layers": layers}
    return cached_model(
        TMP / f"sync-qwen2-L{layers}-fp32", marker, write, f"{model_bytes(layers) / MB:.0f} MB"
    )


def bench_config(hf_dir: Path, *, engines: int, bucket_mb: float, timeout_s: float, **more):
    """The policy rank and engines of a sync: the checkpoint's shape, a small batch (only the probe runs)."""
    sync = {"generation.num_engines": engines, "generation.sync_bucket_mb": bucket_mb}
    sync |= {
        "generation.sync_timeout_s": timeout_s,
        "generation.max_new_tokens": 16,
        "parallel.backend": "gloo",
    }
    batch = {"policy.micro_batch_max_tokens": SEQ_LENGTH, "policy.mini_batch_size": 8, "grpo.kl_coef": 0.0}
    batch |= {"grpo.num_prompts_per_step": 2, "grpo.num_generations": 4, "parallel.transformer_impl": "local"}
    return make_config({**cpu_engine_overrides(hf_dir, seq_length=SEQ_LENGTH), **sync, **batch, **more})


class BenchPolicy(PolicyWorker):
    def pid(self) -> int:
        return os.getpid()


def _reload_from_memory(worker, hf_dir: str) -> float:
    """In a vLLM worker: seconds of vLLM's own reload of the checkpoint's tensors, already in memory
    (read once, untimed): layerwise reload set-up, ``load_weights``, finalisation, the tied output."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    engine = worker.weight_transfer_engine
    cache = engine.__dict__.setdefault("bench_tensors", {})
    if not cache:
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            cache.update(load_file(f))
    start = time.perf_counter()
    initialize_layerwise_reload(engine.model)
    engine.model.load_weights(list(cache.items()))
    finalize_layerwise_reload(engine.model, engine.model_config)
    engine._retie_embeddings()
    return time.perf_counter() - start


def _pid(worker) -> int:
    return os.getpid()


class BenchEngine(VLLMEngine):
    """VLLMEngine with its pid and a reload from memory (nothing else changed)."""

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self) -> list[int]:
        return self.llm.collective_rpc(_pid)

    def reload_from_memory(self, hf_dir: str) -> float:
        seconds = max(self.llm.collective_rpc(_reload_from_memory, args=(hf_dir,)))
        self.llm.reset_prefix_cache()
        return seconds


class BoundPeer:
    """One end of the transport bound: a process that only broadcasts."""

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        from megagrpo.parallel.local import free_port, node_ip

        return node_ip(), free_port()

    def open(self, addr: dict, rank: int, timeout_s: float, total_bytes: int) -> None:
        import torch

        from megagrpo.weight_sync.transport import BroadcastGroup, GroupAddress

        self.group = BroadcastGroup(
            GroupAddress(**addr), rank, backend="gloo", timeout_s=timeout_s, device=torch.device("cpu")
        )
        self.flat = torch.full((total_bytes,), rank + 1, dtype=torch.uint8)  # every page touched, untimed

    def broadcast(self) -> None:
        self.group.broadcast(self.flat, root=0).wait()

    def close(self) -> None:
        self.group.close()


def measure(
    args, hf_dir: Path, bucket_mb: float, policy, engines: list, pids: list[int]
) -> list[Measurement]:
    """The rounds of one bucket size and engine count."""
    import ray

    from megagrpo.parallel.local import node_ip
    from megagrpo.weight_sync.sync import WeightSync

    cfg = bench_config(hf_dir, engines=len(engines), bucket_mb=bucket_mb, timeout_s=args.timeout)
    sync = WeightSync(cfg, policy, engines, vocab_size=QWEN2_SHAPE["vocab_size"])
    peers = [
        ray.remote(num_cpus=cfg.cluster.cpus_per_worker)(BoundPeer).remote() for _ in range(1 + len(engines))
    ]
    host, port = ray.get(peers[0].address.remote())
    addr = {"address": host or node_ip(), "port": port, "world_size": len(peers)}
    ray.get([p.open.remote(addr, rank, args.timeout, sync.total_bytes) for rank, p in enumerate(peers)])
    steps = {
        "sync": sync.sync,
        "flat": lambda: ray.get([p.broadcast.remote() for p in peers]),
        "reload": lambda: ray.get([e.reload_from_memory.remote(str(hf_dir)) for e in engines]),
    }
    try:
        for step in steps.values():  # warm-up: the first sync replaces the dummy weights and allocates
            step()
        sync.sync()  # the probe compares the trainer's weights
        probe = sync.probe()
        pids = [*pids, *ray.get([p.pid.remote() for p in peers])]
        times = interleave(steps, args.repeat, pids=pids)
    finally:
        for p in peers:
            ray.kill(p)
    s = {"size_mb": args.size_mb, "engines": len(engines), "bucket_mb": bucket_mb, "bytes": sync.total_bytes}
    sync_s, flat_s = seconds(times["sync"]), seconds(times["flat"])
    reload_s = [max(t.value) for t in times["reload"]]  # inside the engines: the slowest
    paid = [f + r for f, r in zip(flat_s, seconds(times["reload"]), strict=True)]
    print(
        f"[sync] {s}: sync {min(sync_s):.3f}s, flat {min(flat_s):.3f}s, probe {probe.error:.7f}", flush=True
    )
    return [
        Measurement("sync", sync_s, "s", s),
        Measurement("flat broadcast of the same bytes", flat_s, "s", s),
        Measurement("vLLM's reload of the same tensors from memory", reload_s, "s", s),
        Measurement("sync throughput", [sync.total_bytes / 1e9 / x for x in sync_s], "GB/s", s),
        ratio("flat broadcast / sync", flat_s, sync_s, settings=s, target=">= 0.8"),
        ratio(
            "(flat broadcast + vLLM reload) / sync", paid, sync_s, settings=s, target=">= 0.9", headline=True
        ),
        Measurement(
            "CPU seconds of all the benchmark's processes per sync", [t.cpu_s for t in times["sync"]], "s", s
        ),
        Measurement(
            "probe after a sync: exp |delta logprob| - 1", [probe.error - 1], "", s, target="<= 0.001"
        ),
        other_load(*times.values(), **s),
    ]


def main(argv=None) -> dict:
    import ray

    from megagrpo.runtime.engines import start_engines
    from megagrpo.runtime.groups import RankGroup
    from megagrpo.runtime.ray_session import shutdown_ray, start_ray

    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    hf_dir = source_model(args.size_mb)
    most = max(args.engines)
    cfg = bench_config(hf_dir, engines=most, bucket_mb=args.bucket_mb[0], timeout_s=args.timeout)
    importable_by_workers()
    start_ray(cfg.cluster, num_cpus=2 + 2 * most)  # one logical CPU each: rank, engines, bound actors
    out = []
    try:
        start = time.perf_counter()
        policy = RankGroup(cfg, BenchPolicy, name="sync-bench", timeout_s=args.timeout, wait=False)
        engines = start_engines(cfg, str(hf_dir), engine_cls=BenchEngine, timeout_s=args.timeout)
        policy.ready()  # the rank set up while the engines started, as in the driver
        print(f"[sync] policy and {most} engines up in {time.perf_counter() - start:.0f}s", flush=True)
        pids = [*policy.call_all(BenchPolicy.pid), *ray.get([e.pid.remote() for e in engines])]
        for bucket_mb in args.bucket_mb:
            for n in sorted(set(args.engines)):
                out += measure(args, hf_dir, bucket_mb, policy, engines[:n], pids)
        policy.shutdown()
    finally:
        shutdown_ray()
    lo, hi = min(args.engines), max(args.engines)
    for bucket_mb in args.bucket_mb if lo < hi else ():
        ends = [record.find(out, "sync", engines=n, bucket_mb=bucket_mb) for n in (lo, hi)]
        ratio_s = {"bucket_mb": bucket_mb, "engines": f"{lo} -> {hi}"}
        out.append(
            ratio(
                "sync time growth with engines",
                ends[1].samples,
                ends[0].samples,
                settings=ratio_s,
                target="<= 1.2",
            )
        )
    what = "WeightSync.sync() against a flat broadcast of the same bytes and vLLM's own reload"
    return record.write(args, "sync", what, out, packages=("torch", "vllm", "megatron.core", "ray"))


if __name__ == "__main__":
    main()
