"""Rules that span fields or components, and the one decision of ``parallel``'s ``"auto"`` values.

Everything here runs once, while a config is built (at load, or by direct construction): the schema's
``__post_init__`` methods call :func:`resolve_parallel` and :func:`check_run`. ``megagrpo plan``
(:mod:`megagrpo.plan`) also applies :func:`check_shape` to an HF model's config.json, :func:`check_features`
to the layer implementation the trainer will resolve, and :func:`check_engine_share`. Errors are
:class:`~megagrpo.config.errors.ConfigError`; keys are relative to the section in
:func:`resolve_parallel` (the loader adds ``parallel.``) and fully dotted in :func:`check_run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megagrpo.config.errors import require
from megagrpo.parallel import backends

if TYPE_CHECKING:
    from megagrpo.config.schema import Config, ParallelConfig

__all__ = [
    "check_engine_share",
    "check_features",
    "check_run",
    "check_shape",
    "packs_sequences",
    "resolve_parallel",
]


# ----------------------------------------------------------------------------------------------------------
# parallel: "auto" resolved once
# ----------------------------------------------------------------------------------------------------------


def resolve_parallel(par: ParallelConfig) -> tuple[backends.Backend, backends.TransformerImpl]:
    """(backend, transformer_impl) with "auto" decided by this process, and sequence and context
    parallelism checked against what that layer implementation supports (``backends.IMPL_FEATURES``).

    Explicit values are taken as they are: a config may name NCCL or Transformer Engine for the trainer's
    machines while it is loaded elsewhere; the ranks check availability when they use them.
    """
    transformer_impl = backends.resolve_transformer_impl(par.transformer_impl)
    has = backends.IMPL_FEATURES[transformer_impl]
    here = ""
    if par.transformer_impl == "auto":
        te = "importable" if backends.transformer_engine_available() else "not importable"
        here = f" ('auto' resolves to '{transformer_impl}' here: transformer_engine is {te})"
    require(
        not par.sequence_parallel or "sequence_parallel" in has,
        ("sequence_parallel", "transformer_impl"),
        f"sequence_parallel needs transformer_impl {_supporting('sequence_parallel')}, not "
        f"'{transformer_impl}' (Megatron's local norms refuse it){here}",
    )
    # Megatron's local attention and the torch layers have no context-parallel path; TE's ring attention does.
    require(
        par.context_parallel_size == 1 or "context_parallel" in has,
        ("context_parallel_size", "transformer_impl"),
        f"context_parallel_size > 1 needs transformer_impl {_supporting('context_parallel')}, not "
        f"'{transformer_impl}'{here}",
    )
    return backends.resolve_backend(par.backend), transformer_impl


def _supporting(feature: str) -> str:
    """The layer implementations that support ``feature`` (an ``IMPL_FEATURES`` entry), quoted."""
    return " or ".join(f"'{name}'" for name, has in backends.IMPL_FEATURES.items() if feature in has)


def packs_sequences(cfg: Config, transformer_impl: str) -> bool:
    """Whether the policy's micro-batches are packed end to end (THD) with ``transformer_impl``:
    policy.sequence_packing "auto", layers that keep packed sequences apart (``thd``), and no context
    parallelism (its split of packed rows over CP ranks is not wired up)."""
    return (
        cfg.policy.sequence_packing == "auto"
        and "thd" in backends.IMPL_FEATURES.get(transformer_impl, frozenset())
        and cfg.parallel.context_parallel_size == 1
    )


# ----------------------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------------------


def check_run(cfg: Config) -> None:
    """Checks across components; each raises ConfigError naming every dotted key involved."""
    check_model_split(cfg)
    check_batching(cfg)
    check_lengths(cfg)
    check_resources(cfg)
    require(
        cfg.logging.val_every == 0 or cfg.data.num_val_prompts > 0,
        ("logging.val_every", "data.num_val_prompts"),
        "validation is scheduled but data.num_val_prompts is 0",
    )


def check_model_split(cfg: Config) -> None:
    """TP/PP/CP (and the engines' TP) against the model's shape and the loss aggregation."""
    par, tiny = cfg.parallel, cfg.model.tiny
    cp = par.context_parallel_size
    if cp > 1:
        # Megatron's load-balanced CP splits every sequence into 2 * CP chunks.
        require(
            cfg.model.seq_length % (2 * cp) == 0,
            ("parallel.context_parallel_size", "model.seq_length"),
            f"seq_length {cfg.model.seq_length} must be divisible by 2 * context_parallel_size",
        )
        # Each CP rank scores only its chunks of a sequence; a per-sequence mean would need the
        # sequence's token count from every CP rank.
        require(
            cfg.grpo.loss_agg == "token",
            ("parallel.context_parallel_size", "grpo.loss_agg"),
            "context_parallel_size > 1 needs loss_agg 'token'",
        )
    if tiny is not None:
        check_shape(cfg, tiny, "model.tiny")
    # An HF model's shape is known only once its config is read: ``megagrpo plan`` checks it then.


def check_shape(cfg: Config, shape: Any, where: str) -> None:
    """TP, PP, the engines' TP and seq_length against a model shape (``model.tiny`` or an HF config.json).

    ``shape`` has num_attention_heads, num_query_groups, num_layers and max_position_embeddings;
    ``where`` names its keys in the errors (``model.tiny`` or the config.json path).
    """
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    for name in ("num_attention_heads", "num_query_groups"):
        require(
            getattr(shape, name) % tp == 0,
            ("parallel.tensor_model_parallel_size", f"{where}.{name}"),
            f"tensor_model_parallel_size {tp} must divide {name} {getattr(shape, name)}",
        )
    require(
        shape.num_layers % pp == 0,
        ("parallel.pipeline_model_parallel_size", f"{where}.num_layers"),
        f"pipeline_model_parallel_size {pp} must divide num_layers {shape.num_layers}",
    )
    etp = cfg.generation.engine_tensor_parallel_size
    require(
        shape.num_attention_heads % etp == 0,
        ("generation.engine_tensor_parallel_size", f"{where}.num_attention_heads"),
        f"engine_tensor_parallel_size {etp} must divide num_attention_heads {shape.num_attention_heads}",
    )
    if where == "model.tiny":
        return  # model.tiny's max_position_embeddings is checked with the model section (schema).
    require(
        cfg.model.seq_length <= shape.max_position_embeddings,
        ("model.seq_length", f"{where}.max_position_embeddings"),
        f"seq_length {cfg.model.seq_length} exceeds max_position_embeddings {shape.max_position_embeddings}",
    )


def check_features(cfg: Config, transformer_impl: str) -> None:
    """SP and CP against what the layer implementation the trainer will use supports.

    ``transformer_impl`` is resolved (``local``, ``transformer_engine``, ...); the table is
    :data:`megagrpo.parallel.backends.IMPL_FEATURES`.
    """
    par = cfg.parallel
    has = backends.IMPL_FEATURES.get(transformer_impl, frozenset())
    require(
        not par.sequence_parallel or "sequence_parallel" in has,
        ("parallel.sequence_parallel", "parallel.transformer_impl"),
        f"sequence_parallel is not supported by transformer_impl {transformer_impl!r} "
        f"(resolved from {par.transformer_impl!r})",
    )
    require(
        par.context_parallel_size == 1 or "context_parallel" in has,
        ("parallel.context_parallel_size", "parallel.transformer_impl"),
        f"context_parallel_size > 1 is not supported by transformer_impl {transformer_impl!r} "
        f"(resolved from {par.transformer_impl!r})",
    )


def check_engine_share(cfg: Config) -> None:
    """Every engine gets prompts: the driver gives each engine ceil(P / E) prompts of a step, in order."""
    engines, prompts = cfg.generation.num_engines, cfg.grpo.num_prompts_per_step
    used = -(-prompts // -(-prompts // engines))
    require(
        used == engines,
        ("grpo.num_prompts_per_step", "generation.num_engines"),
        f"{prompts} prompts per step over {engines} engines at ceil({prompts}/{engines}) each leave "
        f"{engines - used} engine(s) without prompts",
    )


def check_batching(cfg: Config) -> None:
    """Mini-batches tile a step's rollouts and split evenly over data-parallel ranks."""
    mbs, dp = cfg.policy.mini_batch_size, cfg.parallel.data_parallel_size
    require(
        cfg.rollouts_per_step % mbs == 0,
        ("policy.mini_batch_size", "grpo.num_prompts_per_step", "grpo.num_generations"),
        f"mini_batch_size {mbs} must divide num_prompts_per_step * num_generations = {cfg.rollouts_per_step}",
    )
    require(
        mbs % dp == 0,
        ("policy.mini_batch_size", "parallel.data_parallel_size"),
        f"mini_batch_size {mbs} must be divisible by data_parallel_size {dp}",
    )


def check_lengths(cfg: Config) -> None:
    """Room for a prompt, the micro-batch token budget and the overlong buffer against the lengths."""
    seq, new = cfg.model.seq_length, cfg.generation.max_new_tokens
    require(
        new < seq,
        ("generation.max_new_tokens", "model.seq_length"),
        f"max_new_tokens {new} leaves no room for a prompt in seq_length {seq}",
    )
    require(
        cfg.policy.micro_batch_max_tokens >= seq,
        ("policy.micro_batch_max_tokens", "model.seq_length"),
        f"micro_batch_max_tokens {cfg.policy.micro_batch_max_tokens} cannot hold one sequence of "
        f"seq_length {seq}",
    )
    eval_new = cfg.eval.max_new_tokens
    require(
        eval_new is None or eval_new < seq,
        ("eval.max_new_tokens", "model.seq_length"),
        f"max_new_tokens {eval_new} leaves no room for a prompt in seq_length {seq}",
    )
    if cfg.grpo.overlong_policy == "soft_penalty":
        require(
            cfg.grpo.overlong_buffer_tokens < new,
            ("grpo.overlong_buffer_tokens", "generation.max_new_tokens"),
            f"overlong_buffer_tokens {cfg.grpo.overlong_buffer_tokens} must be < max_new_tokens {new}",
        )


def check_resources(cfg: Config) -> None:
    """Backend and placement against the cluster's GPUs."""
    cluster, gen = cfg.cluster, cfg.generation
    require(
        cfg.parallel.backend != "nccl" or cluster.gpus_per_node > 0,
        ("parallel.backend", "cluster.gpus_per_node"),
        "backend 'nccl' needs GPUs (gpus_per_node > 0)",
    )
    require(
        gen.placement != "colocated" or cluster.gpus_per_node > 0,
        ("generation.placement", "cluster.gpus_per_node"),
        "colocated placement needs GPUs (engines sleep during training with vLLM's CUDA-only sleep "
        "mode); use 'disaggregated' on CPU",
    )
    require(
        gen.placement != "colocated" or cfg.grpo.max_staleness == 0,
        ("grpo.max_staleness", "generation.placement"),
        "overlapping generation with training needs engines on devices of their own: colocated engines "
        "sleep while the trainer runs; use 'disaggregated' or max_staleness 0",
    )
    require(
        gen.placement != "colocated" or gen.engine_tensor_parallel_size == 1,
        ("generation.placement", "generation.engine_tensor_parallel_size"),
        "colocated placement shares one GPU per engine with a trainer rank: engine_tensor_parallel_size "
        "must be 1 (use 'disaggregated' for multi-GPU engines)",
    )
    for key in ("policy_resource", "engine_resource"):
        require(
            getattr(cluster, key) is None or cluster.ray_address is not None,
            (f"cluster.{key}", "cluster.ray_address"),
            "a custom resource places actors on the nodes of a Ray cluster started with it; a local Ray "
            "(no ray_address) has none, so the actors would never be placed",
        )
    require(
        cluster.engine_resource is None or gen.placement != "colocated",
        ("cluster.engine_resource", "generation.placement"),
        "colocated engines share the policy ranks' placement; engine_resource applies to 'disaggregated'",
    )
    if cluster.gpus_per_node == 0:
        return
    total = cluster.num_nodes * cluster.gpus_per_node
    trainer, engines = cfg.parallel.world_size, gen.num_engines * gen.engine_tensor_parallel_size
    need = max(trainer, engines) if gen.placement == "colocated" else trainer + engines
    require(
        need <= total,
        ("parallel.data_parallel_size", "generation.num_engines", "cluster.gpus_per_node"),
        f"{gen.placement} placement needs {need} GPUs (trainer {trainer}, engines {engines}) but the "
        f"cluster has {total}",
    )
