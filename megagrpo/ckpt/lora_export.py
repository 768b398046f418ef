"""Exports of a LoRA run's checkpoint: a PEFT adapter directory, and the base with the adapters merged in.

Both run on one rank (TP = PP = 1) in this process: the adapters are read from the checkpoint's reshardable
``adapters/`` (whole, whatever layout trained them), onto a stage built with the same adapters.

- :func:`export_peft`: ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names for
  the HF model (``base_model.model.<hf module>.lora_A.weight`` / ``lora_B.weight``). A fused Megatron layer
  becomes one PEFT adapter per HF projection: ``linear_qkv``'s ``B`` rows split into q/k/v (de-interleaved
  per query group, as the base weight), ``linear_fc1``'s into gate/up, each with the same ``A`` (the
  low-rank activation ``A x`` is shared, so the sum is the same update).
- :func:`export_merged`: an HF directory of ``W + alpha / r * B @ A`` for every adapted weight, through the
  same map and writer as ``megatron_to_hf``; the base is read from where ``lora.json`` says it is (an HF
  directory or a megagrpo checkpoint), so a tiny in-process base, stored nowhere, cannot be merged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.durable import atomic_output_dir, atomic_write
from megagrpo.ckpt.hf_files import HFCheckpoint, copy_aux_files, write_sharded
from megagrpo.ckpt.hf_weights import hf_tensors_from_full, load_hf_into_stage
from megagrpo.ckpt.lora import ADAPTERS_DIR, load_adapters, read_lora_meta
from megagrpo.ckpt.megatron import load_megatron, read_model
from megagrpo.ckpt.peft_merge import PEFT_CONFIG, PEFT_WEIGHTS
from megagrpo.models.builder import build_stage
from megagrpo.models.layout import stage_param_names
from megagrpo.models.lora import (
    LoraSpec,
    adapter_state_dict,
    adapter_tensors,
    attach,
    merged,
)
from megagrpo.models.mapping import hf_tensor_shapes, to_hf
from megagrpo.parallel import ParallelSizes, destroy_parallel, init_parallel
from megagrpo.parallel.local import run_in_this_process, run_local_ranks

_PEFT_PREFIX = "base_model.model."


def is_lora_checkpoint(ckpt: str | Path) -> bool:
    return (Path(ckpt) / ADAPTERS_DIR).is_dir()


def _spec(meta: dict) -> LoraSpec:
    return LoraSpec(
        rank=meta["rank"],
        alpha=meta["alpha"],
        dropout=meta["dropout"],
        target_modules=tuple(meta["target_modules"]),
        seed=meta["seed"],
    )


def _with_adapted_stage(ckpt: Path, fn, *, with_base: bool):
    """``fn(model, global names, source, meta)`` on a one-rank stage holding the checkpoint's adapters (and,
    ``with_base``, the base weights they adapt)."""
    meta = read_lora_meta(ckpt)
    source = read_model(ckpt)
    base = meta["base"]
    if with_base and base["source"] == "tiny":
        raise CheckpointError(
            f"{ckpt / 'lora.json'}: the base is a tiny in-process model (model.tiny), stored in no file: "
            "there is nothing to merge the adapters into; export the PEFT adapter instead"
        )
    ctx = init_parallel(ParallelSizes(), backend="gloo")
    try:
        model = build_stage(ctx, source.shape, source.dtype)  # filled by the loads below
        names = stage_param_names(model, ctx, source.shape.num_layers)
        if with_base and base["source"] == "hf_dir":
            rules = source.arch.rules(source.shape)
            load_hf_into_stage(model, ctx, HFCheckpoint(Path(base["path"])), source.shape, rules)
        elif with_base:
            load_megatron(model, Path(base["path"]) / "megatron")
        attach(model, _spec(meta), names)
        load_adapters(model, adapter_state_dict(model, names, ctx), ckpt / ADAPTERS_DIR)
        return fn(model, names, source, meta)
    finally:
        destroy_parallel()


def peft_tensors(found: dict, arch, shape, dtype) -> tuple[dict, list[str]]:
    """(PEFT tensors by key, HF module names adapted) of whole adapters ``found`` by
    ``<global linear name>.lora.weight_a|b`` (``models.lora.adapter_tensors``); also what an adapter sync
    sends (``weight_sync.adapters``)."""
    rules = {r.megatron: r for r in arch.rules(shape)}
    tensors, modules = {}, set()
    for key in sorted(k for k in found if k.endswith(".weight_a")):
        linear = key.removesuffix(".lora.weight_a")
        rule = rules[f"{linear}.weight"]
        a, b = found[key], found[f"{linear}.lora.weight_b"]
        for hf_name, b_hf in zip(rule.hf, to_hf(rule, b, shape), strict=True):
            module = hf_name.removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1])
            # copies: safetensors refuses tensors that share memory (the q/k/v adapters share A)
            tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.to(dtype, copy=True)
            tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b_hf.to(dtype, copy=True)
    return tensors, sorted(modules)


def _peft_rank(rank: int, world_size: int, ckpt: str) -> tuple[dict, list[str]]:
    """The one rank of :func:`export_peft`: (PEFT tensors by key, HF module names adapted)."""

    def collect(model, names, source, meta):
        return peft_tensors(adapter_tensors(model, names), source.arch, source.shape, source.dtype)

    return _with_adapted_stage(Path(ckpt), collect, with_base=False)


def _merged_rank(rank: int, world_size: int, ckpt: str, out: str, max_shard_bytes: int) -> int:
    """The one rank of :func:`export_merged`: the merged HF tensors into ``out`` (an existing directory)."""

    def write(model, names, source, meta):
        rules = source.arch.rules(source.shape)
        shapes = hf_tensor_shapes(source.shape)
        with merged(model):
            params = dict(model.named_parameters())
            full = {names[local]: params[local].detach() for local in names}
            specs = [
                (name, shapes[name], source.dtype)
                for rule in rules
                if rule.export and rule.megatron in full
                for name in rule.hf
            ]
            tensors = ((n, t.to(source.dtype)) for n, t in hf_tensors_from_full(full, source.shape, rules))
            write_sharded(Path(out), specs, tensors, max_shard_bytes)
        return sum(math.prod(s) * d.itemsize for _, s, d in specs)

    return _with_adapted_stage(Path(ckpt), write, with_base=True)


def _one_rank(fn, in_process: bool, *args):
    """``fn`` as the only rank: here (a command-line tool, which exits next) or in a spawned process (a
    trainer's driver, whose own process groups must not be touched)."""
    if in_process:
        return run_in_this_process(fn, *args)
    (result,) = run_local_ranks(fn, 1, *args, timeout_s=24 * 3600)
    return result


def export_peft(ckpt: str | Path, out: str | Path, *, in_process: bool = False) -> Path:
    """A PEFT LoRA adapter directory at ``out`` from the LoRA checkpoint ``ckpt`` (written aside, then
    renamed)."""
    from safetensors.torch import save_file

    ckpt, out = Path(ckpt), Path(out)
    check_exportable(ckpt)
    meta = read_lora_meta(ckpt)
    tensors, modules = _one_rank(_peft_rank, in_process, str(ckpt))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": meta["base"]["path"],
        "r": meta["rank"],
        "lora_alpha": meta["alpha"],
        "lora_dropout": meta["dropout"],
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    with atomic_output_dir(out) as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        atomic_write(tmp / PEFT_CONFIG, json.dumps(config, indent=2) + "\n")
    return out


def export_merged(
    ckpt: str | Path, out: str | Path, *, max_shard_bytes: int = 5 << 30, in_process: bool = False
) -> Path:
    """An HF directory at ``out`` of the base with the checkpoint's adapters merged in."""
    ckpt, out = Path(ckpt), Path(out)
    check_exportable(ckpt)
    source = read_model(ckpt)
    with atomic_output_dir(out) as tmp:
        _one_rank(_merged_rank, in_process, str(ckpt), str(tmp), max_shard_bytes)
        copy_aux_files(source.hf_dir, tmp)
    return out


def check_exportable(ckpt: str | Path) -> None:
    """An adapter export asked of a checkpoint without adapters: an error naming the key."""
    if not is_lora_checkpoint(ckpt):
        raise CheckpointError(
            f"{ckpt}: holds no adapters (policy.lora.rank was 0 in the run that wrote it): a PEFT adapter "
            "export needs a checkpoint of a run with policy.lora.rank > 0"
        )
