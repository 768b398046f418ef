"""SFT and DPO train steps against a bare Megatron step on the same model and tokens.

    python -m benchmarks.sft_dpo [--tp 1 2] [--seq 128] [--batch 8] [--pairs 4] [--repeat 2] [--quick]

In the same rank processes, on the same model (the worker's own engine: weights, DDP buffers,
optimizer) and the same micro-batches (the worker's own packing of its shard), interleaved rounds of

- ``sft``: ``SFTWorker.train_step(batch)`` against ``bare`` (``common.megatron.bare_step``);
- ``dpo``: ``DPOWorker.train_step(pairs)`` on pairs whose reference logprobs were computed before,
  ``dpo+ref`` the same with ``reference_logps`` (the extra forward pass a DPO step needs) timed too,
  against ``bare`` on the pairs' micro-batches.

Ratios are bare / step per round, of wall time and of the rank's CPU time (single-threaded ranks:
the CPU time is what a step costs whatever other jobs take). Target: SFT and DPO >= 0.85.
"""

from __future__ import annotations

import argparse

from .common import record
from .common.megatron import add_model_args, bare_step, device_sync, model_overrides, rank_threads, shape_of
from .common.record import Measurement, ratio
from .common.timing import interleave, other_load, slowest_rank

QUICK = {"tp": [1], "seq": 64, "batch": 2, "pairs": 2, "warmup": 0}


def parse_args(argv=None) -> argparse.Namespace:
    p = record.parser("sft_dpo", __doc__, repeat=2)
    add_model_args(p, tp=[1, 2], seq=128, budget=2048)
    p.add_argument("--batch", type=int, default=8, help="SFT sequences per step")
    p.add_argument("--pairs", type=int, default=4, help="DPO pairs per step")
    args = record.parse(p, argv, QUICK)
    args.shape_values = shape_of(p, args)
    return args


def examples(args, vocab: int, count: int, seed: int):
    """Random sequences of [seq * min_frac, seq] tokens; the first quarter is the (untrained) prompt."""
    import torch

    from megagrpo.data.supervised import Example

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(max(4, int(args.seq * args.min_len_frac)), args.seq + 1, (1,), generator=gen))
        ids = tuple(torch.randint(1, vocab, (n,), generator=gen).tolist())
        out.append(Example(ids, (False,) * (n // 4) + (True,) * (n - n // 4)))
    return out


def rank_main(rank: int, world_size: int, args) -> dict:
    import torch

    from megagrpo.data.supervised import Pair
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.supervised import DPOWorker, SFTWorker
    from megagrpo.types import SequenceBatch

    from .common.configs import make_config

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = model_overrides(args, args.shape_values, world_size)
    cfg = make_config({**overrides, "policy.lr": 1e-5, "sft.num_steps": 1000, "dpo.num_steps": 1000})
    vocab = cfg.model.tiny.vocab_size

    def log(r, done):
        if rank == 0:
            print(f"[sft_dpo] round {r}: " + ", ".join(f"{k} {t.seconds:.2f}s" for k, t in done.items()))

    out = {}
    worker = SFTWorker(cfg)
    try:
        batch = SequenceBatch.from_examples(examples(args, vocab, args.batch, seed=0))
        micro = [m for _, m in worker.micro_batches(batch, worker._my_shard(batch))]
        steps = {"sft": lambda: worker.train_step(batch), "bare": lambda: bare_step(worker.engine, micro)}
        sync = device_sync(worker.ctx.device)
        out["sft"] = interleave(steps, args.repeat, warmup=args.warmup, settle=sync, log=log)
    finally:
        # The DPO job follows in this process: keep the default group (a new gloo rendezvous races
        # the old store's shutdown).
        destroy_parallel(keep_world=True)
    worker = DPOWorker(cfg)
    try:
        ex = examples(args, vocab, 2 * args.pairs, seed=1)
        pairs = SequenceBatch.from_pairs([Pair(ex[2 * i], ex[2 * i + 1]) for i in range(args.pairs)])
        pairs = pairs.replace(ref_logps=worker.reference_logps(pairs))
        micro = [m for _, m in worker.pair_micro_batches(pairs)]
        steps = {
            "dpo": lambda: worker.train_step(pairs),
            "dpo+ref": lambda: worker.train_step(pairs.replace(ref_logps=worker.reference_logps(pairs))),
            "bare": lambda: bare_step(worker.engine, micro),
        }
        out["dpo"] = interleave(steps, args.repeat, warmup=args.warmup, settle=sync, log=log)
    finally:
        destroy_parallel()
    return out


def main(argv=None) -> dict:
    from megagrpo.parallel.local import run_local_ranks

    args = parse_args(argv)
    measurements = []
    for tp in args.tp:
        run = argparse.Namespace(**{**vars(args), "threads": rank_threads(args, tp)})
        ranks = run_local_ranks(rank_main, tp, run, timeout_s=args.timeout)
        for trainer, names in (("sft", ("sft",)), ("dpo", ("dpo", "dpo+ref"))):
            times = {k: slowest_rank([r[trainer][k] for r in ranks]) for k in (*names, "bare")}
            for name in (*names, "bare"):
                wall = [t.seconds for t in times[name]]
                measurements.append(Measurement(f"{trainer}: {name} step", wall, "s", {"tp": tp}))
            for name in names:
                target = ">= 0.85" if name != "dpo+ref" else None  # the reference pass is extra work
                walls = [[t.seconds for t in times[k]] for k in ("bare", name)]
                cpus = [[t.cpu_s for t in times[k]] for k in ("bare", name)]
                kw = {"settings": {"tp": tp}}
                # README's table: the TP 1 rounds (at TP 2 two ranks share the 2 CI cores), as losses'.
                headline = bool(target) and tp == args.tp[0]
                measurements.append(
                    ratio(f"{name} / bare Megatron step", *walls, target=target, headline=headline, **kw)
                )
                measurements.append(ratio(f"{name} / bare Megatron step, CPU time", *cpus, **kw))
            measurements.append(other_load(*times.values(), tp=tp, trainer=trainer))
    what = "SFT and DPO train steps against a bare Megatron step on the same model and micro-batches"
    notes = [
        f"model {args.preset} {args.shape_values}, {args.dtype}; SFT {args.batch} sequences, "
        f"DPO {args.pairs} "
        f"pairs of {int(args.seq * args.min_len_frac)}-{args.seq} tokens; {args.warmup} warm-up round(s)",
    ]
    return record.write(args, "sft_dpo", what, measurements, packages=("torch", "megatron.core"), notes=notes)


if __name__ == "__main__":
    main()
