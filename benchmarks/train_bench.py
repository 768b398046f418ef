#!/usr/bin/env python3
"""Policy training throughput: ``PolicyWorker.train()`` against a bare Megatron step on the same tokens.

    python benchmarks/train_bench.py                      # CPU: TP=1 and TP=2, writes results/train.*
    python benchmarks/train_bench.py --profile            # + cProfile / torch.profiler of both steps
    python benchmarks/train_bench.py --preset qwen2-1.5b --tp 1 --seq 4096 ... (GPU, see gpu_h200.sh)

Both steps run in the same rank processes, on the same model (the worker's own engine, built by
``megagrpo.policy.engine.build_engine``: same weights, DDP buffers and optimizer) and on the same
micro-batches (the worker's own ``micro_batches`` of its DP shard: padded with the local layers,
packed end to end with the torch and TE layers):

- ``train``: ``worker.train(batch)`` with ``policy.mini_batch_size`` = the whole batch, so one
  optimizer step per call. ``old_logprobs`` (and ``gen_logprobs`` for the TIS weight of the
  default config) are computed once before timing, as the GRPO driver does before its updates.
- ``bare``: ``forward_backward`` with Megatron's own ``vocab_parallel_cross_entropy`` summed over
  the same response tokens, then ``optimizer_step``: what a plain Megatron SFT step costs.

Timed iterations alternate the two (ABBA order, so drift on a shared machine hits both alike);
medians are reported. tokens/s counts the real (unpadded) tokens of the batch; the target of the
policy issue is train/bare >= 0.85. With ``--profile`` rank 0 also records one step of each under
cProfile (Python time by function) and torch.profiler (op time), summarized into the JSON.

``--impl local torch`` runs each layer implementation (``parallel.transformer_impl``) in turn, on the
same batch, so their tokens/s sit side by side, with ratios to the local layers' run. ``--packing
off`` keeps padded rows with every layer implementation; ``--append`` adds runs to an existing
report (another sequence length, recompute mode or ``--compile``); ``--steps train`` leaves out the
bare step. Every run also reports activation memory: the peak bytes autograd holds for the backward
pass during one step (``common.memory.SavedActivations``; parameters excluded), on any device.
``--compile`` switches on Megatron's ``torch.compile``'d fusions (SwiGLU, bias-dropout-add) in the
built model.

On CUDA the JSON also has peak memory and MFU: model FLOPs per token ``6 N`` (N = all parameters,
the tied embedding counted once: that is the output projection's matmul) and, separately,
``6 N + 12 L h s`` (attention score and context matmuls, forward + backward, full s x s as in PaLM's
formula; the causal half is not subtracted), over ``--peak-tflops`` (H200 dense bf16: 989).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS
from common.configs import make_config
from common.memory import SavedActivations
from common.models import qwen2_params
from common.sampling import machine_info
from common.tables import md_table, read_results, write_results

from megagrpo.parallel.backends import weight_sync_backend
from megagrpo.types import TrainBatch

# Model shapes: the CPU default is small enough for a 2-core machine; qwen2-1.5b is the real shape.
PRESETS = {
    # make demo's model (tiny_cpu.yaml).
    "tiny": dict(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
    ),
    "cpu": dict(
        num_layers=4,
        hidden_size=512,
        ffn_hidden_size=1408,
        num_attention_heads=8,
        num_query_groups=2,
        vocab_size=32000,
    ),
    "qwen2-1.5b": dict(
        num_layers=28,
        hidden_size=1536,
        ffn_hidden_size=8960,
        num_attention_heads=12,
        num_query_groups=2,
        vocab_size=151936,
    ),
    # Same code path as qwen2-1.5b at toy size, for checking the GPU script on a CPU.
    "smoke": dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=1000,
    ),
}


# ------------------------------------------------------------------------------------ the workload


def bench_config(args, tp: int, impl: str = "local"):
    """The run config: the tiny-model defaults with the benchmark's shape, batch and parallelism."""
    shape = getattr(args, "shape_values", None) or PRESETS[args.preset]  # plan_calibration: no --shape
    return make_config(
        {
            **{f"model.tiny.{k}": v for k, v in shape.items()},
            "model.tiny.tie_word_embeddings": True,
            "model.tiny.max_position_embeddings": args.seq,
            "model.seq_length": args.seq,
            "model.dtype": args.dtype,
            "generation.max_new_tokens": args.seq - args.seq // 4,
            "parallel.tensor_model_parallel_size": tp,
            "parallel.transformer_impl": impl,
            "parallel.backend": args.backend,
            "policy.micro_batch_max_tokens": args.budget,
            "policy.mini_batch_size": args.batch,
            "policy.logprob_chunk_size": args.chunk,
            "policy.recompute": args.recompute,
            "policy.sequence_packing": getattr(args, "packing", "auto"),  # results before --packing
            # The loss as the tiny default runs it, pinned: no reference model (its logprobs would be
            # one more forward outside the step), TIS on the generator's logprobs.
            "grpo.kl_coef": 0.0,
            "grpo.tis_cap": 2.0,
            # one prompt x batch samples, so that mini_batch_size = batch divides the rollouts
            "grpo.num_prompts_per_step": 1,
            "grpo.num_generations": args.batch,
        }
    )


def make_batch(args, vocab_size: int) -> TrainBatch:
    """Fixed random sequences: lengths in [seq * min_frac, seq], prompts a quarter of each."""
    gen = torch.Generator().manual_seed(0)
    low = max(2, int(args.seq * args.min_len_frac))
    seqs, prompts = [], []
    for _ in range(args.batch):
        length = int(torch.randint(low, args.seq + 1, (1,), generator=gen))
        seqs.append(torch.randint(1, vocab_size, (length,), generator=gen).tolist())
        prompts.append(max(1, length // 4))
    batch = TrainBatch.from_sequences(seqs, prompts)
    return batch.replace(advantages=torch.randn(args.batch, generator=gen))


def cross_entropy_loss(logits: torch.Tensor, micro: dict):
    """Megatron's vocab-parallel cross-entropy, summed over the response tokens (per-token protocol).

    ``micro`` is one of ``PolicyWorker.micro_batches``: padded [b, s] rows, or one packed row whose
    per-position values ``packed.unpack`` lays out as [n, S - 1]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    sub: TrainBatch = micro["sub"]
    # Position t predicts token t + 1 of its sequence (targets past a sequence's end are dummies).
    loss_BS = vocab_parallel_cross_entropy(logits, micro["targets"].to(logits.device))  # [b, s] fp32
    packed = micro.get("packed")
    width = sub.input_ids.shape[1] - 1
    loss_NT = packed.unpack(loss_BS) if packed is not None else loss_BS[:, :width]  # [n, S - 1]
    mask_NT = sub.response_mask().to(logits.device)
    loss = torch.where(mask_NT, loss_NT, torch.zeros_like(loss_NT)).sum()
    return loss, mask_NT.sum().to(torch.int), {}


# --------------------------------------------------------------------------------------- the rank


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile_steps(steps: dict, device: torch.device, top: int = 25) -> dict:
    """cProfile and torch.profiler summaries of one call of each step."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, fn in steps.items():
        prof = cProfile.Profile()
        sync_device(device)
        prof.enable()
        fn()
        sync_device(device)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as tprof:
            fn()
            sync_device(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        out[name] = {
            "cprofile_cumulative": text.getvalue(),
            "torch_ops": tprof.key_averages().table(sort_by=sort, row_limit=top),
        }
    return out


def rank_main(rank: int, world_size: int, args) -> dict:
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.engine import forward_backward, optimizer_step
    from megagrpo.policy.worker import PolicyWorker
    from megagrpo.types import balanced_shards

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config(args, world_size, args.impl)
    rss = {"baseline": proc_status_bytes("VmRSS")}  # an idle rank: interpreter, torch, Megatron, groups
    worker = PolicyWorker(cfg)
    rss["after_build"] = proc_status_bytes("VmRSS")
    reset_peak_rss()  # the peak below is that of the steps, with the model and optimizer built
    try:
        engine, device = worker.engine, worker.ctx.device
        if args.compile:
            # Read by Megatron's MLP and layers at every forward: SwiGLU and bias-dropout-add through
            # megatron.core.jit.jit_fuser (torch.compile).
            engine.config.bias_activation_fusion = True
            engine.config.bias_dropout_fusion = True
        batch = make_batch(args, cfg.model.tiny.vocab_size)
        # Outside the timing, as the driver does before its updates: the PPO denominator, and the
        # generator's logprobs that the default config's TIS weight (grpo.tis_cap) needs.
        old = worker.logprobs(batch)
        gen = old + 0.01 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
        batch = batch.replace(old_logprobs=old, gen_logprobs=gen)
        shard = balanced_shards(batch.lengths.tolist(), worker.ctx.dp_size)[worker.ctx.dp_rank]
        # The baseline runs exactly the worker's micro-batches (padded, or packed end to end).
        micro = [m for _, m in worker.micro_batches(batch, shard)]

        def train_step():
            (metrics,) = worker.train(batch)
            return metrics

        def bare_step():
            forward_backward(engine, micro, cross_entropy_loss)
            return optimizer_step(engine)

        steps = {name: {"train": train_step, "bare": bare_step}[name] for name in args.steps}
        times: dict[str, list[float]] = {name: [] for name in steps}
        cpu_times: dict[str, list[float]] = {name: [] for name in steps}
        peak: dict[str, int] = {}
        for i in range(args.warmup + args.iters):
            # ABBA: each pair runs in the opposite order of the previous one.
            for name in list(steps) if i % 2 == 0 else list(steps)[::-1]:
                sync_device(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                start, cpu_start = time.perf_counter(), time.process_time()
                steps[name]()
                sync_device(device)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                    cpu_times[name].append(time.process_time() - cpu_start)
                    if device.type == "cuda":
                        peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated(device))
            if rank == 0:
                done = {k: f"{v[-1]:.2f}s" for k, v in times.items() if v and i >= args.warmup}
                print(f"[train_bench] rank 0 iteration {i}: {done or 'warm-up'}", flush=True)
        rss["peak_steps"] = proc_status_bytes("VmHWM")
        held = worker.reference.tensors.values() if worker.reference else ()
        rss["reference_copy"] = sum(t.numel() * t.element_size() for t in held)
        # Untimed: one more step of each with autograd's saved tensors counted.
        activations = {}
        for name, fn in steps.items():
            with SavedActivations(engine.module) as saved:
                fn()
            activations[name] = saved.peak_bytes
        result = {
            "rank": rank,
            "times_s": times,
            "cpu_times_s": cpu_times,
            "peak_mem_bytes": peak,
            "rss_bytes": rss,
            "activation_bytes": activations,
            "threads": torch.get_num_threads(),
            "micro_batches": [list(m["tokens"].shape) for m in micro],
            "packed": worker.packed,
            "shard_tokens": int(sum(int(batch.lengths[i]) for i in shard)),
            "params_local": sum(p.numel() for p in engine.module.parameters()),
            "recompute": engine.config.recompute_granularity,
            "transformer_impl": engine.transformer_impl,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
        if args.sync_bucket_mb:
            result["sync"] = time_weight_sender(worker, args)
        if args.profile:
            # Every rank runs the profiled steps (they are collective); rank 0's summary is kept.
            profile = _profile_steps(steps, device)
            if rank == 0:
                result["profile"] = profile
        return result
    finally:
        destroy_parallel()


def proc_status_bytes(field: str) -> int:
    """``/proc/self/status`` ``field`` (VmRSS, VmHWM) in bytes; 0 where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: ``5`` to /proc/self/clear_refs)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def time_weight_sender(worker, args) -> dict:
    """The trainer side of a weight sync of this model, against a flat device copy of its bytes.

    The sender is rank 0 of a broadcast group with no receivers (world size 1, NCCL on CUDA, gloo on
    CPU), so what is timed is what the trainer adds on top of the transport: turning Megatron's
    parameters into HF tensors (QKV de-interleave, gate/up split, vocabulary trim) and packing them
    into the double-buffered buckets. ``reshard_s`` is the HF conversion alone (its tensors made
    and dropped). The bound is one device copy of the same number of bytes (``copy_s``): packing
    has to write every byte at least once. TP=1 (one rank), where the plan is this rank's own.
    """
    from dataclasses import replace

    from megagrpo.weight_sync.shards import SyncPath
    from megagrpo.weight_sync.transport import GroupAddress

    device = worker.ctx.device
    # The gathered path's sender: whole HF tensors (at TP 1 the shard-wise path sends the same bytes).
    path = SyncPath("gathered", "train_bench times one sender")
    links = worker.weight_sync_offer(path, 1, int(args.sync_bucket_mb * 2**20))
    if len(links) != 1:
        raise RuntimeError("--sync-bucket-mb times one sender: run it with --tp 1")
    (link,) = links
    plan = tuple(replace(b, source=0) for b in link.buckets)
    backend = weight_sync_backend(worker.cfg.resolved.backend)
    worker.open_weight_sync([GroupAddress(link.address, link.port, 1)], [link.key], backend, 300.0)
    total = sum(b.nbytes for b in plan)

    def timed(fn) -> list[float]:
        times = []
        for i in range(args.warmup + args.iters):
            sync_device(device)
            start = time.perf_counter()
            fn()
            sync_device(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        return times

    def reshard():
        for _ in worker.sender.hf_tensors():  # the sender that send_weights made
            pass

    try:
        sync_device(device)
        if device.type == "cuda":
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        send_s = timed(lambda: worker.send_weights(plan))
        extra = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        reshard_s = timed(reshard)
        flat = torch.empty(2, total, dtype=torch.uint8, device=device)
        copy_s = timed(lambda: flat[1].copy_(flat[0]))
    finally:
        worker.close_weight_sync()
    send, copy = statistics.median(send_s), statistics.median(copy_s)
    return {
        "backend": backend,
        "bucket_mb": args.sync_bucket_mb,
        "buckets": len(plan),
        "tensors": sum(len(b.slots) for b in plan),
        "bytes": total,
        "send_s_all": send_s,
        "reshard_s_all": reshard_s,
        "copy_s_all": copy_s,
        "send_s_median": send,
        "reshard_s_median": statistics.median(reshard_s),
        "copy_s_median": copy,
        "send_gb_per_s": total / send / 1e9,
        "copy_gb_per_s": total / copy / 1e9,
        "send_over_copy": copy / send,
        "send_extra_mem_bytes": extra,
    }


# ------------------------------------------------------------------------------------------ report


def model_params(shape: dict, tied: bool = True) -> int:
    """Parameters of the Qwen2-shaped model (Megatron pads the vocabulary to a multiple of 128)."""
    from megagrpo.models.shape import padded_vocab_size

    hf_shape = {
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["ffn_hidden_size"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_query_groups"],
        "vocab_size": padded_vocab_size(shape["vocab_size"]),
    }
    return qwen2_params(hf_shape, shape["num_layers"], tied=tied)


def summarize(args, tp: int, ranks: list[dict]) -> dict:
    tokens = sum(r["shard_tokens"] for r in ranks) // tp  # each TP group of ranks shares one shard
    out = {
        "impl": ranks[0]["transformer_impl"],
        "compile": args.compile,
        "tp": tp,
        "ranks": tp,
        "tokens_per_step": tokens,
        "packed": ranks[0]["packed"],
    }
    names = list(ranks[0]["times_s"])
    # A step ends when its slowest rank does.
    per_iter = {k: [max(v) for v in zip(*(r["times_s"][k] for r in ranks), strict=True)] for k in names}
    # Process CPU time (all threads) per step: less sensitive than wall time to other jobs taking the
    # cores of a shared machine (a descheduled rank accrues no CPU time).
    cpu = {
        k: statistics.median(max(v) for v in zip(*(r["cpu_times_s"][k] for r in ranks), strict=True))
        for k in names
    }
    for name, times in per_iter.items():
        med = statistics.median(times)
        out[name] = {
            "step_s_median": med,
            "step_s_all": times,
            "tokens_per_s_median": tokens / med,
            "cpu_time_s_median": cpu[name],
            "tokens_per_cpu_s": tokens / cpu[name],
            # The rank that holds the most (TP ranks hold equal shares; PP stages differ).
            "activation_mib": max(r["activation_bytes"][name] for r in ranks) / 2**20,
        }
    if "train" in out and "bare" in out:
        out["ratio_train_over_bare"] = (
            out["train"]["tokens_per_s_median"] / out["bare"]["tokens_per_s_median"]
        )
        pairs = [b / t for t, b in zip(per_iter["train"], per_iter["bare"], strict=True)]
        out["ratio_per_pair_median"] = statistics.median(pairs)
        # The fastest step of each: the least disturbed by other jobs on a shared machine.
        out["ratio_min_step"] = min(per_iter["bare"]) / min(per_iter["train"])
        out["ratio_cpu_time"] = cpu["bare"] / cpu["train"]
        out["target_met"] = out["ratio_train_over_bare"] >= 0.85
    out["micro_batches"] = ranks[0]["micro_batches"]
    out["threads_per_rank"] = ranks[0]["threads"]
    out["recompute"] = ranks[0]["recompute"]
    # Host memory of the rank that grew most: idle process, after building, peak during the steps.
    out["rss_mib"] = max(
        ({k: v / 2**20 for k, v in r["rss_bytes"].items()} for r in ranks),
        key=lambda m: m["peak_steps"] - m["baseline"],
    )
    if ranks[0]["peak_mem_bytes"]:
        out["peak_mem_gib"] = {k: v / 2**30 for k, v in ranks[0]["peak_mem_bytes"].items()}
    if args.peak_tflops:
        shape = args.shape_values
        n = model_params(shape)
        attn = 12 * shape["num_layers"] * shape["hidden_size"] * args.seq
        out["params"] = n
        out["params_counted_rank0"] = ranks[0]["params_local"]
        for name in names:
            rate = out[name]["tokens_per_s_median"]
            out[name]["tflops_6n"] = 6 * n * rate / 1e12
            out[name]["mfu_6n"] = 6 * n * rate / (args.peak_tflops * 1e12 * tp)
            out[name]["mfu_6n_attn"] = (6 * n + attn) * rate / (args.peak_tflops * 1e12 * tp)
    if "profile" in ranks[0]:
        out["profile"] = ranks[0]["profile"]
    if "sync" in ranks[0]:
        out["sync"] = ranks[0]["sync"]
    return out


def _layers(run: dict) -> str:
    recompute = {"selective": " + recompute attn", "full": " + recompute full"}.get(run["recompute"], "")
    return (
        run["impl"]
        + (" packed" if run["packed"] else "")
        + recompute
        + (" + compile" if run.get("compile") else "")
    )


def markdown(report: dict) -> str:
    runs = report["runs"]
    lines = _intro(report)
    lines += _throughput_lines(runs)
    lines += _layer_ratio_lines(runs)
    lines += _bare_ratio_lines(runs)
    lines += _mfu_lines(runs)
    lines += _sync_lines(runs)
    if not report["machine"]["cuda"]:
        lines += [
            "",
            "On a CPU shared with other jobs, wall times are disturbed unevenly (each step's runs are "
            "spread in the `step_s_all` lists of the JSON); the CPU time of single-threaded ranks "
            "(`--threads 1`) is the steadiest measure.",
        ]
    return "\n".join(lines) + "\n"


def _intro(report: dict) -> list[str]:
    """Title, machine, model, batch and command (and the commits of appended runs)."""
    a, m, runs = report["args"], report["machine"], report["runs"]
    lines = [
        "# Policy train step vs bare Megatron step",
        "",
        f"{m['date']}, {m['cuda'] or 'CPU'}, {m['cpus_usable']} usable CPUs, torch {m['torch']}, "
        f"megatron-core {m['megatron_core']}, commit {str(m['git_commit'])[:10]}, load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['loadavg_at_start'])}"
        + (
            f", at end {', '.join(f'{x:.1f}' for x in m['loadavg_at_end'])}."
            if "loadavg_at_end" in m
            else "."
        ),
        f"Model `{a['preset']}` {report['shape']} ({a['dtype']}), {a['batch']} sequences of "
        f"{int(a['seq'] * a['min_len_frac'])}-{a['seq']} tokens, micro-batch budget {a['budget']}, "
        f"logprob chunk {a['chunk']}; {a['warmup']} warm-up + {a['iters']} "
        "timed iterations of each step, alternating; medians. Layers: `parallel.transformer_impl` "
        "(packed: THD micro-batches, else padded rows; recompute attn: Megatron's selective recompute "
        "of core attention). Activation MiB: peak bytes saved for backward during one step. "
        "Command: `" + report["command"] + "`",
        "",
    ]
    commits = sorted({str(r.get("git_commit", m["git_commit"]))[:10] for r in runs})
    if len(commits) > 1:
        lines[3:3] = [
            "Appended runs: "
            + "; ".join(
                f"{_layers(r)} TP {r['tp']} at commit {str(r['git_commit'])[:10]}, load average at start "
                f"{', '.join(f'{x:.1f}' for x in r['loadavg_at_start'])}"
                for r in runs
            )
            + ".",
        ]
    return lines


def _throughput_lines(runs: list[dict]) -> list[str]:
    """One row per run: its train step's throughput (the bare step's for ``--steps bare``)."""
    rows = []
    for r in runs:
        step = "train" if "train" in r else "bare"
        s = r[step]
        rows.append(
            [
                _layers(r),
                r["tp"],
                step,
                r["tokens_per_step"],
                f"{s['tokens_per_s_median']:.1f}",
                f"{s['tokens_per_cpu_s']:.1f}",
                f"{s['activation_mib']:.1f}",
            ]
        )
    return md_table("layers | TP | step | tokens/step | tokens/s | tokens/CPU-s | activation MiB", rows)


def _layer_ratio_lines(runs: list[dict]) -> list[str]:
    """Other layers' train step against the local layers' (else the first run's) at each TP."""
    baseline: dict[int, dict] = {}
    for r in (r for r in runs if "train" in r):
        if r["tp"] not in baseline or (r["impl"] == "local" and baseline[r["tp"]]["impl"] != "local"):
            baseline[r["tp"]] = r
    others = [r for r in runs if r["tp"] in baseline and "train" in r and r is not baseline[r["tp"]]]
    if not others:
        return []
    rows = []
    for r in others:
        base = baseline[r["tp"]]
        rows.append(
            [
                f"{_layers(r)} / {_layers(base)}",
                r["tp"],
                f"{r['train']['tokens_per_s_median'] / base['train']['tokens_per_s_median']:.2f}",
                f"{r['train']['tokens_per_cpu_s'] / base['train']['tokens_per_cpu_s']:.2f}",
                f"{r['train']['activation_mib'] / base['train']['activation_mib']:.3f}",
            ]
        )
    header = "layers | TP | train tokens/s ratio | tokens/CPU-s ratio | activation ratio"
    return ["", *md_table(header, rows)]


def _bare_ratio_lines(runs: list[dict]) -> list[str]:
    """Train against bare, where every run timed both."""
    if not all("bare" in r and "train" in r for r in runs):
        return []
    rows = [
        [
            _layers(r),
            r["tp"],
            f"{r['bare']['tokens_per_s_median']:.1f}",
            f"{r['ratio_train_over_bare']:.3f}",
            f"{r['ratio_per_pair_median']:.3f}",
            f"{r['ratio_min_step']:.3f}",
            f"{r['ratio_cpu_time']:.3f}",
            "met" if r["target_met"] else "missed",
        ]
        for r in runs
    ]
    header = (
        "layers | TP | bare tokens/s | ratio | per-pair median | fastest steps | CPU-time ratio | target 0.85"
    )
    return [
        "",
        "Train vs bare: ratios of train/bare throughput, of the median wall times, the median of the "
        "per-pair ratios, of the fastest step of each, and of the median CPU time of the rank processes.",
        "",
        *md_table(header, rows),
    ]


def _mfu_lines(runs: list[dict]) -> list[str]:
    """Model FLOPs utilization, where a device peak was given."""
    rows = [
        [
            _layers(r),
            r["tp"],
            name,
            f"{r[name]['mfu_6n']:.3f}",
            f"{r[name]['mfu_6n_attn']:.3f}",
            f"{r.get('peak_mem_gib', {}).get(name, float('nan')):.1f}",
        ]
        for r in runs
        for name in ("train", "bare")
        if name in r and "mfu_6n" in r[name]
    ]
    return ["", *md_table("layers | TP | step | MFU 6N | MFU 6N+attn | peak GiB", rows)] if rows else []


def _sync_lines(runs: list[dict]) -> list[str]:
    """The weight-sync sender's time (``--sync-bucket-mb``) against one flat copy of its bytes."""
    lines = []
    for r in (r for r in runs if "sync" in r):
        sy = r["sync"]
        extra = sy["send_extra_mem_bytes"]
        lines += [
            "",
            f"Weight-sync sender (TP {r['tp']}, {sy['backend']}, no receivers): "
            f"{sy['bytes'] / 1e9:.2f} GB in {sy['tensors']} HF tensors, {sy['buckets']} buckets of "
            f"<= {sy['bucket_mb']} MB. "
            f"Send {sy['send_s_median'] * 1e3:.1f} ms ({sy['send_gb_per_s']:.1f} GB/s; HF conversion "
            f"alone {sy['reshard_s_median'] * 1e3:.1f} ms) vs one flat device copy of the same bytes "
            f"{sy['copy_s_median'] * 1e3:.1f} ms ({sy['copy_gb_per_s']:.1f} GB/s): "
            f"{sy['send_over_copy']:.2f} of the copy bound"
            + (f"; {extra / 2**20:.0f} MiB on top of the model while sending." if extra else "."),
        ]
    return lines


def add_workload_args(p: argparse.ArgumentParser, *, warmup: int, iters: int, timeout: float) -> None:
    """The model, layout, batch shape, repetitions and threads of a rank benchmark (this one and
    sft_dpo_bench.py); ``shape_of`` then applies ``--shape`` to the preset."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="model shape")
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="override one of the preset's shape keys (num_layers, hidden_size, ...); repeatable",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="one run (of TP ranks) per value")
    p.add_argument("--seq", type=int, default=512, help="longest sequence")
    p.add_argument("--min-len-frac", type=float, default=0.5, help="shortest sequence as a fraction of --seq")
    p.add_argument("--budget", type=int, default=2048, help="policy.micro_batch_max_tokens")
    p.add_argument("--chunk", type=int, default=1024, help="policy.logprob_chunk_size")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed iterations of each step")
    p.add_argument("--iters", type=int, default=iters, help="timed iterations of each step")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cpus / ranks on CPU)")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per run of ranks")


def shape_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int]:
    """The preset's shape with the ``--shape`` overrides (a bad one is a usage error naming it)."""
    shape = dict(PRESETS[args.preset])
    for item in args.shape:
        key, _, value = item.partition("=")
        if key not in shape or not value.isdigit():
            p.error(f"--shape {item}: want KEY=INT with KEY one of {', '.join(shape)}")
        shape[key] = int(value)
    return shape


def rank_threads(args: argparse.Namespace, tp: int, cpus: int) -> int:
    """``--threads``, else on CPU the cores shared among the TP ranks (no oversubscription); 0 on GPU."""
    if args.threads or torch.cuda.is_available():
        return args.threads
    return max(1, cpus // tp)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p, warmup=2, iters=6, timeout=1800.0)
    p.add_argument(
        "--impl",
        nargs="+",
        default=["local"],
        choices=["local", "torch", "transformer_engine"],
        help="parallel.transformer_impl: one run per value (and TP); ratios are to the local layers' run",
    )
    p.add_argument("--steps", nargs="+", default=["train", "bare"], choices=["train", "bare"])
    p.add_argument("--compile", action="store_true", help="Megatron's torch.compile'd fusions on")
    p.add_argument(
        "--packing",
        default="auto",
        choices=["auto", "off"],
        help="policy.sequence_packing (auto: THD micro-batches where the layers support them)",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences (one optimizer step)")
    p.add_argument(
        "--recompute", default="none", choices=["none", "core_attention", "full"], help="policy.recompute"
    )
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (H200 bf16: 989)")
    p.add_argument(
        "--sync-bucket-mb",
        type=float,
        default=0.0,
        help="also time the weight-sync sender with buckets of this size (TP 1; 0: off)",
    )
    p.add_argument("--profile", action="store_true", help="cProfile + torch.profiler one step of each")
    p.add_argument("--out", type=Path, default=RESULTS / "train.json", help=".json; a .md is written beside")
    p.add_argument(
        "--append", action="store_true", help="add the runs to those already in --out (same args otherwise)"
    )
    args = p.parse_args(argv)
    args.shape_values = shape_of(p, args)
    return args


def main(argv=None) -> dict:
    from megagrpo.parallel.local import run_local_ranks

    args = parse_args(argv)
    report = {
        "benchmark": "policy train step vs bare Megatron forward+backward+optimizer step",
        "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(argv),
        "machine": machine_info("torch", "megatron.core"),
        "shape": args.shape_values,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": [],
    }
    if args.append and args.out.exists():
        previous = read_results(args.out)
        report["runs"] = previous["runs"]
        for run in report["runs"]:  # the code each run measured, and how busy the machine was
            run.setdefault("git_commit", previous["machine"]["git_commit"])
            run.setdefault("loadavg_at_start", previous["machine"]["loadavg_at_start"])
        report["command"] = previous["command"] + "` then `" + report["command"]
    cpus = report["machine"]["cpus_usable"] or os.cpu_count() or 1
    for impl in args.impl:
        for tp in args.tp:
            run_args = argparse.Namespace(**{**vars(args), "impl": impl})
            run_args.threads = rank_threads(args, tp, cpus)
            label = f"{impl}{' + compile' if args.compile else ''} TP={tp}"
            print(f"[train_bench] {label}: {args.warmup} warm-up + {args.iters} timed iterations", flush=True)
            ranks = run_local_ranks(rank_main, tp, run_args, timeout_s=args.timeout)
            run = summarize(run_args, tp, ranks)
            run["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(run_args).items()}
            run["git_commit"] = report["machine"]["git_commit"]
            run["loadavg_at_start"] = report["machine"]["loadavg_at_start"]
            report["runs"].append(run)
            report["machine"]["loadavg_at_end"] = os.getloadavg()
            # Written after every run, so a later run that fails or times out loses nothing.
            write_results(args.out, report, markdown(report))
            step = "train" if "train" in run else "bare"
            print(
                f"[train_bench] {label}: {step} {run[step]['tokens_per_s_median']:.1f} tok/s, "
                f"activations {run[step]['activation_mib']:.1f} MiB"
                + (
                    f", bare ratio {run['ratio_train_over_bare']:.3f}"
                    if "train" in run and "bare" in run
                    else ""
                )
                + (f", MFU(6N) {step} {run[step]['mfu_6n']:.3f}" if "mfu_6n" in run[step] else ""),
                flush=True,
            )
    print(f"[train_bench] wrote {args.out} and {args.out.with_suffix('.md')}", flush=True)
    return report


if __name__ == "__main__":
    main()
