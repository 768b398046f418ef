"""Mixture-of-experts models: the train step against a bare Megatron step, rollout routing replay's
cost per step, expert-wise against gathered weight sync, and the engine's routing capture.

    python -m benchmarks.moe [--preset moe] [--ep 1 2] [--engine-tp 1 2] [--no-engine-ep] [--batch 64]
        [--skip train sync capture] [--repeat 3] [--quick]

The model is a random Qwen3-MoE (``--preset``: ``moe``, 16 experts of width 128, top-2, or
``tiny_moe``, make moe-demo's 8 experts of width 64), float32, Megatron's local layers.

**Train step** (per ``--ep``: EP 1 on one rank, EP 2 on two, which are also the two data-parallel
ranks). One ``PolicyWorker`` built with ``grpo.routing_replay: rollout``, one fixed batch of
``--batch`` random sequences (lengths in [seq / 2, seq]), the old and the generator's logprobs
computed before timing; interleaved rounds (``common.timing``) of

- ``train``: ``PolicyWorker.train(batch)``, one optimizer step, the batch without routing: the
  routers choose (a router able to replay but given no replay action runs Megatron's own top-k,
  the code path of ``grpo.routing_replay: none``);
- ``bare``: ``common.megatron.bare_step`` on the worker's own micro-batches of the same batch: the
  same model and TransformerConfig (the worker's engine), forward + backward + optimizer step;
- ``replay``: ``train`` on the same batch carrying ``TrainBatch.routing``: random distinct experts per
  position, as an engine returns them (``routing.routing_rows``);
- ``check``: ``routing_check`` on the step's routing sample (``algorithms.routing.routing_sample``: the first
  32 sequences), the extra forward the driver runs before each replayed step.

Targets: train / bare tokens/s >= 0.85 (as the dense ``train``); replay / train seconds <= 1.05, which
counts what replay adds to the train call: each micro-batch's router rows cut from the batch's routing,
handed to every router, the replayed experts' probabilities gathered instead of a top-k, and the
different expert loads random routing gives. The routing check is reported as a share of the replayed
step (no target: the driver's 32 sequences against a step of ``--batch``).

**Weight sync** (per ``--engine-tp``). The same shape as an HF checkpoint, a policy ``RankGroup`` of
two ranks at EP 2 (each sends its own experts) and one vLLM CPU engine at that TP; per round and
path (``generation.weight_sync_path`` ``auto``, shard-wise for these layouts, and ``gathered``) a new
``WeightSync``, an untimed sync, the probe and ``--repeat`` timed syncs, the paths alternating
between ``--rounds``. Measured: the bytes each sender broadcasts and each vLLM worker receives per
sync (the plan's, the latter also counted by the engine), the seconds of a sync. Shard-wise at
engine TP 2 each worker should receive about half. Then (unless ``--no-engine-ep``) the same at the
largest ``--engine-tp`` with vLLM's expert parallelism (``generation.engine_expert_parallel``): each
worker holds half the experts whole and receives only those.

**Routing capture** (the engine's side of replay). One vLLM CPU engine in this process, loading the
checkpoint, started with ``grpo.routing_replay: rollout``; interleaved rounds (five at least) of the
same seeded generate call (``--batch`` sequences) with the routed experts captured and without.
Target: captured / plain seconds <= 1.05; the samples must be identical, and every completion must
carry a row for each position the engine forwarded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from .common import importable_by_workers, record
from .common.megatron import (
    PRESETS,
    add_model_args,
    bare_step,
    device_sync,
    model_overrides,
    rank_threads,
    shape_of,
)
from .common.record import Measurement, ratio
from .common.timing import interleave, other_load, seconds, slowest_rank

QUICK = {"preset": "tiny_moe", "ep": [2], "engine_tp": [1], "batch": 32, "seq": 64, "rounds": 1}
PATHS = ("auto", "gathered")
STEPS = ("train", "bare", "replay", "check")


def parse_args(argv=None) -> argparse.Namespace:
    p = record.parser("moe", __doc__)
    add_model_args(p, tp=None, seq=256, budget=2048, preset="moe")
    p.add_argument("--batch", type=int, default=64, help="sequences per step (one optimizer step)")
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2], help="EP sizes (= ranks), a run each")
    p.add_argument("--engine-tp", type=int, nargs="+", default=[1, 2], help="engine TP sizes of the sync")
    p.add_argument(
        "--no-engine-ep",
        dest="engine_ep",
        action="store_false",
        help="leave out the sync into an engine with vLLM's expert parallelism (at the largest --engine-tp)",
    )
    p.add_argument("--bucket-mb", type=float, default=16, help="generation.sync_bucket_mb")
    p.add_argument("--rounds", type=int, default=2, help="sync rounds, alternating the order of the paths")
    p.add_argument(
        "--skip", nargs="+", default=[], choices=["train", "sync", "capture"], help="parts not to run"
    )
    args = record.parse(p, argv, QUICK)
    args.shape_values = shape_of(p, args)
    if not args.shape_values.get("num_experts"):
        p.error(f"--preset {args.preset}: not a mixture-of-experts shape ({', '.join(moe_presets())})")
    return args


def moe_presets() -> list[str]:
    return sorted(k for k, v in PRESETS.items() if v.get("num_experts"))


# ------------------------------------------------------------------------------------ train step


def train_config(args, ep: int):
    from .common.configs import make_config

    return make_config(
        {
            **model_overrides(args, args.shape_values, 1),
            "parallel.expert_model_parallel_size": ep,
            "parallel.data_parallel_size": ep,
            "parallel.transformer_impl": "local",
            "generation.max_new_tokens": args.seq - args.seq // 4,
            "policy.mini_batch_size": args.batch,
            "grpo.kl_coef": 0.0,
            "grpo.off_policy_correction": "tis",
            "grpo.behav_weight_cap": 2.0,
            "grpo.num_prompts_per_step": 1,
            "grpo.num_generations": args.batch,
            "grpo.routing_replay": "rollout",
        }
    )


def engine_routing(batch, layers: int, experts: int, topk: int, seed: int = 3):
    """[B, S, layers, k] uint8: random distinct experts per forwarded position, as an engine returns
    them, laid out as ``TrainBatch.routing``."""
    import numpy as np
    import torch

    from megagrpo.algorithms.routing import routing_rows

    gen = torch.Generator().manual_seed(seed)
    per_sequence = []
    for length in batch.lengths.tolist():
        scores = torch.rand(length - 1, layers, experts, generator=gen)  # [rows, layers, E]
        per_sequence.append(scores.argsort(dim=-1)[..., :topk].numpy().astype(np.uint8))
    return routing_rows(per_sequence, batch.input_ids.shape[1])


def rank_main(rank: int, world_size: int, args) -> dict:
    import torch

    from megagrpo.algorithms.routing import routing_sample
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.worker import PolicyWorker
    from megagrpo.types import balanced_shards

    from .train import make_batch

    torch.set_num_threads(args.threads)
    cfg = train_config(args, world_size)
    worker = PolicyWorker(cfg)
    try:
        shape = args.shape_values
        plain = make_batch(args.seq, args.batch, args.min_len_frac, shape["vocab_size"])
        routing = engine_routing(plain, shape["num_layers"], shape["num_experts"], shape["moe_router_topk"])
        batches = {}
        for name, batch in (("train", plain), ("replay", plain.replace(routing=routing))):
            old = worker.logprobs(batch)
            gen = old + 0.01 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
            batches[name] = batch.replace(old_logprobs=old, gen_logprobs=gen)
        shard = balanced_shards(plain.lengths.tolist(), worker.ctx.dp_size)[worker.ctx.dp_rank]
        micro = [m for _, m in worker.micro_batches(plain, shard)]
        sample = routing_sample(batches["replay"], cfg.parallel.data_parallel_size)
        steps = {
            "train": lambda: worker.train(batches["train"]),
            "bare": lambda: bare_step(worker.engine, micro),
            "replay": lambda: worker.train(batches["replay"]),
            "check": lambda: worker.routing_check(sample),
        }

        def log(r, done):
            if rank == 0:
                print(f"[moe] round {r}: " + ", ".join(f"{k} {t.seconds:.2f}s" for k, t in done.items()))

        device = worker.ctx.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = interleave(steps, args.repeat, warmup=args.warmup, log=log, settle=device_sync(device))
        return {
            "times": times,
            "shard_tokens": sum(int(plain.lengths[i]) for i in shard),
            "sample_size": sample.size,
            "micro_batches": len(micro),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }
    finally:
        destroy_parallel()


def measure_train(args, ep: int) -> list[Measurement]:
    from megagrpo.parallel.local import run_local_ranks

    run = argparse.Namespace(**{**vars(args), "threads": rank_threads(args, ep)})
    settings = {"ep": ep, "seq": args.seq, "batch": args.batch}
    print(f"[moe] train {settings}: {args.warmup} warm-up + {args.repeat} rounds", flush=True)
    ranks = run_local_ranks(rank_main, ep, run, timeout_s=args.timeout)
    tokens = sum(r["shard_tokens"] for r in ranks)  # EP ranks are the DP ranks: each its own shard
    steps = {k: slowest_rank([r["times"][k] for r in ranks]) for k in STEPS}
    secs = {k: seconds(v) for k, v in steps.items()}
    cpu = {k: [t.cpu_s for t in v] for k, v in steps.items()}
    out = [Measurement(f"{k} step", [tokens / s for s in secs[k]], "tokens/s", settings) for k in STEPS[:3]]
    out += [
        ratio("train / bare Megatron step", secs["bare"], secs["train"], settings=settings, target=">= 0.85"),
        ratio("train / bare Megatron step, CPU time", cpu["bare"], cpu["train"], settings=settings),
        ratio(
            "replayed / unreplayed train step, seconds",
            secs["replay"],
            secs["train"],
            settings=settings,
            target="<= 1.05",
        ),
        ratio("replayed / unreplayed train step, CPU time", cpu["replay"], cpu["train"], settings=settings),
        ratio(
            "routing_check / replayed train step, seconds",
            secs["check"],
            secs["replay"],
            settings={**settings, "check_sequences": ranks[0]["sample_size"]},
        ),
        other_load(*steps.values(), **settings),
    ]
    if ranks[0]["peak_bytes"] is not None:  # CUDA: the allocator's peak over the steps, the largest rank's
        peak = max(r["peak_bytes"] for r in ranks) / 2**30
        out.append(Measurement("peak memory of the steps", [peak], "GiB", settings))
    return out


# ------------------------------------------------------------------------------------- weight sync


def source_model(shape: dict):
    """The shape as a random fp32 Qwen3-MoE HF checkpoint (cached under ``results/tmp/``)."""
    from .common import TMP
    from .common.models import cached_model, save_random_model
    from .sync import SEQ_LENGTH

    def write(out) -> None:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(
            vocab_size=shape["vocab_size"],
            hidden_size=shape["hidden_size"],
            intermediate_size=shape["ffn_hidden_size"],
            num_hidden_layers=shape["num_layers"],
            num_attention_heads=shape["num_attention_heads"],
            num_key_value_heads=shape["num_query_groups"],
            head_dim=shape["hidden_size"] // shape["num_attention_heads"],
            num_experts=shape["num_experts"],
            num_experts_per_tok=shape["moe_router_topk"],
            moe_intermediate_size=shape["moe_ffn_hidden_size"],
            norm_topk_prob=True,
            max_position_embeddings=SEQ_LENGTH,
            rope_theta=1e6,
            tie_word_embeddings=True,
        )
        save_random_model(out, config, vary_norms_and_biases=True)

    name = "moe-" + "-".join(f"{v}" for v in shape.values())
    return cached_model(TMP / name, {"shape": shape, "seq": SEQ_LENGTH}, write)


def sync_config(args, hf_dir, engine_tp: int, path: str, engine_ep: bool = False):
    from .sync import bench_config

    return bench_config(
        hf_dir,
        engines=1,
        bucket_mb=args.bucket_mb,
        timeout_s=args.timeout,
        **{
            "generation.engine_tensor_parallel_size": engine_tp,
            "generation.weight_sync_path": path,
            "generation.engine_expert_parallel": engine_ep,
            "parallel.expert_model_parallel_size": 2,
            "parallel.data_parallel_size": 2,
        },
    )


def sender_bytes(sync) -> dict[tuple[int, int], int]:
    """Bytes each sender (stage, EP x TP slot) broadcasts per sync, from the plan."""
    out: dict[tuple[int, int], int] = {}
    for bucket in sync.plan:
        stage, slot, _ = sync.keys[bucket.source]
        out[stage, slot] = out.get((stage, slot), 0) + bucket.nbytes
    return out


def measure_path(args, cfg, policy, engine, pids: list[int]) -> dict:
    import ray

    from megagrpo.weight_sync.sync import WeightSync

    sync = WeightSync(cfg, policy, [engine], vocab_size=args.shape_values["vocab_size"])
    sync.sync()  # untimed: fresh buffers on both sides
    probe = sync.probe()
    times = interleave({"sync": sync.sync}, args.repeat, pids=pids)["sync"]
    received = ray.get(engine.received_bytes.remote())
    print(f"[moe] sync {sync.path.kind}: {received} B per worker, {min(seconds(times)):.3f}s", flush=True)
    return {
        "kind": sync.path.kind,
        "times": times,
        "received": received,
        "planned": sync.worker_bytes,
        "senders": sender_bytes(sync),
        "probe": probe.error,
    }


def run_engine(
    args, hf_dir, policy, engine_tp: int, base_pids: list[int], engine_ep: bool = False
) -> dict[str, list[dict]]:
    """One engine at ``engine_tp`` (``engine_ep``: with vLLM's expert parallelism): the rounds of both
    paths, then the engine stopped."""
    import ray

    from megagrpo.runtime.engines import start_engines
    from megagrpo.runtime.watchdog import alive, start_time, stop_processes

    from .sync import BenchEngine

    cfgs = {p: sync_config(args, hf_dir, engine_tp, p, engine_ep) for p in PATHS}
    start = time.perf_counter()
    (engine,) = start_engines(cfgs["auto"], str(hf_dir), engine_cls=BenchEngine, timeout_s=args.timeout)
    workers = ray.get(engine.worker_pids.remote())
    started = {pid: start_time(pid) for pid in workers}
    print(f"[moe] engine at TP {engine_tp} up in {time.perf_counter() - start:.0f}s", flush=True)
    pids = [*base_pids, ray.get(engine.pid.remote()), *workers]
    rounds: dict[str, list[dict]] = {p: [] for p in PATHS}
    try:
        for r in range(args.rounds):
            for p in PATHS if r % 2 == 0 else PATHS[::-1]:
                rounds[p].append(measure_path(args, cfgs[p], policy, engine, pids))
    finally:
        ray.kill(engine, no_restart=True)
        deadline = time.monotonic() + 10.0  # vLLM's workers follow their engine out; the next one waits
        while time.monotonic() < deadline and any(alive(p, started[p]) for p in workers):
            time.sleep(0.2)
        stop_processes([p for p in workers if alive(p, started[p])])
    return rounds


def sync_measurements(rounds: dict[str, list[dict]], settings: dict) -> list[Measurement]:
    out = []
    for runs in rounds.values():
        first = runs[0]
        s = {**settings, "path": first["kind"]}
        if first["received"] != first["planned"]:
            raise AssertionError(f"{s}: workers received {first['received']}, the plan {first['planned']}")
        out += [
            *record.sync_times(runs, s),
            *(
                Measurement("bytes broadcast per sync by a sender", [n], "B", {**s, "sender": f"ep{slot}"})
                for (_, slot), n in sorted(first["senders"].items())
            ),
            *(
                Measurement("bytes received per sync by a vLLM worker", [n], "B", {**s, "worker": j})
                for j, n in enumerate(first["received"])
            ),
            Measurement(
                "probe after a sync: exp |delta logprob| - 1",
                [max(r["probe"] for r in runs) - 1],
                "",
                s,
                target="<= 0.001",
            ),
        ]
    shard, gathered = rounds["auto"], rounds["gathered"]
    medians = {p: [statistics.median(seconds(r["times"])) for r in runs] for p, runs in rounds.items()}
    out += [
        Measurement(
            "bytes per vLLM worker, expert-wise / gathered",
            [max(shard[0]["received"]) / max(gathered[0]["received"])],
            "x",
            settings,
        ),
        ratio("sync time, expert-wise / gathered", medians["auto"], medians["gathered"], settings=settings),
    ]
    return out


def measure_sync(args) -> list[Measurement]:
    from megagrpo.runtime.groups import RankGroup
    from megagrpo.runtime.ray_session import shutdown_ray, start_ray

    from .sync import BenchPolicy

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    hf_dir = source_model(args.shape_values)
    cfg = sync_config(args, hf_dir, max(args.engine_tp), "auto")
    importable_by_workers()
    start_ray(cfg.cluster, num_cpus=2 + max(args.engine_tp))  # two trainer ranks, the engine's workers
    out = []
    try:
        policy = RankGroup(cfg, BenchPolicy, name="moe-sync-bench", timeout_s=args.timeout)
        pids = policy.call_all(BenchPolicy.pid)
        engines = [(tp, False) for tp in args.engine_tp]
        if args.engine_ep and max(args.engine_tp) > 1:
            engines.append((max(args.engine_tp), True))
        for engine_tp, engine_ep in engines:
            rounds = run_engine(args, hf_dir, policy, engine_tp, pids, engine_ep)
            settings = {"ep": 2, "engine_tp": engine_tp, "bucket_mb": args.bucket_mb, "preset": args.preset}
            out += sync_measurements(rounds, settings | ({"engine_ep": True} if engine_ep else {}))
        policy.shutdown()
    finally:
        shutdown_ray()
    return out


# --------------------------------------------------------------------------------- routing capture


def measure_capture(args) -> list[Measurement]:
    """The engine's share of replay (CPU build: megagrpo's capture hook). One generate call of
    ``--batch`` sequences (``--batch`` / 8 prompts x 8 samples, ``--seq`` / 4 prompt and 3 ``--seq`` / 4
    sampled tokens, no early stop) with the routed experts captured, against the same call without, on
    one in-process vLLM CPU engine loading the random checkpoint (the capture hook stays on its routers;
    uncaptured, it returns at once)."""
    import torch

    from megagrpo.generation.vllm import VLLMEngine
    from megagrpo.types import SamplingSettings

    from .common.configs import cpu_engine_overrides, make_config
    from .sync import SEQ_LENGTH

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    hf_dir = source_model(args.shape_values)
    overrides = cpu_engine_overrides(hf_dir, seq_length=SEQ_LENGTH)
    cfg = make_config(overrides | {"grpo.routing_replay": "rollout", "generation.max_num_seqs": args.batch})
    worker = VLLMEngine(cfg, str(hf_dir), dummy_weights=False)
    capture, gen = worker.routing, torch.Generator().manual_seed(0)
    vocab, prompt_len = args.shape_values["vocab_size"], args.seq // 4
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(args.batch // 8)]
    settings = SamplingSettings(max_tokens=args.seq - prompt_len, temperature=1.0, n=8, ignore_eos=True)
    seeds = list(range(len(prompts)))

    def call(captured: bool):
        def run():
            worker.routing = capture if captured else None
            return worker.generate(prompts, settings, seeds)

        return run

    # Five rounds at least: the call's wall time moves by 10% between rounds, the capture's work is less.
    runs = interleave({"plain": call(False), "captured": call(True)}, max(args.repeat, 5), warmup=1)
    plain, captured = runs["plain"][0].value, runs["captured"][0].value
    same = sum(a.token_ids == b.token_ids for a, b in zip(plain, captured, strict=True)) / len(plain)
    rows = [c.routed_experts.shape[0] == prompt_len + len(c.token_ids) - 1 for c in captured]
    s = {"sequences": len(plain), "prompt": prompt_len, "sampled": settings.max_tokens, "preset": args.preset}
    return [
        Measurement("generate call", [t.seconds for t in runs["plain"]], "s", {**s, "routed experts": "no"}),
        Measurement(
            "generate call", [t.seconds for t in runs["captured"]], "s", {**s, "routed experts": "yes"}
        ),
        ratio(
            "captured / plain generate call, seconds",
            [t.seconds for t in runs["captured"]],
            [t.seconds for t in runs["plain"]],
            settings=s,
            target="<= 1.05",
        ),
        ratio(
            "captured / plain generate call, CPU time",
            [t.cpu_s for t in runs["captured"]],
            [t.cpu_s for t in runs["plain"]],
            settings=s,
        ),
        Measurement("samples identical, captured vs plain", [same], "fraction", s, target=">= 1"),
        Measurement(
            "completions with a row per forwarded position",
            [sum(rows) / len(rows)],
            "fraction",
            s,
            target=">= 1",
        ),
        other_load(*runs.values(), **s),
    ]


def main(argv=None) -> dict:
    from megagrpo.algorithms.routing import ROUTING_SAMPLE

    args = parse_args(argv)
    measurements: list[Measurement] = []
    if "train" not in args.skip:
        for ep in args.ep:
            measurements += measure_train(args, ep)
    if "sync" not in args.skip:
        measurements += measure_sync(args)
    if "capture" not in args.skip:
        measurements += measure_capture(args)
    what = (
        "mixture-of-experts: the train step against a bare Megatron step, routing replay's cost, "
        "expert-wise against gathered weight sync, the engine's routing capture"
    )
    notes = [
        f"model {args.preset} {args.shape_values}, {args.dtype}, local layers; {args.warmup} warm-up round",
        "train: the batch without routing, on the worker built for replay (its routers, given no replay "
        "action, run Megatron's own top-k: grpo.routing_replay none's path); replay: the same batch with "
        "random distinct engine experts per position; the same rounds, interleaved",
        f"routing_check: the driver's forward on a step's first {ROUTING_SAMPLE} sequences, here against a "
        f"step of {args.batch} (make moe-demo's steps hold 512)",
        "sync: bytes of the plan (a sender: the buckets it broadcasts; a worker: what it receives, also "
        "counted by the engine and checked equal); sender ep0 holds the dense weights and experts 0..E/2-1",
    ]
    packages = ("torch", "megatron.core", "vllm", "ray")
    return record.write(args, "moe", what, measurements, packages=packages, notes=notes)


if __name__ == "__main__":
    main()
