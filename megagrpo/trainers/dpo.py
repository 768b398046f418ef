"""Direct preference optimisation: ``megagrpo dpo --config FILE``.

    pairs (JSONL / JSON / Parquet, or sampled from the initial policy on the synthetic task)
        -> chat template -> chosen and rejected token ids, response masks
        -> per step: dpo.batch_size pairs -> reference logprobs (initial weights, swapped in from host memory)
        -> DP shards and micro-batches of whole pairs -> DPO / IPO loss -> optimizer step
        -> metrics, validation, checkpoint

Losses (``megagrpo.algorithms.dpo``): sigmoid DPO (Rafailov et al. 2023) with optional label smoothing,
IPO (Azar et al. 2023), each optionally on length-normalised (mean per token) logprobs. The reference
policy is the initial policy, frozen; its logprobs are computed once per batch, just before the step.
Validation (loss, preference accuracy, margins) on the validation pairs at the start, every
``dpo.val_every`` steps and at the end; with the synthetic task also greedy accuracy on the held-out
problems GRPO validates on.

The synthetic task's pairs (``data.train_path: null``): for each problem, ``dpo.synthetic_samples`` answers
are sampled (temperature 1) from the initial policy; a problem with a wrong answer gives a pair whose chosen
response is a right sample (or the reference answer when none is right) and whose rejected one is the most
frequent wrong sample. They are written to ``<run dir>/data/`` and read back like any dataset. A tiny model
starts from its warm-up (``megagrpo.trainers.warmup``), as GRPO does.

It runs as one process per Megatron rank (spawned locally, or under torchrun; ``megagrpo.runtime.groups``)
in the run skeleton every trainer shares (``megagrpo.trainers.run``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config import Config, save_config
from megagrpo.data.arithmetic import ArithmeticTask
from megagrpo.data.prompts import arithmetic_val_problems
from megagrpo.data.supervised import (
    VAL_SEED_OFFSET,
    PreferenceSource,
    build_preference_source,
    prompt_ids,
    write_records,
)
from megagrpo.data.tokenizer import load_tokenizer
from megagrpo.rewards.arithmetic import arithmetic_reward
from megagrpo.runtime.spmd import LocalGroup, RankCalls, end_rank, run_ranks
from megagrpo.trainers.checkpoints import check_checkpoint_dir, resolve_init_from
from megagrpo.trainers.run import Cadence, Due, Trained, prefixed, run_steps, wandb_settings
from megagrpo.trainers.supervised import decode_answer, greedy_accuracy, restore_checkpoint
from megagrpo.types import SequenceBatch

DPO_SUMMARY = (
    ("train/loss", "loss", "{:.4f}"),
    ("train/accuracy", "pref acc", "{:.2f}"),
    ("train/margin_mean", "margin", "{:.3f}"),
    ("val/greedy_accuracy", "greedy acc", "{:.2f}"),
)
DPO_PANELS = (
    ("loss", ("train/loss", "val/loss")),
    ("preference accuracy", ("train/accuracy", "val/accuracy")),
    ("reward margin", ("train/margin_mean", "val/margin_mean")),
    ("chosen / rejected rewards", ("train/chosen_reward_mean", "train/rejected_reward_mean")),
    ("greedy accuracy", ("val/greedy_accuracy",)),
)


@dataclass(frozen=True)
class DPOResult:
    run_dir: str
    steps: int
    first: dict
    """Validation metrics before the first step (empty when the run was resumed)."""
    last: dict
    """Validation metrics after the last step."""
    seconds: float
    """Step time (reference logprobs + training) of this process's steps."""
    skipped_rows: int
    checkpoint: str | None
    export: str | None
    interrupted: bool = False
    """Stopped by Ctrl-C after a finished step (``checkpoint`` continues it)."""


def run_dpo(cfg: Config) -> DPOResult | None:
    """Run DPO as configured (resuming when ``checkpoint.resume``); the controller's result (None on the
    other ranks under torchrun); KeyboardInterrupt once a Ctrl-C'd run has saved its checkpoint."""
    from megagrpo.trainers.warmup import warmed_up_model

    run_dir = Path(cfg.logging.dir) / cfg.run_name
    cfg = resolve_init_from(cfg)  # a staged recipe's previous stage, checked before anything starts
    check_checkpoint_dir(cfg)
    tok = load_tokenizer(cfg)
    # Datasets are read and checked before anything starts; synthetic pairs need the model first.
    source = build_preference_source(cfg, tok) if cfg.data.train_path is not None else None
    wandb_settings(cfg)
    synthetic_task = None
    if source is None:
        synthetic_task = ArithmeticTask(
            max_operand=cfg.data.arithmetic_max_operand, ops=cfg.data.arithmetic_ops
        )
    cfg, _ = warmed_up_model(cfg, run_dir)  # a tiny model starts from its warm-up, as in GRPO
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    result = run_ranks(_dpo_rank, cfg, tok, source, synthetic_task, str(run_dir))
    if result is not None and result.interrupted:
        raise KeyboardInterrupt
    return result


def _dpo_rank(rank: int, world_size: int, cfg: Config, tok, source, task, run_dir: str):
    from megagrpo.policy.supervised import DPOWorker

    worker = DPOWorker(cfg)
    try:
        group = LocalGroup(worker)
        if source is None:
            source = synthetic_pairs(cfg, group, tok, task, Path(run_dir) / "data")
        return train(cfg, group, tok, source, Path(run_dir))
    finally:
        end_rank()


def train(cfg: Config, group: RankCalls, tok, source: PreferenceSource, run_dir: Path) -> DPOResult | None:
    """The DPO run, on every rank (``group`` calls this rank's worker; the controller logs and saves)."""
    step = restore_checkpoint(cfg, group, _worker().load)
    steps = DPOSteps(cfg, group, tok, source, step)
    cadence = Cadence(
        cfg.dpo.num_steps,
        cfg.dpo.val_every,
        validate_last=True,
        title="DPO",
        summary_keys=DPO_SUMMARY,
        panels=DPO_PANELS,
    )
    outcome = run_steps(cfg, group, steps, run_dir, cadence, step)
    if not group.is_controller:
        return None
    return DPOResult(
        run_dir=str(run_dir),
        steps=outcome.steps,
        first=steps.first,
        last=steps.last,
        seconds=steps.step_time,
        skipped_rows=source.skipped_rows,
        checkpoint=str(outcome.checkpoint) if outcome.checkpoint else None,
        export=str(outcome.export) if outcome.export else None,
        interrupted=outcome.interrupted,
    )


def _worker():
    from megagrpo.policy.supervised import DPOWorker

    return DPOWorker


class DPOSteps:
    """DPO's steps as the run skeleton drives them, and what the result reports of them."""

    def __init__(self, cfg: Config, group: RankCalls, tok, source: PreferenceSource, step: int):
        self.save_method = _worker().save
        self.cfg, self.group, self.tok, self.source, self._step = cfg, group, tok, source, step
        self.val = None
        if source.val:
            val = SequenceBatch.from_pairs(source.val)
            self.val = val.replace(ref_logps=group.call_first(_worker().reference_logps, val))
        synthetic = cfg.data.train_path is None and cfg.data.num_val_prompts
        self.problems = arithmetic_val_problems(cfg) if synthetic else []
        self.first: dict = {}
        self.last: dict = {}
        self.step_time = 0.0

    def start_metrics(self) -> dict:
        self.first = self.last = self.validate()
        return self.first

    def step(self, step: int, due: Due) -> dict:
        worker = _worker()
        batch = SequenceBatch.from_pairs(self.source.batch(step, self.cfg.dpo.batch_size))
        t0 = time.perf_counter()
        batch = batch.replace(ref_logps=self.group.call_first(worker.reference_logps, batch))
        t1 = time.perf_counter()
        train_metrics = self.group.call_first(worker.train_step, batch)
        t2 = time.perf_counter()
        self._step, self.step_time = step, self.step_time + t2 - t0
        metrics = {
            **prefixed("train", train_metrics.as_dict()),
            "data/skipped_rows": self.source.skipped_rows,
            "timing/reference_s": t1 - t0,
            "timing/train_s": t2 - t1,
            "timing/step_s": t2 - t0,
            "throughput/tokens_per_s": batch.num_tokens / (t2 - t0),
        }
        if due.validate:
            self.last = self.validate()
            metrics |= self.last
        return metrics

    def validate(self) -> dict:
        """``val/*`` preference metrics on the validation pairs; ``val/greedy_accuracy`` on held-out
        problems."""
        worker, out = _worker(), {}
        if self.val is not None:
            metrics = self.group.call_first(worker.evaluate, self.val).as_dict()
            out |= prefixed("val", {k: v for k, v in metrics.items() if k != "pairs"})
        if self.problems:
            out["val/greedy_accuracy"] = greedy_accuracy(
                self.group, worker.complete, self.tok, self.problems, self.cfg
            )
        return out

    def trained(self) -> Trained:
        return Trained(self._step, self._step * self.cfg.dpo.batch_size)

    def checkpoint_files(self):
        return None

    def before_save(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ synthetic pairs


def synthetic_pairs(
    cfg: Config, group: RankCalls, tok, task: ArithmeticTask, out_dir: Path
) -> PreferenceSource:
    """Pairs sampled from the initial policy (before a resumed run loads its checkpoint, so the same pairs
    again), written to ``out_dir/{train,val}.jsonl`` by the controller and read back by every rank."""
    dpo = cfg.dpo
    train_path, val_path = out_dir / "train.jsonl", out_dir / "val.jsonl"
    train = _sample_pairs(cfg, group, tok, task, dpo.num_synthetic_pairs, dpo.seed * 1_000_000)
    val = _sample_pairs(cfg, group, tok, task, dpo.num_val_pairs, dpo.seed * 1_000_000 + VAL_SEED_OFFSET)
    if group.is_controller:
        write_records(train_path, train)
        if val:
            write_records(val_path, val)
        print(
            f"dpo: {len(train)} training and {len(val)} validation pairs sampled into {out_dir}", flush=True
        )
    group.barrier()
    data = dataclasses.replace(cfg.data, val_path=str(val_path) if val else None)
    return build_preference_source(dataclasses.replace(cfg, data=data), tok, train_path=str(train_path))


def _sample_pairs(
    cfg: Config, group: RankCalls, tok, task: ArithmeticTask, count: int, seed: int
) -> list[dict]:
    from megagrpo.policy.supervised import DPOWorker

    data, k = cfg.data, cfg.dpo.synthetic_samples
    rows: list[dict] = []
    for attempt in range(20):  # a well-trained policy makes few mistakes: draw until enough pairs
        if len(rows) >= count:
            break
        problems = task.problems(2 * (count - len(rows)), seed=seed + attempt)
        prompts = [prompt_ids(tok, p.prompt, chat_template=data.apply_chat_template) for p in problems]
        max_new = max(len(p.answer) for p in problems) + 1
        answers = group.call_first(
            DPOWorker.complete, [p for p in prompts for _ in range(k)], max_new, 1.0, seed + attempt
        )
        for i, problem in enumerate(problems):
            texts = [decode_answer(tok, ids).strip() for ids in answers[i * k : (i + 1) * k]]
            right = [t for t in texts if arithmetic_reward(t, problem.answer) == 1.0]
            wrong = [t for t in texts if t and arithmetic_reward(t, problem.answer) == 0.0]
            if wrong and len(rows) < count:
                chosen = right[0] if right else problem.answer
                rejected = Counter(wrong).most_common(1)[0][0]
                rows.append(
                    {data.prompt_key: problem.prompt, data.chosen_key: chosen, data.rejected_key: rejected}
                )
    return rows
