"""``megagrpo plan``'s per-rank memory estimate vs measured peaks -> benchmarks/results/plan_calibration.*

    python benchmarks/plan_calibration.py

Measured: the H200 runs of benchmarks/gpu_h200.sh (benchmarks/results/gpu_h200/train_{4096,8192}.json,
``torch.cuda.max_memory_allocated`` of the policy train step, one rank). Each run's config is rebuilt
from the arguments recorded in its JSON with train_bench.py's own ``bench_config`` (same shape, dtype,
TP, micro-batch budget, logprob chunk, recompute, layers), planned with ``make_plan``, and the
estimate's total for the rank is compared with the measured peak. Target: within 15%.
"""

from __future__ import annotations

import argparse

from common import RESULTS
from common.tables import md_table, read_results, write_results

from megagrpo.plan import GIB, make_plan, read_shape

H200_GIB = 141.0


def main() -> None:
    from train_bench import bench_config

    rows, report = [], {"target_rel_error": 0.15, "runs": []}
    for seq in (4096, 8192):
        path = RESULTS / "gpu_h200" / f"train_{seq}.json"
        measured = read_results(path)
        for run in measured["runs"]:  # each run's own arguments where recorded (appended runs differ)
            args = argparse.Namespace(**run.get("args", measured["args"]))
            impl = run.get("impl", "local")
            cfg = bench_config(args, run["tp"], impl)
            shape, where = read_shape(cfg, None)
            plan = make_plan(cfg, shape, where, gpu_memory_gib=H200_GIB)
            est = plan.ranks[0]
            peak = run["peak_mem_gib"]["train"]
            err = est.total / GIB / peak - 1
            parts = {
                k: getattr(est, k) / GIB for k in ("weights", "grads", "optimizer", "activations", "logits")
            }
            report["runs"].append(
                {
                    "source": str(path.relative_to(RESULTS.parent.parent)),
                    "seq": seq,
                    "layers": impl,
                    "recompute": cfg.policy.recompute,
                    "measured_gib": peak,
                    "estimated_gib": est.total / GIB,
                    "rel_error": err,
                    "parts_gib": parts,
                }
            )
            rows.append(
                [
                    seq,
                    f"{impl}, recompute {cfg.policy.recompute}",
                    f"{peak:.1f}",
                    f"{est.total / GIB:.1f}",
                    f"{err:+.1%}",
                    *(f"{v:.1f}" for v in parts.values()),
                ]
            )
    header = (
        "seq | layers | measured GiB | estimate GiB | error | weights | grads | optimizer | activations "
        "| logits"
    )
    lines = [
        "# megagrpo plan: estimated vs measured peak memory per rank",
        "",
        "Measured: torch.cuda.max_memory_allocated of PolicyWorker.train on one H200",
        "(benchmarks/gpu_h200.sh, Qwen2-1.5B shape, bf16, TP 1, 16384-token micro-batches; the layers",
        "and recompute of each run as listed).",
        "Estimate: megagrpo.plan.make_plan for the config train_bench.py built. Command:",
        "`python benchmarks/plan_calibration.py`. Target within 15%.",
        "",
        *md_table(header, rows),
        "",
        "Not calibrated yet: the per-rank RSS of the tiny CPU run.",
    ]
    write_results(RESULTS / "plan_calibration.json", report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
