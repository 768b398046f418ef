"""Delta weight sync against full: bytes per link and sync time over real GRPO steps in bfloat16, the
changed fraction per step; and the delta encoding's GB/s on one device.

    python -m benchmarks.delta_sync [--models tiny m25] [--steps tiny=8 m25=3] [--quick]
    python -m benchmarks.delta_sync --encode [--device cpu|cuda] [--size-mb 256] [--changed 0.02]

Runs (``--encode`` off): for each model, two real ``megagrpo train`` runs at ``model.dtype`` bfloat16 with
the same config and seeds, ``generation.sync_mode`` full and delta (``weight_sync.delta``); the models are
``probe_bf16``'s (``tiny``: the demo's model from its bf16 warm-up, at the demo's ``policy.lr`` 3e-4; ``m25``:
``step``'s ~25M model from random weights, whose rewards are mostly 0 so that its weights move little), and
``tiny_lr1e-6``: the demo's model at ``policy.lr`` 1e-6 (the default of real configs); TP 1, one engine: one
link.
Per step, from each run's metrics.jsonl: the bytes the link carried (``sync/link_bytes_max``; delta mode:
headers and encodings), the sync's seconds without the probe (``timing/sync_s - timing/probe_s``; vLLM
reloads every bucket either way), and in delta mode the fraction of the elements whose bf16 bytes changed
(``sync/changed_fraction``). Every sync's per-tensor digests matched and its probe passed (either stops
the run), and the delta run repeats the full run's training (``train/loss`` per step: an exact sync
changes nothing the engines sample).

``--encode`` (torch only; the gpu script runs it on CUDA): a random bf16 bucket of ``--size-mb`` with
``--changed`` of its elements changed at random places; GB/s of the bucket's bytes for the sender's
``delta.encode`` (compare, indices, values) and the receiver's ``delta.apply``, ``--repeat`` times each.
"""

from __future__ import annotations

import argparse
import time

from .common import TMP, importable_by_workers, record
from .common.record import Measurement
from .common.runs import metrics_rows, per_family, train_run
from .probe_bf16 import MODELS as PROBE_MODELS

MODELS = {
    **PROBE_MODELS,
    # The demo's model at the default policy.lr of real configs (the demo's 3e-4 suits its size): bf16
    # rounding then leaves most elements where they were.
    "tiny_lr1e-6": [*PROBE_MODELS["tiny"], "policy.lr=1e-6"],
}
QUICK = {"models": ["tiny"], "steps": ["tiny=3"], "size_mb": 16.0}
MODES = ("full", "delta")
BF16 = ["model.dtype=bfloat16"]


def parse_args(argv=None) -> argparse.Namespace:
    p = record.parser("delta_sync", __doc__, repeat=5)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "m25"], help="the runs")
    p.add_argument(
        "--steps",
        nargs="+",
        default=["tiny=8", "m25=3", "tiny_lr1e-6=8"],
        help="GRPO steps per model (MODEL=N)",
    )
    p.add_argument("--encode", action="store_true", help="the encoding's GB/s instead of the runs")
    p.add_argument("--device", default="cpu", help="--encode: cpu or cuda")
    p.add_argument("--size-mb", type=float, default=256.0, help="--encode: the bucket's size")
    p.add_argument("--changed", type=float, default=0.02, help="--encode: fraction of elements changed")
    return record.parse(p, argv, QUICK)


def _steps(run) -> dict[int, dict]:
    return {r["step"]: r for r in metrics_rows(run) if r.get("step", 0) >= 1 and "sync/bytes" in r}


def model_runs(args, model: str, steps: int) -> list[Measurement]:
    root = TMP / "delta_sync"
    runs = {
        mode: _steps(
            train_run(root, f"{mode}_{model}", steps, [*MODELS[model], *BF16, f"generation.sync_mode={mode}"])
        )
        for mode in MODES
    }
    out = []
    for mode, rows in runs.items():
        s = {"model": model, "mode": mode, "steps": len(rows)}
        link = [r["sync/link_bytes_max"] / 2**20 for r in rows.values()]
        seconds = [r["timing/sync_s"] - r["timing/probe_s"] for r in rows.values()]
        out += [
            Measurement("bytes on the link per sync", link, "MiB", s),
            Measurement("sync time without the probe", seconds, "s", s),
            Measurement(
                "probe after the sync: exp abs delta logprob",
                [r["sync/probe_error"] for r in rows.values()],
                "x",
                s,
                target="<= 1.05",
            ),
        ]
        if mode == "delta":
            fractions = [r["sync/changed_fraction"] for r in rows.values()]
            out.append(
                Measurement("changed fraction of the bf16 elements, per step", fractions, "fraction", s)
            )
    full, delta = runs["full"], runs["delta"]
    shared = sorted(set(full) & set(delta))
    s = {"model": model, "steps": len(shared)}
    out += [
        Measurement(
            "bytes on the link, delta / full",
            [delta[k]["sync/link_bytes_max"] / full[k]["sync/link_bytes_max"] for k in shared],
            "x",
            s,
            target="< 1",
            headline=model == "tiny_lr1e-6",
        ),
        Measurement(
            "sync time without the probe, delta / full",
            [
                (delta[k]["timing/sync_s"] - delta[k]["timing/probe_s"])
                / (full[k]["timing/sync_s"] - full[k]["timing/probe_s"])
                for k in shared
            ],
            "x",
            s,
        ),
        Measurement(
            "train/loss, delta run - full run (an exact sync changes nothing)",
            [abs(delta[k]["train/loss"] - full[k]["train/loss"]) for k in shared],
            "",
            s,
            target="<= 0.000001",
        ),
    ]
    return out


def encode_rates(args) -> list[Measurement]:
    import torch

    from megagrpo.weight_sync.delta import apply, encode

    device = torch.device(args.device)
    numel = int(args.size_mb * 2**20) // 2
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(numel, generator=gen).to(torch.bfloat16)
    new = old.clone()
    where = torch.randperm(numel, generator=gen)[: int(args.changed * numel)]
    new[where] = (new[where].float() * 1.01 + 1e-3).to(torch.bfloat16)
    old_b, new_b = old.view(torch.uint8).to(device), new.view(torch.uint8).to(device)
    out = torch.empty_like(new_b)

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    encoded, _ = encode(new_b, old_b, torch.int16, 1.0, out)  # warm-up and the payload to apply
    rebuilt = old_b.clone()
    apply(rebuilt, out[: encoded.nbytes], encoded.count, torch.int16)
    if not torch.equal(rebuilt, new_b):
        raise SystemExit("delta_sync --encode: the rebuilt bucket differs from the new one")
    gb = new_b.numel() / 1e9
    enc = [gb / timed(lambda: encode(new_b, old_b, torch.int16, 1.0, out)) for _ in range(args.repeat)]
    app = [
        gb / timed(lambda: apply(old_b.clone(), out[: encoded.nbytes], encoded.count, torch.int16))
        for _ in range(args.repeat)
    ]
    s = {"device": device.type, "size_mb": args.size_mb, "changed": args.changed}
    return [
        Measurement(
            "delta encode (compare, indices, values), bucket bytes per second", enc, "GB/s", s, headline=True
        ),
        Measurement(
            "delta apply (a copy of the bucket, then the scatter), bucket bytes per second", app, "GB/s", s
        ),
        Measurement("encoded bytes / bucket bytes", [encoded.nbytes / new_b.numel()], "x", s),
    ]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.encode:
        out = encode_rates(args)
        what = "the delta weight sync's encoding and its application, GB/s of bucket bytes"
        return record.write(args, "delta_sync", what, out, packages=("torch",))
    importable_by_workers()
    steps = per_family(args.steps, MODELS)
    out = [m for model in args.models for m in model_runs(args, model, steps.get(model, 3))]
    what = (
        "delta weight sync against full over real bf16 GRPO steps: bytes per link, sync time, changed share"
    )
    notes = [
        "one engine at TP 1 and trainer TP 1: one link; every sync's digests and probe checked by the run"
    ]
    return record.write(
        args, "delta_sync", what, out, packages=("torch", "megatron.core", "vllm"), notes=notes
    )


if __name__ == "__main__":
    main()
