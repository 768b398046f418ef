"""LoRA checkpoints: the adapters (a Megatron distributed checkpoint, reshardable) and what they adapt.

A checkpoint of a ``policy.lora`` run holds ``adapters/`` (the adapters only), ``optimizer/`` (their Adam
state: the base has none), ``trainer_state.json`` and ``lora.json``: the adapter settings and a reference
to the base the adapters were trained on, by path and digest (xxh3-64 over the base's weight files, in
name order; for a tiny in-process model, over its shape, dtype and initialisation seed, which determine
it). Loading checks that the run's base is that one, before any adapter is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xxhash

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.dist_files import check_entry_kinds, trusted_metadata_only
from megagrpo.ckpt.durable import atomic_write

if TYPE_CHECKING:
    from megagrpo.config.model import ModelConfig
    from megagrpo.models.description import ModelDescription
    from megagrpo.models.lora import LoraSpec

ADAPTERS_DIR = "adapters"
LORA_META = "lora.json"
_CHUNK = 16 << 20


def _files_digest(files: list[Path], root: Path) -> str:
    digest = xxhash.xxh3_64()
    for file in files:
        digest.update(str(file.relative_to(root)).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def base_reference(info: ModelDescription, model: ModelConfig, *, seed: int) -> dict:
    """{"source", "path", "digest"} of the base weights the policy was built from (``seed``: the
    initialisation seed of a tiny model)."""
    if info.megatron_ckpt is not None:
        root = Path(info.megatron_ckpt) / "megatron"
        files = sorted(p for p in root.rglob("*") if p.is_file())
        return {
            "source": "megatron_ckpt",
            "path": str(info.megatron_ckpt),
            "digest": _files_digest(files, root),
        }
    if info.hf_dir is not None:
        root = Path(info.hf_dir)
        files = sorted(root.glob("*.safetensors"))
        return {"source": "hf_dir", "path": str(root), "digest": _files_digest(files, root)}
    described = json.dumps(
        {"arch": model.arch, "dtype": model.dtype, "tiny": dataclasses.asdict(model.tiny), "seed": seed},
        sort_keys=True,
    )
    return {"source": "tiny", "path": None, "digest": xxhash.xxh3_64_hexdigest(described.encode())}


def write_lora_meta(path: Path, spec: LoraSpec, base: dict) -> None:
    meta = {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "dropout": spec.dropout,
        "target_modules": list(spec.target_modules),
        "seed": spec.seed,
        "base": base,
    }
    atomic_write(path / LORA_META, json.dumps(meta, indent=2) + "\n")


def read_lora_meta(path: Path) -> dict:
    """``lora.json`` of checkpoint ``path``; a CheckpointError naming the key when it has none."""
    meta_path = Path(path) / LORA_META
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path}: no {LORA_META}: not a checkpoint of a LoRA run (policy.lora.rank was 0), so it holds "
            "no adapters to export"
        )
    return json.loads(meta_path.read_text())


def check_lora_meta(path: Path, spec: LoraSpec, base: dict) -> None:
    """Refuse to load adapters trained with other settings or on another base."""
    meta = read_lora_meta(path)
    for key, want in (("rank", spec.rank), ("target_modules", list(spec.target_modules))):
        if meta.get(key) != want:
            raise CheckpointError(
                f"{path / LORA_META}: adapters of {key} {meta.get(key)!r}, this run's "
                f"policy.lora.{key} is {want!r}"
            )
    if meta.get("base", {}).get("digest") != base["digest"]:
        raise CheckpointError(
            f"{path / LORA_META}: the adapters were trained on base {meta.get('base')}, this run's base is "
            f"{base} (model.hf_dir / model.megatron_ckpt / model.tiny differ)"
        )


def load_adapters(model: torch.nn.Module, state: dict, path: Path) -> None:
    """Fill ``model``'s adapters from the distributed checkpoint at ``path`` (``state``: their sharded
    state dict, ``models.lora.adapter_state_dict``), at this job's layout whatever it was saved with."""
    from megatron.core import dist_checkpointing

    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: not a distributed checkpoint of adapters (no metadata.json)")
    targets = {key: _local_tensor(entry) for key, entry in state.items()}
    check_entry_kinds(state, path)
    with trusted_metadata_only():
        loaded = dist_checkpointing.load(state, str(path))
    with torch.no_grad():
        for key, tensor in loaded.items():
            if tensor.data_ptr() != targets[key].data_ptr():
                targets[key].copy_(tensor)


def _local_tensor(entry) -> torch.Tensor:
    """The parameter behind a ShardedTensor (or a gate/up factory of one)."""
    return entry.data
