"""The peer's side of ``benchmarks.peer``: TRL's ``GRPOTrainer`` on an HF model, in a process of its own.

    python -m benchmarks.peer_trl --model HF_DIR --steps N --out FILE.json [--prompts 64] [--generations 8]
        [--max-new-tokens 8] [--mini-batch 256] [--lr 3e-4] [--generation generate|paged|vllm]

The prompts are the embedded arithmetic task's (``37+45=``), drawn from the same stream as
``megagrpo train``'s (prompt ``i`` of the run from seed ``grpo.seed * 1_000_003 + i``), in the same
order (TRL's shuffling off); the reward is the same exact-integer match; validation is greedy accuracy
on the same held-out problems, before and after training, with ``transformers``' ``generate``.

The settings mirror the megagrpo run it is compared with: ``--prompts`` x ``--generations`` completions
per GRPO step, ``--mini-batch`` completions per optimizer step (TRL's ``steps_per_generation``), one
pass over each batch, Adam at a constant ``--lr``, gradient clipping at 1, clip range 0.2 / 0.28, no
KL term, token-level loss over the batch (TRL's ``dapo``), advantages ``(r - group mean) / group std``
(TRL's ``scale_rewards: group``; megagrpo runs with ``grpo.baseline: mean`` beside it). Generation:
``transformers``' ``generate``, its continuous batching (``paged``), or vLLM in this process
(``vllm``: TRL's ``vllm_mode="colocate"``, the CPU build, eager, 1 GiB of KV cache).

A GRPO step's time is the time between the ends of the optimizer steps that close two consecutive
generation batches (generation, reward, logprobs, the optimizer steps, logging), from a
``TrainerCallback``. Writes the per-step times and the validation accuracies as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def arithmetic_rows(n: int, seed: int) -> list[dict]:
    """Prompts 0..n-1 of megagrpo's training stream for the embedded task (tiny_cpu.yaml's settings)."""
    from megagrpo.config import load_config
    from megagrpo.data.prompts import arithmetic_source

    source = arithmetic_source(load_config(None, [f"grpo.seed={seed}"]))
    rows = []
    for prompt in source.batch(0, n):
        rows.append({"prompt": source.decode(prompt.token_ids[1:]), "answer": prompt.answer})
    return rows


def val_rows() -> list[dict]:
    from megagrpo.config import load_config
    from megagrpo.data.prompts import arithmetic_val_problems

    return [{"prompt": p.prompt, "answer": p.answer} for p in arithmetic_val_problems(load_config(None, []))]


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    import torch

    from megagrpo.rewards.arithmetic import arithmetic_reward

    tokenizer.padding_side = "left"
    batch = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(arithmetic_reward(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


def step_clock(per_batch: int, ends: list[float]):
    """A callback appending the time each GRPO step ends (the optimizer step that closes a generation
    batch) to ``ends``; its first entry is the training's start."""
    from transformers import TrainerCallback

    class StepEnds(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step % per_batch == 0:
                ends.append(time.perf_counter())

    return StepEnds()


def grpo_config(args: argparse.Namespace, batch: int, per_batch: int):
    """TRL's settings mirroring the megagrpo run (see the module's docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(args.out.parent / f"{args.out.stem}_trl"),
        per_device_train_batch_size=args.mini_batch,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        generation_batch_size=batch,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        max_steps=args.steps * per_batch,
        shuffle_dataset=False,
        logging_steps=per_batch,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        disable_dropout=True,
        use_transformers_continuous_batching=args.generation == "paged",
        use_vllm=args.generation == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=256,
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (config, safetensors, tokenizer)")
    p.add_argument("--steps", type=int, required=True, help="GRPO steps (generation batches)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--mini-batch", type=int, default=256, help="completions per optimizer step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--generation",
        choices=["generate", "paged", "vllm"],
        default="generate",
        help="transformers' generate, its continuous batching (paged), or vLLM colocated",
    )
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.generation == "vllm":  # vLLM's CPU build in this process, as small as the task allows
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in {**one_rank, "MASTER_PORT": str(free_port())}.items():  # TRL's external launcher
            os.environ.setdefault(key, value)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from megagrpo.rewards.arithmetic import arithmetic_reward

    batch = args.prompts * args.generations
    if batch % args.mini_batch:
        raise SystemExit(f"--mini-batch {args.mini_batch} must divide a batch of {batch} completions")
    per_batch = batch // args.mini_batch
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    val = val_rows()
    before = greedy_accuracy(model, tokenizer, val, args.max_new_tokens)

    def reward(completions, answer, **_):
        return [arithmetic_reward(c, a) for c, a in zip(completions, answer, strict=True)]

    ends: list[float] = []
    config = grpo_config(args, batch, per_batch)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(arithmetic_rows(args.steps * args.prompts, args.seed)),
        processing_class=tokenizer,
        callbacks=[step_clock(per_batch, ends)],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    after = greedy_accuracy(trainer.model, tokenizer, val, args.max_new_tokens)
    step_s = [b - a for a, b in itertools.pairwise(ends)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    report = {
        "trl": __import__("trl").__version__,
        "generation": args.generation,
        "torch_threads": torch.get_num_threads(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "step_s": step_s,
        "train_wall_s": wall,
        "reward": rewards,
        "response_length_mean": lengths,
        "val_accuracy_before": before,
        "val_accuracy_after": after,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"TRL {report['trl']} ({args.generation}): {len(step_s)} steps, median "
        f"{statistics.median(step_s[1:] or step_s):.3f} s/step, greedy val {before:.3f} -> {after:.3f}"
    )
    return report


if __name__ == "__main__":
    main()
