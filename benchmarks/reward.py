"""Reward throughput: responses/s of math-verify and of the scorer's worker pool; a worker's replacement.

    python -m benchmarks.reward [--workers 1 2 4] [--batch 256] [--chars 1500] [--repeat 3] [--quick]

Inputs (made here, deterministic, each batch its own): ``--batch`` DeepScaleR-shaped responses of
about ``--chars`` characters of worked solution ending in ``\\boxed{...}`` (integers, fractions,
decimals, roots, percentages, multiples of pi, equations) against references written as datasets
write them; half are right. Arithmetic: ``a+b`` sums as the tiny task scores them.

One warm-up batch, then ``--repeat`` batches of each way, interleaved:

- ``in process``: the reward function called here, one response after the other (one core, no pool);
- ``pool``: ``RewardScorer.score`` (``DeadlinePool`` of N workers, deadline 60 s): the driver's rate.
  CPU ms per response (this process's, or the workers') is the steadier figure on a shared machine:
  1000 / it is a worker's rate on a core of its own;
- ``arithmetic`` through the pool measures the pool's own cost per task (pipe round trip, pickling),
  the ceiling of any reward it runs;
- replacement: ``--hangs`` tasks that never end, one worker, deadline 0.2 s: (wall - hangs x 0.2) /
  hangs is the time to kill a worker and have its replacement ready.
"""

from __future__ import annotations

import random

from .common import record
from .common.record import Measurement
from .common.timing import interleave, other_load

QUICK = {"workers": [1], "batch": 32, "hangs": 1}


def parse_args(argv=None):
    p = record.parser("reward", __doc__)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="pool sizes")
    p.add_argument("--batch", type=int, default=256, help="responses per batch")
    p.add_argument("--chars", type=int, default=1500, help="characters per response")
    p.add_argument("--hangs", type=int, default=10, help="hung tasks for the replacement time")
    return record.parse(p, argv, QUICK)


def _answer(rng: random.Random, form: int) -> tuple[str, str, str]:
    """(what the model boxes when right, when wrong, the reference as datasets write it)."""
    n, p, q = rng.randint(2, 999), rng.randint(1, 97), rng.choice([2, 4, 5, 8, 3, 7, 9, 11])
    forms = [
        (str(n), str(n + 1), str(n)),
        (f"\\dfrac{{{p}}}{{{q}}}", f"\\frac{{{q}}}{{{p + q}}}", f"\\frac{{{p}}}{{{q}}}"),
        (f"\\frac{{{p}}}{{{q % 4 * 2 or 4}}}", f"\\frac{{{p + 1}}}{{4}}", repr(p / (q % 4 * 2 or 4))),
        (f"{p}\\sqrt{{{q}}}", f"{q}\\sqrt{{{p}}}", f"{p}\\sqrt{{{q}}}"),
        (f"{n % 100}\\%", f"{n % 100 + 5}\\%", str(n % 100)),
        (f"{p}\\pi", str(p), f"{p}\\pi"),
        (f"-\\frac{{{p}}}{{{q}}}", f"\\frac{{{p}}}{{{q}}}", f"-{p}/{q}"),
        (f"x = {n}", f"x = {n + 1}", str(n)),
    ]
    return forms[form]


def math_batch(n: int, chars: int, seed: int) -> tuple[list[str], list[str]]:
    """``n`` responses over the 8 answer forms, random numbers (no two batches repeat their inputs)."""
    rng = random.Random(seed)
    responses, answers = [], []
    for i in range(n):
        right, wrong, reference = _answer(rng, i % 8)
        text = []
        while sum(map(len, text)) < chars:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            text.append(
                f"Step {len(text) + 1}: we have $\\frac{{{a}}}{{{b}}} + {a} = \\frac{{{a * b + a}}}{{{b}}}$, "
                f"so the next quantity is ${a} \\times {b} = {a * b}$.\n"
            )
        responses.append(
            "".join(text) + f"Therefore the answer is $\\boxed{{{right if i % 2 == 0 else wrong}}}$."
        )
        answers.append(reference)
    return responses, answers


def arithmetic_batch(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(n)]
    return [str(a + b + (i % 2)) for i, (a, b) in enumerate(pairs)], [str(a + b) for a, b in pairs]


def scorers(kind: str, workers: list[int]):
    """{way: (score(responses, answers), pids whose CPU time counts)}, and their closers."""
    from megagrpo.config import load_config
    from megagrpo.rewards import RewardScorer
    from megagrpo.rewards.arithmetic import arithmetic_reward
    from megagrpo.rewards.math import math_verify_reward
    from megagrpo.rewards.pool import DeadlinePool

    fn = {"math_verify": math_verify_reward, "arithmetic": arithmetic_reward}[kind]
    ways = {"in process": (lambda r, a: [fn(x, y) for x, y in zip(r, a, strict=True)], None)}
    closers = []
    for n in workers:
        if kind == "arithmetic":  # the scorer runs it in process: drive the pool directly
            pool = DeadlinePool("megagrpo.rewards.arithmetic:arithmetic_reward", n, 60.0)
            score = lambda r, a, pool=pool: pool.map(list(zip(r, a, strict=True))).values
            closers.append(pool.close)
        else:
            overrides = [f"reward.kind={kind}", f"reward.num_workers={n}", "reward.timeout_s=60"]
            scorer = RewardScorer(load_config(None, overrides).reward)
            pool, score = scorer.pool, lambda r, a, s=scorer: s.score(r, a).scores
            closers.append(scorer.close)
        pool.wait_ready()
        ways[f"pool of {n}"] = (score, pool.pids)
    return ways, closers


def replacement_s(hangs: int, deadline_s: float = 0.2) -> float:
    """Seconds beyond the deadline to kill a hung worker and have its replacement ready."""
    import time

    from megagrpo.rewards.pool import DeadlinePool

    pool = DeadlinePool("time:sleep", 1, deadline_s)
    try:
        pool.map([(0.0,)])  # the worker is up
        start = time.perf_counter()
        out = pool.map([(3600.0,)] * hangs)
        wall = time.perf_counter() - start
        if out.timeouts != hangs or pool.replaced != hangs:
            raise RuntimeError(f"{hangs} hangs: {out.timeouts} timeouts, {pool.replaced} replaced")
        pool.map([(0.0,)])  # the last replacement answers
    finally:
        pool.close()
    return (wall - hangs * deadline_s) / hangs


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = []
    for kind in ("math_verify", "arithmetic"):
        make = (lambda s: math_batch(args.batch, args.chars, s)) if kind == "math_verify" else None
        batches = [make(s) if make else arithmetic_batch(args.batch, s) for s in range(args.repeat + 1)]
        ways, closers = scorers(kind, args.workers)
        try:
            for score, _ in ways.values():
                score(*batches[0])  # warm-up: imports, first use of each worker
            feeds = {way: iter(batches[1:]) for way in ways}  # every way scores the same batches
            steps = {w: (lambda f=score, b=feeds[w]: f(*next(b))) for w, (score, _) in ways.items()}
            times = interleave(steps, args.repeat, pids={w: p for w, (_, p) in ways.items() if p})
        finally:
            for close in closers:
                close()
        for way, runs in times.items():
            s, top = {"reward": kind, "way": way}, kind == "math_verify" and way == "in process"
            out.append(Measurement("responses per second", [args.batch / t.seconds for t in runs], "1/s", s))
            cpu_ms = [1e3 * t.cpu_s / args.batch for t in runs]
            out.append(Measurement("CPU ms per response", cpu_ms, "ms", s, headline=top))
        out.append(other_load(*times.values(), reward=kind))
    replaced = [replacement_s(args.hangs)]
    out.append(
        Measurement("hung worker replaced and ready, beyond its deadline", replaced, "s", headline=True)
    )
    what = "reward responses/s in process and through the scorer's worker pool; a hung worker's replacement"
    return record.write(args, "reward", what, out, packages=("sympy",))


if __name__ == "__main__":
    main()
