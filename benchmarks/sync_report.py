"""Tables of ``sync_bench.py``'s results: ``results/<output>.md`` from the report it measured."""

from __future__ import annotations

from common import MB, RESULTS
from common.tables import md_table, read_results, results_json, write_results


def variant_tables(v: dict) -> list[str]:
    if v.get("error"):
        first_line = v["error"].splitlines()[0][:300]
        stopped = f"Stopped after {len(v.get('results', []))} configuration(s): {first_line}"
        if not v.get("results"):
            return [stopped]
    lines = [
        *([stopped, ""] if v.get("error") else []),
        *([f"Fewer engines than asked: {v['engine_limit']}.", ""] if v.get("engine_limit") else []),
    ]
    rows = []
    for r in v["results"]:
        ok = "ok" if r["meets_bound_target"] else "MISS"
        rows.append(
            [
                f"{r['bucket_mb']:g}",
                r["engines"],
                r["buckets"],
                f"{r['sync_s']:.3f}",
                f"{r['sync_gb_per_s']:.3f}",
                f"{r['flat_s']:.3f}",
                f"{r['flat_gb_per_s']:.3f}",
                f"{r['fraction_of_flat']:.2f} {ok}",
                f"{r['bucketed_s']:.3f}",
                f"{r['fraction_of_bucketed']:.2f}",
                "-" if r.get("load_s") is None else f"{r['load_s']:.3f}",
                "-" if r.get("load_s") is None else f"{r['fraction_of_flat_plus_load']:.2f}",
                f"{r['sync_cpu_s']:.2f}, {r['flat_cpu_s']:.2f}, {r['bucketed_cpu_s']:.2f}",
                f"{r['probe_error']:.6f}",
                f"{r['other_cpus_median']:.2f}, {r['other_cpus_max']:.2f}",
            ]
        )
    header = (
        "bucket MB | engines | buckets | sync s | sync GB/s | flat s | flat GB/s | sync/flat "
        "| bucketed s | sync/bucketed | vLLM reload s | (flat + reload)/sync | CPU-s sync, flat, bucketed "
        "| probe error | other CPUs busy (median, max)"
    )
    lines += md_table(header, rows, "r" * 15)
    lines += ["", "Time growth from the fewest to the most engines (target: sync <= 1.2x):", ""]
    rows = []
    for b, g in v["growth"].items():
        ok = ("ok" if g["meets_target"] else "MISS") if g.get("target_applies", True) else "(target: 1 -> 4)"
        rows.append(
            [
                f"{float(b):g}",
                f"{g['from_engines']} -> {g['to_engines']}",
                f"{g['sync']:.2f}x {ok}",
                f"{g['flat']:.2f}x",
                f"{g['bucketed']:.2f}x",
            ]
        )
    lines += md_table("bucket MB | engines | sync | flat bound | bucketed bound", rows, "rlrrr")
    lines += [
        "",
        "Where a sync's time goes (medians, seconds; engine figures are the median over the engines):",
        "",
    ]
    rows = []
    for r in v["results"]:
        t, e = r["trainer_timings"], r["engine_timings"]
        seconds = [
            t.get("send_total_s", 0),
            t.get("send_wait_s", 0),
            e.get("receive_total_s", 0),
            e.get("recv_wait_s", 0),
            e.get("load_weights_s", 0),
            e.get("rpc_start_weight_update_s", 0),
            e.get("rpc_finish_weight_update_s", 0),
            e.get("reset_prefix_cache_s", 0),
        ]
        rows.append([f"{r['bucket_mb']:g}", r["engines"], *(f"{x:.3f}" for x in seconds)])
    header = (
        "bucket MB | engines | trainer send | trainer blocked on broadcast | engine receive "
        "| engine blocked on broadcast | load_weights | start_weight_update | finish_weight_update "
        "| reset_prefix_cache"
    )
    lines += md_table(header, rows, "r" * 10)
    cc = v["copy_costs"]
    lines += [
        "",
        f"Yardstick (this allocator setting): one single-thread copy of {cc['bytes'] / MB:.0f} MB takes "
        f"{cc['copy_warm_s']:.3f} s into a touched buffer and {cc['copy_fresh_s']:.3f} s into a freshly "
        "allocated one.",
    ]
    return lines


def markdown(report: dict) -> str:
    m, model = report["machine"], report["model"]
    shape = model["shape"]
    lines = [
        "# Weight sync: `WeightSync.sync()` vs one flat gloo broadcast",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model: Qwen2-shaped fp32, {model['num_layers']} layers, hidden {shape['hidden_size']}, vocabulary "
        f"{shape['vocab_size']} (tied), {model['bytes'] / MB:.0f} MB. Machine: {m['cpu']}, "
        f"{m['cpus_usable']} CPUs, {m['memory_bytes'] / 2**30:.0f} GiB, load average at start "
        f"{m['loadavg_at_start'][0]:.1f}; torch {m['torch']}, vLLM {m['vllm']}; {m['date']}. "
        f"Medians of {report['args']['repeat']} runs (each kind alternating with the others).",
    ]
    for name, v in report["variants"].items():
        env = " ".join(f"{k}={val}" for k, val in v["env"].items()) or "none"
        lines += ["", f"## Variant `{name}` (extra environment of every process: {env})", ""]
        lines += variant_tables(v)
    lines += [
        "",
        "sync: `WeightSync.sync()` (Megatron params -> HF tensors -> buckets -> gloo broadcast -> vLLM",
        "`load_weights` + layerwise reload), timed by the controller. flat: one `BroadcastGroup.broadcast`",
        "of one preallocated tensor of the same bytes from 1 sender actor to N receiver actors. bucketed:",
        "the same actors replaying the sync's bucket sizes and buffer discipline, no conversion or loading.",
        "vLLM reload: every engine reloading the model's tensors from its own memory through vLLM's",
        "layerwise reload (`load_weights` + finalisation), timed by the controller; flat + reload is what",
        "any sync must pay (move the bytes once, load them); (flat + reload)/sync: target >= 0.9.",
        "GB/s = model bytes / seconds (each receiver gets them all). CPU-s: CPU seconds the benchmark's",
        "processes (policy rank, engines, bound actors, Ray daemons, controller) used during the run: the",
        "work done, which contention does not change much. 'other CPUs busy': CPUs used by processes",
        "other than this benchmark's during the timed runs (the machine is shared).",
    ]
    lines += comparison(report)
    return "\n".join(lines) + "\n"


def comparison(report: dict) -> list[str]:
    """Variant against variant, and the CPU work of a sync against the transport's, from the data."""
    variants = report["variants"]
    base = {(r["bucket_mb"], r["engines"]): r for r in variants.get("default", {}).get("results", [])}
    lines = [
        "",
        "## Work and allocator",
        "",
    ]
    rows = []
    for name, v in variants.items():
        for r in v.get("results", []):
            ref = base.get((r["bucket_mb"], r["engines"])) if name != "default" else None
            time_x = f"{ref['sync_s'] / r['sync_s']:.2f}x" if ref else ""
            work_x = f"{ref['sync_cpu_s'] / r['sync_cpu_s']:.2f}x" if ref and r["sync_cpu_s"] else ""
            work = r["sync_cpu_s"] / r["flat_cpu_s"] if r["flat_cpu_s"] else float("nan")
            rows.append([name, f"{r['bucket_mb']:g}", r["engines"], f"{work:.1f}", time_x, work_x])
    header = (
        "variant | bucket MB | engines | sync CPU-s / flat CPU-s | default sync s / this "
        "| default sync CPU-s / this"
    )
    lines += md_table(header, rows, "lrrrrr")
    lines += [
        "",
        "Times of different variants come from different Ray sessions, minutes apart on a shared machine",
        "(compare their 'other CPUs busy'); CPU seconds, the work done, are the steadier comparison.",
    ]
    return lines


def write_report(report: dict, output: str) -> None:
    path = results_json(output)
    write_results(path, report, markdown(report))
    print(f"wrote {RESULTS / output}.json and .md", flush=True)


def render(output: str) -> dict:
    """Rewrite ``results/<output>.md`` from ``results/<output>.json``."""
    path = results_json(output)
    report = read_results(path)
    path.with_suffix(".md").write_text(markdown(report))
    return report
