#!/usr/bin/env python3
"""Rollout throughput: ``GenerationWorker.generate`` through its Ray actor against raw ``vllm.LLM``.

    .venv/bin/python benchmarks/rollout_bench.py [--prompts 64] [--n 8] [--new-tokens 64] [--prompt-len 16]
                                                 [--layers 4] [--hidden 256] [--vocab 8192] [--repeat 5]
                                                 [--output rollout]

One random Qwen2-shaped fp32 model (made by transformers, cached under ``benchmarks/results/tmp/``;
no ``generation_config.json`` and no EOS token, so every sample runs to ``--new-tokens``), two
engines started once each, as Ray actors with the same CPU reservation:

- ``ours``: ``megagrpo.cluster.launch_engines`` (the production ``GenerationWorker`` actor), called
  as the GRPO driver calls it: ``generate(prompts, SamplingSettings(n, max_tokens, temperature 1),
  seeds)`` with one seed per prompt; timed at the controller around the Ray call, so the actor
  round trip and the conversion to ``Completion`` records are included.
- ``raw``: a bare actor holding ``vllm.LLM`` built with the same engine options (dtype,
  max_model_len, eager, seed, no tokenizer, 1 GiB KV cache, in-process engine core, intra-op
  threads) and vLLM's defaults otherwise; ``llm.generate`` of the same token-id prompts with equivalent
  ``SamplingParams`` (n, max_tokens, temperature 1, the same per-prompt seeds, logprobs=0,
  detokenize=False), timed inside the actor (pure vLLM) and at the controller (with a Ray return of
  the token ids and logprobs). It uses ``load_format="dummy"`` like our engine (whose weights
  arrive by weight sync), so both hold identical weights and must sample identical tokens: the
  benchmark checks that, which proves the two requests are equivalent.
- ``ours`` is also timed inside: a timer is put around the live actor's ``llm.generate`` (through
  Ray's ``__ray_call__``), so each run gives vLLM's share of our call, a ratio contention cannot
  tilt because both figures come from the same run.
- ``raw_unseeded``: the raw engine without per-request seeds (vLLM then samples the whole batch
  with one generator instead of one ``exponential_`` call per request per step): what the
  per-prompt seeds of the driver cost.

Prompt length: at most 16 tokens by default, so that a full batch of vLLM CPU's 256 sequences
(``max_num_seqs``) fits its 4096-token step budget (``max_num_batched_tokens``) and no prompt is
prefilled in pieces. With seeded requests, vLLM 0.32 on CPU fails when it does split one
(``RuntimeError: CPU Generator does not use offset``, from ``gpu_model_runner._bookkeeping_sync``
rewinding the request's generator, which CPU generators do not support); ``--prompt-len 32``
reproduces it, with ``vllm.LLM`` alone as well as through ``GenerationWorker``.

Runs alternate (ABC, then CBA) so drift on the shared machine hits all alike; medians are reported;
tokens/s counts the generated tokens actually returned. Target of the issue: ours / raw >= 0.95.
Every run records the CPUs other processes kept busy meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from common import RESULTS, TMP
from common.configs import cpu_engine_overrides, make_config
from common.models import cached_model, save_random_model
from common.sampling import machine_info, timed_call
from common.tables import md_table, read_results, results_json, write_results

# ------------------------------------------------------------------------------------ the model


def source_model(args) -> Path:
    """A random fp32 Qwen2 checkpoint without EOS (transformers writes it; reused while unchanged)."""
    shape = {
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_attention_heads": args.hidden // 64,  # head size 64: vLLM's CPU attention needs >= 32
        "num_key_value_heads": max(1, args.hidden // 128),
        "num_hidden_layers": args.layers,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq_length,
    }

    def write(out: Path) -> None:
        from transformers import Qwen2Config

        config = Qwen2Config(
            **shape, rope_theta=1e6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None
        )
        save_random_model(out, config)
        # vLLM would add a generation config's EOS to every request's stop tokens.
        (out / "generation_config.json").unlink(missing_ok=True)

    return cached_model(TMP / f"rollout-qwen2-L{args.layers}-h{args.hidden}-v{args.vocab}", shape, write)


def bench_config(model_dir: Path, args):
    return make_config(
        {
            **cpu_engine_overrides(model_dir, seq_length=args.seq_length),
            "generation.max_new_tokens": args.new_tokens,
            "generation.num_engines": 1,
            "generation.temperature": 1.0,
        }
    )


def make_prompts(args) -> tuple[list[list[int]], list[int]]:
    """Token-id prompts of random lengths in [prompt_len / 2, prompt_len], and one seed per prompt."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(args.prompts):
        length = int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=gen))
        prompts.append(torch.randint(0, args.vocab, (length,), generator=gen).tolist())
    # As the GRPO driver derives them: a base plus the prompt's position.
    seeds = [1_000_003 + i for i in range(args.prompts)]
    return prompts, seeds


# ------------------------------------------------------------------------------------ raw vLLM


class RawEngine:
    """``vllm.LLM`` and nothing else, in a Ray actor (no megagrpo code on the timed path)."""

    def __init__(
        self,
        model_dir: str,
        seq_length: int,
        seed: int,
        load_format: str = "dummy",
        threads: int | None = None,
    ):
        # The environment GenerationWorker gives its engine: the engine core in this process (an
        # actor owns its engine), a 1 GiB CPU KV cache, vLLM logging at ERROR, and its intra-op
        # threads (``threads``: megagrpo.generation.worker.engine_cpu_threads of the run's config).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        if threads is not None:
            import torch

            torch.set_num_threads(threads)  # before vLLM starts, as GenerationWorker does
        from vllm import LLM

        self.llm = LLM(
            model=model_dir,
            dtype="float32",
            max_model_len=seq_length,
            enforce_eager=True,
            seed=seed,
            skip_tokenizer_init=True,
            load_format=load_format,
        )

    def pid(self) -> int:
        return os.getpid()

    def generate(
        self, prompts: list[list[int]], n: int, max_tokens: int, seeds: list[int] | None, **sampling
    ):
        """(seconds inside llm.generate, token ids and logprobs per sample, in prompt order);
        ``sampling``: more ``SamplingParams`` (temperature 1 unless given)."""
        from vllm import SamplingParams

        def params(seed):
            return SamplingParams(
                n=n,
                max_tokens=max_tokens,
                seed=seed,
                logprobs=0,
                detokenize=False,
                **{"temperature": 1.0, **sampling},
            )

        per_prompt = [params(s) for s in seeds] if seeds is not None else params(None)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], per_prompt, use_tqdm=False)
        seconds = time.perf_counter() - start
        samples = [
            (list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)])
            for out in outputs
            for c in out.outputs
        ]
        return seconds, samples


# ------------------------------------------------------------------------------------ measuring


def timed(fn, pids: list[int]) -> dict:
    """Wall seconds of ``fn()`` and the CPUs used by ``pids`` and by everything else meanwhile."""
    value, wall, c = timed_call(fn, pids)
    return {
        "seconds": wall,
        "value": value,
        "ours_cpus": c.ours_cpu_s / wall,
        "other_cpus": max(0.0, c.other_cpu_s / wall),
    }


def measure(args, report: dict) -> None:
    import ray

    from megagrpo.cluster import launch_engines, start_ray, wait_for_engines
    from megagrpo.generation.worker import engine_cpu_threads
    from megagrpo.types import SamplingSettings

    model_dir = source_model(args)
    cfg = bench_config(model_dir, args)
    prompts, seeds = make_prompts(args)
    report["workload"] = {
        "model_dir": str(model_dir),
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "n": args.n,
        "max_tokens": args.new_tokens,
        "requested_tokens": len(prompts) * args.n * args.new_tokens,
    }
    start_ray(cfg.cluster, num_cpus=2)
    # Both engines start at once (their start-ups overlap on the machine's cores).
    t0 = time.perf_counter()
    (ours,) = launch_engines(cfg, str(model_dir))
    raw_cls = ray.remote(num_cpus=cfg.cluster.cpus_per_worker)(RawEngine)
    threads = engine_cpu_threads(cfg, len(os.sched_getaffinity(0)))
    raw = raw_cls.remote(str(model_dir), args.seq_length, cfg.generation.seed, threads=threads)
    wait_for_engines([ours, raw])
    report["startup_s"] = {"both": time.perf_counter() - t0}
    pids = [ray.get(raw.pid.remote())]
    pids.append(ray.get(ours.__ray_call__.remote(lambda self: os.getpid())))
    settings = SamplingSettings(max_tokens=args.new_tokens, temperature=1.0, n=args.n)

    # A timer around the production actor's own llm.generate (set on the live actor, which is
    # otherwise untouched): its share of the Ray call is what megagrpo adds on top of vLLM, with
    # both figures taken in the same run, so contention cannot tilt the comparison.
    ray.get(ours.__ray_call__.remote(_time_llm_generate))

    def run_ours():
        comps = ray.get(ours.generate.remote(prompts, settings, seeds))
        return {"samples": [(c.token_ids, c.logprobs) for c in comps], "inside_s": None}

    def run_raw(seeded: bool):
        inside, samples = ray.get(
            raw.generate.remote(prompts, args.n, args.new_tokens, seeds if seeded else None)
        )
        return {"samples": samples, "inside_s": inside}

    kinds = {"ours": run_ours, "raw": lambda: run_raw(True), "raw_unseeded": lambda: run_raw(False)}
    if not args.unseeded:
        del kinds["raw_unseeded"]
    # Warm-up: one small request on each engine (first-call allocations, lazy imports).
    warm_prompts, warm_settings = prompts[:4], SamplingSettings(max_tokens=8, temperature=1.0, n=2)
    ray.get(ours.generate.remote(warm_prompts, warm_settings, seeds[:4]))
    ray.get(raw.generate.remote(warm_prompts, 2, 8, seeds[:4]))
    order = list(kinds)
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    first_samples = {}
    for r in range(args.repeat):
        for kind in order if r % 2 == 0 else order[::-1]:
            res = timed(kinds[kind], pids)
            if kind == "ours":
                res["value"]["inside_s"] = ray.get(ours.__ray_call__.remote(_last_generate_s))
            samples = res["value"]["samples"]
            first_samples.setdefault(kind, samples)
            tokens = sum(len(ids) for ids, _ in samples)
            run = {
                "seconds": res["seconds"],
                "inside_s": res["value"]["inside_s"],
                "tokens": tokens,
                "tokens_per_s": tokens / res["seconds"],
                "engine_cpu_s": res["ours_cpus"] * res["seconds"],
                "ours_cpus": res["ours_cpus"],
                "other_cpus": res["other_cpus"],
            }
            run["tokens_per_cpu_s"] = tokens / run["engine_cpu_s"] if run["engine_cpu_s"] else None
            if run["inside_s"] is not None:
                run["tokens_per_s_inside"] = tokens / run["inside_s"]
            runs[kind].append(run)
            print(
                f"repeat {r} {kind}: {tokens} tokens in {res['seconds']:.2f}s "
                f"= {run['tokens_per_s']:.0f} tok/s"
                + (f" (inside {run['inside_s']:.2f}s)" if run["inside_s"] is not None else "")
                + f", other CPUs busy {res['other_cpus']:.2f}",
                flush=True,
            )
    report["runs"] = runs
    report["same_tokens"] = _compare(first_samples["ours"], first_samples["raw"])
    report["summary"] = summarize(runs)
    ray.kill(raw)
    ray.shutdown()


def _time_llm_generate(worker) -> None:
    """On a GenerationWorker: record the seconds of each ``worker.llm.generate`` call."""
    plain = worker.llm.generate

    def generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            worker.bench_generate_s = time.perf_counter() - start

    worker.llm.generate = generate


def _last_generate_s(worker) -> float:
    return worker.bench_generate_s


def _compare(a: list, b: list) -> dict:
    """How far two runs' samples agree: token ids exactly, logprobs by their largest difference."""
    ids_equal = [x[0] == y[0] for x, y in zip(a, b, strict=True)]
    lp_max = max(
        (abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x[1], y[1], strict=False)), default=0.0
    )
    return {
        "samples": len(ids_equal),
        "ids_equal_fraction": sum(ids_equal) / len(ids_equal),
        "max_abs_logprob_diff": lp_max,
    }


def summarize(runs: dict) -> dict:
    out = {}
    for kind, rs in runs.items():
        out[kind] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "seconds": statistics.median(r["seconds"] for r in rs),
            "tokens": statistics.median(r["tokens"] for r in rs),
            "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] or 0.0 for r in rs),
            "other_cpus_median": statistics.median(r["other_cpus"] for r in rs),
            "other_cpus_max": max(r["other_cpus"] for r in rs),
        }
        if rs[0].get("inside_s") is not None:
            out[kind]["tokens_per_s_inside"] = statistics.median(r["tokens_per_s_inside"] for r in rs)
    ours, raw = out["ours"]["tokens_per_s"], out["raw"]
    out["ratio_vs_raw_inside"] = ours / raw["tokens_per_s_inside"]
    out["ratio_vs_raw_through_ray"] = ours / raw["tokens_per_s"]
    # Work rather than time: less sensitive to how much CPU the shared machine left us.
    out["ratio_tokens_per_cpu_s"] = out["ours"]["tokens_per_cpu_s"] / raw["tokens_per_cpu_s"]
    if "raw_unseeded" in out:
        out["seeded_over_unseeded_raw_inside"] = (
            raw["tokens_per_s_inside"] / out["raw_unseeded"]["tokens_per_s_inside"]
        )
    # Paired ratios (same round of the ABC/CBA cycle), a check on drift between kinds.
    pairs = [
        o["tokens_per_s"] / r["tokens_per_s_inside"] for o, r in zip(runs["ours"], runs["raw"], strict=True)
    ]
    out["paired_ratio_median"] = statistics.median(pairs)
    out["paired_ratios"] = pairs
    # The headline: ours and raw ran back to back in each round, so drift in what the shared
    # machine leaves us cancels in their ratio far more than in a ratio of separate medians.
    out["meets_target"] = out["paired_ratio_median"] >= 0.95
    # Nested in the same run: vLLM's share of our actor call (1.0 = megagrpo adds nothing).
    if runs["ours"][0].get("inside_s") is not None:
        out["ours_vllm_share"] = statistics.median(r["inside_s"] / r["seconds"] for r in runs["ours"])
        out["ours_overhead_s"] = statistics.median(r["seconds"] - r["inside_s"] for r in runs["ours"])
        engine_pairs = [
            o["tokens_per_s_inside"] / r["tokens_per_s_inside"]
            for o, r in zip(runs["ours"], runs["raw"], strict=True)
        ]
        out["engine_paired_ratio_median"] = statistics.median(engine_pairs)
    return out


# ------------------------------------------------------------------------------------- reporting


def markdown(report: dict) -> str:
    m, w, s, a = report["machine"], report["workload"], report["summary"], report["args"]
    ok = "ok" if s["meets_target"] else "MISS"
    same = report["same_tokens"]
    same_text = (
        f"{100 * same['ids_equal_fraction']:.1f}% of {same['samples']} samples have identical token ids; "
        f"largest logprob difference {same['max_abs_logprob_diff']:.2e}"
    )
    lines = [
        "# Rollout: `GenerationWorker.generate` (Ray actor) vs raw `vllm.LLM.generate`",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model: random Qwen2-shaped fp32, {a['layers']} layers, hidden {a['hidden']}, "
        f"vocabulary {a['vocab']}. Workload: {w['prompts']} token-id prompts "
        f"({w['prompt_tokens']} prompt tokens) x {w['n']} samples x "
        f"{w['max_tokens']} new tokens, temperature 1, one seed per prompt. Machine: {m['cpu']}, "
        f"{m['cpus_usable']} CPUs, load average at start {m['loadavg_at_start'][0]:.1f}; vLLM {m['vllm']}, "
        f"torch {m['torch']}; {m['date']}. Medians of {a['repeat']} runs per kind, alternating.",
        "",
    ]
    rows = []
    labels = {
        "ours": "ours: GenerationWorker actor",
        "raw": "raw vllm.LLM, same seeds",
        "raw_unseeded": "raw vllm.LLM, no seeds",
    }
    for kind, label in labels.items():
        if kind not in s:
            continue
        k = s[kind]
        rows.append(
            [
                label,
                "controller (Ray call)",
                f"{k['tokens']:.0f}",
                f"{k['seconds']:.2f}",
                f"{k['tokens_per_s']:.0f}",
                f"{k['tokens_per_cpu_s']:.0f}",
                f"{k['other_cpus_median']:.2f}, {k['other_cpus_max']:.2f}",
            ]
        )
        if "tokens_per_s_inside" in k:
            inside_s = k["tokens"] / k["tokens_per_s_inside"]
            rows.append(
                [
                    label,
                    "inside the actor (llm.generate)",
                    f"{k['tokens']:.0f}",
                    f"{inside_s:.2f}",
                    f"{k['tokens_per_s_inside']:.0f}",
                    None,
                    None,
                ]
            )
    header = (
        "engine | timed | tokens | seconds | tokens/s | tokens per engine CPU-s "
        "| other CPUs busy (median, max)"
    )
    lines += md_table(header, rows, "llrrrrr")
    pairs = ", ".join(f"{x:.2f}" for x in s["paired_ratios"])
    lines += [
        "",
        f"ours / raw tokens/s (raw timed inside its actor), median of the per-round ratios: "
        f"**{s['paired_ratio_median']:.3f}** {ok} (target >= 0.95; rounds: {pairs}). Ratio of the "
        f"medians: {s['ratio_vs_raw_inside']:.3f} (raw inside its actor), "
        f"{s['ratio_vs_raw_through_ray']:.3f} (both through Ray); tokens per engine CPU-second, ours / raw: "
        f"{s['ratio_tokens_per_cpu_s']:.3f}.",
    ]
    if "ours_vllm_share" in s:
        lines.append(
            f"Inside our actor's call (same run, so contention cannot tilt it): vLLM's `llm.generate` takes "
            f"{100 * s['ours_vllm_share']:.1f}% of the controller-timed call; megagrpo + Ray add "
            f"{s['ours_overhead_s']:.3f} s per call (median). Engine against engine (ours' llm.generate "
            f"vs raw's, per round): {s['engine_paired_ratio_median']:.3f}."
        )
    if "seeded_over_unseeded_raw_inside" in s:
        lines.append(
            f"Per-request seeds, raw engine: {s['seeded_over_unseeded_raw_inside']:.3f} x the unseeded "
            "throughput."
        )
    lines += [
        f"Equivalence (first run of ours vs raw, same seeds and dummy weights): {same_text}.",
        "",
        "'other CPUs busy': CPUs used by processes other than the two engines during the run (the",
        "machine is shared). 'engine CPU-s': CPU seconds both engine processes used during the run",
        "(the idle one adds next to nothing): the work done, which contention changes less than time.",
        "Both engines: CPU backend, eager, 1 GiB KV cache, engine core in-process.",
    ]
    if report.get("findings"):
        lines += ["", "## Findings", "", *report["findings"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=16,
        help="longest prompt (shortest is half); see the docstring before raising it",
    )
    parser.add_argument("--seq-length", type=int, default=256, help="max_model_len of both engines")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="multiple of 64 (head size 64)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--no-unseeded", dest="unseeded", action="store_false", help="skip the unseeded raw runs"
    )
    parser.add_argument("--output", default="rollout", help="results/<output>.json and .md")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite results/<output>.md from results/<output>.json"
    )
    args = parser.parse_args(argv)
    if args.hidden % 64 or args.prompt_len + args.new_tokens > args.seq_length:
        parser.error("--hidden must be a multiple of 64 and prompt-len + new-tokens <= seq-length")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    path = results_json(args.output)
    if args.render:
        report = read_results(path)
        report["summary"] = summarize(report["runs"])
        path.with_suffix(".md").write_text(markdown(report))
        return report
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/rollout_bench.py", *(argv or sys.argv[1:])]),
        "args": vars(args),
        "machine": machine_info("torch", "vllm"),
    }
    measure(args, report)
    write_results(path, report, markdown(report))
    print(f"wrote {RESULTS / args.output}.json and .md", flush=True)
    return report


if __name__ == "__main__":
    main()
