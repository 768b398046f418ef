"""The end-to-end GRPO step: its stages, the overhead outside them, and the ~25M step against its
compute bound.

    python -m benchmarks.step [--setups tiny_tp1 ...] [--repeat tiny=8 m25=1] [--extra KEY=VALUE] [--quick]

Each setup is a real ``megagrpo train`` run (its own process: Ray, vLLM, Megatron); its samples
are the steps after its family's ``SKIP`` start-up steps (``--repeat`` of them), from the timings
the driver writes to metrics.jsonl every step:

- ``tiny_tp1`` / ``tiny_tp2``: ``make demo``'s config (64 prompts x 8, at most 8 new tokens, two
  optimizer steps per batch) at trainer TP 1 (the size's best layout) and TP 2 (the demo's);
- ``tiny_async``: ``tiny_tp1`` with generation overlapped with training (``grpo.max_staleness`` 1,
  one thread each side): its step against max(generation, logprobs + train + sync), the step if
  the two sides overlapped perfectly (target <= 1.15);
- ``tiny_distill``: ``tiny_tp1`` as ``megagrpo distill`` from a random teacher of twice the layers (on
  a Megatron rank of its own): the teacher's forward passes per step against the trainer's
  (logprobs + train);
- ``m25_tp1`` / ``m25_tp2``: a ~25M model of the same family (8 layers, hidden 512) from random
  weights, 16 prompts x 8, 128 new tokens (``ignore_eos``: every step does the same work), one
  optimizer step per batch.

Overhead: the train call beyond the ranks' own work (Ray scheduling, the batch through the object
store) plus the driver's time between the stages. The compute bound (m25 setups, ``--bound``):
vLLM alone (``rollout.RawEngine``) generating exactly the measured steps' requests (prompts, seeds,
sampling) from the run's initial weights, plus a bare Megatron step (``train --steps bare``) on as
many sequences of the run's mean length, plus, when a batch gets several optimizer steps, a third
of that for the old-logprob forward of the later mini-batches. Target: step <= 1.1 x bound. What
the bound leaves out is the framework's: the weight sync, the reward, Ray calls and the driver.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from .common import TMP, importable_by_workers, record
from .common.record import Measurement, find, ratio
from .common.runs import export_warmup, metrics_rows, per_family, train_run

SKIP = {"tiny": 2, "m25": 1}
"""Start-up steps left out, by family: the first step allocates (Megatron's buffers, vLLM's first
batches), the tiny model's second wobbles too."""
M25 = [
    *("model.tiny.num_layers=8", "model.tiny.hidden_size=512", "model.tiny.ffn_hidden_size=1536"),
    *("model.tiny.num_attention_heads=8", "model.tiny.num_query_groups=4", "warmup.steps=0"),
    *("grpo.num_prompts_per_step=16", "policy.mini_batch_size=128", "generation.max_new_tokens=128"),
    *("policy.micro_batch_max_tokens=4096", "generation.ignore_eos=true"),
]
SETUPS: dict[str, list[str]] = {
    "tiny_tp1": ["parallel.tensor_model_parallel_size=1"],
    "tiny_tp2": ["parallel.tensor_model_parallel_size=2"],
    "tiny_async": ["parallel.tensor_model_parallel_size=1", "grpo.max_staleness=1", "cluster.cpu_threads=1"],
    "tiny_distill": ["parallel.tensor_model_parallel_size=1"],
    "m25_tp1": [*M25, "parallel.tensor_model_parallel_size=1"],
    "m25_tp2": [*M25, "parallel.tensor_model_parallel_size=2"],
}
STAGES = ("generation_s", "logprobs_s", "train_s", "sync_s", "validation_s", "teacher_s")
"""A step's stages (reward_s is inside generation_s, probe_s inside sync_s; teacher_s: distillation)."""
QUICK_RUN = (
    "warmup.steps=10",
    "policy.micro_batch_max_tokens=8192",
    "grpo.baseline=mean",
    "generation.num_engines=2",
    "logging.val_every=5",
)
"""``--extra`` of the quick step and scaling runs: with it, the demo's config at TP 1 (5 steps from a
10-step warm-up) is the quick peer's megagrpo run (TRL's group-mean advantage, one micro-batch per
optimizer step, two engines, validation before and after), so the three read one run, made once."""
QUICK = {"setups": ["tiny_tp1"], "repeat": ["tiny=3"], "extra": list(QUICK_RUN)}
TARGET = 1.1


def parse_args(argv=None):
    p = record.parser("step", __doc__, repeat=None)
    p.add_argument(
        "--setups",
        nargs="+",
        default=["tiny_tp1", "tiny_tp2", "tiny_async", "tiny_distill", "m25_tp1"],
        choices=SETUPS,
    )
    p.add_argument(
        "--repeat", nargs="+", default=["tiny=8", "m25=1"], help="FAMILY=N or N: measured steps a run"
    )
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides for every setup")
    p.add_argument(
        "--bound", nargs="*", choices=SETUPS, help="setups against their compute bound (default: m25)"
    )
    p.add_argument("--bound-repeat", type=int, default=1, help="timed bare Megatron steps of a bound")
    args = record.parse(p, argv, QUICK)
    args.measured = {"tiny": 8, "m25": 1} | per_family(args.repeat, SKIP)
    if args.bound is None:
        args.bound = [s for s in args.setups if s.startswith("m25")]
    return args


def random_teacher(out: Path) -> Path:
    """A random teacher for the tiny student: its shape with twice the layers, its character tokenizer."""
    from transformers import Qwen2Config

    from megagrpo.data.tokenizer import char_tokenizer, save_tokenizer

    from .common.models import save_random_model

    config = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    save_random_model(out, config)
    save_tokenizer(char_tokenizer(), out)
    return out


def family(name: str) -> str:
    return name.split("_")[0]


def setup_overrides(name: str, extra: list[str] = ()) -> list[str]:
    """The ``megagrpo train`` overrides of setup ``name`` (no validation: the step alone)."""
    return ["logging.val_every=0", *SETUPS[name], *extra]


def measured_rows(run_dir: Path, name: str) -> list[dict]:
    return [r for r in metrics_rows(run_dir) if r["step"] > SKIP[family(name)]]


def stage_measurements(rows: list[dict], s: dict) -> list[Measurement]:
    def col(key: str) -> list[float]:
        return [r.get(f"timing/{key}", 0.0) for r in rows]

    step, stages = col("step_s"), [sum(r.get(f"timing/{k}", 0.0) for k in STAGES) for r in rows]
    overhead = [
        r["timing/train_s"] - r["timing/train_rank_s"] + x - y
        for r, x, y in zip(rows, step, stages, strict=True)
    ]
    # Generation overlapped with training is the engines' time on the next batch (generation_ahead_s).
    generation = [r.get("timing/generation_s", r.get("timing/generation_ahead_s", 0.0)) for r in rows]
    train_side = [
        sum(r.get(f"timing/{k}", 0.0) for k in STAGES[1:4]) for r in rows
    ]  # logprobs + train + sync
    out = [Measurement("step", step, "s", s), Measurement("stage: generation", generation, "s", s)]
    out += [
        Measurement(f"stage: {k.removesuffix('_s')}", col(k), "s", s)
        for k in (*STAGES[1:4], "reward_s", "probe_s")
    ]
    out.append(
        ratio("Ray calls + driver between the stages / step", overhead, step, settings=s, headline=True)
    )
    out.append(Measurement("tokens per second", [r["throughput/tokens_per_s"] for r in rows], "tokens/s", s))
    if s["setup"] == "tiny_distill":
        trainer = [r["timing/logprobs_s"] + r["timing/train_s"] for r in rows]
        out.append(Measurement("stage: teacher", col("teacher_s"), "s", s))
        out.append(
            ratio("teacher / (logprobs + train)", col("teacher_s"), trainer, settings=s, headline=True)
        )
    if "grpo.max_staleness=1" in SETUPS[s["setup"]]:
        bound = [max(g, t) for g, t in zip(generation, train_side, strict=True)]
        name = "step / max(generation, logprobs + train + sync)"
        out.append(ratio(name, step, bound, settings=s, target="<= 1.15", headline=True))
    return out


# ------------------------------------------------------------------------------ the compute bound


def step_requests(cfg, steps: list[int]):
    """Per step, (token-id prompts, seeds) as the driver draws them, and the sampling settings."""
    from megagrpo.data.prompts import build_source
    from megagrpo.trainers.rollouts import group_seed
    from megagrpo.types import SamplingSettings

    if cfg.grpo.filter_zero_variance_groups:
        raise SystemExit("step: dynamic sampling draws extra prompts; the bound needs a setup without it")
    source, per = build_source(cfg), cfg.grpo.num_prompts_per_step
    requests = {}
    for step in steps:
        at = (step - 1) * per
        seeds = [group_seed(cfg, at + i) for i in range(per)]
        requests[step] = ([p.token_ids for p in source.batch(at, per)], seeds)
    g = cfg.grpo.num_generations
    return requests, SamplingSettings.from_config(cfg, stop_token_ids=source.stop_token_ids, n=g)


def vllm_alone(cfg, model: Path, requests: dict, settings) -> list[float]:
    """Seconds inside ``llm.generate`` of a bare vLLM per measured step (step 1 first, a warm-up)."""
    import os

    import ray

    from megagrpo.generation.vllm import engine_cpu_threads
    from megagrpo.runtime.ray_session import shutdown_ray, start_ray

    from .rollout import RawEngine

    importable_by_workers()
    start_ray(cfg.cluster, num_cpus=2)
    try:
        threads = engine_cpu_threads(cfg, len(os.sched_getaffinity(0)))  # the run's engine's
        engine = ray.remote(num_cpus=cfg.cluster.cpus_per_worker)(RawEngine).remote(
            str(model), cfg.model.seq_length, cfg.generation.seed, load_format="auto", threads=threads
        )
        stops = [] if settings.ignore_eos else list(settings.stop_token_ids)
        kw = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k}
        kw |= {"stop_token_ids": stops, "ignore_eos": settings.ignore_eos}  # as VLLMEngine sets them
        out = []
        for step, (prompts, seeds) in requests.items():
            seconds, _ = ray.get(
                engine.generate.remote(prompts, settings.n, settings.max_tokens, seeds, **kw)
            )
            if step != 1:
                out.append(seconds)
    finally:
        shutdown_ray()
    return out


def bare_megatron(cfg, seq: int, repeat: int, out: Path) -> list[float]:
    """Seconds of ``train``'s bare step on the run's batch shape (its own process and ranks)."""
    from .common.megatron import PRESETS

    batch, tp, budget = (
        cfg.rollouts_per_step,
        cfg.parallel.tensor_model_parallel_size,
        cfg.policy.micro_batch_max_tokens,
    )
    shape = [f"--shape={k}={getattr(cfg.model.tiny, k)}" for k in PRESETS["tiny"]]
    # --threads 0: the node's cores shared among the ranks, as the run's
    run = (
        f"--tp={tp} --batch={batch} --seq={seq} --min-len-frac=1.0 --budget={budget} --steps bare --threads=0"
    )
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.train",
        *shape,
        *run.split(),
        f"--repeat={repeat}",
        f"--out={out}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks.train failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rates = find(record.read(out)["measurements"], "bare step").samples
    return [batch * seq / r for r in rates]


def bound_measurements(
    name: str, steps: int, run_dir: Path, extra: list[str], args, root: Path
) -> list[Measurement]:
    from megagrpo.config import load_config

    cfg = load_config(None, [f"grpo.num_steps={steps}", *setup_overrides(name, extra)])
    rows = measured_rows(run_dir, name)
    requests, settings = step_requests(cfg, [1, *(r["step"] for r in rows)])
    prompt = statistics.mean(len(p) for step, (ps, _) in requests.items() if step != 1 for p in ps)
    seq = round(prompt + statistics.mean(r["response/length_mean"] for r in rows))
    model = export_warmup(run_dir, root / "hf")  # the run's initial weights (its engines got them by sync)
    generation = statistics.median(vllm_alone(cfg, model, requests, settings))
    train = statistics.median(bare_megatron(cfg, seq, args.bound_repeat, root / "bare.json"))
    forward = train / 3 * (1 - 1 / cfg.mini_batches_per_step)  # the later mini-batches' old logprobs
    bound = generation + train + forward
    s = {"setup": name}
    step = [r["timing/step_s"] for r in rows]
    return [
        Measurement("compute bound: vLLM alone + bare Megatron step", [bound], "s", s),
        Measurement(
            "step / compute bound", [x / bound for x in step], "x", s, target=f"<= {TARGET}", headline=True
        ),
        Measurement("generation / vLLM alone", [r["timing/generation_s"] / generation for r in rows], "x", s),
        Measurement("train / bare Megatron", [r["timing/train_s"] / (train + forward) for r in rows], "x", s),
    ]


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = TMP / "step"
    shutil.rmtree(root, ignore_errors=True)
    out = []
    for name in args.setups:
        steps = SKIP[family(name)] + args.measured[family(name)]
        if name == "tiny_distill":
            teacher = [f"distill.teacher_hf_dir={random_teacher(root / 'teacher')}"]
            run_dir = train_run(
                root, name, steps, setup_overrides(name, [*args.extra, *teacher]), command="distill"
            )
        else:
            run_dir = train_run(root, name, steps, setup_overrides(name, args.extra))
        out += stage_measurements(measured_rows(run_dir, name), {"setup": name})
        if name in args.bound:
            out += bound_measurements(name, steps, run_dir, args.extra, args, root / name)
    what = "the GRPO step by stage, the overhead outside the stages, the step against its compute bound"
    notes = [f"measured steps per run {args.measured}, after the first {SKIP}; --extra {args.extra}"]
    return record.write(
        args, "step", what, out, packages=("torch", "vllm", "megatron.core", "ray"), notes=notes
    )


if __name__ == "__main__":
    main()
