"""Run checkpoints: atomic ``step_N/`` directories, retention, and finding the one to resume.

A checkpoint is written under a temporary name (``.step_N.tmp``) and published as ``step_N``
(``durable.publish``) only once every part is on disk, so a process killed mid-write leaves the
previous checkpoint as the latest complete one. Layout::

    step_N/megatron/          policy weights (Megatron distributed checkpoint; exportable to HF)
    step_N/optimizer/         optimizer state
    step_N/trainer_state.json LR scheduler + optimizer step count
    step_N/hf/, megagrpo.json model description (as written by hf_to_megatron)
    step_N/driver_state.json  GRPO step, data position, RNG states
    step_N/config.yaml        the run's config
    step_N/manifest.json      size + xxh3-64 of every other file (``megagrpo.ckpt.manifest``), written last

The policy ranks write their parts collectively; on multi-node runs ``checkpoint.dir`` must be a
filesystem every node sees.

Resuming goes through ``latest_verified``: the newest checkpoint whose files match its manifest,
falling back to older ones (and setting the corrupt ones aside as ``step_N.corrupt``) or stopping,
as ``checkpoint.on_corrupt`` says. ``clean_partial`` removes what a killed write left behind.
Trainers other than GRPO use the same functions.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.ckpt import manifest
from megagrpo.ckpt.durable import publish
from megagrpo.ckpt.manifest import CheckpointCorrupt, FileDigest

_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory); the message says why and
    which checkpoint is still the latest."""


@dataclass(frozen=True)
class DriverState:
    step: int
    """Last completed GRPO step."""
    data_position: int
    """Prompts consumed from the training stream."""
    rng: dict
    """Python and torch RNG states of the driver process."""

    @staticmethod
    def capture(step: int, data_position: int) -> DriverState:
        return DriverState(
            step=step,
            data_position=data_position,
            rng={"python": _encode_python_rng(random.getstate()), "torch": torch.get_rng_state().tolist()},
        )

    def restore_rng(self) -> None:
        random.setstate(_decode_python_rng(self.rng["python"]))
        torch.set_rng_state(torch.tensor(self.rng["torch"], dtype=torch.uint8))


def _encode_python_rng(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_python_rng(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(found)


def latest(root: Path) -> Path | None:
    dirs = step_dirs(root)
    return dirs[-1][1] if dirs else None


def clean_partial(root: Path) -> list[Path]:
    """Remove checkpoints a killed or failed write left half-written under ``root``; returns them."""
    stale = sorted(root.glob(".step_*.tmp")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for checkpoint ``step`` (leftovers of killed writes are removed)."""
    root.mkdir(parents=True, exist_ok=True)
    clean_partial(root)
    tmp = root / f".step_{step}.tmp"
    tmp.mkdir()
    return tmp


def abort(tmp: Path) -> None:
    """Drop a checkpoint whose write failed (its space is given back; the latest stays as it was)."""
    shutil.rmtree(tmp, ignore_errors=True)


def commit(
    tmp: Path,
    state: DriverState,
    config_yaml: str,
    keep_last: int,
    digests: dict[str, FileDigest] | None = None,
) -> Path:
    """Write the driver's part and the manifest, rename ``tmp`` to ``step_N`` and drop all but the
    newest ``keep_last``.

    ``digests``: the digests of files already known (reported by their writers), by path relative
    to ``tmp``; every other file is read back for the manifest.
    """
    (tmp / "driver_state.json").write_text(json.dumps(state.__dict__) + "\n")
    (tmp / "config.yaml").write_text(config_yaml)
    manifest.write(tmp, manifest.build(tmp, digests))
    # Re-running a step after a resume replaces that step's checkpoint; the rename is the commit.
    final = publish(tmp, tmp.parent / f"step_{state.step}")
    for _, old in step_dirs(tmp.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_driver_state(ckpt: Path) -> DriverState:
    path = ckpt / "driver_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt}: not a complete checkpoint (no driver_state.json)")
    return DriverState(**json.loads(path.read_text()))


def latest_verified(root: Path, on_corrupt: str = "fallback", report=print) -> Path | None:
    """The newest checkpoint under ``root`` whose files match its manifest (None when there is none).

    A checkpoint that fails is reported (``report``: the file and the check). ``on_corrupt``:
    ``"fallback"`` tries the next older one, says which one was taken, and renames those that
    failed to ``step_N.corrupt`` (kept for inspection, skipped by retention and later resumes);
    ``"error"`` raises CheckpointCorrupt at the first failure. When checkpoints exist and none
    verifies, raises CheckpointCorrupt naming each failure.
    """
    if on_corrupt not in ("fallback", "error"):
        raise ValueError(f"on_corrupt must be 'fallback' or 'error', got {on_corrupt!r}")
    failed: list[tuple[Path, CheckpointCorrupt]] = []
    for _, path in reversed(step_dirs(root)):
        try:
            manifest.verify(path)
        except CheckpointCorrupt as err:
            report(f"checkpoint {path.name} fails verification: {err}")
            if on_corrupt == "error":
                raise CheckpointCorrupt(
                    err.ckpt, err.file, f"{err.check} (checkpoint.on_corrupt: error, so not falling back)"
                ) from None
            failed.append((path, err))
            continue
        for bad, _ in failed:
            aside = bad.with_name(bad.name + ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            bad.rename(aside)
            report(f"checkpoint {bad.name} set aside as {aside.name}")
        if failed:
            report(f"falling back to {path.name}, the newest checkpoint that verifies")
        return path
    if failed:
        detail = "; ".join(str(err) for _, err in failed)
        raise CheckpointCorrupt(root, "", f"no checkpoint verifies: {detail}")
    return None
