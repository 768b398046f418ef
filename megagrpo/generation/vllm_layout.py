"""vLLM's weight layout (0.32; its Qwen2 / Llama / Qwen3 and Qwen2-MoE / Qwen3-MoE models): where each HF
tensor goes among a vLLM worker's parameters, the :class:`~megagrpo.generation.engine.EngineLayout` of
``generation.engine: vllm``, which ``weight_sync.shards`` plans the sync with.

- ``q/k/v_proj`` are blocks 0, 1, 2 of ``self_attn.qkv_proj``; ``gate/up_proj`` (of the MLP or the shared
  expert) blocks 0, 1 of ``gate_up_proj``: both column-parallel, split along rows;
- ``o_proj`` and ``down_proj`` are row-parallel: split along columns;
- ``embed_tokens`` and ``lm_head`` split along rows of the vocabulary padded to a multiple of
  :data:`VLLM_VOCAB_PADDING`;
- a routed expert's ``gate/up`` go into ``mlp.experts.routed_experts.w13_weight[x]`` (blocks 0, 1 along
  rows) and its ``down`` into ``w2_weight[x]`` (along columns);
- everything else (norms, the router, the shared expert's gate) is whole on every worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megagrpo.weight_sync.shards import Placement

VLLM_VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: its embedding and LM head pad the vocabulary to a multiple of it
(a unit test checks it against the installed vLLM)."""

_FUSED = re.compile(
    r"^(.*\.)(?:self_attn\.([qkv])_proj|(mlp\.(?:shared_expert\.)?)(gate|up)_proj)\.(weight|bias)$"
)
_EXPERT = re.compile(r"^(.*\.mlp\.)experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.shared_expert.down_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_placement(hf_name: str) -> Placement:
    expert = _EXPERT.match(hf_name)
    if expert:
        prefix, index, proj = expert.groups()
        stacked = f"{prefix}experts.routed_experts."
        if proj == "down":
            return Placement(stacked + "w2_weight", 1, 0, int(index))
        return Placement(stacked + "w13_weight", 0, ("gate", "up").index(proj), int(index))
    match = _FUSED.match(hf_name)
    if match:
        prefix, qkv, mlp, gate_up, kind = match.groups()
        if qkv:
            return Placement(f"{prefix}self_attn.qkv_proj.{kind}", 0, "qkv".index(qkv))
        return Placement(f"{prefix}{mlp}gate_up_proj.{kind}", 0, ("gate", "up").index(gate_up))
    if hf_name.endswith(_ROW_PARALLEL):
        return Placement(hf_name, 1, 0)
    if hf_name in _VOCAB:
        return Placement(hf_name, 0, 0)
    return Placement(hf_name, -1, 0)


@dataclass(frozen=True)
class VLLMLayout:
    """vLLM's layout as an ``EngineLayout`` (a plain value: it travels to the trainer ranks with a call)."""

    name: str = "vLLM"

    def placement(self, hf_name: str) -> Placement:
        return vllm_placement(hf_name)

    def padded_vocab(self, vocab_size: int) -> int:
        return vllm_padded_vocab(vocab_size)


VLLM_LAYOUT = VLLMLayout()
