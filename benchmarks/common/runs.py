"""``megagrpo train`` runs for the benchmarks that time the whole GRPO step (step, scaling, peer):
each in a process of its own, with an earlier run's warm-up reused, and its metrics.jsonl read back."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHARED_WARMUPS = "MEGAGRPO_BENCH_WARMUPS"
"""Environment variable naming a directory where the runs of several benchmarks share their tiny
models' warm-ups, one per warm-up config (``megagrpo.trainers.warmup.warmup_stamp``), and their whole runs,
one per run config: the suite sets it, so that step, scaling and peer train the demo's warm-up
once rather than once each, and a run that two benchmarks ask for (the same config and steps)
is made once."""


def _trainer(command: str) -> str:
    """The trainer a ``megagrpo COMMAND`` run's config is loaded (validated) for."""
    return "distill" if command == "distill" else "grpo"


def shared_warmup(overrides: list[str], command: str = "train") -> Path | None:
    """Where the warm-up of a ``megagrpo COMMAND`` run with ``overrides`` (on the default config) is kept
    for other runs of this suite, or None outside a suite and for a model that is not warmed up (an HF
    one)."""
    if not os.environ.get(SHARED_WARMUPS):
        return None
    from megagrpo.config import load_config
    from megagrpo.trainers.warmup import warmup_stamp

    cfg = load_config(None, overrides, trainer=_trainer(command))
    if cfg.model.tiny is None:
        return None
    key = hashlib.sha256(warmup_stamp(cfg).encode()).hexdigest()[:16]
    return Path(os.environ[SHARED_WARMUPS]) / key


def shared_run(args: list[str], command: str = "train") -> Path | None:
    """Where a suite keeps the run of ``megagrpo COMMAND`` with ``args`` (on the default config) for
    the other benchmarks that ask for the same run, or None outside a suite. Its key is the command and
    the whole config but the run's name and directory."""
    if not os.environ.get(SHARED_WARMUPS):
        return None
    import yaml

    from megagrpo.config import config_to_dict, load_config

    config = config_to_dict(load_config(None, args, trainer=_trainer(command)))
    config["command"] = command
    config.pop("run_name")
    config["logging"].pop("dir")
    key = hashlib.sha256(yaml.safe_dump(config, sort_keys=True).encode()).hexdigest()[:16]
    return Path(os.environ[SHARED_WARMUPS]) / "runs" / key


def _publish(src: Path, shared: Path) -> None:
    """``src`` as ``shared`` (hard links: the files are not written again), whole or not at all."""
    from megagrpo.ckpt.durable import atomic_output_dir

    with atomic_output_dir(shared) as tmp:
        shutil.copytree(src, tmp, copy_function=os.link, dirs_exist_ok=True)


def train_run(
    root: Path,
    name: str,
    steps: int,
    overrides: list[str],
    warmup: Path | None = None,
    shared: bool = True,
    command: str = "train",
    entry: str = "megagrpo.cli",
) -> Path:
    """Run ``name`` under ``root/runs`` for ``steps`` GRPO steps with ``overrides`` (no TensorBoard,
    progress bar, checkpoints or export), starting from the copy of ``warmup`` when given, else from
    the suite's shared warm-up of the same config when there is one (the run's own is shared after
    it); returns its run directory. In a suite, a run of the same config and steps that another
    benchmark made is not made again: its directory is copied (hard links) to ``name``'s;
    ``shared=False`` makes a run of its own (another round of the same config); ``command`` is the
    trainer (``train``, ``distill``), ``entry`` the module run as ``python -m`` (one that patches an engine
    into the registry, then runs megagrpo's CLI). A failed run stops the benchmark with the run's output."""
    run_dir = root / "runs" / name
    args = [
        f"logging.dir={root / 'runs'}",
        f"run_name={name}",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        f"grpo.num_steps={steps}",
        "checkpoint.dir=null",
        "checkpoint.export_hf_at_end=false",
        "checkpoint.save_every=0",
        *overrides,
    ]
    made = shared_run(args, command) if shared else None
    if made is not None and made.is_dir():
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(made, run_dir, copy_function=os.link)
        print(f"[runs] {name}: the suite's earlier run of this config", flush=True)
        return run_dir
    shared_warm = shared_warmup(overrides, command) if warmup is None else None
    if shared_warm is not None and shared_warm.is_dir():
        warmup = shared_warm
    if warmup is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(warmup, run_dir / "warmup")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", entry, command, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"[runs] {name}: {time.perf_counter() - start:.0f}s", flush=True)
    if shared_warm is not None and not shared_warm.is_dir() and (run_dir / "warmup").is_dir():
        _publish(run_dir / "warmup", shared_warm)
    if made is not None and not made.is_dir():
        _publish(run_dir, made)
    return run_dir


def metrics_rows(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def per_family(values: list[str], families) -> dict[str, int]:
    """``["tiny=20", "m25=4"]`` -> {"tiny": 20, "m25": 4}; a bare ``N`` applies to every family of
    ``families``; a family not among them is an error naming it."""
    out: dict[str, int] = {}
    for value in values:
        family, _, n = value.rpartition("=")
        if family and family not in families:
            raise SystemExit(f"{value}: {family!r} is not one of {', '.join(families)}")
        out |= {family: int(n)} if family else dict.fromkeys(families, int(n))
    return out


def export_warmup(run_dir: Path, out: Path) -> Path:
    """The run's warmed-up model as an HF directory (weights, config, tokenizer), for TRL."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "megagrpo.cli", "export", "--ckpt", str(run_dir / "warmup" / "ckpt")]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True)
    return out
