#!/usr/bin/env python3
"""The GRPO step against its compute bound: what vLLM alone takes to generate the step's requests
plus what Megatron alone takes to train on the step's tokens.

    python benchmarks/bound_bench.py [--setups m25_tp1 m25_tp2] [--steps 4] [--out FILE.json]

For each setup of ``step_bench.py`` (same names, same configs):

1. **step**: a real ``megagrpo train`` run of ``--steps`` steps; the median step time over the
   steps after its family's ``step_bench.SKIP_STEPS`` (start-up allocations), from its metrics.jsonl.
2. **generation bound**: a bare ``vllm.LLM`` (``rollout_bench.RawEngine`` in a Ray actor with the
   run's engine reservation and threads; no megagrpo code on the timed path) loads the run's initial weights
   (its warm-up exported to HF) and generates exactly the requests of the measured steps: the same
   prompts in the same order, G samples each, the run's temperature, top-p/k, max new tokens, stop
   tokens and per-prompt seeds; timed inside ``llm.generate``, the first step's requests first as a warm-up.
3. **train bound**: ``train_bench.py``'s bare step (Megatron's forward+backward schedule with a
   plain cross-entropy loss on the response tokens, then the optimizer step; no megagrpo loss,
   metrics or Ray) on the same number of sequences with the run's mean sequence length (all of
   that length: padding-free, so the bound is if anything low), the run's micro-batch token budget
   and its trainer layout and threads per rank; median of ``--train-iters``.
4. **old-logprob forward**: when a batch gets several optimizer steps, the run also scores the
   later mini-batches (a forward of their tokens); the bound then adds that share of a bare
   forward, taken as a third of the bare step's time (a forward is a third of forward+backward).

ratio = step / (generation bound + train bound [+ forward]); the issue's target at ~25M: <= 1.1. The
step also pays the weight sync, the reward and the driver, which the bound leaves out on purpose:
they are the framework's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import RESULTS, TMP
from common.runs import export_warmup, run_report
from common.tables import md_table, write_results
from step_bench import SETUPS, SKIP_STEPS, family, measured_rows, summarize
from step_bench import run as run_setup

HERE = Path(__file__).resolve().parent
TARGET = 1.1


def setup_config(name: str, steps: int, extra: list[str]):
    """The run's config (as ``megagrpo train`` loads it with the setup's overrides)."""
    from megagrpo.config import load_config

    return load_config(None, ["logging.val_every=0", f"grpo.num_steps={steps}", *SETUPS[name], *extra])


def step_requests(cfg, steps: list[int]):
    """Per step: (token-id prompts, seeds) as the driver draws them (no dynamic sampling), and the
    sampling settings with the source's stop tokens."""
    from megagrpo.data.prompts import build_source
    from megagrpo.types import SamplingSettings

    if cfg.grpo.filter_zero_variance_groups:
        raise SystemExit("bound_bench: dynamic sampling draws extra prompts; use a setup without it")
    source = build_source(cfg)
    per_step = cfg.grpo.num_prompts_per_step
    requests = {}
    for step in steps:
        position = (step - 1) * per_step
        prompts = [p.token_ids for p in source.batch(position, per_step)]
        seeds = [cfg.generation.seed * 1_000_003 + position + i for i in range(per_step)]
        requests[step] = (prompts, seeds)
    g = cfg.grpo.num_generations
    settings = SamplingSettings.from_config(cfg, stop_token_ids=source.stop_token_ids, n=g)
    return requests, settings


def generation_bound(cfg, model_dir: Path, requests: dict, settings) -> dict:
    """vLLM alone on ``requests`` (``step_requests``: step 1 first, as the warm-up, then the measured
    steps): seconds inside ``llm.generate`` per measured step."""
    import ray
    from rollout_bench import RawEngine

    from megagrpo.cluster import start_ray
    from megagrpo.generation.worker import engine_cpu_threads

    start_ray(cfg.cluster, num_cpus=2)
    try:
        actor = ray.remote(num_cpus=cfg.cluster.cpus_per_worker)(RawEngine)
        threads = engine_cpu_threads(cfg, len(os.sched_getaffinity(0)))  # the run's engine's
        engine = actor.remote(
            str(model_dir), cfg.model.seq_length, cfg.generation.seed, load_format="auto", threads=threads
        )
        kwargs = {  # as GenerationWorker.generate builds its SamplingParams
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
            "stop_token_ids": [] if settings.ignore_eos else list(settings.stop_token_ids),
            "ignore_eos": settings.ignore_eos,
        }
        runs = []
        for step in requests:  # step 1: the warm-up
            prompts, seeds = requests[step]
            seconds, samples = ray.get(
                engine.generate.remote(prompts, settings.n, settings.max_tokens, seeds, **kwargs)
            )
            tokens = sum(len(ids) for ids, _ in samples)
            print(f"[bound_bench] vLLM alone, step {step}: {tokens} tokens in {seconds:.2f} s", flush=True)
            if step != 1:
                runs.append({"step": step, "seconds": seconds, "tokens": tokens, "samples": len(samples)})
    finally:
        ray.shutdown()
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "response_tokens_mean": statistics.mean(r["tokens"] / r["samples"] for r in runs),
        "runs": runs,
    }


def train_bound(cfg, name: str, seq: int, iters: int, root: Path) -> dict:
    """train_bench's bare Megatron step on the run's batch shape (its own process and ranks)."""
    out = root / f"train_{name}.json"
    tiny, policy = cfg.model.tiny, cfg.policy
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
    shape = [f"--shape={key}={getattr(tiny, key)}" for key in (*keys, "vocab_size")]
    command = [
        sys.executable,
        str(HERE / "train_bench.py"),
        *shape,
        f"--tp={cfg.parallel.tensor_model_parallel_size}",
        f"--batch={cfg.rollouts_per_step}",
        f"--seq={seq}",
        "--min-len-frac=1.0",
        f"--budget={policy.micro_batch_max_tokens}",
        "--steps",
        "bare",
        "--warmup=1",
        f"--iters={iters}",
        f"--out={out}",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"train_bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (run,) = json.loads(out.read_text())["runs"]
    return {
        "seconds": run["bare"]["step_s_median"],
        "seconds_all": run["bare"]["step_s_all"],
        "tokens": run["tokens_per_step"],
        "threads_per_rank": run["threads_per_rank"],
        "micro_batches": len(run["micro_batches"]),
        "command": " ".join(["python", *[c.replace(f"{HERE.parent}/", "") for c in command[1:]]]),
    }


def measure(
    name: str, steps: int, run_dir: Path, step: dict, train_iters: int, root: Path, extra: list[str] = ()
) -> dict:
    """The bound of setup ``name`` whose ``steps``-step run (with ``extra`` overrides) is ``run_dir``
    (``step``: its summary by ``step_bench.summarize``); scratch files under ``root``."""
    cfg = setup_config(name, steps, list(extra))
    rows = measured_rows(run_dir, name)
    measured = [r["step"] for r in rows]
    response = statistics.mean(r["response/length_mean"] for r in rows)
    requests, settings = step_requests(cfg, [1, *measured])
    prompt = statistics.mean(len(p) for step in measured for p in requests[step][0])
    seq = round(prompt + response)
    model = export_warmup(run_dir, root / "hf")  # the run's initial weights (its engines got them by sync)
    generation = generation_bound(cfg, model, requests, settings)
    train = train_bound(cfg, name, seq, train_iters, root)
    later = 1 - 1 / cfg.mini_batches_per_step  # the share of the batch scored before the first update
    forward = train["seconds"] / 3 * later
    bound = generation["seconds"] + train["seconds"] + forward
    return {
        "step_s": step["step_s"],
        "stages": {k: step[k] for k in ("generation_s", "train_s", "sync_s", "logprobs_s", "reward_s")},
        "steps_measured": measured,
        "run_response_tokens_mean": response,
        "prompt_tokens_mean": prompt,
        "sequence_tokens": seq,
        "generation_bound": generation,
        "train_bound": train,
        "forward_bound_s": forward,
        "bound_s": bound,
        "ratio": step["step_s"] / bound,
        "generation_ratio": step["generation_s"] / generation["seconds"],
        "train_ratio": step["train_s"] / (train["seconds"] + forward),
        "target": TARGET,
        "target_met": step["step_s"] / bound <= TARGET,
    }


def markdown_lines(bounds: dict[str, dict]) -> list[str]:
    """The bound table of ``{setup: measure(...)}``, with what it compares."""
    rows = []
    for name, r in bounds.items():
        g, t = r["generation_bound"], r["train_bound"]
        rows.append(
            [
                name,
                f"{r['step_s']:.2f}",
                f"{r['stages']['generation_s']:.2f} / {g['seconds']:.2f} = {r['generation_ratio']:.2f}",
                f"{r['stages']['train_s']:.2f} / {t['seconds'] + r['forward_bound_s']:.2f} "
                f"= {r['train_ratio']:.2f}",
                f"{r['stages']['sync_s']:.2f}",
                f"{r['bound_s']:.2f}",
                f"**{r['ratio']:.3f}** {'met' if r['target_met'] else 'MISSED'}",
                f"{r['run_response_tokens_mean']:.1f} / {g['response_tokens_mean']:.1f}",
            ]
        )
    return [
        "## The step against its compute bound",
        "",
        "Bound = vLLM alone generating the measured steps' requests (same prompts, seeds, sampling; "
        "median per step, timed inside `llm.generate`) + a bare Megatron forward+backward+optimizer "
        "step of the same sequences at the run's mean length and micro-batch budget (train_bench) "
        "[+ the old-logprob forward of the later mini-batches, a third of the bare step per share]. "
        f"Target at ~25M: step <= {TARGET} x bound. Seconds; stage / its bound = ratio.",
        "",
        *md_table(
            "setup | step s | generation / vLLM alone | train / bare Megatron | sync | bound s | "
            "step / bound | response tokens: run / vLLM alone",
            rows,
        ),
        "",
        "What the bound leaves out is the framework's: the weight sync and its probe, the reward, "
        "Ray calls and the driver between stages, megagrpo's loss and metrics inside the step.",
    ]


def main(argv=None) -> dict:
    """The bound alone (``step_bench.py`` reports it beside the stages, reusing its runs)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="+", default=["m25_tp1", "m25_tp2"], choices=list(SETUPS))
    p.add_argument("--steps", type=int, default=4, help=f"GRPO steps a run (untimed first: {SKIP_STEPS})")
    p.add_argument("--train-iters", type=int, default=3, help="timed bare Megatron steps")
    p.add_argument("--out", type=Path, default=RESULTS / "bound.json")
    args = p.parse_args(argv)
    for name in args.setups:
        if args.steps <= SKIP_STEPS[family(name)]:
            p.error(f"--steps {args.steps}: {name} leaves its first {SKIP_STEPS[family(name)]} untimed")
    root = TMP / "bound_bench"
    shutil.rmtree(root, ignore_errors=True)
    report = run_report("GRPO step vs its compute bound", "bound_bench.py", argv, args)
    report["setups"] = {}
    for name in args.setups:
        run_dir = run_setup(name, args.steps, root, {}, [])
        bound = measure(name, args.steps, run_dir, summarize(run_dir, name), args.train_iters, root / name)
        report["setups"][name] = bound
        text = "\n".join(
            [
                f"# {report['benchmark']}",
                "",
                f"Command: `{report['command']}`",
                "",
                *markdown_lines(report["setups"]),
            ]
        )
        write_results(args.out, report, text + "\n")  # after every setup: a later failure loses nothing
    print(text)
    return report


if __name__ == "__main__":
    main()
