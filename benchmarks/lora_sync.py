"""LoRA's two weight syncs against each other and against full fine-tuning's: bytes per sync, sync time,
generation time, over real GRPO steps in bfloat16.

    python -m benchmarks.lora_sync [--models tiny m25] [--steps tiny=8 m25=3] [--rank 8] [--quick]

For each model (``probe_bf16``'s: ``tiny``, the demo's model from its bf16 warm-up; ``m25``, ``step``'s ~25M
model from random weights), three real ``megagrpo train`` runs with the same config and seeds at
``model.dtype`` bfloat16, TP 1 and one engine: ``full`` (no adapters: every weight trained and sent),
``merged`` (``policy.lora.rank``, ``generation.lora_sync: merged``: the merged weights sent every sync) and
``adapter`` (``generation.lora_sync: adapter``: the base with the first sync, the adapters alone after it,
applied by vLLM's LoRA support). Per step after the first (whose sync sends the base in every mode), from
each run's metrics.jsonl: the bytes the sync sent (``sync/bytes``: buckets and adapters), its seconds
without the probe (``timing/sync_s - timing/probe_s``), the rollouts' generation seconds
(``timing/generation_s``: vLLM computes the adapters beside the base in adapter mode) and the probe. Every
sync's digests matched and its probe passed (either stops the run).
"""

from __future__ import annotations

import argparse

from .common import TMP, importable_by_workers, record
from .common.record import Measurement
from .common.runs import metrics_rows, per_family, train_run
from .probe_bf16 import MODELS

QUICK = {"models": ["tiny"], "steps": ["tiny=3"]}
BF16 = ["model.dtype=bfloat16"]


def modes(rank: int) -> dict[str, list[str]]:
    lora = [f"policy.lora.rank={rank}", f"policy.lora.alpha={2 * rank}"]
    return {
        "full": [],
        "merged": [*lora, "generation.lora_sync=merged"],
        "adapter": [*lora, "generation.lora_sync=adapter"],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = record.parser("lora_sync", __doc__, repeat=None)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "m25"], help="the runs")
    p.add_argument("--steps", nargs="+", default=["tiny=8", "m25=3"], help="GRPO steps per model (MODEL=N)")
    p.add_argument("--rank", type=int, default=8, help="policy.lora.rank of the LoRA runs")
    return record.parse(p, argv, QUICK)


def _later_steps(run) -> dict[int, dict]:
    """Steps after the first (the first sync of a run sends the base in every mode)."""
    return {r["step"]: r for r in metrics_rows(run) if r.get("step", 0) >= 2 and "sync/bytes" in r}


def _sync_s(row: dict) -> float:
    return row["timing/sync_s"] - row["timing/probe_s"]


def model_runs(args, model: str, steps: int) -> list[Measurement]:
    root = TMP / "lora_sync"
    runs = {
        mode: _later_steps(train_run(root, f"{mode}_{model}", steps, [*MODELS[model], *BF16, *extra]))
        for mode, extra in modes(args.rank).items()
    }
    out = []
    for mode, rows in runs.items():
        s = {"model": model, "mode": mode, "rank": args.rank if mode != "full" else 0, "steps": len(rows)}
        out += [
            Measurement("bytes per sync", [r["sync/bytes"] / 2**20 for r in rows.values()], "MiB", s),
            Measurement("sync time without the probe", [_sync_s(r) for r in rows.values()], "s", s),
            Measurement(
                "generation time per step", [r["timing/generation_s"] for r in rows.values()], "s", s
            ),
            Measurement(
                "probe after the sync: exp abs delta logprob",
                [r["sync/probe_error"] for r in rows.values()],
                "x",
                s,
                target="<= 1.05",
            ),
        ]
    merged, adapter = runs["merged"], runs["adapter"]
    shared = sorted(set(merged) & set(adapter))
    s = {"model": model, "rank": args.rank, "steps": len(shared)}
    out += [
        Measurement(
            "bytes per sync, adapter / merged",
            [adapter[k]["sync/bytes"] / merged[k]["sync/bytes"] for k in shared],
            "x",
            s,
            target="< 1",
            headline=model == "tiny",
        ),
        Measurement(
            "sync time without the probe, adapter / merged",
            [_sync_s(adapter[k]) / _sync_s(merged[k]) for k in shared],
            "x",
            s,
        ),
        Measurement(
            "generation time per step, adapter / merged",
            [adapter[k]["timing/generation_s"] / merged[k]["timing/generation_s"] for k in shared],
            "x",
            s,
        ),
        Measurement(
            "sync + generation per step, adapter / merged",
            [
                (_sync_s(adapter[k]) + adapter[k]["timing/generation_s"])
                / (_sync_s(merged[k]) + merged[k]["timing/generation_s"])
                for k in shared
            ],
            "x",
            s,
        ),
    ]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    importable_by_workers()
    steps = per_family(args.steps, MODELS)
    out = [m for model in args.models for m in model_runs(args, model, steps.get(model, 3))]
    what = "LoRA's merged and adapter weight syncs, and full fine-tuning's, over real bf16 GRPO steps"
    notes = [
        "one engine at TP 1 and trainer TP 1; every sync's digests and probe checked by the run",
        "steps after the first only: the first sync of every run sends the base",
    ]
    return record.write(
        args, "lora_sync", what, out, packages=("torch", "megatron.core", "vllm"), notes=notes
    )


if __name__ == "__main__":
    main()
