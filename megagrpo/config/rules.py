"""The checks across fields and sections: one :func:`validate` pass per trainer, run at load.

A :class:`~megagrpo.config.schema.Config` checks each section's own fields when it is built; what spans
sections is checked here, once, for the command about to run, on the sections it reads: ``megagrpo
train`` (``"grpo"``) checks batching, generation lengths, engine placement and the user's reward module;
``megagrpo sft`` does not (an SFT config needs no ``generation`` section). ``load_config`` calls
:func:`validate` after :func:`megagrpo.config.resolve`, and the error names the file. ``megagrpo plan``
(:mod:`megagrpo.plan`) also applies :func:`check_shape` to an HF model's config.json,
:func:`check_features` to the layer implementation the trainer's machines will resolve, and
:func:`check_engine_share`. Errors are :class:`~megagrpo.config.errors.ConfigError` with fully dotted keys.

Nothing here probes the machine: the layer implementation checked is the config's resolved one.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal, get_args

from megagrpo.config import rules_user
from megagrpo.config.errors import ConfigError, require
from megagrpo.config.rollout import CAPABILITIES, ENGINE_CAPABILITIES
from megagrpo.config.rules_lora import check_lora
from megagrpo.parallel import backends

if TYPE_CHECKING:
    from megagrpo.config.schema import Config

__all__ = [
    "TRAINERS",
    "Trainer",
    "check_engine_share",
    "check_features",
    "check_shape",
    "validate",
]

Trainer = Literal["grpo", "distill", "sft", "dpo", "eval", "warmup"]
"""The commands a config is validated for: ``megagrpo train`` (and ``plan``), ``distill``, ``sft``, ``dpo``,
``eval``, ``warmup``."""
TRAINERS: tuple[str, ...] = get_args(Trainer)

_WARMS_UP = ("grpo", "distill", "dpo")
"""Trainers that first warm a tiny model up (``megagrpo.trainers.warmup.warmed_up_model``)."""


def validate(cfg: Config, trainer: Trainer = "grpo") -> None:
    """Every check across sections that ``trainer`` needs; ConfigError naming the dotted keys at fault.

    ``cfg`` must be resolved (``cfg.resolved``): sequence and context parallelism are checked against the
    layer implementation it resolved to. ``"grpo"`` and ``"eval"`` import the user's reward module
    (``reward.function``) to check it; building a Config never does.
    """
    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}; got {trainer!r}")
    if trainer == "eval":
        _check_generation_lengths(cfg)
        _check_engine(cfg, trainer=False)
        _check_cluster(cfg, trainer=False)
        rules_user.check_reward(cfg)
        rules_user.check_env(cfg)
        return
    check_features(cfg, cfg.resolved.transformer_impl)
    rollouts = trainer in ("grpo", "distill")
    _check_model_split(cfg, engines=rollouts)
    _check_micro_batch(cfg)
    if rollouts:
        _check_distill(cfg, trainer)
        _check_grpo(cfg)
        _check_generation_lengths(cfg)
        _check_engine(cfg, trainer=True)
        _check_sync_mode(cfg)
        _check_cluster(cfg, trainer=True)
        rules_user.check_reward(cfg)
        rules_user.check_env(cfg)
    elif trainer == "sft":
        _check_batch_over_dp(cfg, "sft.batch_size", cfg.sft.batch_size, "data")
    elif trainer == "dpo":
        _check_dpo(cfg)
    if trainer == "warmup" or (trainer in _WARMS_UP and cfg.model.tiny is not None):
        _check_warmup(cfg, run_alone=trainer == "warmup")


# ----------------------------------------------------------------------------------------------------------
# The policy's model and layout (every trainer that trains)
# ----------------------------------------------------------------------------------------------------------


def check_features(cfg: Config, transformer_impl: str, *, decided: str = "here") -> None:
    """Sequence and context parallelism against what ``transformer_impl`` supports
    (:data:`megagrpo.parallel.backends.IMPL_FEATURES`).

    ``transformer_impl`` is resolved (``local``, ``torch``, ``transformer_engine``); ``decided`` says, for
    a ``parallel.transformer_impl: auto``, where that resolution was made ("here": the loading process).
    """
    par = cfg.parallel
    has = backends.IMPL_FEATURES.get(transformer_impl, frozenset())
    note = ""
    if par.transformer_impl == "auto":
        te = "importable" if transformer_impl == "transformer_engine" else "not importable"
        note = f" ('auto' resolves to '{transformer_impl}' {decided}: transformer_engine is {te})"
    require(
        not par.sequence_parallel or "sequence_parallel" in has,
        ("parallel.sequence_parallel", "parallel.transformer_impl"),
        f"sequence_parallel needs transformer_impl {_supporting('sequence_parallel')}, not "
        f"'{transformer_impl}' (Megatron's local norms refuse it){note}",
    )
    # Megatron's local attention and the torch layers have no context-parallel path; TE's ring attention does.
    require(
        par.context_parallel_size == 1 or "context_parallel" in has,
        ("parallel.context_parallel_size", "parallel.transformer_impl"),
        f"context_parallel_size > 1 needs transformer_impl {_supporting('context_parallel')}, not "
        f"'{transformer_impl}'{note}",
    )


def _supporting(feature: str) -> str:
    """The layer implementations that support ``feature`` (an ``IMPL_FEATURES`` entry), quoted."""
    return " or ".join(f"'{name}'" for name, has in backends.IMPL_FEATURES.items() if feature in has)


def _check_model_split(cfg: Config, *, engines: bool) -> None:
    """TP/PP/CP (and, with ``engines``, the engines' TP) against the model's shape."""
    cp = cfg.parallel.context_parallel_size
    if cp > 1:
        # Megatron's load-balanced CP splits every sequence into 2 * CP chunks.
        require(
            cfg.model.seq_length % (2 * cp) == 0,
            ("parallel.context_parallel_size", "model.seq_length"),
            f"seq_length {cfg.model.seq_length} must be divisible by 2 * context_parallel_size",
        )
    if cfg.model.tiny is not None:
        check_shape(cfg, cfg.model.tiny, "model.tiny", engines=engines)
    elif cfg.model.hf_dir is not None:
        _check_hf_model(cfg, engines=engines)


def _check_hf_model(cfg: Config, *, engines: bool) -> None:
    """An HF model's config.json, where it is readable here (a multinode run's model may live on the
    trainer's machines only: the policy then checks it as it starts)."""
    import json
    from pathlib import Path

    from megagrpo.models.registry import shape_from_hf_config

    config_json = Path(cfg.model.hf_dir) / "config.json"
    try:
        data = json.loads(config_json.read_text())
    except (OSError, json.JSONDecodeError):
        return
    _, shape = shape_from_hf_config(data, str(config_json))
    check_shape(cfg, shape, str(config_json), engines=engines)


def check_shape(cfg: Config, shape: Any, where: str, *, engines: bool = True) -> None:
    """TP, PP, the engines' TP (``engines``) and seq_length against a model shape (``model.tiny`` or an HF
    config.json).

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
    if engines:
        etp = cfg.generation.engine_tensor_parallel_size
        require(
            shape.num_attention_heads % etp == 0,
            ("generation.engine_tensor_parallel_size", f"{where}.num_attention_heads"),
            f"engine_tensor_parallel_size {etp} must divide num_attention_heads {shape.num_attention_heads}",
        )
    if getattr(shape, "num_experts", 0):
        _check_experts(cfg, shape, where)
        if engines and cfg.generation.engine_expert_parallel:
            etp = cfg.generation.engine_tensor_parallel_size
            require(
                etp > 1 and shape.num_experts % etp == 0,
                ("generation.engine_expert_parallel", "generation.engine_tensor_parallel_size"),
                f"vLLM's expert parallelism splits the {shape.num_experts} experts over an engine's "
                f"engine_tensor_parallel_size ({etp}) workers: it must be > 1 and divide num_experts",
            )
    else:
        _check_dense(cfg, where)
    check_lora(cfg, shape, where)
    if where == "model.tiny":
        return  # model.tiny's max_position_embeddings is checked with the model section (schema).
    require(
        cfg.model.seq_length <= shape.max_position_embeddings,
        ("model.seq_length", f"{where}.max_position_embeddings"),
        f"seq_length {cfg.model.seq_length} exceeds max_position_embeddings {shape.max_position_embeddings}",
    )


def _check_experts(cfg: Config, shape: Any, where: str) -> None:
    """A mixture-of-experts model: EP splits the experts evenly, ETP (TP where unset) each expert's
    width, and EP x ETP folds over a stage's ranks as Megatron's expert groups need; Megatron's MoE
    layers with tensor parallelism need sequence parallelism, which Megatron's local layers (their
    norms) refuse."""
    par = cfg.parallel
    tp, ep, experts = par.tensor_model_parallel_size, par.expert_model_parallel_size, shape.num_experts
    require(
        experts % ep == 0,
        ("parallel.expert_model_parallel_size", f"{where}.num_experts"),
        f"expert_model_parallel_size {ep} must divide num_experts {experts}",
    )
    etp = par.expert_tensor_parallel_size or tp
    stage = tp * par.data_parallel_size * par.context_parallel_size
    require(
        stage % (ep * etp) == 0,
        ("parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size"),
        f"expert_model_parallel_size x expert_tensor_parallel_size ({ep} x {etp}) must divide the ranks "
        f"of a pipeline stage, tensor x data x context parallel ({stage})",
    )
    require(
        tp % etp == 0,
        ("parallel.expert_tensor_parallel_size", "parallel.tensor_model_parallel_size"),
        f"expert_tensor_parallel_size {etp} must divide tensor_model_parallel_size {tp} (an expert is split "
        "over no more ranks than the other layers; 1 or null are the usual choices)",
    )
    width = shape.moe_ffn_hidden_size
    key = "moe_ffn_hidden_size" if where == "model.tiny" else "moe_intermediate_size"
    require(
        width % etp == 0,
        ("parallel.expert_tensor_parallel_size", f"{where}.{key}"),
        f"expert_tensor_parallel_size {etp} must divide the expert width {key} {width}",
    )
    if tp > 1:
        impl = cfg.resolved.transformer_impl if cfg.resolution is not None else par.transformer_impl
        require(
            par.sequence_parallel and impl in ("torch", "transformer_engine"),
            ("parallel.tensor_model_parallel_size", "parallel.sequence_parallel"),
            f"mixture-of-experts layers at tensor_model_parallel_size {tp} need sequence_parallel true "
            f"(Megatron's MoE layers) and transformer_impl torch or transformer_engine (got {impl!r})",
        )


def _check_dense(cfg: Config, where: str) -> None:
    """What only a mixture-of-experts model has, asked of a dense one."""
    for key, value, default in (
        ("parallel.expert_model_parallel_size", cfg.parallel.expert_model_parallel_size, 1),
        ("parallel.expert_tensor_parallel_size", cfg.parallel.expert_tensor_parallel_size, None),
        ("generation.engine_expert_parallel", cfg.generation.engine_expert_parallel, False),
        ("grpo.routing_replay", cfg.grpo.routing_replay, "none"),
        ("policy.freeze_router", cfg.policy.freeze_router, False),
        ("policy.moe_aux_loss_coeff", cfg.policy.moe_aux_loss_coeff, 0.0),
    ):
        require(
            value == default,
            (key, f"{where}.num_experts"),
            f"{key}={value} is for mixture-of-experts models; {where} is a dense model",
        )


def _check_micro_batch(cfg: Config) -> None:
    seq = cfg.model.seq_length
    require(
        cfg.policy.micro_batch_max_tokens >= seq,
        ("policy.micro_batch_max_tokens", "model.seq_length"),
        f"micro_batch_max_tokens {cfg.policy.micro_batch_max_tokens} cannot hold one sequence of "
        f"seq_length {seq}",
    )


def _check_batch_over_dp(cfg: Config, key: str, size: int, what: str) -> None:
    """A supervised batch of ``size`` (at ``key``) gives every data-parallel rank some ``what``."""
    dp = cfg.parallel.data_parallel_size
    require(
        size >= dp,
        (key, "parallel.data_parallel_size"),
        f"batch_size {size} leaves some of the {dp} data-parallel ranks without {what}",
    )


# ----------------------------------------------------------------------------------------------------------
# Per trainer
# ----------------------------------------------------------------------------------------------------------


def _check_distill(cfg: Config, trainer: str) -> None:
    """``megagrpo distill`` needs a teacher that matches the student; ``megagrpo train`` refuses one."""
    if trainer == "grpo":
        require(
            cfg.distill.teacher_hf_dir is None,
            "distill.teacher_hf_dir",
            "is set: distillation runs with `megagrpo distill` (megagrpo train would ignore the teacher)",
        )
        return
    # Per-token advantages: GSPO's one ratio per sequence has no place for them (gspo_token has).
    require(
        cfg.grpo.loss != "gspo",
        ("grpo.loss", "distill.teacher_hf_dir"),
        "distillation gives every token its own advantage; loss 'gspo' takes one per sequence (use "
        "gspo_token, grpo or cispo)",
    )
    _check_teacher(cfg)


def _check_teacher(cfg: Config) -> None:
    """The teacher's config.json: a supported architecture, and a shape its own TP / PP divide. (Its
    tokenizer is compared with the student's where the trainer reads its data:
    ``megagrpo.data.tokenizer.check_same_tokenizer``.)"""
    import json
    from pathlib import Path

    from megagrpo.config.teacher import teacher_config
    from megagrpo.models.registry import shape_from_hf_config

    teacher_dir = cfg.distill.teacher_hf_dir
    if teacher_dir is None:
        raise ConfigError("distill.teacher_hf_dir", "is required by megagrpo distill (an HF directory)")
    config_json = Path(teacher_dir) / "config.json"
    try:
        data = json.loads(config_json.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError("distill.teacher_hf_dir", f"cannot read {config_json}: {err}") from None
    _, shape = shape_from_hf_config(data, str(config_json))
    check_shape(teacher_config(cfg), shape, str(config_json), engines=False)


def _check_grpo(cfg: Config) -> None:
    """Mini-batches tile a step's rollouts over the DP ranks; CP's loss; overlong buffer; validation."""
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
    # Each CP rank scores only its chunks of a sequence; a per-sequence mean would need the sequence's
    # token count from every CP rank.
    require(
        cfg.parallel.context_parallel_size == 1 or cfg.grpo.loss_agg == "token",
        ("parallel.context_parallel_size", "grpo.loss_agg"),
        "context_parallel_size > 1 needs loss_agg 'token'",
    )
    new, key = cfg.generation.max_new_tokens, "generation.max_new_tokens"
    if cfg.env.enabled:  # an episode's length budget
        new, key = cfg.env.max_episode_tokens, "env.max_episode_tokens"
    if cfg.grpo.overlong_policy == "soft_penalty":
        require(
            cfg.grpo.overlong_buffer_tokens < new,
            ("grpo.overlong_buffer_tokens", key),
            f"overlong_buffer_tokens {cfg.grpo.overlong_buffer_tokens} must be < {key.split('.')[1]} {new}",
        )
    # Partial rollouts play episodes as they come (generation.stream_episodes): no turn-synchronous waves.
    require(
        cfg.grpo.async_mode != "partial" or not cfg.env.enabled or cfg.env.schedule == "async",
        ("grpo.async_mode", "env.schedule"),
        "async_mode 'partial' runs episodes with env.schedule 'async' (the 'turns' baseline waits for "
        "every episode's turn, which requests of other groups would hold up)",
    )
    require(
        cfg.logging.val_every == 0 or cfg.data.num_val_prompts > 0,
        ("logging.val_every", "data.num_val_prompts"),
        "validation is scheduled but data.num_val_prompts is 0",
    )


def _check_dpo(cfg: Config) -> None:
    """What DPO needs of the layout: no CP, a pair per micro-batch, a pair per data-parallel rank."""
    budget, seq = cfg.policy.micro_batch_max_tokens, cfg.model.seq_length
    require(
        cfg.parallel.context_parallel_size == 1,
        "parallel.context_parallel_size",
        "DPO does not support context parallelism yet (set 1)",
    )
    require(
        budget >= 2 * seq,
        ("policy.micro_batch_max_tokens", "model.seq_length"),
        f"micro_batch_max_tokens {budget} cannot hold a pair (two sequences of up to seq_length {seq}) "
        "in one micro-batch: it must be >= 2 * seq_length",
    )
    _check_batch_over_dp(cfg, "dpo.batch_size", cfg.dpo.batch_size, "pairs")


def _check_warmup(cfg: Config, *, run_alone: bool) -> None:
    """The warm-up's SFT run (``megagrpo.trainers.warmup.warmup_config``); ``run_alone``: ``megagrpo
    warmup``, which needs a tiny model and steps to run."""
    if run_alone:
        require(
            cfg.model.tiny is not None,
            "model.tiny",
            "the warm-up runs on the tiny model only: set model.tiny (model.hf_dir is not supported here)",
        )
        require(cfg.warmup.steps >= 1, "warmup.steps", "is 0: nothing to run (set warmup.steps=N)")
    _check_batch_over_dp(cfg, "warmup.batch_size", cfg.warmup.batch_size, "data")


def _check_generation_lengths(cfg: Config) -> None:
    """Room for a prompt next to the responses the engines generate (training and evaluation)."""
    seq, new = cfg.model.seq_length, cfg.generation.max_new_tokens
    require(
        new < seq,
        ("generation.max_new_tokens", "model.seq_length"),
        f"max_new_tokens {new} leaves no room for a prompt in seq_length {seq}",
    )
    eval_new = cfg.eval.max_new_tokens
    require(
        eval_new is None or eval_new < seq,
        ("eval.max_new_tokens", "model.seq_length"),
        f"max_new_tokens {eval_new} leaves no room for a prompt in seq_length {seq}",
    )


def engine_needs(cfg: Config, *, trainer: bool) -> dict[str, tuple[str, ...]]:
    """The engine capabilities (``config.rollout.CAPABILITIES``) this config asks for, each with the
    keys that ask for it; ``trainer``: GRPO's engines (a trainer beside them), else ``megagrpo eval``'s."""
    gen, needs = cfg.generation, {}
    if cfg.env.enabled:
        needs["episodes"] = ("env.environment",)
    if gen.engine_expert_parallel:
        needs["expert_parallel"] = ("generation.engine_expert_parallel",)
    if trainer and gen.placement == "colocated":
        needs["sleep"] = ("generation.placement",)
    if trainer and cfg.grpo.routing_replay == "rollout":
        needs["routed_experts"] = ("grpo.routing_replay",)
    if trainer and cfg.grpo.async_mode == "partial":
        needs["stream"] = ("grpo.async_mode",)
    if trainer and cfg.policy.lora.enabled and gen.lora_sync == "adapter":
        needs["lora_adapters"] = ("generation.lora_sync",)
    return needs


def _check_engine(cfg: Config, *, trainer: bool) -> None:
    """The engine ``generation.engine`` names can do all the config asks of it: one error naming every
    key it cannot serve."""
    engine = cfg.generation.engine
    needs = engine_needs(cfg, trainer=trainer)
    missing = {c: keys for c, keys in needs.items() if c not in ENGINE_CAPABILITIES[engine]}
    require(
        not missing,
        ("generation.engine", *(key for keys in missing.values() for key in keys)),
        f"engine {engine!r} cannot " + "; nor ".join(CAPABILITIES[c] for c in missing),
    )


def _check_sync_mode(cfg: Config) -> None:
    """Delta sync with fp32 weights: warned, not refused. An fp32 step moves almost every element by more
    than its rounding, so nearly every bucket goes whole (and is also compared and copied on both sides);
    bf16's rounding is what leaves most elements unchanged."""
    if cfg.generation.sync_mode == "delta" and cfg.model.dtype == "float32":
        warnings.warn(
            "generation.sync_mode: delta with model.dtype float32 buys little: an fp32 step changes nearly "
            "every element, so buckets go whole after being compared with their last bytes; it pays with "
            "bfloat16 weights, whose rounding leaves most elements unchanged",
            UserWarning,
            stacklevel=2,
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


def _check_cluster(cfg: Config, *, trainer: bool) -> None:
    """Backend, engine placement and custom resources against the Ray cluster, for the runs Ray places:
    GRPO's trainer ranks (``trainer``) and engines, or ``megagrpo eval``'s engines alone."""
    cluster, gen = cfg.cluster, cfg.generation
    require(
        not trainer or cfg.parallel.backend != "nccl" or cluster.gpus_per_node > 0,
        ("parallel.backend", "cluster.gpus_per_node"),
        "backend 'nccl' needs GPUs (gpus_per_node > 0)",
    )
    require(
        not trainer or cfg.policy.offload == "none" or gen.placement == "colocated",
        ("policy.offload", "generation.placement"),
        "offloading hands the trainer's GPUs to colocated engines; disaggregated engines have their own",
    )
    require(
        not trainer or gen.placement != "colocated" or gen.num_engines <= cfg.parallel.world_size,
        ("generation.placement", "generation.num_engines", "parallel.world_size"),
        f"colocated placement puts engine i on trainer rank i's device: at most {cfg.parallel.world_size} "
        f"engines for {cfg.parallel.world_size} ranks, got {gen.num_engines}",
    )
    require(
        not trainer or gen.placement != "colocated" or cfg.grpo.max_staleness == 0,
        ("grpo.max_staleness", "generation.placement")
        + (("grpo.async_mode",) if cfg.grpo.async_mode == "partial" else ()),
        "overlapping generation with training (async_mode 'partial' always does) needs engines on devices "
        "of their own: colocated engines sleep while the trainer runs; use 'disaggregated' or "
        "max_staleness 0",
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
    ranks = cfg.parallel.world_size if trainer else 0
    engines = gen.num_engines * gen.engine_tensor_parallel_size
    need = max(ranks, engines) if gen.placement == "colocated" else ranks + engines
    require(
        need <= total,
        ("parallel.data_parallel_size", "generation.num_engines", "cluster.gpus_per_node"),
        f"{gen.placement} placement needs {need} GPUs (trainer {ranks}, engines {engines}) but the "
        f"cluster has {total}",
    )
