"""The declarative HF <-> Megatron parameter map of a decoder-only model.

One table of rules per model shape, used in both directions by the converters, by weight sync
and by the tests. A rule names one Megatron parameter (canonical name: local layer spec, global
layer index, full TP=1 tensor with padded vocabulary) and the HF tensors it is made of, plus the
transform between them:

- ``copy``:  one tensor, same layout;
- ``qkv``:   HF q/k/v projections <-> Megatron's ``linear_qkv``, whose rows are interleaved per
             query group: ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]``;
- ``gated``: HF gate/up projections <-> Megatron's ``linear_fc1`` rows ``[gate; up]``;
- ``vocab``: embedding/output rows, padded with zeros to Megatron's padded vocabulary on import
             and trimmed on export.

Wildcards: ``*`` in a name stands for the layer index on both sides.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from megagrpo.models.shape import GPTShape

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer;
# its parameter names map onto the local spec's canonical ones.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


# Transformer Engine's grouped-GEMM experts (Megatron's ``TEGroupedMLP``, which its TE spec builds
# with ``moe_grouped_gemm``) hold one ``linear_fc1`` / ``linear_fc2`` per MoE layer, a ``TEGroupedLinear``
# whose i-th GEMM's weight is the parameter ``weight{i}`` (``bias{i}``), i the local expert index; the
# local spec's ``SequentialMLP`` names the same tensor ``local_experts.{i}.linear_fc1.weight``. Same
# shape: an expert's [2 f / ETP, h] and [h, f / ETP].
_TE_GROUPED_RE = re.compile(r"^(.*\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_SEQUENTIAL_RE = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
# Megatron's legacy ``GroupedMLP`` fuses every local expert into two tensors; the map has no rule for
# them, and the builder never selects it (``builder.layer_spec`` refuses it).
LEGACY_GROUPED_RE = re.compile(r"\.mlp\.experts\.weight[12]$")


def canonical_name(name: str) -> str:
    """A Megatron parameter name as the local layer spec spells it (TE's fused norms and grouped-GEMM
    experts as the local spec's separate norms and ``SequentialMLP`` experts)."""
    grouped = _TE_GROUPED_RE.match(name)
    if grouped:
        prefix, linear, kind, expert = grouped.groups()
        return f"{prefix}local_experts.{expert}.{linear}.{kind}"
    for te_suffix, local_suffix in _TE_ALIASES.items():
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


def te_grouped_name(name: str) -> str:
    """A canonical routed expert's name as Transformer Engine's grouped experts spell it
    (``...experts.local_experts.3.linear_fc1.weight`` -> ``...experts.linear_fc1.weight3``); the inverse
    of :func:`canonical_name` for them, other names unchanged."""
    sequential = _SEQUENTIAL_RE.match(name)
    if sequential is None:
        return name
    prefix, expert, linear, kind = sequential.groups()
    return f"{prefix}{linear}.{kind}{expert}"


def te_name(name: str) -> str:
    """A canonical Megatron parameter name as Transformer Engine's layers spell it (the norm fused
    into the next linear layer). Megatron's local and torch layer specs checkpoint under these names
    too (their ``sharded_state_dict_keys_map``), so a checkpoint written by one layer implementation
    names its tensors as the other asks for them."""
    for te_suffix, local_suffix in _TE_ALIASES.items():
        if name.endswith(local_suffix):
            return name[: -len(local_suffix)] + te_suffix
    return name


@dataclass(frozen=True)
class Rule:
    megatron: str
    """Canonical Megatron parameter name (may contain ``*`` for the layer index)."""
    hf: tuple[str, ...]
    """HF tensor names it is built from, in the order the transform expects."""
    transform: str = "copy"
    """One of copy, qkv, gated, vocab."""
    export: bool = True
    """False for a Megatron parameter that has no HF tensor of its own (a tied output layer)."""

    def at_layer(self, layer: int) -> Rule:
        return Rule(
            megatron=self.megatron.replace("*", str(layer)),
            hf=tuple(n.replace("*", str(layer)) for n in self.hf),
            transform=self.transform,
            export=self.export,
        )


def _mlp_rules(megatron: str, hf: str) -> list[Rule]:
    """A SwiGLU MLP: Megatron's ``<megatron>.linear_fc1`` ([gate; up]) and ``linear_fc2`` (per layer)."""
    return [
        Rule(
            f"decoder.layers.*.{megatron}.linear_fc1.weight",
            (f"model.layers.*.{hf}.gate_proj.weight", f"model.layers.*.{hf}.up_proj.weight"),
            "gated",
        ),
        Rule(f"decoder.layers.*.{megatron}.linear_fc2.weight", (f"model.layers.*.{hf}.down_proj.weight",)),
    ]


def _moe_rules(shape: GPTShape) -> list[Rule]:
    """A mixture-of-experts MLP: the router, every expert's MLP (by its global index: under expert
    parallelism a rank holds ``local_experts`` 0.. of its own range, see ``layout.expert_global_name``),
    and Qwen2-MoE's shared expert with its sigmoid gate."""
    rules = [Rule("decoder.layers.*.mlp.router.weight", ("model.layers.*.mlp.gate.weight",))]
    for e in range(shape.num_experts):
        rules += _mlp_rules(f"mlp.experts.local_experts.{e}", f"mlp.experts.{e}")
    if shape.moe_shared_expert_ffn_hidden_size:
        rules += _mlp_rules("mlp.shared_experts", "mlp.shared_expert")
        rules.append(
            Rule(
                "decoder.layers.*.mlp.shared_experts.gate_weight",
                ("model.layers.*.mlp.shared_expert_gate.weight",),
            )
        )
    return rules


def decoder_rules(shape: GPTShape) -> list[Rule]:
    """Concrete (layer-expanded) rules for a Qwen2/Llama/Qwen3-style decoder of ``shape``."""
    layer = [
        Rule("decoder.layers.*.input_layernorm.weight", ("model.layers.*.input_layernorm.weight",)),
        Rule(
            "decoder.layers.*.self_attention.linear_qkv.weight",
            tuple(f"model.layers.*.self_attn.{p}_proj.weight" for p in "qkv"),
            "qkv",
        ),
        Rule(
            "decoder.layers.*.self_attention.linear_proj.weight", ("model.layers.*.self_attn.o_proj.weight",)
        ),
        Rule(
            "decoder.layers.*.pre_mlp_layernorm.weight", ("model.layers.*.post_attention_layernorm.weight",)
        ),
        *(_moe_rules(shape) if shape.is_moe else _mlp_rules("mlp", "mlp")),
    ]
    if shape.qkv_bias:
        layer.append(
            Rule(
                "decoder.layers.*.self_attention.linear_qkv.bias",
                tuple(f"model.layers.*.self_attn.{p}_proj.bias" for p in "qkv"),
                "qkv",
            )
        )
    if shape.qk_layernorm:
        layer += [
            Rule(
                "decoder.layers.*.self_attention.q_layernorm.weight",
                ("model.layers.*.self_attn.q_norm.weight",),
            ),
            Rule(
                "decoder.layers.*.self_attention.k_layernorm.weight",
                ("model.layers.*.self_attn.k_norm.weight",),
            ),
        ]
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    rules += [rule.at_layer(i) for i in range(shape.num_layers) for rule in layer]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if shape.tie_word_embeddings:
        # Under PP the last stage keeps its own copy of the tied embedding as output_layer.
        rules.append(Rule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", export=False))
    else:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def megatron_shape(rule: Rule, hf_shapes: dict[str, tuple[int, ...]], padded_vocab: int) -> tuple[int, ...]:
    """The full canonical Megatron tensor's shape of ``rule`` (TP = 1, padded vocabulary), from the
    shapes of its HF tensors, as :func:`to_megatron` makes it."""
    first = hf_shapes[rule.hf[0]]
    if rule.transform == "vocab":
        return (padded_vocab, *first[1:])
    return (sum(hf_shapes[n][0] for n in rule.hf), *first[1:])


def megatron_numel(rule: Rule, hf_shapes: dict[str, tuple[int, ...]], padded_vocab: int) -> int:
    return math.prod(megatron_shape(rule, hf_shapes, padded_vocab))


def _mlp_shapes(prefix: str, h: int, ffn: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (ffn, h),
        prefix + "up_proj.weight": (ffn, h),
        prefix + "down_proj.weight": (h, ffn),
    }


def _moe_shapes(shape: GPTShape, p: str) -> dict[str, tuple[int, ...]]:
    h = shape.hidden_size
    shapes = {p + "mlp.gate.weight": (shape.num_experts, h)}
    for e in range(shape.num_experts):
        shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", h, shape.moe_ffn_hidden_size))
    if shape.moe_shared_expert_ffn_hidden_size:
        shapes.update(_mlp_shapes(p + "mlp.shared_expert.", h, shape.moe_shared_expert_ffn_hidden_size))
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def hf_tensor_shapes(shape: GPTShape) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``shape`` holds, with its shape (for validating inputs)."""
    h, hd, ffn = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    q_rows, kv_rows = shape.num_attention_heads * hd, shape.num_query_groups * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_rows, h),
                p + "self_attn.k_proj.weight": (kv_rows, h),
                p + "self_attn.v_proj.weight": (kv_rows, h),
                p + "self_attn.o_proj.weight": (h, q_rows),
            }
        )
        shapes.update(_moe_shapes(shape, p) if shape.is_moe else _mlp_shapes(p + "mlp.", h, ffn))
        if shape.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q_rows,),
                    p + "self_attn.k_proj.bias": (kv_rows,),
                    p + "self_attn.v_proj.bias": (kv_rows,),
                }
            )
        if shape.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: GPTShape) -> torch.Tensor:
    groups, hd = shape.num_query_groups, shape.head_dim
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    per_group = [
        q.reshape(groups, -1, *rest),  # [groups, q_heads_per_group * hd, ...]
        k.reshape(groups, hd, *rest),
        v.reshape(groups, hd, *rest),
    ]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def _qkv_to_hf(qkv: torch.Tensor, shape: GPTShape) -> list[torch.Tensor]:
    groups, hd = shape.num_query_groups, shape.head_dim
    q_rows = shape.num_attention_heads // groups * hd
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, q_rows + 2 * hd, *rest)
    q, k, v = grouped.split([q_rows, hd, hd], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def to_megatron(rule: Rule, hf: list[torch.Tensor], shape: GPTShape, padded_vocab: int) -> torch.Tensor:
    """The full canonical Megatron tensor of ``rule`` from its HF tensors."""
    if rule.transform == "copy":
        return hf[0]
    if rule.transform == "qkv":
        return _qkv_to_megatron(*hf, shape)
    if rule.transform == "gated":
        return torch.cat(hf, dim=0)
    if rule.transform == "vocab":
        rows = hf[0]
        if padded_vocab == rows.shape[0]:
            return rows
        pad = rows.new_zeros(padded_vocab - rows.shape[0], *rows.shape[1:])
        return torch.cat([rows, pad], dim=0)
    raise AssertionError(f"unknown transform {rule.transform}")


@dataclass(frozen=True)
class RowRead:
    """Rows ``[start, stop)`` of HF tensor ``hf`` land at row ``dest`` of a Megatron shard."""

    hf: str
    start: int
    stop: int
    dest: int


@dataclass(frozen=True)
class ShardRows:
    """A TP shard of a Megatron tensor as whole rows of its HF tensors (rows of a 1-D tensor are
    its elements). Shard rows that no read covers (vocabulary padding) are zero."""

    rows: int
    reads: tuple[RowRead, ...]


def shard_rows(
    rule: Rule,
    hf_rows: dict[str, int],
    shape: GPTShape,
    padded_vocab: int,
    *,
    partition_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> ShardRows | None:
    """Where each row of this rank's shard of ``to_megatron(rule, ...)`` comes from, or None where
    the shard is not made of whole HF rows (a split along dim 1 at TP > 1).

    ``hf_rows``: the first dimension of each HF tensor of the rule. The shard equals
    ``tp_shard(to_megatron(...))``: readers can fill it straight from the file, row range by row
    range, with no full tensor in between (the tests check the two agree for every transform).
    """
    if partition_dim < 0 or tp_size == 1:
        tp_rank, tp_size = 0, 1
    elif partition_dim != 0:
        return None
    r = tp_rank

    def split(name: str) -> tuple[int, int]:
        per = hf_rows[name] // tp_size
        return r * per, (r + 1) * per

    if rule.transform == "copy":
        (name,) = rule.hf
        lo, hi = split(name)
        return ShardRows(hi - lo, (RowRead(name, lo, hi, 0),))
    if rule.transform == "gated":
        gate, up = rule.hf
        lo, hi = split(gate)
        return ShardRows(2 * (hi - lo), (RowRead(gate, lo, hi, 0), RowRead(up, lo, hi, hi - lo)))
    if rule.transform == "vocab":
        (name,) = rule.hf
        per = padded_vocab // tp_size
        lo, hi = r * per, min((r + 1) * per, hf_rows[name])
        return ShardRows(per, (RowRead(name, lo, hi, 0),) if lo < hi else ())
    if rule.transform == "qkv":
        q, k, v = rule.hf
        groups, hd = shape.num_query_groups, shape.head_dim
        q_rows = hf_rows[q] // groups
        block = q_rows + 2 * hd
        per = groups // tp_size
        reads = []
        for j, g in enumerate(range(r * per, (r + 1) * per)):
            base = j * block
            reads += [
                RowRead(q, g * q_rows, (g + 1) * q_rows, base),
                RowRead(k, g * hd, (g + 1) * hd, base + q_rows),
                RowRead(v, g * hd, (g + 1) * hd, base + q_rows + hd),
            ]
        return ShardRows(per * block, tuple(reads))
    raise AssertionError(f"unknown transform {rule.transform}")


def to_hf(rule: Rule, tensor: torch.Tensor, shape: GPTShape) -> list[torch.Tensor]:
    """The HF tensors of ``rule`` (in ``rule.hf`` order) from the full canonical Megatron tensor."""
    if rule.transform == "copy":
        return [tensor]
    if rule.transform == "qkv":
        return _qkv_to_hf(tensor, shape)
    if rule.transform == "gated":
        return list(tensor.chunk(2, dim=0))
    if rule.transform == "vocab":
        return [tensor[: shape.vocab_size]]
    raise AssertionError(f"unknown transform {rule.transform}")
