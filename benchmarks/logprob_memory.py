#!/usr/bin/env python3
"""Peak memory of the chunked vocab-parallel logprob path against gathering full-vocab fp32 logits.

    python benchmarks/logprob_memory.py                                   # CPU: 2048 tokens
    python benchmarks/logprob_memory.py --tokens 8192 16384 --device cuda # what gpu_h200.sh runs

Input, as the model hands it over: bf16 logits [tokens, vocab] requiring grad (the Qwen2 vocabulary,
151936, by default) and target ids. Each variant runs forward + backward (an upstream gradient on
the logprobs) in a fresh process, so nothing of one variant's allocations is left for the next:

- ``chunked``: ``megagrpo.policy.logprobs.vocab_parallel_logprobs`` (what ``PolicyWorker.logprobs``
  uses), fp32 only for one ``--chunk`` of tokens at a time;
- ``chunked_entropy``: the same with ``with_entropy=True`` (what ``PolicyWorker.train`` uses);
- ``full``: ``torch.log_softmax(logits.float(), -1).gather(...)``: the straightforward approach (at
  TP > 1 it would all-gather the vocabulary first, adding a bf16 [tokens, vocab] on every rank);
- ``full_entropy``: the same plus the entropy ``-(p * logp).sum(-1)`` without gradient.

Peak memory is what the variant adds on top of its inputs (the logits' own gradient is part of it, the
same for every variant): on CUDA ``max_memory_allocated`` minus the allocation before the call; on CPU
the peak resident set (VmHWM, reset through /proc/self/clear_refs just before the call; ru_maxrss if
that is not allowed) minus the RSS before. The two approaches are also checked to agree on the
logprobs and gradients of a small case. Results: benchmarks/results/logprob_memory.json and .md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import RESULTS
from common.sampling import machine_info, mem_available, proc_status
from common.tables import md_table, write_results

VARIANTS = ("chunked", "chunked_entropy", "full", "full_entropy")
MB = 2**20


def logprobs_of(variant: str, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """[tokens] fp32 logprobs of ``targets`` with gradient to ``logits`` [tokens, vocab]."""
    if variant.startswith("chunked"):
        from megagrpo.policy.logprobs import vocab_parallel_logprobs

        lp, _ = vocab_parallel_logprobs(
            logits, targets, chunk_size=chunk, with_entropy=variant == "chunked_entropy"
        )
        return lp
    logp_TV = torch.log_softmax(logits.float(), dim=-1)  # [tokens, vocab] fp32
    if variant == "full_entropy":
        with torch.no_grad():
            _entropy_T = -(logp_TV.exp() * logp_TV).sum(dim=-1)
    return logp_TV.gather(-1, targets[:, None]).squeeze(-1)


# ------------------------------------------------------------------------------- one variant, alone


def _reset_cpu_peak() -> str:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return "VmHWM"
    except OSError:
        return "ru_maxrss"


def _cpu_peak_bytes(method: str) -> int:
    if method == "VmHWM":
        return proc_status("self", ("VmHWM",))["VmHWM"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(variant: str, tokens: int, vocab: int, chunk: int, device: torch.device, repeats: int) -> dict:
    """Peak extra memory (and time) of one forward + backward of ``variant``."""
    gen = torch.Generator(device=device).manual_seed(0)
    # Imports, kernels and autograd's engine are set up once, on a small input, outside the measurement.
    small = torch.zeros(16, vocab, device=device, dtype=torch.bfloat16, requires_grad=True)
    logprobs_of(variant, small, torch.zeros(16, dtype=torch.long, device=device), chunk).sum().backward()
    del small
    # bf16 straight from the generator: no fp32 staging copy that would set the peak before the call.
    logits = torch.randn(tokens, vocab, generator=gen, device=device, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    grad_T = torch.randn(tokens, generator=gen, device=device)  # upstream d loss / d logprob
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        method = "cuda.max_memory_allocated"
    else:
        before = proc_status("self", ("VmRSS",))["VmRSS"]
        method = _reset_cpu_peak()
    start = time.perf_counter()
    logprobs_of(variant, logits, targets, chunk).backward(grad_T)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _cpu_peak_bytes(method)
    times = [time.perf_counter() - start]
    for _ in range(repeats - 1):
        logits.grad = None
        start = time.perf_counter()
        logprobs_of(variant, logits, targets, chunk).backward(grad_T)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {
        "variant": variant,
        "tokens": tokens,
        "vocab": vocab,
        "chunk": chunk,
        "device": str(device),
        "method": method,
        "input_logits_mb": logits.numel() * logits.element_size() / MB,
        "before_mb": before / MB,
        "peak_extra_mb": (peak - before) / MB,
        "time_s": times,
    }


# ----------------------------------------------------------------------------------------- parent


def check_agreement(device: torch.device, vocab: int, chunk: int) -> dict:
    """Both approaches give the same logprobs and gradients (small case, same bf16 input)."""
    gen = torch.Generator(device=device).manual_seed(1)
    logits = torch.randn(3 * chunk // 2 + 7, vocab, generator=gen, device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (logits.shape[0],), generator=gen, device=device)
    grad_T = torch.randn(logits.shape[0], generator=gen, device=device)
    out = {}
    for variant in ("chunked", "full"):
        x = logits.detach().clone().requires_grad_(True)
        lp = logprobs_of(variant, x, targets, chunk)
        lp.backward(grad_T)
        out[variant] = (lp.detach(), x.grad.float())
    return {
        "tokens": logits.shape[0],
        "logprobs_max_abs_diff": float((out["chunked"][0] - out["full"][0]).abs().max()),
        "grad_max_abs_diff": float((out["chunked"][1] - out["full"][1]).abs().max()),
    }


def estimate_full_gib(tokens: int, vocab: int) -> float:
    """Rough peak of the full variant: fp32 log-softmax, its gradient and the incoming one, bf16 grad."""
    return tokens * vocab * (3 * 4 + 2 + 2) / 2**30


def run_variant(args, variant: str, tokens: int, device: torch.device) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        variant,
        "--tokens",
        str(tokens),
        "--vocab",
        str(args.vocab),
        "--chunk",
        str(args.chunk),
        "--device",
        device.type,
        "--repeats",
        str(args.repeats),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at {tokens} tokens failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    m, a = report["machine"], report["args"]
    lines = [
        "# Logprob path: peak memory, chunked vs full-vocab fp32",
        "",
        f"{m['date']}, {m['cuda'] or 'CPU'}, torch {m['torch']}; bf16 logits [tokens, {a['vocab']}] "
        f"requiring grad, forward + backward, chunk {a['chunk']}, each variant in a fresh process. "
        f"Peak = memory added on top of the inputs ({report['runs'][0]['method']}). "
        "Command: `" + report["command"] + "`",
        "",
    ]
    header = (
        "tokens | input logits MB | chunked MB | chunked+entropy MB | full MB | full+entropy MB "
        "| full / chunked | full+ent / chunked+ent"
    )
    rows = [
        [
            s["tokens"],
            f"{s['input_logits_mb']:.0f}",
            *(f"{s['peak_extra_mb'][v]:.0f}" for v in VARIANTS),
            f"{s['ratio_full_over_chunked']:.2f}",
            f"{s['ratio_full_entropy_over_chunked_entropy']:.2f}",
        ]
        for s in report["summary"]
    ]
    lines += md_table(header, rows)
    lines += [
        "",
        "Times (s, median of the fresh process's runs): "
        + "; ".join(
            f"{s['tokens']} tokens: " + ", ".join(f"{k} {v:.3f}" for k, v in s["time_s_median"].items())
            for s in report["summary"]
        ),
        "",
        f"Agreement (bf16 input, {report['agreement']['tokens']} tokens): logprobs max |diff| "
        f"{report['agreement']['logprobs_max_abs_diff']:.2e}, gradient max |diff| "
        f"{report['agreement']['grad_max_abs_diff']:.2e}.",
        "The logits' own bf16 gradient ([tokens, vocab], the same in every variant) is included in each "
        "peak; at TP > 1 the full approach would first all-gather the vocabulary (another bf16 "
        "[tokens, vocab] per rank) while the chunked path works on vocab / TP.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048], help="logit rows (one run each)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2: 151936)")
    p.add_argument("--chunk", type=int, default=1024, help="policy.logprob_chunk_size")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=0, help="timed runs per process (0: 3 on CUDA, 1 on CPU)")
    p.add_argument("--out", type=Path, default=RESULTS / "logprob_memory.json", help=".json; .md beside it")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if not args.repeats:
        args.repeats = 3 if device.type == "cuda" else 1
    if args.worker:
        (tokens,) = args.tokens
        print(json.dumps(measure(args.worker, tokens, args.vocab, args.chunk, device, args.repeats)))
        return None

    report = {
        "benchmark": "logprob path peak memory: chunked vocab-parallel vs full-vocab fp32 log_softmax",
        "command": " ".join(["python", *(sys.argv if argv is None else [__file__, *argv])]),
        "machine": machine_info("torch"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "worker"},
        "agreement": check_agreement(device, min(args.vocab, 32768), 256),
        "runs": [],
        "summary": [],
    }
    for tokens in args.tokens:
        need = estimate_full_gib(tokens, args.vocab) + 3 * tokens * args.vocab * 2 / 2**30
        available_gib = mem_available() / 2**30 or float("inf")  # 0: not reported
        if device.type == "cpu" and need > 0.8 * available_gib:
            raise SystemExit(
                f"{tokens} tokens x {args.vocab} needs ~{need:.1f} GiB for the full variant; only "
                f"{available_gib:.1f} GiB available: use fewer --tokens"
            )
        runs = {}
        for variant in VARIANTS:
            runs[variant] = run_variant(args, variant, tokens, device)
            print(
                f"[logprob_memory] {tokens} tokens {variant}: {runs[variant]['peak_extra_mb']:.0f} MB",
                flush=True,
            )
        report["runs"] += list(runs.values())
        peak = {k: r["peak_extra_mb"] for k, r in runs.items()}
        report["summary"].append(
            {
                "tokens": tokens,
                "input_logits_mb": runs["full"]["input_logits_mb"],
                "peak_extra_mb": peak,
                "ratio_full_over_chunked": peak["full"] / peak["chunked"],
                "ratio_full_entropy_over_chunked_entropy": peak["full_entropy"] / peak["chunked_entropy"],
                "time_s_median": {k: sorted(r["time_s"])[len(r["time_s"]) // 2] for k, r in runs.items()},
            }
        )
    write_results(args.out, report, markdown(report))
    for s in report["summary"]:
        print(
            f"[logprob_memory] {s['tokens']} tokens: chunked {s['peak_extra_mb']['chunked']:.0f} MB, "
            f"full {s['peak_extra_mb']['full']:.0f} MB, ratio {s['ratio_full_over_chunked']:.2f}",
            flush=True,
        )
    print(f"[logprob_memory] wrote {args.out} and {args.out.with_suffix('.md')}", flush=True)
    return report


if __name__ == "__main__":
    main()
