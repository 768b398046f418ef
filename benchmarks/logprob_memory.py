"""Peak memory of the chunked vocab-parallel logprobs against a full-vocabulary fp32 log-softmax.

    python -m benchmarks.logprob_memory [--tokens 2048] [--vocab 151936] [--device cuda] [--quick]

Input as the model hands it over: bf16 logits [tokens, vocab] requiring grad, and target ids. Each
variant runs forward + backward in a fresh process (nothing of one variant's allocations is left
for the next):

- ``chunked``: ``megagrpo.policy.logprobs.vocab_parallel_logprobs`` (``PolicyWorker.logprobs``), fp32
  for one ``--chunk`` of tokens at a time; ``chunked_entropy`` with the entropy (``train``'s);
- ``full``: ``log_softmax(logits.float()).gather(...)``; ``full_entropy`` with ``-(p logp).sum()``.

Peak = what the variant adds on top of its inputs (the logits' own gradient included): CUDA's
``max_memory_allocated`` above the allocation before, on CPU VmHWM (reset just before) above VmRSS.
``--repeat`` times each variant's call in its process. Both approaches are checked to agree on a
small case.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from .common import record
from .common.record import Measurement

VARIANTS = ("chunked", "chunked_entropy", "full", "full_entropy")
QUICK = {"tokens": [256], "vocab": 4096, "chunk": 128}


def parse_args(argv=None):
    p = record.parser("logprob_memory", __doc__, repeat=1)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048], help="logit rows (one run each)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2: 151936)")
    p.add_argument("--chunk", type=int, default=1024, help="policy.logprob_chunk_size")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    return record.parse(p, argv, QUICK)


def logprobs_of(variant: str, logits, targets, chunk: int):
    """[tokens] fp32 logprobs of ``targets`` with gradient to ``logits`` [tokens, vocab]."""
    import torch

    if variant.startswith("chunked"):
        from megagrpo.policy.logprobs import vocab_parallel_logprobs

        return vocab_parallel_logprobs(
            logits, targets, chunk_size=chunk, with_entropy=variant.endswith("entropy")
        )[0]
    logp_TV = torch.log_softmax(logits.float(), dim=-1)  # [tokens, vocab] fp32
    if variant == "full_entropy":
        with torch.no_grad():
            _entropy_T = -(logp_TV.exp() * logp_TV).sum(dim=-1)
    return logp_TV.gather(-1, targets[:, None]).squeeze(-1)


def measure_variant(args) -> dict:
    """In the child process: peak extra bytes and seconds of ``args.variant``'s forward + backward."""
    import torch

    from .common.machine import proc_status

    device, (tokens,) = torch.device(args.device), args.tokens
    gen = torch.Generator(device=device).manual_seed(0)
    # Imports, kernels and autograd's engine set up on a small input, outside the measurement.
    small = torch.zeros(16, args.vocab, device=device, dtype=torch.bfloat16, requires_grad=True)
    logprobs_of(
        args.variant, small, torch.zeros(16, dtype=torch.long, device=device), args.chunk
    ).sum().backward()
    del small
    # bf16 straight from the generator: no fp32 staging copy to set the peak before the call.
    logits = torch.randn(
        tokens, args.vocab, generator=gen, device=device, dtype=torch.bfloat16
    ).requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), generator=gen, device=device)
    grad_T = torch.randn(tokens, generator=gen, device=device)  # upstream d loss / d logprob
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        before = proc_status("self", ("VmRSS",))["VmRSS"]
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM from the current RSS
    times = []
    for _ in range(args.repeat):
        logits.grad = None
        start = time.perf_counter()
        logprobs_of(args.variant, logits, targets, args.chunk).backward(grad_T)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else proc_status("self", ("VmHWM",))["VmHWM"]
    )
    return {"peak_mb": (peak - before) / 2**20, "seconds": times}


def agreement(device: str, vocab: int, chunk: int) -> tuple[float, float]:
    """Largest logprob and gradient differences of chunked and full on one bf16 input."""
    import torch

    gen = torch.Generator(device=device).manual_seed(1)
    logits = torch.randn(3 * chunk // 2 + 7, vocab, generator=gen, device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (logits.shape[0],), generator=gen, device=device)
    grad_T = torch.randn(logits.shape[0], generator=gen, device=device)
    out = []
    for variant in ("chunked", "full"):
        x = logits.detach().clone().requires_grad_(True)
        lp = logprobs_of(variant, x, targets, chunk)
        lp.backward(grad_T)
        out.append((lp.detach(), x.grad.float()))
    return float((out[0][0] - out[1][0]).abs().max()), float((out[0][1] - out[1][1]).abs().max())


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.variant:  # the child: one variant, one size
        print(json.dumps(measure_variant(args)))
        return None
    out = []
    for tokens in args.tokens:
        peaks = {}
        for variant in VARIANTS:
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.logprob_memory",
                "--variant",
                variant,
                "--tokens",
                str(tokens),
            ]
            cmd += ["--vocab", str(args.vocab), "--chunk", str(args.chunk), "--device", args.device]
            done = subprocess.run([*cmd, "--repeat", str(args.repeat)], capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{variant} at {tokens} tokens failed:\n{done.stderr[-3000:]}")
            child = json.loads(done.stdout.strip().splitlines()[-1])
            peaks[variant] = child["peak_mb"]
            s = {"variant": variant, "tokens": tokens, "vocab": args.vocab}
            out.append(
                Measurement("peak memory above the inputs, forward + backward", [child["peak_mb"]], "MiB", s)
            )
            out.append(Measurement("forward + backward", child["seconds"], "s", s))
            print(f"[logprob_memory] {tokens} tokens {variant}: {child['peak_mb']:.0f} MiB", flush=True)
        for kind in ("", "_entropy"):
            name = f"full{kind} / chunked{kind} peak memory"
            s = {"tokens": tokens, "vocab": args.vocab}
            out.append(
                Measurement(
                    name,
                    [peaks[f"full{kind}"] / peaks[f"chunked{kind}"]],
                    "x",
                    s,
                    target="> 1",
                    headline=not kind,
                )
            )
    diffs = agreement(args.device, min(args.vocab, 32768), 256)
    for what, diff in zip(("logprobs", "gradients"), diffs, strict=True):
        out.append(
            Measurement(f"chunked vs full: largest {what} difference", [diff], "", {"dtype": "bfloat16"})
        )
    what = "peak memory of chunked vocab-parallel logprobs against a full fp32 log-softmax (fwd + bwd)"
    return record.write(args, "logprob_memory", what, out, notes=[f"{args.device}, chunk {args.chunk}"])


if __name__ == "__main__":
    main()
