"""The GRPO train step against a bare Megatron step on the same model and tokens.

    python -m benchmarks.train [--tp 1 2] [--impl local torch] [--seq 256] [--repeat 3] [--quick]
                               [--lora-rank 0 8]

Both steps run in the same rank processes, on the same model (the worker's own engine: weights,
DDP buffers, optimizer) and the same micro-batches (the worker's own packing of its shard):

- ``train``: ``PolicyWorker.train(batch)``, one optimizer step per call (``policy.mini_batch_size``
  = the batch); the old and the generator's logprobs are computed once before timing, as the GRPO
  driver does before its updates;
- ``bare``: ``common.megatron.bare_step``: Megatron's schedule with a plain cross-entropy on the
  same response tokens, then the optimizer step.

Interleaved rounds (``common.timing``); tokens/s counts the real (unpadded) tokens. Target:
train / bare >= 0.85 in every round. Also measured: the activation memory of a step (bytes autograd
holds for backward), and the peak memory against ``megagrpo plan``'s estimate for the same config
(CUDA: the allocator's peak; CPU: the rank's RSS growth over its idle process, the host copy of
the reference policy left out; target: within 15%). On CUDA, MFU = 6 N tokens/s / peak (N: all
parameters, the tied embedding once) and with attention's 12 L h s per token; with
``--sync-bucket-mb``, the weight-sync sender (HF conversion + double-buffered buckets, a group
without receivers) against one flat device copy of the same bytes. Several ``--seq`` keep the
first one's tokens per step; several ``--impl`` add their ratio to the first's. ``--steps`` may add
the other losses of ``grpo.loss`` (``gspo``, ``gspo_token``, ``cispo``): the same ``train`` call with
the worker's loss swapped, each against ``train`` (GRPO's loss) in the same rounds; target: the same
cost within noise (0.85..1.15). With ``--offload`` (the gpu suite's run), after the steps: the sleep path
of colocated placement (``policy.offload: all``: optimizer state, gradient buffers and weights to host
memory, the allocator's free blocks back to the driver, then everything back), seconds each way, the
device bytes freed, and on CUDA the allocator's reserve before and after.

``--lora-rank`` (``policy.lora.rank``, all four target layers; 0: full fine-tuning): a run of ranks per
value. Every run counts on its worker the parameters that train and the bytes of their gradient buffers
and optimizer state (Adam's moments; in bf16 also the fp32 master weights); several values add each later
run's train step (tokens/s), peak memory, activation memory and that state as ratios to the first value's
run (separate processes, one after the other: not interleaved).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from .common import record
from .common.machine import proc_status
from .common.megatron import add_model_args, bare_step, device_sync, model_overrides, rank_threads, shape_of
from .common.record import Measurement, ratio
from .common.timing import interleave, other_load, seconds, slowest_rank

QUICK = {"tp": [1], "batch": 2, "seq": [64]}
# grpo.loss's other values and what each needs (GSPO: sequence aggregation, no token TIS weight).
LOSSES = {
    "gspo": {
        "loss": "gspo",
        "loss_agg": "sequence",
        "off_policy_correction": "none",
        "behav_weight_cap": None,
    },
    "gspo_token": {
        "loss": "gspo_token",
        "loss_agg": "sequence",
        "off_policy_correction": "none",
        "behav_weight_cap": None,
    },
    "cispo": {"loss": "cispo"},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = record.parser("train", __doc__)
    add_model_args(p, tp=[1, 2], seq=256, budget=1024, seqs=True)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (at the first --seq)")
    p.add_argument("--impl", nargs="+", default=["local"], choices=["local", "torch", "transformer_engine"])
    p.add_argument("--steps", nargs="+", default=["train", "bare"], choices=["train", "bare", *LOSSES])
    p.add_argument("--recompute", default="none", choices=["none", "core_attention", "full"])
    p.add_argument(
        "--lora-rank", type=int, nargs="+", default=[0], help="policy.lora.rank per run (0: full fine-tuning)"
    )
    p.add_argument("--compile", action="store_true", help="Megatron's torch.compile'd fusions on")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (H200 bf16: 989)")
    p.add_argument("--sync-bucket-mb", type=float, default=0.0, help="also time the weight-sync sender")
    p.add_argument(
        "--offload", action="store_true", help="also time the colocated sleep path (policy.offload: all)"
    )
    args = record.parse(p, argv, QUICK)
    if min(args.lora_rank) < 0 or len(set(args.lora_rank)) != len(args.lora_rank):
        p.error(f"--lora-rank {' '.join(map(str, args.lora_rank))}: want distinct ranks >= 0 (0: full)")
    args.shape_values = shape_of(p, args)
    return args


def bench_config(args, tp: int, impl: str, seq: int, batch: int, lora: int = 0):
    from .common.configs import make_config

    run = argparse.Namespace(**{**vars(args), "seq": seq})
    return make_config(
        {
            **model_overrides(run, args.shape_values, tp),
            "generation.max_new_tokens": seq - seq // 4,
            "parallel.transformer_impl": impl,
            "policy.mini_batch_size": batch,
            "policy.recompute": args.recompute,
            # The tiny default's loss, pinned: no reference model, TIS on the generator's logprobs.
            "grpo.kl_coef": 0.0,
            "grpo.off_policy_correction": "tis",
            "grpo.behav_weight_cap": 2.0,
            "grpo.num_prompts_per_step": 1,
            "grpo.num_generations": batch,
            # Parks nothing until the benchmark calls offload (--offload), which colocated placement does.
            "policy.offload": "all" if args.offload else "none",
            "generation.placement": "colocated" if args.offload else "disaggregated",
            "policy.lora.rank": lora,
        }
    )


def make_batch(seq: int, batch: int, min_frac: float, vocab: int):
    """Fixed random sequences, lengths in [seq * min_frac, seq], prompts a quarter of each."""
    import torch

    from megagrpo.types import TrainBatch

    gen = torch.Generator().manual_seed(0)
    low = max(2, int(seq * min_frac))
    lengths = [int(torch.randint(low, seq + 1, (1,), generator=gen)) for _ in range(batch)]
    seqs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]
    out = TrainBatch.from_sequences(seqs, [max(1, n // 4) for n in lengths])
    return out.replace(advantages=torch.randn(batch, generator=gen))


def _vm(field: str) -> int:
    return proc_status("self", (field,)).get(field, 0)


def trained_state(engine) -> dict:
    """This rank's parameters that train, and the bytes of their gradient buffers and optimizer state
    (the tensors the optimizer keeps that are not the model's own parameters: Adam's moments, and the fp32
    master copies of bf16 weights)."""
    from megagrpo.policy.offload import grad_buffers, optimizer_tensors

    params = list(engine.module.parameters())
    own = {p.untyped_storage().data_ptr() for p in params}
    kept = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in optimizer_tensors(engine.optimizer)
    }
    return {
        "trained_params": sum(p.numel() for p in params if p.requires_grad),
        "params": sum(p.numel() for p in params),
        "grad_bytes": sum(b.numel() * b.element_size() for b in grad_buffers(engine.model[0])),
        "optimizer_bytes": sum(n for ptr, n in kept.items() if ptr not in own),
    }


def rank_main(rank: int, world_size: int, args, impl: str, seq: int, batch: int, lora: int = 0) -> dict:
    import torch

    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.worker import PolicyWorker
    from megagrpo.types import balanced_shards

    from .common.memory import SavedActivations

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config(args, world_size, impl, seq, batch, lora)
    idle = _vm("VmRSS")  # interpreter, torch, Megatron, process groups
    worker = PolicyWorker(cfg)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the steps' peak
    try:
        engine, device = worker.engine, worker.ctx.device
        if args.compile:  # read by Megatron's MLP and layers at every forward
            engine.config.bias_activation_fusion = engine.config.bias_dropout_fusion = True
        data = make_batch(seq, batch, args.min_len_frac, cfg.model.tiny.vocab_size)
        old = worker.logprobs(data)
        gen = old + 0.01 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
        data = data.replace(old_logprobs=old, gen_logprobs=gen)
        shard = balanced_shards(data.lengths.tolist(), worker.ctx.dp_size)[worker.ctx.dp_rank]
        micro = [m for _, m in worker.micro_batches(data, shard)]
        steps = {"train": with_loss(worker, data, {}), "bare": lambda: bare_step(engine, micro)}
        steps |= {name: with_loss(worker, data, knobs) for name, knobs in LOSSES.items()}
        steps = {k: steps[k] for k in args.steps}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def log(r, done):
            if rank == 0:
                print(f"[train] round {r}: " + ", ".join(f"{k} {t.seconds:.2f}s" for k, t in done.items()))

        times = interleave(steps, args.repeat, warmup=args.warmup, settle=device_sync(device), log=log)
        out = {"times": times, "state": trained_state(engine)}
        out["shard_tokens"] = int(sum(int(data.lengths[i]) for i in shard))
        held = worker.reference.tensors.values() if worker.reference else ()
        reference = sum(t.numel() * t.element_size() for t in held)
        if device.type == "cuda":
            out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        else:
            out["peak_bytes"] = _vm("VmHWM") - idle - reference
        with SavedActivations(engine.module) as saved:  # untimed: one more step, its saved tensors counted
            next(iter(steps.values()))()
        out["activation_bytes"] = saved.peak_bytes
        if args.sync_bucket_mb:
            out["sync"] = time_sender(worker, args)
        if args.offload:
            out["offload"] = time_offload(worker, args.repeat)
        return out
    finally:
        destroy_parallel()


def with_loss(worker, data, knobs: dict):
    """``worker.train(data)`` with the worker's loss knobs replaced by ``knobs`` for the call."""
    from dataclasses import replace

    grpo_loss = worker.loss_cfg
    changed = replace(grpo_loss, **knobs)

    def step():
        worker.loss_cfg = changed
        try:
            return worker.train(data)
        finally:
            worker.loss_cfg = grpo_loss

    return step


def time_sender(worker, args) -> dict:
    """The trainer side of a weight sync (one rank, a group without receivers: what the trainer adds
    to the transport) and one device copy of the same bytes (every byte is packed once at least)."""
    from dataclasses import replace

    import torch

    from megagrpo.generation.engine import engine_spec
    from megagrpo.parallel.backends import weight_sync_backend
    from megagrpo.weight_sync.shards import SyncPath
    from megagrpo.weight_sync.transport import GroupAddress

    device = worker.ctx.device
    layout = engine_spec(worker.cfg.generation.engine).layout()
    links = worker.weight_sync_offer(
        SyncPath("gathered", "benchmark"), 1, int(args.sync_bucket_mb * 2**20), layout
    )
    if len(links) != 1:
        raise SystemExit("--sync-bucket-mb times one sender: run it with --tp 1")
    plan = tuple(replace(b, source=0) for b in links[0].buckets)  # this rank's own plan
    backend = weight_sync_backend(worker.cfg.resolved.backend)
    worker.open_weight_sync(
        [GroupAddress(links[0].address, links[0].port, 1)], [links[0].key], backend, 300.0
    )
    total = sum(b.nbytes for b in plan)
    flat = torch.empty(2, total, dtype=torch.uint8, device=device)
    try:
        steps = {"send": lambda: worker.send_weights(plan), "copy": lambda: flat[1].copy_(flat[0])}
        times = interleave(steps, args.repeat, warmup=args.warmup, settle=device_sync(device))
    finally:
        worker.close_weight_sync()
    return {"bytes": total, "send": seconds(times["send"]), "copy": seconds(times["copy"])}


def time_offload(worker, rounds: int) -> dict:
    """The colocated sleep path after the steps: ``offload("sync")`` (optimizer state, gradient buffers)
    and ``offload("generation")`` (weights) to host memory, then ``reload``; per round the seconds of
    each and the device bytes the worker freed, and on CUDA the memory the allocator held before and
    after (what the engines could take)."""
    import time

    import torch

    device, out = worker.ctx.device, {"offload_s": [], "reload_s": [], "freed": [], "held": []}
    for _ in range(rounds):
        held = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        start = time.perf_counter()
        freed = worker.offload("sync") + worker.offload("generation")
        middle = time.perf_counter()
        after = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        worker.reload()
        out["offload_s"].append(middle - start)
        out["reload_s"].append(time.perf_counter() - middle)
        out["freed"].append(freed)
        out["held"].append((held, after))
    return out


def plan_estimate(cfg) -> float:
    """``megagrpo plan``'s memory estimate for rank 0 of ``cfg``, bytes."""
    from megagrpo.plan import make_plan, read_shape

    shape, where = read_shape(cfg, None)
    return make_plan(cfg, shape, where, gpu_memory_gib=141.0).ranks[0].total


def _flops_per_token(shape: dict, seq: int) -> dict[str, int]:
    """MFU's numerators: all parameters (the tied embedding once), 6 N (+ attention) per token."""
    from megagrpo.models.shape import padded_vocab_size

    from .common.models import qwen2_params

    hf = {"hidden_size": shape["hidden_size"], "intermediate_size": shape["ffn_hidden_size"]}
    hf |= {
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_query_groups"],
    }
    n = qwen2_params(
        {**hf, "vocab_size": padded_vocab_size(shape["vocab_size"])}, shape["num_layers"], tied=True
    )
    return {"6N": 6 * n, "6N + attention": 6 * n + 12 * shape["num_layers"] * shape["hidden_size"] * seq}


def measure_run(
    args, tp: int, impl: str, seq: int, batch: int, settings: dict, lora: int = 0
) -> list[Measurement]:
    from megagrpo.parallel.local import run_local_ranks

    run = argparse.Namespace(**{**vars(args), "threads": rank_threads(args, tp)})
    print(f"[train] {settings}: {args.warmup} warm-up + {args.repeat} rounds", flush=True)
    ranks = run_local_ranks(rank_main, tp, run, impl, seq, batch, lora, timeout_s=args.timeout)
    tokens = sum(r["shard_tokens"] for r in ranks) // tp  # the TP ranks share one shard
    steps = {k: slowest_rank([r["times"][k] for r in ranks]) for k in args.steps}
    rates = {k: [tokens / t.seconds for t in v] for k, v in steps.items()}
    out = [Measurement(f"{k} step", v, "tokens/s", settings) for k, v in rates.items()]

    def add(name: str, samples, unit: str, s=settings, **kw) -> None:
        out.append(Measurement(name, samples, unit, s, **kw))

    for loss in (k for k in steps if k in LOSSES and "train" in steps):
        per_round = ratio("", rates[loss], rates["train"]).samples
        # README's table: the TP 1 rounds (at TP 2 two ranks share the 2 CI cores with the contenders)
        add(f"{loss} step / grpo step", per_round, "x", target="0.85..1.15", headline=tp == 1)
    if "train" in steps and "bare" in steps:
        per_round = ratio("", rates["train"], rates["bare"]).samples
        add("train / bare Megatron step", per_round, "x", target=">= 0.85", headline=True)
        cpu = [[t.cpu_s for t in steps[k]] for k in ("bare", "train")]
        add("train / bare Megatron step, CPU time", ratio("", *cpu).samples, "x")
    add(f"{args.steps[0]} step activation memory", [max(r["activation_bytes"] for r in ranks) / 2**20], "MiB")
    state = ranks[0]["state"]  # the TP ranks hold equal shares
    add("parameters that train, rank 0", [state["trained_params"]], "params")
    add(
        "gradient buffers + optimizer state, rank 0",
        [(state["grad_bytes"] + state["optimizer_bytes"]) / 2**20],
        "MiB",
    )
    peak = max(r["peak_bytes"] for r in ranks)
    add("peak memory of the steps, the largest rank", [peak / 2**20], "MiB")
    estimate = plan_estimate(bench_config(args, tp, impl, seq, batch, lora))
    add(  # README's table: once, from train's own run (losses repeats the same model's estimate)
        "megagrpo plan's memory estimate / measured peak",
        [estimate / peak],
        "x",
        target="0.85..1.15",
        headline=args.steps[:2] == ["train", "bare"],
    )
    if args.peak_tflops:
        for k, v in rates.items():
            for what, per_token in _flops_per_token(args.shape_values, seq).items():
                mfu = [per_token * x / (args.peak_tflops * 1e12 * tp) for x in v]
                add(f"{k} step MFU ({what})", mfu, "fraction", headline=k == "train" and what == "6N")
        add("peak memory of the steps", [peak / 2**30], "GiB")
    if "sync" in ranks[0]:
        sync = ranks[0]["sync"]
        s = {**settings, "bytes": sync["bytes"], "bucket_mb": args.sync_bucket_mb}
        first = seq == args.seq[0]  # README's table: the sender at the first --seq (the bytes are the same)
        add("weight-sync sender", [sync["bytes"] / x / 1e9 for x in sync["send"]], "GB/s", s, headline=first)
        add(
            "one flat device copy of the same bytes",
            [sync["bytes"] / x / 1e9 for x in sync["copy"]],
            "GB/s",
            s,
        )
    if "offload" in ranks[0]:
        off = ranks[0]["offload"]
        add("sleep path: offload to host (optimizer, gradients, weights)", off["offload_s"], "s")
        add("sleep path: reload to the device", off["reload_s"], "s")
        add("sleep path: device memory the worker freed", [b / 2**30 for b in off["freed"]], "GiB")
        if any(before for before, _ in off["held"]):  # CUDA: the allocator's reserve, before and after
            add("allocator's reserve before the sleep path", [b / 2**30 for b, _ in off["held"]], "GiB")
            add("allocator's reserve after the sleep path", [a / 2**30 for _, a in off["held"]], "GiB")
    return [*out, other_load(*steps.values(), **settings)]


LORA_COMPARED = (
    "train step",
    "train step activation memory",
    "peak memory of the steps, the largest rank",
    "gradient buffers + optimizer state, rank 0",
)
"""The measurements of a LoRA run given as ratios to the first ``--lora-rank``'s run."""


def against_first(runs: dict, key: str, names, label) -> list[Measurement]:
    """Each later run's measurements called ``names`` as ratios to the first run's of the same settings
    but ``key`` (``runs``: the runs' measurements by their value of ``key``, in order; a value that is
    falsy, lora rank 0, is no setting); ``label(value, first)`` ends the ratio's name."""
    first, *later = runs
    out = []
    for value in later:
        for m in (m for m in runs[value] if m.name in names):
            same = {k: v for k, v in m.settings.items() if k != key} | ({key: first} if first else {})
            ref = [r for r in runs[first] if r.name == m.name and r.settings == same]
            if len(ref) != 1:
                raise KeyError(f"{len(ref)} measurements {m.name!r} with {same}")
            samples = m.samples[: len(ref[0].samples)]
            out.append(
                ratio(f"{m.name}, {label(value, first)}", samples, ref[0].samples, settings=m.settings)
            )
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    measurements: list[Measurement] = []
    by_impl: dict[str, list[Measurement]] = {}
    by_lora: dict[int, list[Measurement]] = {}
    for lora in args.lora_rank:
        for impl in args.impl:
            for seq in args.seq:
                batch = max(2, args.batch * args.seq[0] // seq)  # a group needs two
                for tp in args.tp:
                    settings = {"tp": tp, "impl": impl, "seq": seq, "batch": batch}
                    settings |= {"lora_rank": lora} if lora else {}
                    run = measure_run(args, tp, impl, seq, batch, settings, lora)
                    by_impl.setdefault(impl, []).extend(run)
                    by_lora.setdefault(lora, []).extend(run)
                    measurements += run
    # each other layer implementation, and each LoRA rank, against the first's same run
    step = (f"{args.steps[0]} step", f"{args.steps[0]} step activation memory")
    measurements += against_first(by_impl, "impl", step, lambda impl, base: f"{impl} / {base} layers")
    measurements += against_first(
        by_lora, "lora_rank", LORA_COMPARED, lambda r, first: f"LoRA / {f'rank {first}' if first else 'full'}"
    )
    what = "PolicyWorker.train() against a bare Megatron step on the same model and micro-batches"
    notes = [f"model {args.preset} {args.shape_values}, {args.dtype}; {args.warmup} warm-up round(s)"]
    return record.write(args, "train", what, measurements, packages=("torch", "megatron.core"), notes=notes)


if __name__ == "__main__":
    main()
