#!/usr/bin/env python3
"""SFT and DPO training throughput against a bare Megatron step on the same model and tokens.

    python benchmarks/sft_dpo_bench.py                  # CPU: TP=1 and TP=2, writes results/sft_dpo.*
    python benchmarks/sft_dpo_bench.py --preset qwen2-1.5b --dtype bfloat16 --tp 1 --seq 2048 ... (GPU)

In the same rank processes, on the same model (the worker's own engine: same weights, DDP buffers,
optimizer) and the same micro-batches (the worker's own packing of its DP shard):

- ``sft``: ``SFTWorker.train_step(batch)``, one optimizer step;
- ``dpo``: ``DPOWorker.train_step(batch)`` on pairs whose reference logprobs were computed before timing
  (``dpo+ref`` also times ``reference_logps``, the extra forward pass a DPO step needs);
- ``bare``: ``forward_backward`` with Megatron's ``vocab_parallel_cross_entropy`` summed over the same
  trained tokens, then ``optimizer_step``: a plain Megatron step on the same micro-batches.

Iterations alternate the steps being compared (ABBA order, so drift on a shared machine hits both alike);
medians are reported; tokens/s counts the real (unpadded) tokens. Target of the SFT/DPO issue: SFT and DPO
train tokens/s >= 0.85 of bare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS
from common.configs import make_config
from common.sampling import machine_info
from common.tables import md_table, write_results
from train_bench import add_workload_args, cross_entropy_loss, rank_threads, shape_of, sync_device


def bench_config(args, tp: int):
    shape = args.shape_values
    return make_config(
        {
            **{f"model.tiny.{k}": v for k, v in shape.items()},
            "model.tiny.tie_word_embeddings": True,
            "model.tiny.max_position_embeddings": args.seq,
            "model.seq_length": args.seq,
            "model.dtype": args.dtype,
            "generation.max_new_tokens": args.seq // 2,
            "parallel.tensor_model_parallel_size": tp,
            "parallel.transformer_impl": "local",
            "parallel.backend": args.backend,
            "policy.micro_batch_max_tokens": args.budget,
            "policy.logprob_chunk_size": args.chunk,
            "policy.lr": 1e-5,
            "sft.num_steps": 1000,
            "dpo.num_steps": 1000,
        }
    )


def make_examples(args, vocab: int, count: int, seed: int):
    """Random sequences, lengths in [seq * min_frac, seq]; the first quarter is the (untrained) prompt."""
    from megagrpo.data.supervised import Example

    gen = torch.Generator().manual_seed(seed)
    low = max(4, int(args.seq * args.min_len_frac))
    out = []
    for _ in range(count):
        n = int(torch.randint(low, args.seq + 1, (1,), generator=gen))
        ids = tuple(torch.randint(1, vocab, (n,), generator=gen).tolist())
        out.append(Example(ids, (False,) * (n // 4) + (True,) * (n - n // 4)))
    return out


def _timed(steps: dict, order: list[list[str]], device, args, rank: int, label: str) -> dict:
    """{step: {"wall": [s, ...], "cpu": [s, ...]}}: wall seconds and this rank process's CPU seconds."""
    times = {k: {"wall": [], "cpu": []} for k in steps}
    for i in range(args.warmup + args.iters):
        for name in order[i % 2]:
            sync_device(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            steps[name]()
            sync_device(device)
            if i >= args.warmup:
                times[name]["wall"].append(time.perf_counter() - start)
                times[name]["cpu"].append(time.process_time() - cpu_start)
        if rank == 0:
            print(
                f"[sft_dpo_bench] {label} iteration {i}: " + ("warm-up" if i < args.warmup else "timed"),
                flush=True,
            )
    return times


def rank_main(rank: int, world_size: int, args) -> dict:
    from megagrpo.data.supervised import Pair
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.engine import forward_backward, optimizer_step
    from megagrpo.policy.supervised import DPOWorker, SFTWorker
    from megagrpo.types import SequenceBatch

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config(args, world_size)
    vocab = cfg.model.tiny.vocab_size
    out = {"rank": rank, "threads": torch.get_num_threads()}

    worker = SFTWorker(cfg)
    try:
        batch = SequenceBatch.from_examples(make_examples(args, vocab, args.batch, seed=0))
        micro = [m for _, m in worker.micro_batches(batch, worker._my_shard(batch))]

        def bare():
            forward_backward(worker.engine, micro, cross_entropy_loss)
            return optimizer_step(worker.engine)

        steps = {"sft": lambda: worker.train_step(batch), "bare": bare}
        out["sft"] = _timed(steps, [["sft", "bare"], ["bare", "sft"]], worker.ctx.device, args, rank, "SFT")
        out["sft_tokens"] = batch.num_tokens
        out["sft_micro_batches"] = [list(m["tokens"].shape) for m in micro]
    finally:
        # The DPO job follows in this process: keep the default group (a new gloo rendezvous races
        # the old store's shutdown).
        destroy_parallel(keep_world=True)

    worker = DPOWorker(cfg)
    try:
        examples = make_examples(args, vocab, 2 * args.pairs, seed=1)
        pairs = SequenceBatch.from_pairs(
            [Pair(examples[2 * i], examples[2 * i + 1]) for i in range(args.pairs)]
        )
        pairs = pairs.replace(ref_logps=worker.reference_logps(pairs))
        micro = [m for _, m in worker.pair_micro_batches(pairs)]

        def bare():
            forward_backward(worker.engine, micro, cross_entropy_loss)
            return optimizer_step(worker.engine)

        def with_reference():
            worker.train_step(pairs.replace(ref_logps=worker.reference_logps(pairs)))

        steps = {"dpo": lambda: worker.train_step(pairs), "dpo+ref": with_reference, "bare": bare}
        order = [["dpo", "dpo+ref", "bare"], ["bare", "dpo+ref", "dpo"]]
        out["dpo"] = _timed(steps, order, worker.ctx.device, args, rank, "DPO")
        out["dpo_tokens"] = pairs.num_tokens
        out["dpo_micro_batches"] = [list(m["tokens"].shape) for m in micro]
    finally:
        destroy_parallel()
    return out


def summarize(args, tp: int, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    run = {"tp": tp, "threads_per_rank": r0["threads"]}
    for trainer, tokens in (("sft", r0["sft_tokens"]), ("dpo", r0["dpo_tokens"])):
        part = {"tokens": tokens, "micro_batches": r0[f"{trainer}_micro_batches"]}
        for name, t in r0[trainer].items():
            wall, cpu = statistics.median(t["wall"]), statistics.median(t["cpu"])
            part[name] = {"median_s": wall, "cpu_median_s": cpu, "tokens_per_s": tokens / wall, **t}
        for name in r0[trainer]:
            if name != "bare":
                part[name]["ratio_over_bare"] = part["bare"]["median_s"] / part[name]["median_s"]
                part[name]["cpu_ratio_over_bare"] = part["bare"]["cpu_median_s"] / part[name]["cpu_median_s"]
        run[trainer] = part
    return run


def markdown(report: dict) -> str:
    rows = []
    for run in report["runs"]:
        for trainer, names in (("sft", ("sft",)), ("dpo", ("dpo", "dpo+ref"))):
            part = run[trainer]
            for name in names:
                rows.append(
                    [
                        f"TP={run['tp']}",
                        name,
                        f"{part[name]['tokens_per_s']:.1f}",
                        f"{part['bare']['tokens_per_s']:.1f}",
                        f"{part[name]['ratio_over_bare']:.3f}",
                        f"{part[name]['cpu_ratio_over_bare']:.3f}",
                        len(part["micro_batches"]),
                    ]
                )
    a = report["args"]
    lines = [
        "# SFT and DPO train step vs bare Megatron forward+backward+step",
        "",
        f"`{report['command']}`",
        "",
        f"Model `{a['preset']}` {report['shape']}, {a['dtype']}; SFT {a['batch']} sequences, "
        f"DPO {a['pairs']} pairs; lengths in [{a['min_len_frac']} x {a['seq']}, {a['seq']}]; "
        f"micro-batch budget {a['budget']} tokens; {a['warmup']} warm-up + {a['iters']} timed iterations "
        "(medians); machine load average at the end "
        f"{report['machine'].get('loadavg_at_end')}.",
        "",
        *md_table(
            "layout | step | tokens/s | bare tokens/s | ratio | CPU-time ratio | micro-batches",
            rows,
        ),
        "",
        "`dpo+ref` includes the reference-policy forward pass of the step (a DPO step needs it; the bare "
        "step has no counterpart). Ratios are bare/step of the median wall times and of the median CPU "
        "time of the rank processes (single-threaded ranks: the CPU time is what a step costs, whatever "
        "other jobs take; wall times on a shared machine are disturbed unevenly). Target: sft and dpo "
        ">= 0.85.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p, warmup=1, iters=5, timeout=3600.0)
    p.add_argument("--batch", type=int, default=16, help="SFT sequences per step")
    p.add_argument("--pairs", type=int, default=8, help="DPO pairs per step")
    p.add_argument("--out", type=Path, default=RESULTS / "sft_dpo.json")
    args = p.parse_args(argv)
    args.shape_values = shape_of(p, args)
    return args


def main(argv=None) -> dict:
    from megagrpo.parallel.local import run_local_ranks

    args = parse_args(argv)
    report = {
        "benchmark": "SFT and DPO train step vs bare Megatron forward+backward+optimizer step",
        "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(argv),
        "machine": machine_info("torch", "megatron.core"),
        "shape": args.shape_values,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": [],
    }
    cpus = report["machine"]["cpus_usable"] or os.cpu_count() or 1
    for tp in args.tp:
        run_args = argparse.Namespace(**vars(args))
        run_args.threads = rank_threads(args, tp, cpus)
        run = summarize(run_args, tp, run_local_ranks(rank_main, tp, run_args, timeout_s=args.timeout))
        report["runs"].append(run)
        report["machine"]["loadavg_at_end"] = os.getloadavg()
        write_results(args.out, report, markdown(report))
        ratios = ", ".join(
            f"{name} {run[t][name]['ratio_over_bare']:.3f} ({run[t][name]['cpu_ratio_over_bare']:.3f})"
            for t, name in (("sft", "sft"), ("dpo", "dpo"), ("dpo", "dpo+ref"))
        )
        print(f"[sft_dpo_bench] TP={tp}: wall (CPU) ratios over bare: {ratios}", flush=True)
    return report


if __name__ == "__main__":
    main()
