"""Megatron layers on PyTorch's own fused kernels (``parallel.transformer_impl: torch``).

The decoder layer is Megatron's local one (``SelfAttention`` + ``MLP`` with Megatron's tensor-parallel
linears, same parameter names, same checkpoint keys), with two modules swapped:

- core attention: ``torch.nn.functional.scaled_dot_product_attention``, causal, grouped-query
  attention without repeating K/V (``enable_gqa``) wherever the kernel takes it: PyTorch's flash /
  memory-efficient / cuDNN kernels on CUDA, its flash kernel on CPU. No [s, s] score, probability or
  mask tensor exists; Megatron's local attention keeps [b, heads, s, s] fp32 probabilities for the
  backward pass.
- RMSNorm: ``torch.nn.RMSNorm`` (``torch.nn.functional.rms_norm``, a fused kernel on CUDA), which
  unlike Megatron's wrapper of it also runs under sequence parallelism.

Packed micro-batches (THD: the sequences end to end in one row, boundaries in ``PackedSeqParams``)
go through ``torch.nn.attention.varlen.varlen_attn`` (flash attention over cumulative sequence
lengths) where it runs: CUDA, fp16/bf16. Elsewhere (every CPU, fp32 on CUDA) PyTorch 2.13 has no
variable-length kernel (``aten::_flash_attention_forward`` is CUDA-only), and each sequence goes
through causal SDPA on its own segment: the same result, one kernel call per sequence.

Context parallelism is not implemented here (it needs Transformer Engine's ring attention; the
config checks refuse CP with these layers). Tensor, pipeline and sequence parallelism are Megatron's
own: the linears and the schedule are unchanged, and the norms' weights carry the
``sequence_parallel`` attribute that makes Megatron all-reduce their gradients over TP.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math

import torch
import torch.nn.functional as F

__all__ = ["RMSNorm", "SDPAttention", "block_spec", "layer_spec"]

# Kernels that take K/V with fewer heads than Q (``enable_gqa``) without repeating them: PyTorch's
# flash kernels (CPU flash in every dtype; CUDA flash and cuDNN in fp16/bf16). The CUDA
# memory-efficient kernel, PyTorch's only fused one for fp32, does not, and SDPA would fall back to
# its unfused math kernel; K/V are repeated for it instead (memory O(s), not O(s^2)).
_GQA_NATIVE_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def _gqa_native(query: torch.Tensor) -> bool:
    return query.device.type != "cuda" or query.dtype in _GQA_NATIVE_CUDA_DTYPES


@functools.cache
def _varlen_options() -> frozenset[str] | None:
    """The keyword arguments of this PyTorch's ``varlen_attn``, None without it. Its signature has moved
    between releases: causal is ``window_size=(-1, 0)`` or ``is_causal=True``, and ``enable_gqa``
    (K/V with fewer heads) is in some releases only."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_available(query: torch.Tensor) -> bool:
    """Whether PyTorch's variable-length flash attention can run on ``query`` (CUDA, fp16/bf16)."""
    if query.device.type != "cuda" or query.dtype not in _GQA_NATIVE_CUDA_DTYPES:
        return False
    options = _varlen_options()
    return options is not None and ("window_size" in options or "is_causal" in options)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way Megatron builds a norm (``config, hidden_size, eps``).

    Under sequence parallelism each TP rank normalises its own slice of the sequence, so each holds
    part of the weight's gradient: the ``sequence_parallel`` attribute makes Megatron's
    ``finalize_model_grads`` all-reduce it over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"the torch layers implement RMSNorm only, config asks for {config.normalization}"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("the torch layers' RMSNorm has no zero-centered gamma")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


class SDPAttention(torch.nn.Module):
    """Megatron's core-attention interface over ``scaled_dot_product_attention`` (causal only).

    In:  query [s, b, heads / tp, d], key and value [s, b, groups / tp, d]; THD: [t, heads / tp, d].
    Out: [s, b, heads / tp * d]; THD: [t, heads / tp * d].
    The ``attention_mask`` argument is not read: attention is causal by construction, and the right
    padding of a micro-batch's rows comes after every real token, so no real token sees it.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.utils import divide

        super().__init__()
        if config.context_parallel_size > 1:
            raise ValueError("the torch layers have no context-parallel attention; use transformer_engine")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"the torch layers implement causal attention only, got {attn_mask_type}")
        if config.apply_query_key_layer_scaling or config.softmax_type != "vanilla":
            raise ValueError("the torch layers implement plain softmax attention (no layer scaling, offsets)")
        if config.window_size is not None:
            raise ValueError("the torch layers implement full causal attention (no sliding window)")
        tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        self.config = config
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("the torch layers take no attention bias")
        dropout = self.dropout if self.training else 0.0
        if dropout > 0 and not self.config.sequence_parallel:
            # Dropout inside a TP region differs per TP rank: Megatron's tracker forks the RNG.
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._attend(query, key, value, packed_seq_params, dropout)
        return self._attend(query, key, value, packed_seq_params, dropout)

    def _attend(self, query, key, value, packed_seq_params, dropout: float) -> torch.Tensor:
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences must be THD, got {packed_seq_params.qkv_format!r}")
            return self._packed(query, key, value, packed_seq_params, dropout)
        s, b = query.shape[:2]
        q_BHSD = query.permute(1, 2, 0, 3)  # [b, heads, s, d]
        k_BGSD, v_BGSD = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, groups, s, d]
        out_BHSD = self._sdpa(q_BHSD, k_BGSD, v_BGSD, dropout)
        return out_BHSD.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads * d]

    def _sdpa(self, q, k, v, dropout: float) -> torch.Tensor:
        """Causal SDPA over [b, heads, s, d] queries and [b, groups, s, d] keys/values."""
        gqa = self.heads != self.groups
        if gqa and not _gqa_native(q):
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
            gqa = False
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale, enable_gqa=gqa
        )

    def _packed(self, query, key, value, params, dropout: float) -> torch.Tensor:
        """THD: query [t, heads, d], key/value [t, groups, d] -> [t, heads * d], causal per segment.

        Segments are ``cu_seqlens_q_padded`` (each sequence with its own padding, which comes after
        its tokens and so is never attended to by them) when given, else ``cu_seqlens_q``.
        """
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = (
            params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        )
        if cu_kv is not None and cu_kv is not cu and not torch.equal(cu_kv, cu):
            raise ValueError("self-attention over packed sequences needs the same boundaries for q and kv")
        t = query.shape[0]
        if dropout == 0.0 and _varlen_available(query):
            return self._varlen(query, key, value, cu, params.max_seqlen_q).reshape(t, -1)
        bounds = [int(x) for x in cu.tolist()]
        outs = []
        for start, end in itertools.pairwise(bounds):
            if end == start:
                continue
            # [len, heads, d] -> [1, heads, len, d]
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            outs.append(self._sdpa(q, k, v, dropout)[0].transpose(0, 1))  # [len, heads, d]
        if bounds[-1] != t:
            raise ValueError(f"packed boundaries end at {bounds[-1]}, the row holds {t} tokens")
        return torch.cat(outs, dim=0).reshape(t, -1)

    def _varlen(self, query, key, value, cu: torch.Tensor, max_len: int) -> torch.Tensor:
        """``varlen_attn`` over THD q [t, heads, d], k/v [t, groups, d] -> [t, heads, d], causal.

        ``max_len``: the longest segment (``max_seqlen_q`` of the padded segments, as the worker packs).
        """
        from torch.nn.attention.varlen import varlen_attn

        options = _varlen_options()
        kwargs = {"scale": self.scale}
        if "window_size" in options:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
        if self.heads != self.groups:
            if "enable_gqa" in options:
                kwargs["enable_gqa"] = True
            else:  # a release that checks head counts without a GQA switch
                key = key.repeat_interleave(self.heads // self.groups, dim=1)
                value = value.repeat_interleave(self.heads // self.groups, dim=1)
        cu32 = cu.to(device=query.device, dtype=torch.int32)
        return varlen_attn(query, key, value, cu32, cu32, max_len, max_len, **kwargs)


def layer_spec(qk_layernorm: bool = False):
    """The ``ModuleSpec`` of one decoder layer: Megatron's local layer with SDPA and torch RMSNorm.

    Same submodule names as ``get_gpt_layer_local_spec`` (so the same parameter names), and the same
    checkpoint key map (norm weights saved under Transformer Engine's names).
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    qk_norm = RMSNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def block_spec(config, pp_rank: int):
    """This pipeline stage's ``TransformerBlockSubmodules``: its layers and a torch RMSNorm as the
    final norm (given a bare layer spec, Megatron would pick its own, which refuses sequence
    parallelism). A mixture-of-experts model's layers take Megatron's MoE block (router, experts as
    ``SequentialMLP`` of tensor-parallel linears, the shared expert) as their MLP: with tensor
    parallelism Megatron's MoE layers need sequence parallelism, which these layers allow."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = layer_spec(config.qk_layernorm)
    if config.num_moe_experts:
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

        layer.submodules.mlp = get_moe_module_spec_for_backend(
            LocalSpecProvider(), num_experts=config.num_moe_experts, moe_grouped_gemm=False
        )
    layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=RMSNorm)
