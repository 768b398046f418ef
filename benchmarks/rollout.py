"""Rollouts through megagrpo's engine actor against a bare ``vllm.LLM`` on the same requests.

    python -m benchmarks.rollout [--prompts 64] [--n 8] [--new-tokens 64] [--layers 4] [--repeat 3] [--quick]

One random Qwen2-shaped fp32 model (no EOS: every sample runs to ``--new-tokens``), two engines
started at once, as Ray actors with the same CPU reservation and threads:

- ``ours``: the production ``VLLMEngine`` (``runtime.engines.launch_engines``), called as the
  GRPO driver calls it, one seed per prompt; timed at the controller around the Ray call (the
  round trip and the conversion to ``Completion`` records included); a timer around its own
  ``llm.generate`` gives vLLM's share of that call, a ratio from one run that contention cannot tilt;
- ``raw``: ``RawEngine``, ``vllm.LLM`` alone with the same engine options and equivalent
  ``SamplingParams`` (same seeds), timed inside its actor (pure vLLM). Both load dummy weights, so
  they hold the same ones and must sample identical tokens: the check that the requests match;
- ``raw unseeded``: the same without per-request seeds (what the driver's seeds cost).

Prompts of at most ``--prompt-len`` tokens (16): vLLM 0.32 on CPU cannot rewind a seeded generator
after prefilling a prompt in pieces, so a full batch must fit one step's token budget. Interleaved
rounds; tokens/s counts the tokens returned. Target: ours / raw >= 0.95 in every round.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .common import TMP, importable_by_workers, record
from .common.configs import cpu_engine_overrides, make_config
from .common.models import cached_model, save_random_model
from .common.record import Measurement, ratio
from .common.timing import interleave, other_load

QUICK = {"prompts": 8, "n": 2, "new_tokens": 8, "layers": 1, "hidden": 64, "vocab": 1024, "seq_length": 64}


def parse_args(argv=None):
    p = record.parser("rollout", __doc__)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16, help="longest prompt (the shortest is half)")
    p.add_argument("--seq-length", type=int, default=256, help="max_model_len of both engines")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="a multiple of 64 (head size 64)")
    p.add_argument("--vocab", type=int, default=8192)
    args = record.parse(p, argv, QUICK)
    if args.hidden % 64 or args.prompt_len + args.new_tokens > args.seq_length:
        p.error("--hidden must be a multiple of 64 and --prompt-len + --new-tokens <= --seq-length")
    return args


def source_model(args) -> Path:
    """A random fp32 Qwen2 checkpoint without EOS (vLLM adds a generation config's EOS to the stops)."""
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
        (out / "generation_config.json").unlink(missing_ok=True)

    return cached_model(TMP / f"rollout-qwen2-L{args.layers}-h{args.hidden}-v{args.vocab}", shape, write)


class RawEngine:
    """``vllm.LLM`` and nothing else, in a Ray actor (no megagrpo code on the timed path)."""

    def __init__(self, model_dir: str, seq_length: int, seed: int, load_format="dummy", threads=None):
        # VLLMEngine's environment: the engine core in this process, 1 GiB of KV cache, its threads.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
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
        """(seconds inside ``llm.generate``, [(token ids, logprobs)] per sample in prompt order)."""
        from vllm import SamplingParams

        def params(seed):
            kw = {"temperature": 1.0, **sampling}
            return SamplingParams(n=n, max_tokens=max_tokens, seed=seed, logprobs=0, detokenize=False, **kw)

        per_prompt = [params(s) for s in seeds] if seeds is not None else params(None)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], per_prompt, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [
            (list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)])
            for out in outputs
            for c in out.outputs
        ]


def time_generate(worker) -> None:
    """On a live VLLMEngine: keep the seconds of each ``llm.generate`` call."""
    plain = worker.llm.generate

    def generate(*a, **kw):
        start = time.perf_counter()
        try:
            return plain(*a, **kw)
        finally:
            worker.bench_generate_s = time.perf_counter() - start

    worker.llm.generate = generate


def random_prompts(args) -> list[list[int]]:
    """``args.prompts`` prompts of random tokens, lengths uniform in [prompt_len / 2, prompt_len]."""
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=gen)
    return [torch.randint(0, args.vocab, (int(n),), generator=gen).tolist() for n in lengths]


def main(argv=None) -> dict:
    import ray

    from megagrpo.generation.vllm import engine_cpu_threads
    from megagrpo.runtime.engines import launch_engines, wait_for_engines
    from megagrpo.runtime.ray_session import shutdown_ray, start_ray
    from megagrpo.types import SamplingSettings

    args = parse_args(argv)
    model = source_model(args)
    cfg = make_config(
        {
            **cpu_engine_overrides(model, seq_length=args.seq_length),
            "generation.max_new_tokens": args.new_tokens,
            "generation.temperature": 1.0,
        }
    )
    prompts = random_prompts(args)
    seeds = [1_000_003 + i for i in range(args.prompts)]  # as the driver derives them
    importable_by_workers()
    start_ray(cfg.cluster, num_cpus=2)
    try:
        (ours,) = launch_engines(cfg, str(model))  # both start at once
        threads = engine_cpu_threads(cfg, len(os.sched_getaffinity(0)))
        raw = ray.remote(num_cpus=cfg.cluster.cpus_per_worker)(RawEngine).remote(
            str(model), args.seq_length, cfg.generation.seed, threads=threads
        )
        wait_for_engines([ours, raw])
        pids = [ray.get(raw.pid.remote()), ray.get(ours.__ray_call__.remote(lambda w: os.getpid()))]
        ray.get(ours.__ray_call__.remote(time_generate))
        settings = SamplingSettings(max_tokens=args.new_tokens, temperature=1.0, n=args.n)
        ray.get(
            ours.generate.remote(prompts[:4], SamplingSettings(max_tokens=8, temperature=1.0, n=2), seeds[:4])
        )
        ray.get(raw.generate.remote(prompts[:4], 2, 8, seeds[:4]))  # warm-up: first-call allocations

        def run_ours():
            comps = ray.get(ours.generate.remote(prompts, settings, seeds))
            inside = ray.get(ours.__ray_call__.remote(lambda w: w.bench_generate_s))
            return inside, [(c.token_ids, c.logprobs) for c in comps]

        steps = {
            "ours": run_ours,
            "raw": lambda: ray.get(raw.generate.remote(prompts, args.n, args.new_tokens, seeds)),
            "raw unseeded": lambda: ray.get(raw.generate.remote(prompts, args.n, args.new_tokens, None)),
        }
        times = interleave(steps, args.repeat, pids=pids)
    finally:
        shutdown_ray()
    tokens = {k: [sum(len(ids) for ids, _ in t.value[1]) for t in v] for k, v in times.items()}
    # ours: at the controller (megagrpo's actor call); raw: inside its actor (vLLM alone)
    taken = {k: [t.seconds if k == "ours" else t.value[0] for t in v] for k, v in times.items()}
    rate = {k: [n / s for n, s in zip(tokens[k], taken[k], strict=True)] for k in times}
    (_, a), (_, b) = times["ours"][0].value, times["raw"][0].value  # same seeds, same weights
    same = sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) / len(a)
    diffs = [abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x[1], y[1], strict=False)]
    s = {"prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens, "layers": args.layers}
    out = [Measurement("tokens per second", rate[k], "tokens/s", {**s, "engine": k}) for k in times]
    out += [
        ratio(
            "ours / raw vLLM, tokens/s",
            rate["ours"],
            rate["raw"],
            settings=s,
            target=">= 0.95",
            headline=True,
        ),
        Measurement(
            "vLLM's share of our actor call", [t.value[0] / t.seconds for t in times["ours"]], "fraction", s
        ),
        ratio("seeded / unseeded raw vLLM, tokens/s", rate["raw"], rate["raw unseeded"], settings=s),
        Measurement("samples with identical token ids, ours vs raw", [same], "fraction", s, target=">= 1"),
        Measurement("largest logprob difference, ours vs raw", [max(diffs, default=0.0)], "", s),
        other_load(*times.values()),
    ]
    what = "rollouts through megagrpo's VLLMEngine actor against a bare vllm.LLM on the same requests"
    return record.write(args, "rollout", what, out, packages=("torch", "vllm", "ray"))


if __name__ == "__main__":
    main()
