"""Run checkpoints as every trainer uses them: where a run starts from, the one checkpoint writer (which
honours ``checkpoint.on_error``), the final model and its HF export.

The writer runs on every rank of a rank group (``megagrpo.runtime.groups.RankCalls``): the Ray group of
GRPO, where the controller is this process, or an SPMD group (SFT, DPO, the warm-up), where every rank runs
the same code and rank 0 is the controller. The controller opens the temporary directory, every rank
writes its part, the controller adds the run's own files and commits the checkpoint with its manifest.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from megagrpo.ckpt import manifest
from megagrpo.ckpt import run as ckpt_io
from megagrpo.ckpt.convert import megatron_to_hf
from megagrpo.ckpt.durable import publish
from megagrpo.ckpt.links import check_no_outside_links
from megagrpo.ckpt.lora import read_lora_meta
from megagrpo.ckpt.lora_export import export_merged, export_peft, is_lora_checkpoint
from megagrpo.config import Config, ConfigError, config_to_dict
from megagrpo.config.yaml_text import read_yaml
from megagrpo.runtime.spmd import RankCalls


def write_errors() -> tuple[type[BaseException], ...]:
    """What a failed checkpoint write raises: the disk's errors, here or inside a policy actor (Ray's
    error, when this process uses Ray: a trainer-only rank does not import it)."""
    ray_errors = sys.modules.get("ray.exceptions")
    return (OSError, ray_errors.RayTaskError) if ray_errors else (OSError,)


def error_summary(err: BaseException) -> str:
    """The message of an error raised in an actor (its cause) or here, without tracebacks."""
    cause = getattr(err, "cause", None) or err
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__


def save_checkpoint(
    cfg: Config,
    group: RankCalls,
    save: Callable,
    step: int,
    position: int,
    extra: Callable[[Path], None] | None = None,
) -> Path | None:
    """Checkpoint ``step`` into ``checkpoint.dir/step_N`` on every rank of ``group``: ``save`` (the
    worker's save method, returning the digests of the files it wrote) on every rank, then ``extra(tmp)``
    and the commit (driver state, config, manifest) on the controller. Returns the checkpoint on every
    rank.

    A write that fails (disk full, unwritable directory) is removed, the previous checkpoint stays
    the latest, and the run stops (CheckpointWriteError, raised on every rank) or, with
    ``checkpoint.on_error: continue``, goes on without this one (None on every rank).
    """
    root = Path(cfg.checkpoint.dir).absolute()
    tmp, error = group.from_controller(lambda: _attempt(ckpt_io.begin, root, step))
    written: list = []
    if error is None:
        try:
            written = group.call_all(save, str(tmp))
        except write_errors() as err:
            error = error_summary(err)
    reports = group.gather_to_controller((written, error))

    def commit() -> tuple[Path | None, str | None]:
        errors = [e for _, e in reports if e is not None]
        if not errors:
            digests = {
                name: d for rank_written, _ in reports for part in rank_written for name, d in part.items()
            }
            state = ckpt_io.DriverState.capture(step, position)
            config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
            done = _attempt(_commit, tmp, extra, state, config_yaml, cfg.checkpoint.keep_last, digests)
            if done[1] is None:
                return done
            errors = [done[1]]
        if tmp is not None:
            ckpt_io.abort(tmp)
        latest = ckpt_io.latest(root)
        message = (
            f"checkpoint step_{step} could not be written to {root}: {errors[0]}; "
            f"the latest checkpoint is still {latest.name if latest else '(none)'}"
        )
        if cfg.checkpoint.on_error == "stop":
            raise ckpt_io.CheckpointWriteError(f"{message} (checkpoint.on_error: stop)")
        print(f"{message}; continuing without it (checkpoint.on_error: continue)", flush=True)
        return None, message

    saved, _ = group.from_controller(commit)
    return saved


def _commit(tmp: Path, extra, state, config_yaml: str, keep_last: int, digests: dict) -> Path:
    if extra is not None:
        extra(tmp)
    return ckpt_io.commit(tmp, state, config_yaml, keep_last, digests)


def _attempt(fn: Callable, *args):
    """(fn(*args), None), or (None, the error's summary) when the write failed."""
    try:
        return fn(*args), None
    except write_errors() as err:
        return None, error_summary(err)


def save_model(group: RankCalls, save: Callable, out: Path, extra: Callable | None = None) -> Path:
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


def export_final(ckpt: Path, out: Path) -> Path:
    """HF export of the final policy, replacing this run's previous export (written aside, then swapped)."""
    staging = out.with_name(out.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    if is_lora_checkpoint(ckpt):
        # A LoRA run: its adapters as a PEFT directory (beside), merged into the base where that is in files.
        shutil.rmtree(out.with_name("peft_adapter.new"), ignore_errors=True)
        publish(export_peft(ckpt, out.with_name("peft_adapter.new")), out.with_name("peft_adapter"))
        if read_lora_meta(ckpt)["base"]["source"] == "tiny":
            return out.with_name("peft_adapter")
        export_merged(ckpt, staging)
    else:
        megatron_to_hf(ckpt, staging)
    return publish(staging, out)


# ------------------------------------------------------------------------------------ where a run starts


def check_checkpoint_dir(cfg: Config) -> None:
    """A fresh run must not mix its checkpoints with an earlier run's (a resume would pick the wrong
    one): refuse before anything starts."""
    if cfg.checkpoint.dir is None or cfg.checkpoint.resume:
        return
    existing = ckpt_io.step_dirs(Path(cfg.checkpoint.dir))
    if existing:
        raise FileExistsError(
            f"checkpoint.dir {cfg.checkpoint.dir} already holds checkpoints (latest: {existing[-1][1].name}) "
            "from an earlier run: continue it with --resume, choose another checkpoint.dir, or remove them"
        )


def verified_resume_point(cfg: Config) -> Path | None:
    """The checkpoint a resume (``checkpoint.resume``, set by ``--resume``) continues from: the newest
    that matches its manifest (falling back past corrupt ones, or stopping, as ``checkpoint.on_corrupt``
    says); None for a fresh start. A checkpoint half-written by a killed run is removed first."""
    if not cfg.checkpoint.resume or cfg.checkpoint.dir is None:
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


def resolve_init_from(cfg: Config) -> Config:
    """``cfg`` with ``model.init_from`` (an earlier run's directory) replaced by the model it names
    (:func:`run_result`); ConfigError naming ``model.init_from`` when that run has no result.

    The model directory the run starts from (``model.hf_dir``, given or found here) is checked for
    links out of it (``ckpt.links``) before anything starts: the ranks copy its files into every
    checkpoint."""
    if cfg.model.init_from is not None:
        hf_dir, ckpt = run_result(Path(cfg.model.init_from), "model.init_from")
        model = dataclasses.replace(
            cfg.model, init_from=None, hf_dir=str(hf_dir), megatron_ckpt=str(ckpt) if ckpt else None
        )
        cfg = dataclasses.replace(cfg, model=model)
    if cfg.model.hf_dir is not None:
        check_no_outside_links(cfg.model.hf_dir)
    return cfg


def run_result(run: Path, key: str) -> tuple[Path, Path | None]:
    """(HF directory, megatron checkpoint or None) of a finished run: its HF export
    (``<run>/hf_export``), or else the latest checkpoint of its ``checkpoint.dir`` (read from
    ``<run>/config.yaml``) that matches its manifest (its ``hf/`` holds config and tokenizer).
    ConfigError naming ``key`` when the run holds neither (not run yet, or without checkpoints)."""
    if not run.is_dir():
        raise ConfigError(key, f"{run} is not a directory: run the stage it names first (its run directory)")
    export = run / "hf_export"
    if (export / "config.json").is_file():
        print(f"{key}: {run} -> its HF export {export}", flush=True)
        return export, None
    saved = run / "config.yaml"
    if not saved.is_file():
        raise ConfigError(key, f"{run} holds neither an HF export (hf_export/) nor a run's config.yaml")
    ckpt_dir = _saved_checkpoint_dir(saved, key)
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


def _saved_checkpoint_dir(saved: Path, key: str) -> str | None:
    """``checkpoint.dir`` of a run's saved config.yaml, read as any config is (no duplicate keys, no alias
    bomb); ConfigError naming ``key`` and the file when it cannot be read."""
    try:
        data = read_yaml(saved.read_text(encoding="utf-8"), str(saved))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"{saved} is not a readable YAML config ({err})") from None
    except ConfigError as err:
        raise ConfigError(key, f"{saved}: {', '.join(err.keys)}: {err.message}") from None
    section = data.get("checkpoint") if isinstance(data, dict) else None
    found = section.get("dir") if isinstance(section, dict) else None
    return found if isinstance(found, str) else None


def model_dir_for_eval(path: Path, out_dir: Path) -> Path:
    """The HF directory ``megagrpo eval --checkpoint`` loads: a run directory's HF export; else a
    checkpoint (a run's latest verified one, or ``path`` itself when it is one, verified against its
    manifest) exported to ``out_dir/hf``."""
    if (path / manifest.MANIFEST_NAME).is_file() or (path / "driver_state.json").is_file():
        nbytes = manifest.verify(path)
        print(f"verified {path}: {nbytes / 1e6:.1f} MB match {manifest.MANIFEST_NAME}")
        ckpt = path
    else:
        hf_dir, ckpt = run_result(path, "--checkpoint")
        if ckpt is None:
            return hf_dir
    return export_final(ckpt, out_dir / "hf")
