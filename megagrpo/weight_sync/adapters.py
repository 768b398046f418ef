"""The trainer's side of ``generation.lora_sync: adapter``: each pipeline stage's LoRA adapters, whole and
in PEFT's names, for the engines' own LoRA support (``generation.vllm_lora``).

Adapters are small (rank x (in + out) per adapted layer), so they are gathered whole over TP here and
travel as tensors through the controller (Ray's object store), not through the broadcast groups the
weight buckets use; vLLM cuts each worker's TP slices itself. A column-parallel layer's ``B`` is gathered
over its output rows (a gated ``linear_fc1``'s gate and up halves each), a row-parallel layer's ``A``
over its input columns (``models.lora``). The names and the split of Megatron's fused layers into HF
projections are the PEFT export's (``ckpt.lora_export.peft_tensors``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megagrpo.models.layout import ADAPTER_MODULE, stage_param_names
from megagrpo.models.lora import LoraAdapter, adapters
from megagrpo.weight_sync.buckets import checksum


def _gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def whole(adapter: LoraAdapter, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of ``adapter`` whole, on every TP rank (collective over TP)."""
    a, b = adapter.weight_a.detach(), adapter.weight_b.detach()
    tp = ctx.sizes.tp
    if tp == 1:
        return a, b
    group = ctx.pgs.tp
    if adapter.kind == "row":
        return torch.cat(_gather(a, group, tp), dim=1), b
    parts = _gather(b, group, tp)
    if adapter.gated:  # each rank holds [gate_r; up_r]: the whole is [gate; up]
        halves = [p.chunk(2, dim=0) for p in parts]
        return a, torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return a, torch.cat(parts, dim=0)


def stage_adapters(ctx, module: torch.nn.Module, info) -> dict[str, torch.Tensor] | None:
    """This stage's adapters as PEFT tensors (``base_model.model.<hf module>.lora_A|B.weight``, in the
    model's dtype), on the stage's first rank (TP, DP and CP rank 0); None on the others. Collective over
    the stage's TP group."""
    from megagrpo.ckpt.lora_export import peft_tensors

    names = stage_param_names(module, ctx, info.shape.num_layers)
    found = {}
    for name, _, adapter in adapters(module):
        a, b = whole(adapter, ctx)
        linear = names[f"{name}.weight"].removesuffix(".weight")
        found[f"{linear}.{ADAPTER_MODULE}.weight_a"], found[f"{linear}.{ADAPTER_MODULE}.weight_b"] = a, b
    if not (ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.cp_rank == 0):
        return None
    tensors, _ = peft_tensors(found, info.arch, info.shape, info.dtype)
    return {name: t.cpu() for name, t in tensors.items()}


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of named tensors: one entry ``name:dtype:shape:checksum`` per tensor (``buckets.checksum``),
    sorted and joined by ``;``, so that the digests of parts (pipeline stages) join into the whole's, and
    a mismatch names its tensor. What the trainer sent and what each engine worker built its adapter
    from."""
    entries = (f"{name}:{t.dtype}:{tuple(t.shape)}:{checksum(t.contiguous())}" for name, t in tensors.items())
    return ";".join(sorted(entries))


def peft_elements_per_layer(shape, targets: tuple[str, ...], rank: int) -> int:
    """Elements of one transformer layer's adapters as an adapter sync sends them (PEFT's form: the fused
    QKV and gate/up adapters one per HF projection, each with its own copy of the shared ``A``), for
    ``megagrpo plan``."""
    h, d, ffn = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    per_target = {
        "linear_qkv": rank * (3 * h + q + 2 * kv),
        "linear_proj": rank * (q + h),
        "linear_fc1": rank * (2 * h + 2 * ffn),
        "linear_fc2": rank * (ffn + h),
    }
    return sum(per_target[t] for t in targets)


def adapter_sync_bytes(cfg, shape, itemsize: int) -> int:
    """Bytes of the adapters one adapter sync sends (``generation.lora_sync: adapter``; 0 otherwise)."""
    lora = cfg.policy.lora
    if not (lora.enabled and cfg.generation.lora_sync == "adapter"):
        return 0
    return shape.num_layers * peft_elements_per_layer(shape, lora.targets, lora.rank) * itemsize
