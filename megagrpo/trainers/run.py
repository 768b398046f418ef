"""The one run skeleton every trainer (GRPO, SFT, DPO, the warm-up) runs its steps in.

    restore (or start at step 0) -> validation at step 0 -> for each step: the trainer's step, validation
    on its cadence, a checkpoint on ``checkpoint.save_every`` -> the final checkpoint -> close resources
    -> HF export -> the end-of-run report

A trainer is an object with the :class:`Steps` members; :func:`run_steps` owns everything around them:
the metrics sinks, the cadences, Ctrl-C (the first finishes the step, checkpoints and stops; a second
aborts), one ``save_checkpoint`` that honours ``checkpoint.on_error``, a checkpoint of what the policy
has trained when the engines fail past their restarts, and closing the trainer's resources on every
way out. It runs on every rank of an SPMD job (the controller logs, saves and reports) as well as in
the GRPO controller, which drives its ranks through Ray.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from megagrpo.config import Config, config_to_dict
from megagrpo.metrics import MetricsLogger, WandbSettings, require_wandb
from megagrpo.runtime.faults import EngineFailure
from megagrpo.runtime.spmd import RankCalls
from megagrpo.trainers.checkpoints import export_final, save_checkpoint


@dataclass(frozen=True)
class Due:
    """What the skeleton does at the end of a step besides the step itself (a trainer that must prepare
    for them inside its step, as GRPO's weight sync does, reads them)."""

    validate: bool
    save: bool


@dataclass(frozen=True)
class Trained:
    """What the policy holds: the last step it trained and the data position after that step."""

    step: int
    position: int


class Steps(Protocol):
    """A trainer as the skeleton drives it."""

    save_method: Callable
    """The worker method that writes a rank's part of a checkpoint (returns its files' digests)."""

    def start_metrics(self) -> dict | None:
        """Metrics of step 0 (validation before training), or None for no step-0 record."""

    def step(self, step: int, due: Due) -> dict:
        """Train one step (and validate it when ``due.validate``); its metrics."""

    def trained(self) -> Trained:
        """What a checkpoint taken now holds (also mid-step, when the engines fail)."""

    def checkpoint_files(self) -> Callable[[Path], None] | None:
        """Files the controller adds to a checkpoint being written, or None."""

    def before_save(self) -> None:
        """Right before a checkpoint is written (every rank): e.g. colocated engines give their GPU
        memory back, so that the save does not meet them there."""

    def finish(self) -> None:
        """After the final checkpoint (every rank): e.g. the warm-up's saved model."""

    def close(self) -> None:
        """Release what the trainer started (engines, threads, pools); called on every way out."""


@dataclass(frozen=True)
class Cadence:
    """How often a trainer validates and checkpoints, and how its metrics are shown."""

    total_steps: int
    val_every: int
    """Validate every this many steps (0: never, but at the start and, with ``validate_last``, the end)."""
    validate_last: bool = False
    """Validate after the last step too."""
    title: str | None = None
    summary_keys: tuple | None = None
    panels: tuple | None = None

    def due(self, cfg: Config, step: int) -> Due:
        validating = bool(self.val_every) and step % self.val_every == 0
        ckpt = cfg.checkpoint
        return Due(
            validate=validating or (self.validate_last and step == self.total_steps),
            save=bool(ckpt.dir and ckpt.save_every) and step % ckpt.save_every == 0,
        )


@dataclass(frozen=True)
class RunOutcome:
    steps: int
    """The last step trained (all of the run, resumed steps included)."""
    checkpoint: Path | None
    export: Path | None
    interrupted: bool
    """Stopped by Ctrl-C after a finished step (a checkpoint of it is ``checkpoint``)."""


def run_steps(
    cfg: Config, group: RankCalls, trainer: Steps, run_dir: Path, cadence: Cadence, start_step: int
) -> RunOutcome:
    """Run ``trainer`` from ``start_step`` (0, or the step a resume restored) to ``cadence.total_steps``
    on this rank of ``group``; see the module docstring. Every rank returns the same outcome."""
    step, final = start_step, None
    try:
        with stops_on_interrupt(group) as stop, engine_failures_checkpointed(cfg, group, trainer):
            kind = {"title": cadence.title, "summary_keys": cadence.summary_keys, "panels": cadence.panels}
            make_log = lambda: metrics_logger(cfg, run_dir, cadence.total_steps, start_step, **kind)
            with group.controller_only(make_log) as log:
                first = trainer.start_metrics() if step == 0 else None
                if log and first is not None:
                    log.log(0, first)
                while step < cadence.total_steps and not stop():
                    step += 1
                    due = cadence.due(cfg, step)
                    metrics = trainer.step(step, due)
                    if log:
                        log.log(step, metrics)
                    if due.save:
                        save(cfg, group, trainer)
                curves = log.write_curves() if log else None
        if cfg.checkpoint.dir:
            final = save(cfg, group, trainer)
        trainer.finish()
    finally:
        trainer.close()
    interrupted = step < cadence.total_steps
    if interrupted:
        if group.is_controller:
            saved = f": saved {final}; continue with --resume" if final else ""
            print(f"\ninterrupted after step {step}{saved}", flush=True)
        return RunOutcome(step, final, None, True)
    export = None
    if group.is_controller:
        if final and cfg.checkpoint.export_hf_at_end:
            export = export_final(final, run_dir / "hf_export")
        print(f"\nrun directory: {run_dir}\n  metrics: {run_dir / 'metrics.jsonl'}\n  curves:  {curves}")
        if export:
            print(f"  HF export: {export}")
    return RunOutcome(step, final, export, False)


def save(cfg: Config, group: RankCalls, trainer: Steps) -> Path | None:
    """A checkpoint of what ``trainer``'s policy holds now."""
    now = trainer.trained()
    trainer.before_save()
    return save_checkpoint(
        cfg, group, trainer.save_method, now.step, now.position, trainer.checkpoint_files()
    )


@contextmanager
def engine_failures_checkpointed(cfg: Config, group: RankCalls, trainer: Steps) -> Iterator[None]:
    """Engines failing past ``generation.max_engine_restarts``: checkpoint what the policy has trained,
    then stop (the EngineFailure goes on to the caller, saying where to resume)."""
    try:
        yield
    except EngineFailure as err:
        saved = save(cfg, group, trainer) if cfg.checkpoint.dir else None
        where = f"; saved {saved}, continue with --resume" if saved else ""
        raise EngineFailure(f"{err}{where}", err.engine) from err


@contextmanager
def stops_on_interrupt(group: RankCalls) -> Iterator[Callable[[], bool]]:
    """``stop()``: whether to stop before the next step. The first Ctrl-C asks for it (the step running
    finishes, then the run checkpoints and stops); a second stops at once (KeyboardInterrupt).

    The controller decides for the whole group: other ranks of an SPMD job ignore Ctrl-C while the run
    steps and learn the decision from the controller before each step, so that every rank stops after
    the same one.
    """
    requested = [False]

    def on_sigint(signum, frame):
        if requested[0]:
            raise KeyboardInterrupt
        requested[0] = True
        print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint if group.is_controller else signal.SIG_IGN)
    try:
        yield lambda: group.from_controller(lambda: requested[0])
    finally:
        signal.signal(signal.SIGINT, previous)


# ------------------------------------------------------------------------------------------ run helpers


def prefixed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def wandb_settings(cfg: Config) -> WandbSettings | None:
    """The W&B sink of ``logging.wandb`` (ConfigError now, before any worker, when wandb is missing)."""
    if not cfg.logging.wandb:
        return None
    require_wandb()
    return WandbSettings(
        project=cfg.logging.wandb_project,
        name=cfg.run_name,
        mode=cfg.logging.wandb_mode,
        config=config_to_dict(cfg),
    )


def metrics_logger(cfg: Config, run_dir: Path, total_steps: int, start_step: int, **kind) -> MetricsLogger:
    """The run's metrics sinks as ``logging`` configures them; ``kind``: title, summary_keys, panels
    (None: the logger's defaults)."""
    return MetricsLogger(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        progress=cfg.logging.progress_bar,
        print_every=cfg.logging.log_every,
        total_steps=total_steps,
        start_step=start_step,
        resume=start_step > 0,
        wandb=wandb_settings(cfg),
        **{k: v for k, v in kind.items() if v is not None},
    )


@contextmanager
def timed(timings: dict, key: str) -> Iterator[None]:
    """``timings[key]``: the seconds the block took."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = time.perf_counter() - start
