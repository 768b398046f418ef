"""A PEFT LoRA adapter directory merged into its HF base: what ``megagrpo eval`` evaluates of one.

``merge_peft`` reads ``adapter_config.json`` + ``adapter_model.safetensors`` (``megagrpo export --peft``'s,
or any PEFT LoRA adapter with per-module ``lora_A`` / ``lora_B`` of the base's linear weights) and writes an
HF directory of the base with ``W + alpha / r * B @ A`` in place of every adapted weight, computed as the
merged export (``ckpt.lora_export.export_merged``) computes it (in fp32, rounded once to the base's dtype),
so that merging the PEFT export of a checkpoint gives that checkpoint's merged export byte for byte. The
base is ``base_model_name_or_path`` (a directory), or ``base`` when given. Every check (the base, each
adapter key's module and shape, the settings this merge does not implement) runs before anything is
written; an error names the file and the key.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.durable import atomic_output_dir
from megagrpo.ckpt.hf_files import HFCheckpoint, copy_aux_files, write_sharded

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
# Settings of a PEFT LoRA config this merge does not implement, and the value it needs.
_PLAIN = {
    "fan_in_fan_out": False,
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
    "target_parameters": None,
}


def is_peft_dir(path: str | Path) -> bool:
    return (Path(path) / PEFT_CONFIG).is_file()


def read_peft_config(adapter: Path) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter, its settings checked (errors name the key)."""
    path = adapter / PEFT_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable PEFT adapter config ({err})") from None
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters merge")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise CheckpointError(f"{path}: {key} must be a positive number, got {config.get(key)!r}")
    for key, plain in _PLAIN.items():
        if config.get(key, plain) not in (plain, None, [], {}):
            raise CheckpointError(
                f"{path}: {key} is {config[key]!r}; merging supports a plain LoRA adapter ({key} {plain!r})"
            )
    return config


def peft_base(adapter: Path, config: dict, base: str | Path | None) -> Path:
    """The HF directory the adapter adapts: ``base`` when given, else ``base_model_name_or_path``."""
    named = base if base is not None else config.get("base_model_name_or_path")
    how = "--base" if base is not None else f"{adapter / PEFT_CONFIG}: base_model_name_or_path"
    if not named:
        raise CheckpointError(
            f"{adapter / PEFT_CONFIG}: base_model_name_or_path is {named!r}: name the base HF directory "
            "with --base"
        )
    path = Path(named)
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{how} {named!r} is not an HF model directory here (no config.json); name the base with --base"
        )
    return path


def _adapter_pairs(adapter: Path, config: dict, base: HFCheckpoint) -> dict[str, tuple]:
    """{base weight name: (A, B)} of the adapter, each key and shape checked against the base."""
    from safetensors import safe_open

    path = adapter / PEFT_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{adapter}: no {PEFT_WEIGHTS} (only safetensors adapters are read)")
    found: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = _KEY.match(key)
            if match is None:
                raise CheckpointError(
                    f"{path}: tensor {key} is not a LoRA factor (base_model.model.<module>.lora_A|B.weight)"
                )
            weight = f"{match.group(1)}.weight"
            if weight not in base.tensors:
                raise CheckpointError(
                    f"{path}: tensor {key} adapts {weight}, which the base {base.dir} does not have"
                )
            found.setdefault(weight, {})[match.group(2)] = f.get_tensor(key)
    if not found:
        raise CheckpointError(f"{path}: holds no LoRA factors")
    rank = config["r"]
    for weight, factors in found.items():
        out, fan_in = base.tensors[weight].shape
        key = f"base_model.model.{weight.removesuffix('.weight')}.lora_"
        for side, want in (("A", (rank, fan_in)), ("B", (out, rank))):
            if side not in factors:
                raise CheckpointError(f"{path}: {key}{side}.weight is missing (its pair is there)")
            if tuple(factors[side].shape) != want:
                raise CheckpointError(
                    f"{path}: {key}{side}.weight has shape {list(factors[side].shape)}; rank r={rank} "
                    f"({PEFT_CONFIG}) and the base's {weight} {list((out, fan_in))} need {list(want)}"
                )
    return {w: (f["A"], f["B"]) for w, f in found.items()}


def merge_peft(
    adapter: str | Path, out: str | Path, *, base: str | Path | None = None, max_shard_bytes: int = 5 << 30
) -> Path:
    """An HF directory at ``out`` (written aside, then renamed) of the adapter's base with the adapter
    merged in; ``base`` overrides the config's ``base_model_name_or_path``."""
    adapter, out = Path(adapter), Path(out)
    config = read_peft_config(adapter)
    source = HFCheckpoint(peft_base(adapter, config, base))
    pairs = _adapter_pairs(adapter, config, source)
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    names = sorted(source.tensors)
    specs = [(n, source.tensors[n].shape, source.tensors[n].dtype) for n in names]

    def tensors():
        for name in names:
            weight = source.read(name)
            if name in pairs:
                a, b = pairs[name]
                # As the merged export: the fp32 weight plus the fp32 update, rounded once.
                delta = (b.float() @ a.float()) * scale
                weight = (weight.float() + delta).to(weight.dtype)
            yield name, weight

    with atomic_output_dir(out) as tmp:
        write_sharded(tmp, specs, tensors(), max_shard_bytes)
        copy_aux_files(source.dir, tmp)
    return out


def merged_for_eval(adapter: str | Path, out_dir: str | Path, *, base: str | Path | None = None) -> Path:
    """``megagrpo eval`` of a PEFT adapter: the merged model at ``out_dir/hf``, replacing an earlier
    eval's (merged aside, then swapped in)."""
    import shutil

    from megagrpo.ckpt.durable import publish

    final = Path(out_dir) / "hf"
    staging = final.with_name("hf.new")
    shutil.rmtree(staging, ignore_errors=True)
    return publish(merge_peft(adapter, staging, base=base), final)
