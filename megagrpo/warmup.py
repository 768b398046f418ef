"""Supervised warm-up of a tiny model on the synthetic arithmetic task, on Megatron ranks.

GRPO needs a policy that is sometimes right: a randomly initialised model never is, so every
group has zero reward variance and no gradient. The warm-up teaches the tiny default model the
answer format with a short masked next-token run (loss only on answer tokens), then measures
greedy exact-match accuracy on held-out prompts. It runs the real trainer stack: Megatron-Core
GPTModel, Megatron DDP + optimizer + LR scheduler, Megatron's pipeline schedule, over gloo on CPU
(NCCL on GPU), with the TP/PP/DP layout from the config.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.ckpt.durable import publish
from megagrpo.ckpt.megatron import save_megatron, write_checkpoint_meta
from megagrpo.config import Config
from megagrpo.data.arithmetic import EOS_ID, PAD_ID, ArithmeticTask, CharTokenizer, Problem
from megagrpo.models.description import describe_model
from megagrpo.parallel import ParallelSizes, destroy_parallel, init_parallel
from megagrpo.parallel.local import run_local_ranks
from megagrpo.policy.engine import (
    OptimizerSettings,
    TrainEngine,
    build_engine,
    build_lr_scheduler,
    forward_backward,
    optimizer_step,
)
from megagrpo.rewards.arithmetic import arithmetic_reward

# Eval prompts come from a seed stream far from the training one: the sets do not overlap by construction.
_EVAL_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class WarmupResult:
    accuracy_before: float
    """Greedy exact-match accuracy on the eval prompts before training."""
    accuracy_after: float
    """The same after the warm-up."""
    final_loss: float
    """Mean answer-token cross-entropy of the last logged step."""
    steps: int
    seconds: float
    tokens_per_s: float
    """Training tokens (all positions of the padded batch) per second of step time."""
    metrics_path: str


def _sequence_batch(problems: list[Problem], tok: CharTokenizer, seq_len: int) -> dict:
    """Right-padded [BOS prompt answer EOS] rows with labels shifted by one and a mask on the answer."""
    batch = len(problems)
    tokens = torch.full((batch, seq_len + 1), PAD_ID, dtype=torch.long)  # [b, s+1]
    answer_mask = torch.zeros(batch, seq_len + 1, dtype=torch.bool)
    for row, prob in enumerate(problems):
        prompt = tok.encode(prob.prompt, bos=True)
        answer = [*tok.encode(prob.answer), EOS_ID]
        ids = prompt + answer
        if len(ids) > seq_len + 1:
            raise ValueError(f"problem {prob.prompt!r} needs {len(ids)} tokens, more than {seq_len + 1}")
        tokens[row, : len(ids)] = torch.tensor(ids)
        answer_mask[row, len(prompt) : len(ids)] = True
    return {
        "tokens": tokens[:, :-1],
        "position_ids": torch.arange(seq_len).expand(batch, -1),
        "labels": tokens[:, 1:],
        "loss_mask": answer_mask[:, 1:],
    }


def _masked_ce(logits: torch.Tensor, batch: dict):
    from megatron.core import tensor_parallel

    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch["labels"])  # [b, s]
    mask = batch["loss_mask"].to(losses.dtype)
    total = (losses * mask).sum()
    count = mask.sum().to(torch.int)
    return total, count, {"loss_sum": total.detach(), "tokens": count}


def _greedy_answers(engine: TrainEngine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy decoding with full forwards (tiny model, short answers): logits stay vocab-parallel,
    the argmax is taken over the TP-gathered vocabulary, and the last stage broadcasts each step's
    tokens to every pipeline stage."""
    import torch.distributed as dist

    ctx = engine.ctx
    lengths = [len(p) for p in prompts]
    seq_len = max(lengths) + max_new
    tokens = torch.full((len(prompts), seq_len), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = torch.tensor(ids)
    lengths_t = torch.tensor(lengths)
    rows = torch.arange(len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    for module in engine.model:
        module.eval()
    try:
        for _ in range(max_new):
            picked = {}

            def pick_next(logits: torch.Tensor, batch: dict, picked=picked, lengths_t=lengths_t):
                last = logits[rows, lengths_t - 1].float()  # [b, vocab / tp]
                if ctx.sizes.tp > 1:
                    parts = [torch.empty_like(last) for _ in range(ctx.sizes.tp)]
                    dist.all_gather(parts, last.contiguous(), group=ctx.pgs.tp)
                    last = torch.cat(parts, dim=-1)
                picked["next"] = last.argmax(dim=-1)
                return torch.zeros(()), torch.tensor(1, dtype=torch.int), {}

            batch = {"tokens": tokens, "position_ids": torch.arange(seq_len).expand(len(prompts), -1)}
            with torch.no_grad():
                forward_backward(engine, [batch], pick_next, forward_only=True)
            nxt = picked.get("next", torch.zeros(len(prompts), dtype=torch.long))
            if ctx.sizes.pp > 1:
                last_stage = dist.get_global_rank(ctx.pgs.pp, ctx.sizes.pp - 1)
                dist.broadcast(nxt, src=last_stage, group=ctx.pgs.pp)
            tokens[rows, lengths_t] = nxt
            lengths_t = lengths_t + 1
            for row, tok in enumerate(nxt.tolist()):
                out[row].append(tok)
    finally:
        for module in engine.model:
            module.train()
    return out


def _accuracy(engine: TrainEngine, problems: list[Problem], tok: CharTokenizer) -> float:
    max_new = max(len(p.answer) for p in problems) + 1
    answers = _greedy_answers(engine, [tok.encode(p.prompt, bos=True) for p in problems], max_new)
    scores = [arithmetic_reward(tok.decode(ids), p.answer) for ids, p in zip(answers, problems, strict=True)]
    return sum(scores) / len(scores)


def _warmup_rank(rank: int, world_size: int, cfg: Config, metrics_path: str, ckpt: str | None) -> dict | None:
    ctx = init_parallel(
        ParallelSizes.from_config(cfg.parallel),
        backend=cfg.parallel.resolved_backend,
        seed=cfg.warmup.seed + 1234,
    )
    try:
        return _train(ctx, cfg, metrics_path, Path(ckpt) if ckpt else None)
    finally:
        destroy_parallel()


def _train(ctx, cfg: Config, metrics_path: str, ckpt: Path | None) -> dict | None:
    wu, tok = cfg.warmup, CharTokenizer()
    task = ArithmeticTask(max_operand=cfg.data.arithmetic_max_operand, ops=cfg.data.arithmetic_ops)
    shape = describe_model(cfg).shape
    if tok.vocab_size > shape.vocab_size:
        raise ValueError(
            f"model.tiny.vocab_size={shape.vocab_size} is smaller than the task's {tok.vocab_size}"
        )
    engine = build_engine(
        ctx,
        shape,
        OptimizerSettings(lr=wu.lr, clip_grad=cfg.policy.clip_grad, weight_decay=cfg.policy.weight_decay),
        transformer_impl=cfg.parallel.resolved_transformer_impl,
    )
    scheduler = build_lr_scheduler(
        engine, lr=wu.lr, warmup_steps=max(1, wu.steps // 10), total_steps=wu.steps
    )
    reporter = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0
    eval_problems = task.problems(wu.num_eval_prompts, seed=wu.seed + _EVAL_SEED_OFFSET)
    acc_before = _accuracy(engine, eval_problems, tok)
    if wu.batch_size % ctx.dp_size:
        raise ValueError(
            f"warmup.batch_size={wu.batch_size} is not divisible by data parallel size {ctx.dp_size}"
        )
    per_rank = wu.batch_size // ctx.dp_size
    # Longest row: BOS, "a op b =", the widest answer, EOS. One fixed shape for every step keeps
    # the pipeline schedule simple.
    width = len(str(task.max_operand))
    seq_len = 1 + 2 * width + 2 + 2 * width + 1 + 1

    log = open(metrics_path, "w") if reporter else None  # noqa: SIM115 - closed in finally
    step_time, tokens_done, loss = 0.0, 0, float("nan")
    try:
        for step in range(1, wu.steps + 1):
            problems = task.problems(wu.batch_size, seed=wu.seed * 1_000_000 + step)
            batch = _sequence_batch(
                problems[ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank], tok, seq_len
            )
            t0 = time.perf_counter()
            outs = forward_backward(engine, [batch], _masked_ce)
            _, grad_norm = optimizer_step(engine)
            scheduler.step(1)
            step_time += time.perf_counter() - t0
            tokens_done += wu.batch_size * seq_len
            if reporter and (step % 10 == 0 or step == wu.steps):
                loss = float(sum(o["loss_sum"] for o in outs) / sum(o["tokens"] for o in outs))
                row = {
                    "step": step,
                    "loss": loss,
                    "grad_norm": grad_norm,
                    "lr": scheduler.get_lr(engine.optimizer.param_groups[0]),
                    "tokens_per_s": tokens_done / step_time,
                }
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(
                    f"[warmup] step {step:4d}/{wu.steps}  loss {loss:.4f}  grad_norm {grad_norm:.3f}  "
                    f"{row['tokens_per_s']:.0f} tok/s",
                    flush=True,
                )
    finally:
        if log is not None:
            log.close()
    acc_after = _accuracy(engine, eval_problems, tok)
    if ckpt is not None:
        _save(ctx, engine, cfg, ckpt)
    if not reporter:
        return None
    return {
        "accuracy_before": acc_before,
        "accuracy_after": acc_after,
        "final_loss": loss,
        "steps": wu.steps,
        "seconds": step_time,
        "tokens_per_s": tokens_done / step_time if step_time else 0.0,
    }


def _save(ctx, engine, cfg: Config, ckpt: Path) -> None:
    """The warmed-up weights as a megagrpo checkpoint (loadable by the policy, exportable to HF),
    written under a temporary name and renamed by rank 0 once every rank has written its part."""
    import torch.distributed as dist

    info = describe_model(cfg)
    tmp = ckpt.parent / f".{ckpt.name}.tmp"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    save_megatron(engine.module, tmp / "megatron")
    if ctx.rank == 0:
        sizes = ctx.sizes
        write_checkpoint_meta(tmp, info.arch, info.shape, info.dtype, tp=sizes.tp, pp=sizes.pp, hf_files=None)
        publish(tmp, ckpt)
    dist.barrier()


def run_warmup(cfg: Config, *, ckpt: Path | None = None) -> WarmupResult | None:
    """Run the warm-up and return the reporting rank's result; with ``ckpt``, save the weights there.

    Spawns ``parallel.world_size`` local ranks, or, under torchrun, runs as this process's rank
    (then only the reporting rank gets a result; the others get None).
    """
    if cfg.warmup.steps <= 0:
        raise ValueError("warmup.steps is 0: nothing to run (set warmup.steps=N)")
    if cfg.model.tiny is None:
        raise ValueError(
            "warm-up runs on the tiny model only: set model.tiny (model.hf_dir is not supported here)"
        )
    out_dir = Path(cfg.logging.dir) / cfg.run_name / "warmup"
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    tmp_path = out_dir / f".metrics.jsonl.{os.getpid()}.tmp"
    world = cfg.parallel.world_size
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun (launch/torchrun.sh) this process already is one rank of the job.
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but the config's parallel layout "
                f"needs DP x TP x PP x CP = {world}"
            )
        result = _warmup_rank(int(os.environ["RANK"]), world, cfg, str(tmp_path), ckpt and str(ckpt))
        if result is None:
            return None
    else:
        results = run_local_ranks(_warmup_rank, world, cfg, str(tmp_path), ckpt and str(ckpt), timeout_s=3600)
        (result,) = [r for r in results if r is not None]
    publish(tmp_path, metrics_path)
    return WarmupResult(**result, metrics_path=str(metrics_path))
