"""Supervised fine-tuning: ``megagrpo sft --config FILE``.

    records (JSONL / JSON / Parquet, or the synthetic task) -> chat template -> token ids + assistant mask
        -> per step: sft.batch_size sequences -> DP shards -> token-budget micro-batches
        -> Megatron cross-entropy on assistant tokens -> optimizer step -> metrics, validation, checkpoint

The loss is the mean cross-entropy per trained token of the whole batch (Megatron's per-token loss over
all micro-batches and DP ranks), so micro-batching and DP do not change it. Validation: the loss on the
validation examples at the start, every ``sft.val_every`` steps and at the end; with the synthetic task
also greedy exact-match accuracy on held-out problems. The tiny model's warm-up before GRPO is an SFT run
on the synthetic task (``megagrpo.warmup``).

It runs as one process per Megatron rank (spawned locally, or under torchrun; ``megagrpo.runs``); data
are read, tokenized and checked before any rank starts. Launch: ``megagrpo sft --config FILE``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config import Config, ConfigError, save_config
from megagrpo.data.supervised import SFTSource, build_sft_source, prompt_ids
from megagrpo.data.tokenizer import load_tokenizer, save_tokenizer
from megagrpo.rewards.arithmetic import arithmetic_reward
from megagrpo.runs import (
    LocalGroup,
    check_checkpoint_dir,
    end_rank,
    export_final,
    metrics_logger,
    prefixed,
    resolve_init_from,
    restore_checkpoint,
    run_ranks,
    save_checkpoint,
    save_model,
    wandb_settings,
)
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


def run_sft(
    cfg: Config, *, resume: bool = False, run_dir: Path | None = None, final_model: Path | None = None
) -> SFTResult | None:
    """Run SFT as configured; ``final_model`` also saves the final weights there (the warm-up's use).

    Returns the controller's result (None on the other ranks under torchrun).
    """
    run_dir = Path(run_dir) if run_dir is not None else Path(cfg.logging.dir) / cfg.run_name
    cfg = resolve_init_from(cfg)  # a staged recipe's previous stage, checked before anything starts
    check_checkpoint_dir(cfg, resume)
    check_layout(cfg)
    source = build_sft_source(cfg, load_tokenizer(cfg))  # bad data and configs stop here, before any rank
    wandb_settings(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    return run_ranks(_sft_rank, cfg, source, str(run_dir), resume, str(final_model) if final_model else None)


def check_layout(cfg: Config) -> None:
    dp = cfg.parallel.data_parallel_size
    if cfg.sft.batch_size < dp:
        raise ConfigError(
            ("sft.batch_size", "parallel.data_parallel_size"),
            f"batch_size {cfg.sft.batch_size} leaves some of the {dp} data-parallel ranks without data",
        )


def _sft_rank(rank: int, world_size: int, cfg: Config, source: SFTSource, run_dir: str, resume: bool, final):
    from megagrpo.policy.supervised import SFTWorker

    worker = SFTWorker(cfg)
    try:
        return train(cfg, LocalGroup(worker), source, Path(run_dir), resume, Path(final) if final else None)
    finally:
        end_rank()


def train(
    cfg: Config, group: LocalGroup, source: SFTSource, run_dir: Path, resume: bool, final_model: Path | None
) -> SFTResult | None:
    """The SFT loop, on every rank (``group`` calls this rank's worker; the controller logs and saves)."""
    from megagrpo.policy.supervised import SFTWorker

    sft = cfg.sft
    step, _ = restore_checkpoint(cfg, group, SFTWorker.load, resume)
    first, last, train_metrics, step_time, tokens = {}, {}, {}, 0.0, 0

    def logger():
        return metrics_logger(
            cfg, run_dir, sft.num_steps, step, title="SFT", summary_keys=SFT_SUMMARY, panels=SFT_PANELS
        )

    with group.controller_only(logger) as log:
        if step == 0:
            first = last = validate(group, source)
            if log:
                log.log(0, first)
        while step < sft.num_steps:
            step += 1
            batch = SequenceBatch.from_examples(source.batch(step, sft.batch_size))
            t0 = time.perf_counter()
            train_metrics = group.call_first(SFTWorker.train_step, batch).as_dict()
            elapsed = time.perf_counter() - t0
            step_time, tokens = step_time + elapsed, tokens + batch.num_tokens
            metrics = {
                **prefixed("train", train_metrics),
                "data/skipped_rows": source.skipped_rows,
                "timing/step_s": elapsed,
                "throughput/tokens_per_s": batch.num_tokens / elapsed,
            }
            if step == sft.num_steps or (sft.val_every and step % sft.val_every == 0):
                last = validate(group, source)
                metrics |= last
            if log:
                log.log(step, metrics)
            if cfg.checkpoint.dir and cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                save_checkpoint(
                    cfg, group, SFTWorker.save, step, step * sft.batch_size, _tokenizer_files(cfg, source)
                )
        curves = log.write_curves() if log else None
    final = None
    if cfg.checkpoint.dir:
        final = save_checkpoint(
            cfg, group, SFTWorker.save, step, step * sft.batch_size, _tokenizer_files(cfg, source)
        )
    if final_model is not None:
        save_model(group, SFTWorker.save, final_model, _tokenizer_files(cfg, source))
    if not group.is_controller:
        return None
    export = export_final(final, run_dir / "hf_export") if final and cfg.checkpoint.export_hf_at_end else None
    print(f"\nrun directory: {run_dir}\n  metrics: {run_dir / 'metrics.jsonl'}\n  curves:  {curves}")
    if export:
        print(f"  HF export: {export}")
    return SFTResult(
        run_dir=str(run_dir),
        steps=step,
        first=first,
        last=last,
        final_loss=train_metrics.get("loss", float("nan")),
        seconds=step_time,
        tokens_per_s=tokens / step_time if step_time else 0.0,
        skipped_rows=source.skipped_rows,
        checkpoint=str(final) if final else None,
        export=str(export) if export else None,
    )


def validate(group: LocalGroup, source: SFTSource) -> dict[str, float]:
    """``val/loss`` on the validation examples; with the synthetic task, ``val/greedy_accuracy``."""
    from megagrpo.policy.supervised import SFTWorker

    out = {}
    if source.val:
        out["val/loss"] = group.call_first(SFTWorker.evaluate, SequenceBatch.from_examples(source.val)).loss
    if source.val_problems:
        out["val/greedy_accuracy"] = greedy_accuracy(
            group, SFTWorker.complete, source.tok, source.val_problems, source.cfg
        )
    return out


def greedy_accuracy(group: LocalGroup, complete, tok, problems, cfg: Config) -> float:
    """Exact-match accuracy of greedy answers to the synthetic problems (``complete``: a worker method)."""
    prompts = [prompt_ids(tok, p.prompt, chat_template=cfg.data.apply_chat_template) for p in problems]
    answers = group.call_first(complete, prompts, max(len(p.answer) for p in problems) + 1)
    texts = [decode_answer(tok, ids) for ids in answers]
    return sum(arithmetic_reward(t, p.answer) for t, p in zip(texts, problems, strict=True)) / len(problems)


def decode_answer(tok, ids: list[int]) -> str:
    """Text of generated ids up to the first EOS; ids outside the tokenizer's vocabulary are dropped."""
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    return tok.decode([i for i in ids if i < len(tok)], skip_special_tokens=True)


def _tokenizer_files(cfg: Config, source: SFTSource):
    """A built-in tokenizer goes into the checkpoint's hf/ directory (an HF model's files are copied there
    from model.hf_dir already), so exports are complete HF directories."""
    if cfg.model.tiny is None:
        return None
    return lambda tmp: save_tokenizer(source.tok, tmp / "hf")
