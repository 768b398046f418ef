"""Random Qwen2-shaped HF checkpoints, the inputs the benchmarks build instead of downloading one.

Shapes use the HF config's names (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``vocab_size``); the tensor list is written out here, independently of
megagrpo's own HF map, so that the conversion benchmark checks the converters against HF's layout.
A model is built once under ``benchmarks/results/tmp/`` and reused while its marker (the shape it
was built for) is unchanged.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from . import MB

QWEN2_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
"""The shape of the conversion and weight-sync benchmarks' models; layers are added to reach a size."""

MARKER = "bench-source.json"


def qwen2_tensor_shapes(shape: dict, num_layers: int, *, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2 checkpoint in HF order: embedding, layers, final norm, lm_head
    (none when ``tied``)."""
    h, ffn, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    q_rows, kv_rows = h, shape["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_rows, h),
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.weight": (kv_rows, h),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.weight": (kv_rows, h),
                p + "self_attn.v_proj.bias": (kv_rows,),
                p + "self_attn.o_proj.weight": (h, q_rows),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (ffn, h),
                p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not tied:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def qwen2_params(shape: dict, num_layers: int, *, tied: bool) -> int:
    """Parameters of a Qwen2 model (biases on q/k/v, two norms per layer, final norm; the embedding
    once when ``tied``)."""
    return sum(math.prod(s) for s in qwen2_tensor_shapes(shape, num_layers, tied=tied).values())


def layers_for(size_mb: float, model_bytes: Callable[[int], int]) -> int:
    """Fewest layers whose checkpoint (``model_bytes(layers)``) is at least ``size_mb`` MB."""
    layers = 1
    while model_bytes(layers) < size_mb * MB:
        layers += 1
    return layers


def cached_model(out: Path, marker: dict, write: Callable[[Path], None], what: str = "") -> Path:
    """``out`` if it was built for ``marker``; else ``write(tmp)`` into a fresh sibling directory,
    which is then renamed to ``out`` (an interrupted build leaves no directory that looks complete)."""
    marker_file = out / MARKER
    if marker_file.is_file() and json.loads(marker_file.read_text()) == marker:
        print(f"reusing model {out}", flush=True)
        return out
    print(f"writing model {out}{f' ({what})' if what else ''}", flush=True)
    shutil.rmtree(out, ignore_errors=True)  # first: two multi-GB models may not fit on the disk
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    (tmp / MARKER).write_text(json.dumps(marker) + "\n")
    os.replace(tmp, out)
    return out


def write_random_shards(out: Path, shapes: dict[str, tuple[int, ...]], num_shards: int, dtype) -> None:
    """Random weights (0.02 x standard normal, seed 0) as HF safetensors shards of about equal size
    plus their index, written shard by shard: at most one shard is in memory at a time."""
    import torch
    from safetensors.torch import save_file

    itemsize = dtype.itemsize
    total = sum(itemsize * math.prod(s) for s in shapes.values())
    cap = -(-total // num_shards)
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, shape in shapes.items():
        nbytes = itemsize * math.prod(shape)
        if groups[-1] and group_bytes + nbytes > cap:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {n: (0.02 * torch.randn(shapes[n], generator=gen)).to(dtype) for n in names}
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save_random_model(out: Path, config, *, vary_norms_and_biases: bool = False) -> None:
    """A model of transformers' ``config`` with its own random init (seed 0), saved in fp32 by
    ``save_pretrained``. ``vary_norms_and_biases``: norm weights ~ N(1, 0.1) and biases ~ N(0, 0.1)
    instead of ones and zeros, so that a weight transfer that drops them shows."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if vary_norms_and_biases:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.1)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.1)
    model.save_pretrained(out)
