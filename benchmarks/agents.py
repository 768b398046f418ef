"""Multi-turn episodes: the asynchronous schedule against the turn-synchronous one, on the same episodes.

    python -m benchmarks.agents [--tasks 32] [--n 4] [--max-turns 10] [--latency-ms 100] [--repeat 3]

One vLLM CPU engine in this process (a random fp32 Qwen2-shaped model over the tiny model's 18-token
character vocabulary, padded to 32 ids, so about one token in 32 ends a turn: turn lengths vary as real
ones do) and ``megagrpo.envs.episodes.EpisodeRunner`` with its environment worker pool, run twice per
round on the same tasks and seeds (``env.schedule``):

- ``async``: each episode's next turn goes to the engine as soon as its observation is ready;
- ``turns``: every episode's turn t is sampled, then every environment steps, then turn t + 1.

The environment (``LatencyEnv``) gives each task a number of turns with a long tail (geometric: another
turn with probability 0.7, so half the episodes end within 2 turns and some run to ``--max-turns``) and
answers each turn after a delay with a long tail (log-normal, median ``--latency-ms``, sigma 1: a tool
call that runs code). Both schedules must produce identical episodes (the
same token ids: checked). Measured per round: wall time of the call, the engine's busy fraction (time
inside the engine's steps / wall time), the requests each engine step decoded on average (how full the
continuous batch was) and tokens sampled per second. Target: turns / async wall time
>= 1.3 in every round.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from megagrpo.envs.base import Environment, Step

from .common import TMP, importable_by_workers, record
from .common.configs import cpu_engine_overrides, make_config
from .common.models import cached_model, save_random_model
from .common.record import Measurement, ratio
from .common.timing import interleave, other_load

QUICK = {"tasks": 4, "n": 2, "max_turns": 4, "latency_ms": 20.0, "layers": 1, "hidden": 64}
VOCAB = 32


class LatencyEnv(Environment):
    """``task["turns"]`` turns; each step takes ``task["delays"][t]`` seconds, then answers "=" (the next
    turn's cue) or ends the episode with reward 1."""

    def __init__(self):
        self.turn = 0
        self.task: dict = {}

    def reset(self, task: dict) -> list[dict]:
        self.task = task
        return [{"role": "user", "content": f"{task['id']}="}]

    def step(self, turn: str) -> Step:
        time.sleep(self.task["delays"][self.turn])
        self.turn += 1
        if self.turn >= self.task["turns"]:
            return Step(reward=1.0, done=True)
        return Step(messages=[{"role": "user", "content": "="}])


def make_tasks(count: int, max_turns: int, latency_ms: float, seed: int = 0) -> list[dict]:
    """Turns per episode: geometric (another turn with probability 0.7) capped at ``max_turns``; delays
    log-normal (sigma 1)."""
    rng = random.Random(seed)
    tasks = []
    for i in range(count):
        turns = 1
        while turns < max_turns and rng.random() < 0.7:
            turns += 1
        delays = [latency_ms / 1000 * math.exp(rng.gauss(0.0, 1.0)) for _ in range(max_turns)]
        tasks.append({"id": i, "turns": turns, "delays": delays})
    return tasks


def parse_args(argv=None):
    p = record.parser("agents", __doc__)
    p.add_argument("--tasks", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="episodes per task")
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=96, help="tokens per turn at most")
    p.add_argument("--latency-ms", type=float, default=100.0, help="median environment step time")
    p.add_argument("--workers", type=int, default=8, help="environment worker processes")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128, help="a multiple of 64 (head size 64)")
    return record.parse(p, argv, QUICK)


def source_model(args) -> Path:
    """A random fp32 Qwen2 checkpoint over the character vocabulary, with its tokenizer and chat template."""
    shape = {
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 128),
        "num_hidden_layers": args.layers,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
    }

    def write(out: Path) -> None:
        from transformers import Qwen2Config

        from megagrpo.data.tokenizer import char_tokenizer

        config = Qwen2Config(**shape, rope_theta=1e6, tie_word_embeddings=True)
        save_random_model(out, config)
        (out / "generation_config.json").unlink(missing_ok=True)
        char_tokenizer().save_pretrained(str(out))

    return cached_model(TMP / f"agents-qwen2-L{args.layers}-h{args.hidden}", shape, write)


class _TimedEngine:
    """A TurnEngine that adds up the time spent in the engine's steps and the requests each step had."""

    def __init__(self, engine):
        self.engine = engine
        self.reset()

    def reset(self):
        self.busy_s, self.steps, self.running, self.in_steps = 0.0, 0, 0, 0

    def add(self, *a):
        self.engine.add(*a)
        self.running += 1

    def busy(self):
        return self.engine.busy()

    def step(self):
        start = time.perf_counter()
        self.steps += 1
        self.in_steps += self.running
        try:
            turns = self.engine.step()
            self.running -= len(turns)
            return turns
        finally:
            self.busy_s += time.perf_counter() - start


def main(argv=None) -> dict:
    import dataclasses

    from megagrpo.envs.episodes import EpisodeRunner
    from megagrpo.generation.vllm import VLLMEngine, vllm_turn_engine
    from megagrpo.types import SamplingSettings

    args = parse_args(argv)
    model = source_model(args)
    cfg = make_config(
        {
            **cpu_engine_overrides(model, seq_length=2048),
            "policy.micro_batch_max_tokens": 2048,
            "generation.max_num_seqs": max(args.tasks * args.n, 8),
            "env.environment": "benchmarks.agents:LatencyEnv",
            "env.max_turns": args.max_turns,
            "env.max_new_tokens": args.new_tokens,
            "env.max_episode_tokens": 2000,
            "env.num_workers": args.workers,
        }
    )
    importable_by_workers()
    worker = VLLMEngine(cfg, str(model))
    renderer, pool = worker.episode_parts()  # the engine actor's own renderer and environment pool
    pool.wait_ready()
    tasks = make_tasks(args.tasks, args.max_turns, args.latency_ms)
    seeds = [1_000_003 + i for i in range(args.tasks)]
    settings = SamplingSettings(max_tokens=args.new_tokens, temperature=1.0, n=args.n)

    def runner(schedule: str):
        env = dataclasses.replace(cfg.env, schedule=schedule)
        engine = _TimedEngine(vllm_turn_engine(worker.llm, settings, renderer.stop_token_ids))

        def run():
            start = time.perf_counter()
            comps = EpisodeRunner(engine, renderer, pool, env, max_context=2048).run(tasks, args.n, seeds)
            wall = time.perf_counter() - start
            busy, batch = engine.busy_s / wall, engine.in_steps / max(1, engine.steps)
            engine.reset()
            return busy, batch, comps

        return run

    try:
        runner("async")()  # warm-up: first-call allocations
        times = interleave({"async": runner("async"), "turns": runner("turns")}, args.repeat)
    finally:
        worker.close_episodes()
    what = "multi-turn episodes, asynchronous vs turn-synchronous schedule, on the same tasks and seeds"
    return record.write(args, "agents", what, _measurements(args, times), packages=("torch", "vllm"))


def _measurements(args, times: dict) -> list[Measurement]:
    """Per schedule: wall time, engine busy fraction, requests per engine step, sampled tokens/s; the
    ratio of the two schedules' wall times; whether their episodes were identical."""
    same = all(
        [c.token_ids for c in a.value[2]] == [c.token_ids for c in t.value[2]]
        for a, t in zip(times["async"], times["turns"], strict=True)
    )
    comps = times["async"][0].value[2]
    sampled = sum(sum(c.loss_mask) for c in comps)
    turns = sum(c.stats["turns"] for c in comps)
    s = {
        "episodes": len(comps),
        "max_turns": args.max_turns,
        "turns_mean": round(turns / len(comps), 2),
        "latency_ms": args.latency_ms,
        "tokens_per_turn_mean": round(sampled / turns, 1),
    }
    out = []
    for name, runs in times.items():
        at = {**s, "schedule": name}
        out += [
            Measurement("wall time", [t.seconds for t in runs], "s", at),
            Measurement("engine busy", [t.value[0] for t in runs], "fraction", at),
            Measurement("requests per engine step", [t.value[1] for t in runs], "", at),
            Measurement("sampled tokens/s", [sampled / t.seconds for t in runs], "tokens/s", at),
        ]
    return [
        *out,
        ratio(
            "turn-synchronous / async wall time",
            [t.seconds for t in times["turns"]],
            [t.seconds for t in times["async"]],
            settings=s,
            target=">= 1.3",
            headline=True,
        ),
        Measurement("identical episodes, async vs turns", [float(same)], "fraction", s, target=">= 1"),
        other_load(*times.values()),
    ]


if __name__ == "__main__":
    main()
