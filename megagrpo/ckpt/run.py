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

The policy ranks write their parts collectively; on multi-node runs ``checkpoint.dir`` must be a
filesystem every node sees.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.ckpt.durable import publish

_STEP_RE = re.compile(r"^step_(\d+)$")


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


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for checkpoint ``step`` (leftovers of killed writes are removed)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".step_{step}.tmp"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, state: DriverState, config_yaml: str, keep_last: int) -> Path:
    """Write the driver's part, rename ``tmp`` to ``step_N`` and drop all but the newest ``keep_last``."""
    (tmp / "driver_state.json").write_text(json.dumps(state.__dict__) + "\n")
    (tmp / "config.yaml").write_text(config_yaml)
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
