"""Supervised fine-tuning: ``megagrpo sft --config FILE``.

    records (JSONL / JSON / Parquet, or the synthetic task) -> chat template -> token ids + assistant mask
        -> per step: sft.batch_size sequences -> DP shards -> token-budget micro-batches
        -> Megatron cross-entropy on assistant tokens -> optimizer step -> metrics, validation, checkpoint

The loss is the mean cross-entropy per trained token of the whole batch (Megatron's per-token loss over
all micro-batches and DP ranks), so micro-batching and DP do not change it. Validation: the loss on the
validation examples at the start, every ``sft.val_every`` steps and at the end; with the synthetic task
also greedy exact-match accuracy on held-out problems. The tiny model's warm-up before GRPO is an SFT run
on the synthetic task (``megagrpo.trainers.warmup``).

It runs as one process per Megatron rank (spawned locally, or under torchrun; ``megagrpo.runtime.groups``)
in the run skeleton every trainer shares (``megagrpo.trainers.run``); data are read, tokenized and checked
before any rank starts. Launch: ``megagrpo sft --config FILE``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config import Config, save_config
from megagrpo.data.supervised import SFTSource, build_sft_source
from megagrpo.data.tokenizer import load_tokenizer, save_tokenizer
from megagrpo.runtime.spmd import LocalGroup, RankCalls, end_rank, run_ranks
from megagrpo.trainers.checkpoints import check_checkpoint_dir, resolve_init_from, save_model
from megagrpo.trainers.run import Cadence, Due, Trained, prefixed, run_steps, wandb_settings
from megagrpo.trainers.supervised import greedy_accuracy, restore_checkpoint
from megagrpo.types import SequenceBatch

SFT_SUMMARY = (
    ("train/loss", "loss", "{:.4f}"),
    ("val/loss", "val", "{:.4f}"),
    ("val/greedy_accuracy", "acc", "{:.2f}"),
)
SFT_PANELS = (("loss", ("train/loss", "val/loss")), ("greedy accuracy", ("val/greedy_accuracy",)))


@dataclass(frozen=True)
class SFTResult:
    run_dir: str
    steps: int
    """Optimizer steps done (all of the run, resumed ones included)."""
    first: dict
    """Validation metrics before the first step (empty when the run was resumed)."""
    last: dict
    """Validation metrics after the last step."""
    final_loss: float
    """Training loss of the last step."""
    seconds: float
    """Step time of this process's steps."""
    tokens_per_s: float
    """Training tokens (real, unpadded) per second of step time."""
    skipped_rows: int
    checkpoint: str | None
    export: str | None
    interrupted: bool = False
    """Stopped by Ctrl-C after a finished step (``checkpoint`` continues it)."""


def run_sft(cfg: Config, *, run_dir: Path | None = None, final_model: Path | None = None) -> SFTResult | None:
    """Run SFT as configured (resuming when ``checkpoint.resume``); ``final_model`` also saves the final
    weights there (the warm-up's use). Returns the controller's result (None on the other ranks under
    torchrun); KeyboardInterrupt once a Ctrl-C'd run has saved its checkpoint."""
    run_dir = Path(run_dir) if run_dir is not None else Path(cfg.logging.dir) / cfg.run_name
    cfg = resolve_init_from(cfg)  # a staged recipe's previous stage, checked before anything starts
    check_checkpoint_dir(cfg)
    source = build_sft_source(cfg, load_tokenizer(cfg))  # bad data and configs stop here, before any rank
    wandb_settings(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    result = run_ranks(_sft_rank, cfg, source, str(run_dir), str(final_model) if final_model else None)
    if result is not None and result.interrupted:
        raise KeyboardInterrupt
    return result


def _sft_rank(rank: int, world_size: int, cfg: Config, source: SFTSource, run_dir: str, final: str | None):
    from megagrpo.policy.supervised import SFTWorker

    worker = SFTWorker(cfg)
    try:
        return train(cfg, LocalGroup(worker), source, Path(run_dir), Path(final) if final else None)
    finally:
        end_rank()


def train(
    cfg: Config, group: RankCalls, source: SFTSource, run_dir: Path, final_model: Path | None
) -> SFTResult | None:
    """The SFT run, on every rank (``group`` calls this rank's worker; the controller logs and saves)."""
    from megagrpo.policy.supervised import SFTWorker

    step = restore_checkpoint(cfg, group, SFTWorker.load)
    steps = SFTSteps(cfg, group, source, step, final_model)
    cadence = Cadence(
        cfg.sft.num_steps,
        cfg.sft.val_every,
        validate_last=True,
        title="SFT",
        summary_keys=SFT_SUMMARY,
        panels=SFT_PANELS,
    )
    outcome = run_steps(cfg, group, steps, run_dir, cadence, step)
    if not group.is_controller:
        return None
    return SFTResult(
        run_dir=str(run_dir),
        steps=outcome.steps,
        first=steps.first,
        last=steps.last,
        final_loss=steps.train_metrics.get("loss", float("nan")),
        seconds=steps.step_time,
        tokens_per_s=steps.tokens / steps.step_time if steps.step_time else 0.0,
        skipped_rows=source.skipped_rows,
        checkpoint=str(outcome.checkpoint) if outcome.checkpoint else None,
        export=str(outcome.export) if outcome.export else None,
        interrupted=outcome.interrupted,
    )


class SFTSteps:
    """SFT's steps as the run skeleton drives them, and what the result reports of them."""

    def __init__(self, cfg: Config, group: RankCalls, source: SFTSource, step: int, final_model: Path | None):
        from megagrpo.policy.supervised import SFTWorker

        self.save_method = SFTWorker.save
        self.cfg, self.group, self.source, self.final_model = cfg, group, source, final_model
        self._step = step
        self.first: dict = {}
        self.last: dict = {}
        self.train_metrics: dict = {}
        self.step_time, self.tokens = 0.0, 0

    def start_metrics(self) -> dict:
        self.first = self.last = self.validate()
        return self.first

    def step(self, step: int, due: Due) -> dict:
        from megagrpo.policy.supervised import SFTWorker

        batch = SequenceBatch.from_examples(self.source.batch(step, self.cfg.sft.batch_size))
        t0 = time.perf_counter()
        self.train_metrics = self.group.call_first(SFTWorker.train_step, batch).as_dict()
        elapsed = time.perf_counter() - t0
        self._step = step
        self.step_time, self.tokens = self.step_time + elapsed, self.tokens + batch.num_tokens
        metrics = {
            **prefixed("train", self.train_metrics),
            "data/skipped_rows": self.source.skipped_rows,
            "timing/step_s": elapsed,
            "throughput/tokens_per_s": batch.num_tokens / elapsed,
        }
        if due.validate:
            self.last = self.validate()
            metrics |= self.last
        return metrics

    def validate(self) -> dict[str, float]:
        """``val/loss`` on the validation examples; with the synthetic task, ``val/greedy_accuracy``."""
        from megagrpo.policy.supervised import SFTWorker

        out, source = {}, self.source
        if source.val:
            batch = SequenceBatch.from_examples(source.val)
            out["val/loss"] = self.group.call_first(SFTWorker.evaluate, batch).loss
        if source.val_problems:
            out["val/greedy_accuracy"] = greedy_accuracy(
                self.group, SFTWorker.complete, source.tok, source.val_problems, source.cfg
            )
        return out

    def trained(self) -> Trained:
        return Trained(self._step, self._step * self.cfg.sft.batch_size)

    def checkpoint_files(self):
        """A built-in tokenizer goes into the checkpoint's hf/ directory (an HF model's files are copied
        there from model.hf_dir already), so exports are complete HF directories."""
        if self.cfg.model.tiny is None:
            return None
        return lambda tmp: save_tokenizer(self.source.tok, tmp / "hf")

    def before_save(self) -> None:
        pass

    def finish(self) -> None:
        if self.final_model is not None:
            save_model(self.group, self.save_method, self.final_model, self.checkpoint_files())

    def close(self) -> None:
        pass
