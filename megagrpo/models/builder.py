"""Build Megatron ``GPTModel`` stages from a ``TransformerConfig``.

The layer spec is Transformer Engine's, ours on PyTorch's fused kernels (``torch_layers``) or
Megatron's local one, as ``transformer_impl`` says ("auto", for callers without a config, is resolved
by ``megagrpo.parallel.backends``). All three name their parameters alike (up to TE's fused norms,
which ``mapping.canonical_name`` aliases). Each pipeline stage builds only its own layers; the first
stage owns the embedding, the last the output layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megagrpo.models import torch_layers
from megagrpo.models.layout import tp_partition_dim
from megagrpo.models.mapping import canonical_name
from megagrpo.models.shape import GPTShape, padded_vocab_size
from megagrpo.parallel.backends import resolve_transformer_impl

if TYPE_CHECKING:
    from megagrpo.parallel import ParallelContext


def transformer_config(
    shape: GPTShape,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    on_cpu: bool = False,
    initialize: bool = True,
    recompute: str = "none",
    recompute_num_layers: int = 1,
    ep: int = 1,
    etp: int | None = None,
    moe_aux_loss_coeff: float = 0.0,
    routing_replay: bool = False,
):
    """The Megatron ``TransformerConfig`` for ``shape`` (RMSNorm + SwiGLU + RoPE decoder; mixture-of-
    experts MLPs split over ``ep`` expert-parallel ranks when the shape has experts, each expert's width
    over ``etp`` ranks, by default TP).

    ``initialize=False`` skips random initialisation (weights are about to be loaded).
    ``recompute``: "none", "core_attention" (selective) or "full" (groups of
    ``recompute_num_layers`` layers), as ``policy.recompute`` documents.
    """
    from megatron.core.transformer import TransformerConfig

    recompute_args = {
        "none": {},
        "core_attention": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
        "full": dict(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=recompute_num_layers,
        ),
    }
    if recompute not in recompute_args:
        raise ValueError(f"recompute must be one of {sorted(recompute_args)}, got {recompute!r}")
    config = TransformerConfig(
        **recompute_args[recompute],
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        layernorm_epsilon=shape.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=on_cpu,
        perform_initialization=initialize,
        # Megatron scales attention scores in fp32 only under fp16; keep softmax in fp32 throughout.
        attention_softmax_in_fp32=True,
        **moe_config(shape, ep=ep, etp=etp, aux_loss_coeff=moe_aux_loss_coeff, routing_replay=routing_replay),
    )
    check_router_replay(config)
    return config


def check_router_replay(config) -> None:
    """Refuse Megatron's fused router top-k together with router replay: in Megatron-Core 0.16.1
    ``topk_routing_with_score_function`` returns the fused kernel's experts before it looks at the
    router's replay, so the experts vLLM sampled with (``grpo.routing_replay``) would be ignored without
    a word and the trainer would route on its own."""
    if getattr(config, "moe_router_fusion", False) and getattr(config, "moe_enable_routing_replay", False):
        raise ValueError(
            "moe_router_fusion (Megatron's fused router top-k) with grpo.routing_replay 'rollout' "
            "(moe_enable_routing_replay): the fused top-k returns before the replayed experts are applied; "
            "turn one of them off"
        )


def moe_config(
    shape: GPTShape,
    *,
    ep: int = 1,
    etp: int | None = None,
    aux_loss_coeff: float = 0.0,
    routing_replay: bool = False,
) -> dict:
    """TransformerConfig's mixture-of-experts fields for ``shape`` ({} for a dense model).

    The router as transformers computes it: softmax over the experts, top-k; Qwen3-MoE's renormalised
    top-k probabilities (``norm_topk_prob``) are Megatron's softmax over the top-k logits
    (``moe_router_pre_softmax`` False), Qwen2-MoE's plain probabilities its softmax before the top-k.
    Dropless (no capacity factor), the all-to-all dispatcher, no load-balancing loss unless
    ``aux_loss_coeff`` > 0 (RL runs train without one; then Switch's per-layer loss), the shared
    expert's sigmoid gate as Qwen2-MoE has it; ``routing_replay``: routers that can replay given
    experts (Megatron's router replay)."""
    if not shape.is_moe:
        return {}
    shared = shape.moe_shared_expert_ffn_hidden_size
    return dict(
        num_moe_experts=shape.num_experts,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_topk=shape.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not shape.moe_norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_enable_routing_replay=routing_replay,
        moe_router_fusion=False,  # its fused top-k returns before replay applies (check_router_replay)
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=None,
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        moe_shared_expert_overlap=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def layer_spec(config, transformer_impl: str = "auto", *, pp_rank: int = 0):
    """What ``GPTModel`` takes as ``transformer_layer_spec`` for ``transformer_impl`` on pipeline stage
    ``pp_rank`` (a layer spec; for the torch layers, the stage's block of layers and final norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    impl = resolve_transformer_impl(transformer_impl, check_available=True)
    experts = config.num_moe_experts
    if experts:
        from megagrpo.compat import megatron_moe

        megatron_moe.install()
    if impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=config.qk_layernorm
        )
        refuse_legacy_grouped_experts(spec)
        return spec
    if impl == "torch":
        return torch_layers.block_spec(config, pp_rank)
    return get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm, normalization="RMSNorm"
    )


def refuse_legacy_grouped_experts(spec) -> None:
    """Megatron's TE spec falls back to its legacy ``GroupedMLP`` (every local expert fused into two
    tensors, ``weight1`` / ``weight2``) when the installed Transformer Engine has no grouped linear
    layer. The HF map, weight sync and export know ``SequentialMLP``'s and ``TEGroupedMLP``'s per-expert
    tensors only: refuse it before the model is built."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    mlp = getattr(getattr(spec, "submodules", None), "mlp", None)
    experts = getattr(getattr(mlp, "submodules", None), "experts", None)
    if getattr(experts, "module", None) is GroupedMLP:
        raise ValueError(
            "this Transformer Engine has no grouped linear layer, so Megatron's TE spec builds the legacy "
            "GroupedMLP experts (fused weight1/weight2), which megagrpo cannot load, sync or export; "
            "install a Transformer Engine with GroupedLinear (>= 1.7) or set "
            "parallel.transformer_impl to torch or local"
        )


def build_gpt_model(
    shape: GPTShape,
    config,
    pgs,
    *,
    transformer_impl: str = "auto",
    pre_process: bool = True,
    post_process: bool = True,
):
    """One pipeline stage of the GPT model, its parameters on the current device."""
    from megatron.core.models.gpt import GPTModel

    check_router_replay(config)  # again: callers adjust the config between building it and the model

    tp = config.tensor_model_parallel_size
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, transformer_impl, pp_rank=pgs.pp.rank()),
        vocab_size=padded_vocab_size(shape.vocab_size, tp),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        pg_collection=pgs,
    )
    _mark_tensor_parallel(model)
    _params_to_dtype(model, config.params_dtype)
    if not config.use_cpu_initialization:
        model.cuda(torch.cuda.current_device())
    return model


def _params_to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter in the model's dtype. The local spec's norms are torch modules made
    in fp32 whatever ``params_dtype`` says (Megatron's own training casts them with Float16Module,
    which would also turn the logits to fp32): in bf16 they would run unfused on mixed dtypes and
    differ from what vLLM, and an HF export, hold. Buffers (RoPE frequencies) stay as they are."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Tag every parameter with Megatron's TP attributes, which Megatron itself only sets when it
    initialises weights. Without them, a model built for loading (``perform_initialization=False``)
    would have its TP-split weights treated as replicas: grad norms, clipping and the distributed
    optimizer would count only TP rank 0's shards."""
    from megatron.core.tensor_parallel.layers import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    for name, param in model.named_parameters():
        dim = tp_partition_dim(canonical_name(name))
        if dim >= 0 and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)


def build_stage(ctx: ParallelContext, shape: GPTShape, dtype: torch.dtype, *, initialize: bool = False):
    """This rank's stage of a model for moving weights (conversion, export): the layout of ``ctx``,
    no recompute, Megatron's local layers on CPU and the best available ones otherwise."""
    config = transformer_config(
        shape,
        tp=ctx.sizes.tp,
        pp=ctx.sizes.pp,
        dtype=dtype,
        on_cpu=ctx.device.type == "cpu",
        initialize=initialize,
        ep=ctx.sizes.ep,
        etp=ctx.sizes.expert_tp,
    )
    return build_gpt_model(
        shape,
        config,
        ctx.pgs,
        transformer_impl="local" if ctx.device.type == "cpu" else "auto",
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
    )
