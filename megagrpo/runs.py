"""What every trainer does around its loop: the run directory, checkpoint-directory checks, metrics
sinks, HF export, and, for the trainer-only jobs (SFT, DPO, the warm-up), running as SPMD ranks.

Trainer-only jobs run one process per Megatron rank: ``run_ranks`` spawns ``parallel.world_size`` local
processes, or, under torchrun (``launch/torchrun.sh``, one or many nodes), runs in this process as its
rank. Every rank runs the same trainer loop and calls its own worker through :class:`LocalGroup`, which
has the typed-call surface of ``megagrpo.cluster.RankGroup`` (``call_first(SFTWorker.train_step,
batch)``); global rank 0 is the controller that logs metrics and commits checkpoints.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import yaml

from megagrpo.ckpt import run as ckpt_io
from megagrpo.ckpt.convert import megatron_to_hf
from megagrpo.ckpt.durable import publish
from megagrpo.config import Config, config_to_dict
from megagrpo.metrics import MetricsLogger, WandbSettings, require_wandb

__all__ = [
    "LocalGroup",
    "check_checkpoint_dir",
    "end_rank",
    "export_final",
    "metrics_logger",
    "prefixed",
    "resolve_init_from",
    "restore_checkpoint",
    "run_ranks",
    "run_result",
    "save_checkpoint",
    "save_model",
    "verified_resume_point",
    "wandb_settings",
]


def prefixed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def resolve_init_from(cfg: Config) -> Config:
    """``cfg`` with ``model.init_from`` (an earlier run's directory) replaced by the model it names
    (:func:`run_result`); ConfigError naming ``model.init_from`` when that run has no result."""
    import dataclasses

    if cfg.model.init_from is None:
        return cfg
    hf_dir, ckpt = run_result(Path(cfg.model.init_from), "model.init_from")
    model = dataclasses.replace(
        cfg.model, init_from=None, hf_dir=str(hf_dir), megatron_ckpt=str(ckpt) if ckpt else None
    )
    return dataclasses.replace(cfg, model=model)


def run_result(run: Path, key: str) -> tuple[Path, Path | None]:
    """(HF directory, megatron checkpoint or None) of a finished run: its HF export
    (``<run>/hf_export``), or else the latest checkpoint of its ``checkpoint.dir`` (read from
    ``<run>/config.yaml``) that matches its manifest (its ``hf/`` holds config and tokenizer).
    ConfigError naming ``key`` when the run holds neither (not run yet, or without checkpoints)."""
    from megagrpo.config import ConfigError

    if not run.is_dir():
        raise ConfigError(key, f"{run} is not a directory: run the stage it names first (its run directory)")
    export = run / "hf_export"
    if (export / "config.json").is_file():
        print(f"{key}: {run} -> its HF export {export}", flush=True)
        return export, None
    saved = run / "config.yaml"
    if not saved.is_file():
        raise ConfigError(key, f"{run} holds neither an HF export (hf_export/) nor a run's config.yaml")
    ckpt_dir = (yaml.safe_load(saved.read_text()).get("checkpoint") or {}).get("dir")
    found = None
    if ckpt_dir:
        found = ckpt_io.latest_verified(
            Path(ckpt_dir), "fallback", report=lambda m: print(f"{key}: {m}", flush=True)
        )
    if found is None or not (found / "hf" / "config.json").is_file():
        raise ConfigError(
            key,
            f"{run} has no HF export (hf_export/) and no verified checkpoint in its checkpoint.dir "
            f"({ckpt_dir}): did that run finish?",
        )
    print(f"{key}: {run} -> its latest checkpoint {found}", flush=True)
    return found / "hf", found


def check_checkpoint_dir(cfg: Config, resume: bool) -> None:
    """A fresh run must not mix its checkpoints with an earlier run's (--resume would pick the
    wrong one): refuse before anything starts."""
    if cfg.checkpoint.dir is None or resume or cfg.checkpoint.resume:
        return
    existing = ckpt_io.step_dirs(Path(cfg.checkpoint.dir))
    if existing:
        raise FileExistsError(
            f"checkpoint.dir {cfg.checkpoint.dir} already holds checkpoints (latest: {existing[-1][1].name}) "
            "from an earlier run: continue it with --resume, choose another checkpoint.dir, or remove them"
        )


def export_final(ckpt: Path, out: Path) -> Path:
    """HF export of the final policy, replacing this run's previous export (written aside, then swapped)."""
    staging = out.with_name(out.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    megatron_to_hf(ckpt, staging)
    return publish(staging, out)


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
    """The run's metrics sinks as ``logging`` configures them; ``kind``: title, summary_keys, panels."""
    return MetricsLogger(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        progress=cfg.logging.progress_bar,
        print_every=cfg.logging.log_every,
        total_steps=total_steps,
        start_step=start_step,
        resume=start_step > 0,
        wandb=wandb_settings(cfg),
        **kind,
    )


# ----------------------------------------------------------------------------------- SPMD ranks


class LocalGroup:
    """The rank group of an SPMD job as seen from one of its ranks: calls run on this rank's worker."""

    def __init__(self, worker: Any):
        import torch.distributed as dist

        self.worker = worker
        self.is_controller = dist.get_rank() == 0

    def call_all(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """This rank's result of ``method`` (a method of the worker's class), as a one-element list."""
        from megagrpo.cluster import method_name  # the same check as the Ray group's

        return [getattr(self.worker, method_name(type(self.worker), method))(*args, **kwargs)]

    def call_first(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """``method``'s result on this rank (the workers return the same result on every rank)."""
        return self.call_all(method, *args, **kwargs)[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def gather_to_controller(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on the controller (an empty list elsewhere)."""
        import torch.distributed as dist

        values = [None] * dist.get_world_size() if self.is_controller else None
        dist.gather_object(value, values, dst=0)
        return values if self.is_controller else []

    def from_controller(self, make: Callable[[], Any]) -> Any:
        """``make()`` run once, on the controller; its result on every rank (an exception there is
        raised on every rank, so none is left waiting)."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.is_controller:
            try:
                box[0] = ("ok", make())
            except Exception as err:  # re-raised on every rank below
                box[0] = ("error", err)
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    def controller_only(self, make: Callable[[], Any]):
        """``make()`` on the controller (a context manager, e.g. the metrics logger); elsewhere a no-op."""
        return make() if self.is_controller else nullcontext()


def run_ranks(fn: Callable, cfg: Config, *args: Any, timeout_s: float = 86_400.0) -> Any:
    """``fn(rank, world_size, cfg, *args)`` on every rank of the job; the controller's (rank 0's) result.

    Under torchrun this process is one rank (other ranks return None here); otherwise
    ``parallel.world_size`` local processes are spawned.
    """
    from megagrpo.parallel.local import run_local_ranks

    world = cfg.parallel.world_size
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but the config's parallel layout "
                f"needs DP x TP x PP x CP = {world}"
            )
        rank = int(os.environ["RANK"])
        result = fn(rank, world, cfg, *args)
        return result if rank == 0 else None
    return run_local_ranks(fn, world, cfg, *args, timeout_s=timeout_s)[0]


def end_rank() -> None:
    """Tear down this rank's parallel state after a job. Under torchrun the process may run another job
    next (``megagrpo dpo`` on a tiny model first runs its warm-up): the default group is kept for it,
    since a new rendezvous on gloo races the old store's shutdown (seen as a hang)."""
    from megagrpo.parallel import destroy_parallel

    destroy_parallel(keep_world="TORCHELASTIC_RUN_ID" in os.environ)


def save_checkpoint(
    cfg: Config, group: LocalGroup, save: Callable, step: int, position: int, extra: Callable | None = None
) -> Path:
    """``checkpoint.dir/step_N`` written by every rank (``save``: the worker's save method, which returns
    the digests of the files it wrote), then committed with its manifest by the controller; ``extra(tmp)``
    adds files on the controller before the commit."""
    root = Path(cfg.checkpoint.dir)
    tmp = root / f".step_{step}.tmp"
    if group.is_controller:
        tmp = ckpt_io.begin(root, step)
    group.barrier()
    digests = group.gather_to_controller(group.call_first(save, str(tmp)))
    if group.is_controller:
        if extra is not None:
            extra(tmp)
        config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        known = {name: digest for rank_digests in digests for name, digest in rank_digests.items()}
        state = ckpt_io.DriverState.capture(step, position)
        ckpt_io.commit(tmp, state, config_yaml, cfg.checkpoint.keep_last, known)
    group.barrier()
    return root / f"step_{step}"


def save_model(group: LocalGroup, save: Callable, out: Path, extra: Callable | None = None) -> Path:
    """The model (a megagrpo checkpoint, loadable and exportable) at ``out``, written aside and renamed."""
    tmp = out.parent / f".{out.name}.tmp"
    if group.is_controller:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    group.barrier()
    group.call_all(save, str(tmp))
    if group.is_controller:
        if extra is not None:
            extra(tmp)
        publish(tmp, out)
    group.barrier()
    return out


def verified_resume_point(cfg: Config, resume: bool) -> Path | None:
    """The checkpoint a resume continues from: the newest that matches its manifest (falling back
    past corrupt ones, or stopping, as ``checkpoint.on_corrupt`` says); None for a fresh start.
    A checkpoint half-written by a killed run is removed first."""
    if not (resume or cfg.checkpoint.resume) or cfg.checkpoint.dir is None:
        return None
    root = Path(cfg.checkpoint.dir)
    for stale in ckpt_io.clean_partial(root):
        print(f"resume: removed {stale.name}, a checkpoint left half-written by a stopped run", flush=True)
    found = ckpt_io.latest_verified(
        root, cfg.checkpoint.on_corrupt, report=lambda m: print(f"resume: {m}", flush=True)
    )
    if found is None:
        print("resume: no complete checkpoint found; starting from step 0", flush=True)
    return found


def restore_checkpoint(cfg: Config, group: LocalGroup, load: Callable, resume: bool) -> tuple[int, int]:
    """(last completed step, data position): from the newest checkpoint that verifies when resuming
    (the controller verifies, every rank loads what it chose)."""
    if not (resume or cfg.checkpoint.resume):
        return 0, 0
    chosen = group.from_controller(lambda: verified_resume_point(cfg, resume))
    if chosen is None:
        return 0, 0
    group.call_all(load, str(chosen))
    state = ckpt_io.load_driver_state(chosen)
    if group.is_controller:
        print(f"resume: continuing after step {state.step} from {chosen}", flush=True)
    return state.step, state.data_position
