#!/usr/bin/env python3
"""Reward throughput: samples/s of the reward scorer's worker pool, per worker, for math-verify and for
the exact-match arithmetic reward, with N workers; and what replacing a killed worker costs.

    python benchmarks/reward_bench.py [--workers 1 2 4] [--batch 512] [--repeat 3] [--chars 1500]

Inputs (made here, deterministic): ``--batch`` DeepScaleR-shaped responses, each about ``--chars``
characters of worked solution ending in ``\\boxed{...}`` (integers, fractions, decimals, percentages,
roots, multiples of pi, an equation), against references written the way datasets write them (bare
LaTeX, decimals, ``a/b``); half of them are right. Arithmetic: ``a+b`` sums as the tiny task scores them.

What runs, on ``--repeat`` batches after one warm-up batch, each batch its own inputs (medians reported):

- ``in_process``: the reward function called in this process, one response after another: the rate of
  one core with no pool;
- ``pool_N``: ``RewardScorer.score`` (``DeadlinePool`` with N workers, deadline 60 s): the rate the
  driver gets; per worker = rate / N. CPU seconds per sample (this process's for ``in_process``, the
  workers' user + system time for the pool, in 10 ms ticks) are recorded too: on a shared machine
  they are steadier than wall time, and 1 / (CPU s per sample) is a worker's rate on a core of its own;
- ``arithmetic`` runs in process in the scorer (microseconds); through the pool it measures the pool's
  own cost per task (pipe round trip, pickling), the ceiling of any reward it runs;
- ``replace``: ``--hangs`` tasks that never end, one worker, deadline 0.2 s: (wall - hangs x 0.2) / hangs
  is the time to kill a worker, fork its replacement from the fork server and have it ready (a task
  waits for a ready worker, so the next hang's deadline starts after that).

The machine's other load is recorded per measurement (``other_cpus``: CPUs other processes kept busy).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import random
import statistics
import time

from common import RESULTS
from common.sampling import Contention, machine_info
from common.tables import md_table, write_results


def _answer(rng: random.Random, form: int) -> tuple[str, str, str]:
    """(what the model boxes when right, when wrong, the reference as datasets write it)."""
    n, p, q = rng.randint(2, 999), rng.randint(1, 97), rng.choice([2, 4, 5, 8, 3, 7, 9, 11])
    if form == 0:
        return str(n), str(n + 1), str(n)
    if form == 1:
        return f"\\dfrac{{{p}}}{{{q}}}", f"\\frac{{{q}}}{{{p + q}}}", f"\\frac{{{p}}}{{{q}}}"
    if form == 2:
        q = rng.choice([2, 4, 5, 8])
        return f"\\frac{{{p}}}{{{q}}}", f"\\frac{{{p + 1}}}{{{q}}}", repr(p / q)
    if form == 3:
        return f"{p}\\sqrt{{{q}}}", f"{q}\\sqrt{{{p}}}", f"{p}\\sqrt{{{q}}}"
    if form == 4:
        return f"{n % 100}\\%", f"{n % 100 + 5}\\%", str(n % 100)
    if form == 5:
        return f"{p}\\pi", str(p), f"{p}\\pi"
    if form == 6:
        return f"-\\frac{{{p}}}{{{q}}}", f"\\frac{{{p}}}{{{q}}}", f"-{p}/{q}"
    return f"x = {n}", f"x = {n + 1}", str(n)


def math_batch(n: int, chars: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` responses over 8 answer forms (integers, fractions vs decimals, roots, percentages, pi,
    negative fractions, equations) with random numbers, so no two batches repeat their inputs."""
    rng = random.Random(seed)
    responses, answers = [], []
    for i in range(n):
        right, wrong, reference = _answer(rng, i % 8)
        steps, text = 0, []
        while sum(map(len, text)) < chars:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            steps += 1
            text.append(
                f"Step {steps}: we have $\\frac{{{a}}}{{{b}}} + {a} = \\frac{{{a * b + a}}}{{{b}}}$, "
                f"so the next quantity is ${a} \\times {b} = {a * b}$.\n"
            )
        final = right if i % 2 == 0 else wrong
        responses.append("".join(text) + f"Therefore the answer is $\\boxed{{{final}}}$.")
        answers.append(reference)
    return responses, answers


def arithmetic_batch(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(n)]
    return [str(a + b + (i % 2)) for i, (a, b) in enumerate(pairs)], [str(a + b) for a, b in pairs]


def in_process(fn, batches: list[tuple[list[str], list[str]]]) -> dict:
    """``batches[0]`` warms up; the others are timed (wall and this process's CPU time)."""
    responses, answers = batches[0]
    [fn(r, a) for r, a in zip(responses, answers, strict=True)]
    walls, cpus, others, scores = [], [], [], []
    for responses, answers in batches[1:]:
        with Contention([]) as load:
            t0, c0 = time.perf_counter(), time.process_time()
            scores += [fn(r, a) for r, a in zip(responses, answers, strict=True)]
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        others.append(load.other_cpus)
    size, wall = len(responses), statistics.median(walls)
    return {
        "wall_s": walls,
        "samples_per_s": size / wall,
        "samples_per_s_per_worker": size / wall,
        "cpu_s_per_sample": statistics.median(cpus) / size,
        "mean_score": sum(scores) / len(scores),
        "other_cpus": statistics.median(others),
    }


def through_pool(kind: str, workers: int, batches: list[tuple[list[str], list[str]]]) -> dict:
    from megagrpo.config import load_config
    from megagrpo.rewards import RewardScorer
    from megagrpo.rewards.pool import DeadlinePool

    if kind == "arithmetic":  # the scorer runs it in process: drive the pool directly
        pool = DeadlinePool("megagrpo.rewards.arithmetic:arithmetic_reward", workers, 60.0)

        def score(r, a):
            out = pool.map(list(zip(r, a, strict=True)))
            return out.values, out.timeouts, out.errors

        close = pool.close
    else:
        overrides = [f"reward.kind={kind}", f"reward.num_workers={workers}", "reward.timeout_s=60"]
        scorer = RewardScorer(load_config(None, overrides).reward)
        pool = scorer.pool

        def score(r, a):
            out = scorer.score(r, a)
            return out.scores, out.timeouts, out.errors

        close = scorer.close
    try:
        pool.wait_ready()
        score(*batches[0])  # warm-up: first use of each worker
        walls, cpu, others, scores = [], [], [], []
        for responses, answers in batches[1:]:
            with Contention(pool.pids) as load:
                t0 = time.perf_counter()
                batch_scores, timeouts, errors = score(responses, answers)
                walls.append(time.perf_counter() - t0)
            assert (timeouts, errors) == (0, 0), (timeouts, errors)
            scores += batch_scores
            cpu.append(load.ours_cpu_s)
            others.append(load.other_cpus)
    finally:
        close()
    wall = statistics.median(walls)
    return {
        "wall_s": walls,
        "samples_per_s": len(responses) / wall,
        "samples_per_s_per_worker": len(responses) / wall / workers,
        "cpu_s_per_sample": statistics.median(cpu) / len(responses),
        "mean_score": sum(scores) / len(scores),
        "other_cpus": statistics.median(others),
    }


def replacement_cost(hangs: int, deadline_s: float = 0.2) -> dict:
    from megagrpo.rewards.pool import DeadlinePool

    pool = DeadlinePool("time:sleep", 1, deadline_s)
    try:
        pool.map([(0.0,)])  # the worker is up
        t0 = time.perf_counter()
        out = pool.map([(3600.0,)] * hangs)
        wall = time.perf_counter() - t0
        assert out.timeouts == hangs and pool.replaced == hangs, (out, pool.replaced)
        t0 = time.perf_counter()
        after = pool.map([(0.0,)])  # the last replacement starts and answers
        first_task_s = time.perf_counter() - t0
        assert after.timeouts == 0, after
    finally:
        pool.close()
    return {
        "hangs": hangs,
        "deadline_s": deadline_s,
        "wall_s": wall,
        "per_replacement_s": (wall - hangs * deadline_s) / hangs,
        "first_task_after_s": first_task_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chars", type=int, default=1500)
    parser.add_argument("--hangs", type=int, default=10)
    parser.add_argument("--output", default="reward")
    args = parser.parse_args(argv)

    from megagrpo.rewards.arithmetic import arithmetic_reward
    from megagrpo.rewards.math import math_verify_reward

    machine = machine_info("sympy") | {"math_verify": importlib.metadata.version("math-verify")}
    report = {"machine": machine, "args": vars(args), "results": {}}
    seeds = range(args.repeat + 1)  # a warm-up batch, then --repeat timed ones, each its own inputs
    batches = {
        "math_verify": [math_batch(args.batch, args.chars, seed) for seed in seeds],
        "arithmetic": [arithmetic_batch(args.batch, seed) for seed in seeds],
    }
    fns = {"math_verify": math_verify_reward, "arithmetic": arithmetic_reward}
    rows = []
    for kind, kind_batches in batches.items():
        res = report["results"][kind] = {"in_process": in_process(fns[kind], kind_batches)}
        for n in args.workers:
            res[f"pool_{n}"] = through_pool(kind, n, kind_batches)
        for name, r in res.items():
            cpu = r["cpu_s_per_sample"]
            rows.append(
                (
                    kind,
                    "in process (1 core, no pool)" if name == "in_process" else f"pool, {name[5:]} worker(s)",
                    f"{r['samples_per_s']:.0f}",
                    f"{r['samples_per_s_per_worker']:.0f}",
                    f"{cpu * 1e3:.3f}",
                    f"{r['mean_score']:.2f}",
                    f"{r['other_cpus']:.2f}",
                )
            )
        print(rows[-1], flush=True)
    report["replace"] = rep = replacement_cost(args.hangs)
    m = report["machine"]
    lines = [
        "# Reward throughput",
        "",
        f"{args.batch} responses per batch (math: ~{args.chars} characters of worked solution ending in "
        f"\\boxed{{}}, half right; arithmetic: `a+b` sums), medians of {args.repeat} batches after a "
        f"warm-up one. {m['cpus_usable']} usable CPUs ({m['cpu']}), load average at start "
        f"{m['loadavg_at_start'][0]:.1f}; math-verify {m['math_verify']}, sympy {m['sympy']}.",
        "",
        *md_table(
            "reward | how | samples/s | per worker | CPU ms/sample | mean score | other CPUs busy",
            rows,
            align="llrrrrr",
        ),
        "",
        f"A hung worker killed at its deadline and replaced (forked from the fork server): "
        f"{rep['per_replacement_s'] * 1e3:.1f} ms per replacement beyond the deadline "
        f"({rep['hangs']} hangs, deadline {rep['deadline_s']} s, {rep['wall_s']:.2f} s in all); "
        f"the last replacement answered its first task in {rep['first_task_after_s'] * 1e3:.1f} ms.",
    ]
    write_results(RESULTS / f"{args.output}.json", report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
