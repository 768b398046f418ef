"""Metrics sink of the trainers: ``metrics.jsonl`` + TensorBoard + a terminal progress line + a curves PNG,
and Weights & Biases when ``logging.wandb`` is set (the optional ``wandb`` package; offline mode writes the
run under the run directory).

Used on the controller only (one process), one :meth:`MetricsLogger.log` call per step (GRPO, SFT or DPO:
each passes its own title, summary keys and curve panels). The JSONL file is
the source of truth: each line is fsync'd, so a crash keeps every finished step, and :meth:`write_curves`
reads it back, so curves of a resumed run include the steps logged before the restart.

JSON cannot hold NaN/inf in strict mode (``json.dumps`` would write the non-standard ``NaN`` token that
``jq`` and most other readers reject), so non-finite floats are written as ``null``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from megagrpo.ckpt.durable import atomic_file, atomic_write

__all__ = [
    "CURVE_PANELS",
    "STEP_TIME_KEY",
    "SUMMARY_KEYS",
    "MetricsLogger",
    "WandbSettings",
    "read_metrics",
    "require_wandb",
]

SUMMARY_KEYS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "reward", "{:.2f}"),
    ("val/accuracy", "acc", "{:.2f}"),
    ("response/length_mean", "len", "{:.1f}"),
)
"""(metric key, short label, format) shown on the terminal, in this order; absent keys are skipped."""

STEP_TIME_KEY = "timing/step_s"
"""Seconds per step as the driver measured it; when absent, the wall-clock time between log calls is shown."""

CURVE_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean", "val/accuracy")),
    ("response length (tokens)", ("response/length_mean",)),
    # Separate panels: KL is typically ~1e-3 while entropy is ~1, so on one axis the KL line looks flat.
    ("KL(policy || ref)", ("train/kl_mean",)),
    ("entropy", ("train/entropy_mean",)),
)
"""(title, keys) per panel of :meth:`MetricsLogger.write_curves`; panels with no data are skipped."""

_RESERVED = ("step", "time")


@dataclass(frozen=True)
class WandbSettings:
    """Where a run goes in Weights & Biases (from ``logging.wandb_*``)."""

    project: str
    name: str
    mode: str
    """"online" or "offline" (offline: files under ``<run dir>/wandb``, uploaded later by ``wandb sync``)."""
    config: dict = field(default_factory=dict)
    """The run's config, recorded with the run."""


def require_wandb() -> None:
    """ConfigError naming ``logging.wandb`` unless the wandb package can be imported."""
    import importlib.util

    from megagrpo.config import ConfigError

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb",
            "is true but the wandb package is not installed: pip install 'megagrpo[wandb]' "
            "(or set logging.wandb=false)",
        )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file; a torn last line (crash mid-write) is skipped, not an error."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _json_value(value: Any) -> Any:
    # numpy scalars are not JSON-serialisable as such (np.float64 is, np.float32 and np.int64 are not).
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


class MetricsLogger:
    """Writes one record per GRPO step to ``run_dir/metrics.jsonl``, TensorBoard and the terminal.

    ``resume=True`` (continuing from a checkpoint taken after ``start_step``) keeps the records of steps
    <= start_step and drops later ones, which the resumed run will log again; TensorBoard events of those
    steps are purged likewise. ``resume=False`` starts a fresh file. Without a progress bar, the summary
    line is printed every ``print_every`` steps and for the last step (``logging.log_every``); the files
    get every step.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        print_every: int = 1,
        total_steps: int,
        start_step: int = 0,
        resume: bool = False,
        title: str = "GRPO",
        summary_keys: tuple[tuple[str, str, str], ...] = SUMMARY_KEYS,
        panels: tuple[tuple[str, tuple[str, ...]], ...] = CURVE_PANELS,
        wandb: WandbSettings | None = None,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step must be in [0, total_steps={total_steps}], got {start_step}")
        if print_every < 1:
            raise ValueError(f"print_every must be >= 1, got {print_every}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.print_every = print_every
        self.summary_keys, self.panels = summary_keys, panels
        self._wandb = _start_wandb(wandb, self.run_dir, resume) if wandb is not None else None
        if resume:
            kept = [r for r in read_metrics(self.path) if r["step"] <= start_step]
            # Rewritten even when nothing is dropped: this also removes a line torn by the crash.
            atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a" if resume else "w")  # noqa: SIM115 - closed in close()

        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events of steps >= purge_step that an earlier, crashed run wrote.
            purge = start_step + 1 if resume else None
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)

        self._progress = None
        if progress and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn(f"[bold]{title}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[summary]}"),
            )
            self._task = self._progress.add_task(title, total=total_steps, completed=start_step, summary="")
            self._progress.start()
        self._latest: dict[str, Any] = {}
        self._last_log = time.monotonic()
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        """Record the metrics of GRPO step ``step`` (1-based: the step just finished) everywhere."""
        if clash := [k for k in _RESERVED if k in metrics]:
            raise ValueError(f"metric keys {clash} are reserved for the record itself")
        now = time.monotonic()
        elapsed, self._last_log = now - self._last_log, now
        values = {key: _json_value(v) for key, v in metrics.items()}
        record = {"step": step, "time": time.time(), **values}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, numbers.Real):
                    self._tb.add_scalar(key, float(value), step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in values.items() if v is not None}, step=step)

        step_s = values.get(STEP_TIME_KEY)
        step_s = step_s if isinstance(step_s, int | float) else elapsed
        if self._progress is not None:
            # Val accuracy only comes on validation steps: keep showing the latest value in between.
            self._latest.update({k: v for k, v in values.items() if v is not None})
            summary = _summary(self._latest, step_s, self.summary_keys)
            self._progress.update(self._task, completed=step, summary=summary)
        elif step % self.print_every == 0 or step == self.total_steps:
            summary = _summary(values, step_s, self.summary_keys)
            print(f"step {step}/{self.total_steps}  {summary}", flush=True)

    def close(self) -> None:
        """Flush and close the outputs and stop the progress bar; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def write_curves(self, path: Path | None = None) -> Path:
        """Plot the logger's panels (GRPO: CURVE_PANELS) vs step from metrics.jsonl into a PNG (default
        run_dir/curves.png).

        Reads the file rather than an in-memory history so a resumed run plots its earlier steps too.
        """
        # Lazy: plotting is a once-per-run extra; matplotlib is slow to import and optional on clusters.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        path = Path(path) if path is not None else self.run_dir / "curves.png"
        records = read_metrics(self.path)
        panels = [(title, keys) for title, keys in self.panels if any(k in r for r in records for k in keys)]
        panels = panels or [self.panels[0]]  # an empty run still yields a (blank) figure, not an error
        fig = Figure(figsize=(6, 2.4 * len(panels)), layout="constrained")
        FigureCanvasAgg(fig)  # explicit Agg canvas: no pyplot, no global backend switch, no display needed
        axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]
        for ax, (title, keys) in zip(axes, panels, strict=True):
            for key in keys:
                rows = [r for r in records if key in r]
                if rows:  # None (a non-finite value) -> NaN: a gap in the line
                    ys = [math.nan if r[key] is None else r[key] for r in rows]
                    ax.plot([r["step"] for r in rows], ys, marker=".", label=key)
            ax.set_title(title)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(loc="best", fontsize="small")
        axes[-1].set_xlabel("step")
        with atomic_file(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
        return path


def _start_wandb(settings: WandbSettings, run_dir: Path, resume: bool):
    """A W&B run in ``run_dir``; a resumed run continues the W&B run its first part started."""
    require_wandb()
    import wandb

    id_file = run_dir / "wandb_run_id"
    if resume and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        atomic_write(id_file, run_id + "\n")
    return wandb.init(
        project=settings.project,
        name=settings.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=settings.mode,
        config=settings.config,
    )


def _summary(metrics: Mapping[str, Any], step_s: float, keys=SUMMARY_KEYS) -> str:
    parts = [
        f"{label} {fmt.format(metrics[key])}"
        for key, label, fmt in keys
        if isinstance(metrics.get(key), int | float)
    ]
    return "  ".join([*parts, f"{step_s:.1f}s"])
