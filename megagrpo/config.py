"""Typed run configuration: one keyword-only dataclass per component, loaded from YAML.

A run is described by a YAML file with one section per component (``model``, ``parallel``, ``policy``,
``generation``, ``grpo``, ``data``, ``reward``, ``checkpoint``, ``logging``, ``cluster``) plus ``run_name``.
Command-line overrides use dotted keys (``grpo.num_generations=8``). Everything is validated once, in
:func:`load_config`: unknown keys, wrong types and inconsistent settings raise :class:`ConfigError`, whose
message names the dotted key at fault and the file it came from. Paths are only checked for type here; they
are opened (and fail) where they are used.
"""

import dataclasses
import difflib
import importlib.util
import os
import re
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megagrpo import config_files

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PolicyConfig",
    "RewardConfig",
    "TinyModelConfig",
    "config_to_dict",
    "load_config",
    "save_config",
]

# The default file and --config's names are found by megagrpo.config_files (package data, not the checkout).
DEFAULT_CONFIG_PATH = config_files.DEFAULT_CONFIG_PATH


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the dotted key(s) and the source."""

    def __init__(self, keys: str | Sequence[str], message: str, source: str | None = None):
        self.keys: tuple[str, ...] = (keys,) if isinstance(keys, str) else tuple(keys)
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        what = f"{', '.join(self.keys)}: " if self.keys else ""
        super().__init__(f"{where}{what}{message}")

    def __reduce__(self):
        # The default pickling replays __init__ with the formatted string; Ray pickles exceptions.
        return (type(self), (self.keys, self.message, self.source))

    def with_context(self, prefix: str = "", source: str | None = None, note: str = "") -> "ConfigError":
        """The same error with keys under `prefix`, attributed to `source`, with `note` appended."""
        keys = tuple(_join(prefix, k) for k in self.keys)
        return ConfigError(keys, self.message + note, source if source is not None else self.source)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _require(ok: bool, keys: str | Sequence[str], message: str) -> None:
    if not ok:
        raise ConfigError(keys, message)


def _check(obj: object, name: str, ok: bool, rule: str) -> None:
    """Raise ConfigError naming field `name` of `obj` unless `ok`; `rule` says what is allowed."""
    if not ok:
        raise ConfigError(name, f"must be {rule}, got {getattr(obj, name)!r}")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        _check(obj, name, getattr(obj, name) >= 1, ">= 1")


def _transformer_engine_available() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------------------
# Components
# ----------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class TinyModelConfig:
    """Shape of a randomly initialised model built in-process (tests, CPU runs); nothing is downloaded."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 128
    """Width of the residual stream."""
    ffn_hidden_size: int = 256
    """Width of the gated MLP's intermediate layer."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int = 2
    """Number of key/value heads (grouped-query attention); must divide num_attention_heads."""
    vocab_size: int = 512
    """Vocabulary size; token ids are used directly, so no tokenizer is needed."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary embedding is set up for; must be >= model.seq_length."""
    rope_theta: float = 1_000_000.0
    """Rotary embedding base (Qwen2 uses 1e6)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output projection (as small Qwen2 models do)."""
    qkv_bias: bool = True
    """Add a bias to the Q/K/V projections (Qwen2 does; Llama does not)."""

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        _positive(self, "num_query_groups", "vocab_size", "max_position_embeddings")
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            ("hidden_size", "num_attention_heads"),
            f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
            f"{self.num_attention_heads}",
        )
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            ("num_attention_heads", "num_query_groups"),
            f"num_query_groups {self.num_query_groups} must divide num_attention_heads "
            f"{self.num_attention_heads}",
        )
        _check(self, "rope_theta", self.rope_theta > 0, "> 0")
        _check(self, "norm_epsilon", self.norm_epsilon > 0, "> 0")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Which weights to train: an HF checkpoint, a converted Megatron checkpoint, or a tiny random model."""

    hf_dir: str | None = None
    """Local HF checkpoint directory (config, tokenizer, safetensors); vLLM and the tokenizer read it."""
    megatron_ckpt: str | None = None
    """Megatron distributed checkpoint converted from hf_dir; loaded instead of converting at start-up."""
    arch: Literal["qwen2"] = "qwen2"
    """Architecture of the tiny model (an HF checkpoint's architecture is read from its config)."""
    tiny: TinyModelConfig | None = None
    """Shape of a self-built random model; mutually exclusive with hf_dir and megatron_ckpt."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter and compute dtype of the trainer and the engines."""
    seq_length: int = 4096
    """Maximum total tokens (prompt + response) in one sequence."""

    def __post_init__(self) -> None:
        if self.tiny is not None:
            _require(
                self.hf_dir is None and self.megatron_ckpt is None,
                ("tiny", "hf_dir", "megatron_ckpt"),
                "set either tiny or hf_dir/megatron_ckpt, not both",
            )
            _require(
                self.tiny.max_position_embeddings >= self.seq_length,
                ("tiny.max_position_embeddings", "seq_length"),
                f"max_position_embeddings {self.tiny.max_position_embeddings} < seq_length {self.seq_length}",
            )
        else:
            _require(
                self.hf_dir is not None,
                ("hf_dir", "megatron_ckpt", "tiny"),
                "no model given: set hf_dir (optionally with megatron_ckpt) or tiny"
                if self.megatron_ckpt is None
                else "megatron_ckpt needs hf_dir too (the tokenizer and vLLM's model config come from it)",
            )
        _check(self, "seq_length", self.seq_length >= 2, ">= 2")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """How the trainer's Megatron model is split over ranks; world_size = DP * TP * PP * CP."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP); must divide the number of attention heads and query groups."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (PP); must divide the number of layers."""
    context_parallel_size: int = 1
    """Context parallel size (CP); > 1 needs Transformer Engine attention and grpo.loss_agg token
    (sequences are padded, cut into 2 x CP chunks, and each rank scores its own two)."""
    expert_model_parallel_size: int = 1
    """Expert parallel size (EP); must stay 1 until MoE models are supported."""
    data_parallel_size: int = 1
    """Data parallel size (DP): replicas of the TP x PP x CP model; must divide policy.mini_batch_size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (shards norms/dropout activations over TP); needs TP > 1."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; "auto" picks nccl when CUDA is available, else gloo."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Megatron layer implementation; "auto" picks transformer_engine when importable, else local."""

    def __post_init__(self) -> None:
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        _positive(self, "expert_model_parallel_size", "data_parallel_size")
        _require(
            not self.sequence_parallel or self.tensor_model_parallel_size > 1,
            ("sequence_parallel", "tensor_model_parallel_size"),
            "sequence_parallel needs tensor_model_parallel_size > 1",
        )
        _check(
            self,
            "expert_model_parallel_size",
            self.expert_model_parallel_size == 1,
            "1 (MoE is not supported yet)",
        )
        _require(
            not self.sequence_parallel or self.transformer_impl != "local",
            ("sequence_parallel", "transformer_impl"),
            "sequence_parallel needs transformer_impl 'transformer_engine' (Megatron's local norms refuse "
            "it)",
        )
        if self.context_parallel_size > 1:
            # Megatron's local attention has no context-parallel path; only TE's ring attention does.
            _require(
                self.transformer_impl != "local",
                ("context_parallel_size", "transformer_impl"),
                "context_parallel_size > 1 needs transformer_impl 'transformer_engine', not 'local'",
            )
            _require(
                self.transformer_impl != "auto" or _transformer_engine_available(),
                ("context_parallel_size", "transformer_impl"),
                "context_parallel_size > 1 needs Transformer Engine, but transformer_impl 'auto' "
                "resolves to 'local' here (transformer_engine is not importable)",
            )

    @property
    def world_size(self) -> int:
        """Trainer ranks: DP * TP * PP * CP."""
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        return self.data_parallel_size * tp * pp * cp

    @property
    def resolved_transformer_impl(self) -> Literal["local", "transformer_engine"]:
        """transformer_impl with "auto" resolved on this machine."""
        if self.transformer_impl == "auto":
            return "transformer_engine" if _transformer_engine_available() else "local"
        return self.transformer_impl


@dataclass(kw_only=True, frozen=True)
class PolicyConfig:
    """Optimizer and batching of the policy update."""

    lr: float = 1e-6
    """Peak learning rate (Adam)."""
    min_lr: float = 0.0
    """Final learning rate of the cosine schedule."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Linear warm-up length in optimizer steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: hold lr, or decay it to min_lr over all optimizer steps of the run."""
    sequence_packing: Literal["auto", "off"] = "auto"
    """"auto": with Transformer Engine layers, a micro-batch's sequences are laid end to end in one
    row (THD, no padding; fused attention keeps them apart); "off", or with the local layers: right-
    padded [batch, seq] micro-batches."""
    micro_batch_max_tokens: int = 8192
    """Token budget of one packed micro-batch (forward/backward); must fit one model.seq_length sequence."""
    mini_batch_size: int = 64
    """Sequences per optimizer step; must divide grpo.num_prompts_per_step * grpo.num_generations."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when turning logits into log-probs, bounding the float32 vocab-sized buffer."""
    recompute: Literal["none", "core_attention", "full"] = "none"
    """Activation recompute in the backward pass: "core_attention" keeps q/k/v and recomputes the
    attention probabilities (Megatron's selective recompute; needed for long sequences on the local,
    unfused attention), "full" keeps only each group of recompute_num_layers layers' input."""
    recompute_num_layers: int = 1
    """With recompute "full": layers per recomputed group (uniform split of each pipeline stage)."""

    def __post_init__(self) -> None:
        _check(self, "lr", self.lr > 0, "> 0")
        _require(0 <= self.min_lr <= self.lr, ("min_lr", "lr"), f"need 0 <= min_lr <= lr, got {self.min_lr}")
        _check(self, "weight_decay", self.weight_decay >= 0, ">= 0")
        for name in ("adam_beta1", "adam_beta2"):
            _check(self, name, 0 <= getattr(self, name) < 1, "in [0, 1)")
        _check(self, "adam_eps", self.adam_eps > 0, "> 0")
        _check(self, "clip_grad", self.clip_grad >= 0, ">= 0 (0 disables)")
        _check(self, "lr_warmup_steps", self.lr_warmup_steps >= 0, ">= 0")
        _positive(self, "micro_batch_max_tokens", "mini_batch_size", "logprob_chunk_size")
        _positive(self, "recompute_num_layers")


@dataclass(kw_only=True, frozen=True)
class GenerationConfig:
    """Rollout engines (vLLM) and the weight sync from the trainer to them."""

    backend: Literal["vllm"] = "vllm"
    """Inference engine."""
    num_engines: int = 1
    """Number of independent engine instances (each on engine_tensor_parallel_size devices)."""
    engine_tensor_parallel_size: int = 1
    """Tensor parallel size inside one engine."""
    temperature: float = 1.0
    """Sampling temperature; must be > 0 since GRPO needs diverse samples per prompt."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = 1024
    """Maximum response length; must be < model.seq_length to leave room for the prompt."""
    seed: int = 0
    """Engine sampling seed."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may claim (weights + KV cache), in (0, 1]."""
    cpu_kvcache_space_gib: int | None = None
    """KV-cache size for vLLM's CPU backend in GiB; null keeps vLLM's default."""
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (slower decode, faster start, less memory)."""
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    """Engines share the trainer's devices (sleeping during training), or run on devices of their own."""
    sync_bucket_mb: float = 512.0
    """Size of the buckets weights are sent to the engines in, in MiB."""
    probe_max_error: float = 1.001
    """Largest trainer/engine probability ratio the post-sync probe tolerates (>= 1); catches broken syncs."""
    sync_timeout_s: float = 600.0
    """Seconds to wait for a weight sync before failing the run."""

    def __post_init__(self) -> None:
        _positive(self, "num_engines", "engine_tensor_parallel_size", "max_new_tokens")
        _check(self, "sync_bucket_mb", self.sync_bucket_mb > 0, "> 0")
        _check(self, "temperature", self.temperature > 0, "> 0")
        _check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        _check(self, "top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or >= 1")
        _check(self, "gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]")
        _check(
            self,
            "cpu_kvcache_space_gib",
            self.cpu_kvcache_space_gib is None or self.cpu_kvcache_space_gib >= 1,
            ">= 1 or null",
        )
        _check(self, "probe_max_error", self.probe_max_error >= 1, ">= 1")
        _check(self, "sync_timeout_s", self.sync_timeout_s > 0, "> 0")


@dataclass(kw_only=True, frozen=True)
class GRPOConfig:
    """The algorithm: group sampling, advantages and the clipped surrogate loss."""

    num_prompts_per_step: int = 32
    """Prompts sampled per step."""
    num_generations: int = 8
    """Responses per prompt (the group size); >= 2 so that a group has a baseline."""
    num_steps: int = 100
    """Rollout-and-update steps in the run."""
    clip_eps_low: float = 0.2
    """PPO clip below: ratios under 1 - clip_eps_low are clipped; in (0, 1)."""
    clip_eps_high: float = 0.2
    """PPO clip above: ratios over 1 + clip_eps_high are clipped (DAPO's clip-higher sets 0.28); in (0, 1)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; null disables it."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy; 0 needs no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman): k1 = log-ratio, k2 = squared log-ratio / 2, k3 = low-variance, >= 0."""
    loss_agg: Literal["token", "sequence"] = "token"
    """Average the loss over all tokens of the mini-batch (DAPO), or per sequence then over sequences."""
    normalize_adv_std: bool = True
    """Divide advantages by the group's reward std (GRPO); false keeps mean-centred rewards (Dr. GRPO)."""
    filter_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (their advantages are zero) before the update."""
    overlong_policy: Literal["none", "mask", "soft_penalty"] = "none"
    """Truncated responses: train on them as is, mask them out of the loss, or DAPO's soft length penalty."""
    overlong_buffer_tokens: int = 0
    """soft_penalty: the penalty ramps from 0 to overlong_penalty over the last this-many allowed tokens."""
    overlong_penalty: float = 1.0
    """soft_penalty: reward subtracted from a response that reaches max_new_tokens."""
    tis_cap: float | None = None
    """Truncated importance sampling cap (>= 1) on the trainer/engine probability ratio; null disables it."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """Above tis_cap: weight the token by the cap, or drop it from the loss."""
    seed: int = 0
    """Seed for prompt order and anything random in the trainer."""

    def __post_init__(self) -> None:
        _positive(self, "num_prompts_per_step", "num_steps")
        _check(self, "num_generations", self.num_generations >= 2, ">= 2 (a group needs a baseline)")
        for name in ("clip_eps_low", "clip_eps_high"):
            _check(self, name, 0 < getattr(self, name) < 1, "in (0, 1)")
        _check(self, "dual_clip", self.dual_clip is None or self.dual_clip > 1, "> 1 or null")
        _check(self, "kl_coef", self.kl_coef >= 0, ">= 0")
        _check(self, "overlong_buffer_tokens", self.overlong_buffer_tokens >= 0, ">= 0")
        _require(
            self.overlong_policy != "soft_penalty" or self.overlong_buffer_tokens >= 1,
            ("overlong_buffer_tokens", "overlong_policy"),
            "overlong_policy 'soft_penalty' needs overlong_buffer_tokens >= 1",
        )
        _check(self, "overlong_penalty", self.overlong_penalty >= 0, ">= 0")
        _check(self, "tis_cap", self.tis_cap is None or self.tis_cap >= 1, ">= 1 or null")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Prompts and reference answers."""

    train_path: str | None = None
    """Training prompts (a JSONL or Parquet file); null uses synthetic_task."""
    val_path: str | None = None
    """Validation prompts; null draws them from synthetic_task (or holds none if train_path is set)."""
    prompt_key: str = "problem"
    """Record field holding the question."""
    answer_key: str = "answer"
    """Record field holding the reference answer given to the reward."""
    synthetic_task: Literal["arithmetic"] = "arithmetic"
    """Generated task used when train_path is null."""
    arithmetic_max_operand: int = 99
    """Synthetic arithmetic: operands are drawn uniformly from [0, arithmetic_max_operand]."""
    arithmetic_ops: str = "+-"
    """Synthetic arithmetic: operators to draw from (any of "+-*")."""
    num_val_prompts: int = 0
    """Validation prompts evaluated every logging.val_every steps; 0 disables validation."""
    template: str = "{prompt}"
    """Prompt text; the literal `{prompt}` is replaced (str.replace, so braces like \\boxed{} are kept)."""
    apply_chat_template: bool = False
    """Wrap the templated prompt in the tokenizer's chat template as a single user turn."""

    def __post_init__(self) -> None:
        _require("{prompt}" in self.template, "template", f"must contain '{{prompt}}', got {self.template!r}")
        _require(bool(self.prompt_key), "prompt_key", "must not be empty")
        _require(bool(self.answer_key), "answer_key", "must not be empty")
        _check(self, "num_val_prompts", self.num_val_prompts >= 0, ">= 0")
        _check(self, "arithmetic_max_operand", 1 <= self.arithmetic_max_operand <= 9999, "in [1, 9999]")
        _check(
            self,
            "arithmetic_ops",
            bool(self.arithmetic_ops) and set(self.arithmetic_ops) <= set("+-*"),
            'a non-empty string of operators from "+-*"',
        )


@dataclass(kw_only=True, frozen=True)
class WarmupConfig:
    """Supervised warm-up on the synthetic task, so a random tiny model has a reward signal for GRPO."""

    steps: int = 0
    """Optimizer steps of supervised training before GRPO; 0 skips the warm-up."""
    lr: float = 3e-3
    """Peak learning rate of the warm-up (linear warm-up over the first 10% of steps, then constant)."""
    batch_size: int = 64
    """Sequences per warm-up optimizer step."""
    num_eval_prompts: int = 64
    """Held-out prompts scored by greedy exact match after the warm-up."""
    seed: int = 0
    """Seed of the warm-up's data stream (disjoint from the GRPO prompts)."""

    def __post_init__(self) -> None:
        _check(self, "steps", self.steps >= 0, ">= 0")
        _check(self, "lr", self.lr > 0, "> 0")
        _positive(self, "batch_size", "num_eval_prompts")


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """How responses are scored."""

    kind: Literal["math_verify", "arithmetic"] = "math_verify"
    """math_verify: symbolic equivalence of the last \\boxed{} answer; arithmetic: exact integer match."""
    num_workers: int = 4
    """Processes scoring responses in parallel."""
    timeout_s: float = 5.0
    """Per-response scoring timeout; a response that times out scores 0."""

    def __post_init__(self) -> None:
        _positive(self, "num_workers")
        _check(self, "timeout_s", self.timeout_s > 0, "> 0")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Saving, resuming and exporting."""

    dir: str | None = None
    """Checkpoint directory; null disables checkpointing."""
    save_every: int = 0
    """Save every this many steps; 0 saves only at the end of the run."""
    keep_last: int = 2
    """Number of most recent checkpoints kept on disk."""
    resume: bool = False
    """Resume from the latest checkpoint in dir if there is one."""
    export_hf_at_end: bool = False
    """Write an HF-format copy of the final policy to `<dir>/hf`."""

    def __post_init__(self) -> None:
        _check(self, "save_every", self.save_every >= 0, ">= 0")
        _positive(self, "keep_last")
        if self.dir is None:
            for name in ("resume", "export_hf_at_end"):
                _require(not getattr(self, name), (name, "dir"), f"{name} needs dir to be set")
            _require(self.save_every == 0, ("save_every", "dir"), "save_every > 0 needs dir to be set")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """Metrics and progress output."""

    dir: str = "runs"
    """Root of run outputs; a run writes config.yaml and metrics under `<dir>/<run_name>/`."""
    tensorboard: bool = False
    """Also write TensorBoard event files."""
    log_every: int = 1
    """Print and record metrics every this many steps."""
    val_every: int = 0
    """Validate every this many steps; 0 disables validation."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        _require(bool(self.dir), "dir", "must not be empty")
        _positive(self, "log_every")
        _check(self, "val_every", self.val_every >= 0, ">= 0")


@dataclass(kw_only=True, frozen=True)
class ClusterConfig:
    """Ray cluster the actors are placed on."""

    ray_address: str | None = None
    """Address of a running Ray cluster; null starts a local one."""
    num_nodes: int = 1
    """Nodes used."""
    gpus_per_node: int = 0
    """GPUs used per node; 0 runs everything on CPU."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per Ray actor (fractions allowed)."""

    def __post_init__(self) -> None:
        _positive(self, "num_nodes")
        _check(self, "gpus_per_node", self.gpus_per_node >= 0, ">= 0")
        _check(self, "cpus_per_worker", self.cpus_per_worker > 0, "> 0")


@dataclass(kw_only=True, frozen=True)
class Config:
    """A whole run. Cross-component checks live in __post_init__; keys in its errors are fully dotted."""

    run_name: str = "megagrpo"
    """Name of the run; outputs go to `<logging.dir>/<run_name>/`."""
    model: ModelConfig
    """Weights to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallelism."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Optimizer and batching."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Rollout engines and weight sync."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Algorithm."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Optional supervised warm-up before GRPO (tiny models on the synthetic task)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray resources."""

    def __post_init__(self) -> None:
        _require(
            re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name) is not None,
            "run_name",
            f"must be non-empty and use only letters, digits, '.', '_' and '-', got {self.run_name!r}",
        )
        self._check_model_split()
        self._check_batching()
        self._check_lengths()
        self._check_resources()
        _require(
            self.logging.val_every == 0 or self.data.num_val_prompts > 0,
            ("logging.val_every", "data.num_val_prompts"),
            "validation is scheduled but data.num_val_prompts is 0",
        )

    def _check_model_split(self) -> None:
        par, tiny = self.parallel, self.model.tiny
        tp, pp, cp = (
            par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            par.context_parallel_size,
        )
        if cp > 1:
            # Megatron's load-balanced CP splits every sequence into 2 * CP chunks.
            _require(
                self.model.seq_length % (2 * cp) == 0,
                ("parallel.context_parallel_size", "model.seq_length"),
                f"seq_length {self.model.seq_length} must be divisible by 2 * context_parallel_size",
            )
            # Each CP rank scores only its chunks of a sequence; a per-sequence mean would need the
            # sequence's token count from every CP rank.
            _require(
                self.grpo.loss_agg == "token",
                ("parallel.context_parallel_size", "grpo.loss_agg"),
                "context_parallel_size > 1 needs loss_agg 'token'",
            )
        if tiny is None:
            return  # An HF model's shape is known only once its config is read.
        for name in ("num_attention_heads", "num_query_groups"):
            _require(
                getattr(tiny, name) % tp == 0,
                ("parallel.tensor_model_parallel_size", f"model.tiny.{name}"),
                f"tensor_model_parallel_size {tp} must divide {name} {getattr(tiny, name)}",
            )
        _require(
            tiny.num_layers % pp == 0,
            ("parallel.pipeline_model_parallel_size", "model.tiny.num_layers"),
            f"pipeline_model_parallel_size {pp} must divide num_layers {tiny.num_layers}",
        )
        etp = self.generation.engine_tensor_parallel_size
        _require(
            tiny.num_attention_heads % etp == 0,
            ("generation.engine_tensor_parallel_size", "model.tiny.num_attention_heads"),
            f"engine_tensor_parallel_size {etp} must divide num_attention_heads {tiny.num_attention_heads}",
        )

    def _check_batching(self) -> None:
        mbs, dp = self.policy.mini_batch_size, self.parallel.data_parallel_size
        _require(
            self.rollouts_per_step % mbs == 0,
            ("policy.mini_batch_size", "grpo.num_prompts_per_step", "grpo.num_generations"),
            f"mini_batch_size {mbs} must divide num_prompts_per_step * num_generations = "
            f"{self.rollouts_per_step}",
        )
        _require(
            mbs % dp == 0,
            ("policy.mini_batch_size", "parallel.data_parallel_size"),
            f"mini_batch_size {mbs} must be divisible by data_parallel_size {dp}",
        )

    def _check_lengths(self) -> None:
        seq, new = self.model.seq_length, self.generation.max_new_tokens
        _require(
            new < seq,
            ("generation.max_new_tokens", "model.seq_length"),
            f"max_new_tokens {new} leaves no room for a prompt in seq_length {seq}",
        )
        _require(
            self.policy.micro_batch_max_tokens >= seq,
            ("policy.micro_batch_max_tokens", "model.seq_length"),
            f"micro_batch_max_tokens {self.policy.micro_batch_max_tokens} cannot hold one sequence of "
            f"seq_length {seq}",
        )
        if self.grpo.overlong_policy == "soft_penalty":
            _require(
                self.grpo.overlong_buffer_tokens < new,
                ("grpo.overlong_buffer_tokens", "generation.max_new_tokens"),
                f"overlong_buffer_tokens {self.grpo.overlong_buffer_tokens} must be < max_new_tokens {new}",
            )

    def _check_resources(self) -> None:
        cluster, gen = self.cluster, self.generation
        _require(
            self.parallel.backend != "nccl" or cluster.gpus_per_node > 0,
            ("parallel.backend", "cluster.gpus_per_node"),
            "backend 'nccl' needs GPUs (gpus_per_node > 0)",
        )
        _require(
            gen.placement != "colocated" or cluster.gpus_per_node > 0,
            ("generation.placement", "cluster.gpus_per_node"),
            "colocated placement needs GPUs (engines sleep during training with vLLM's CUDA-only sleep "
            "mode); use 'disaggregated' on CPU",
        )
        _require(
            gen.placement != "colocated" or gen.engine_tensor_parallel_size == 1,
            ("generation.placement", "generation.engine_tensor_parallel_size"),
            "colocated placement shares one GPU per engine with a trainer rank: engine_tensor_parallel_size "
            "must be 1 (use 'disaggregated' for multi-GPU engines)",
        )
        if cluster.gpus_per_node == 0:
            return
        total = cluster.num_nodes * cluster.gpus_per_node
        trainer, engines = self.parallel.world_size, gen.num_engines * gen.engine_tensor_parallel_size
        need = max(trainer, engines) if gen.placement == "colocated" else trainer + engines
        _require(
            need <= total,
            ("parallel.data_parallel_size", "generation.num_engines", "cluster.gpus_per_node"),
            f"{gen.placement} placement needs {need} GPUs (trainer {trainer}, engines {engines}) but the "
            f"cluster has {total}",
        )

    @property
    def rollouts_per_step(self) -> int:
        """Sequences generated per step: num_prompts_per_step * num_generations."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations

    @property
    def mini_batches_per_step(self) -> int:
        """Optimizer steps per GRPO step."""
        return self.rollouts_per_step // self.policy.mini_batch_size


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """safe_load, plus YAML 1.2 floats: PyYAML reads `1e-6` (no dot) as a string, a classic lr trap."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return tp.__name__


def _value_desc(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints are widened to float, nothing else is converted."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            try:
                return _coerce(options[0], value, key)
            except ConfigError as e:
                if e.keys != (key,):
                    raise  # An error inside a nested mapping is more precise than "expected X or null".
        else:
            for option in options:
                try:
                    return _coerce(option, value, key)
                except ConfigError:
                    pass
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_value_desc(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_value_desc(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return _from_dict(tp, value, key)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }
    assert tp in ok, f"config annotation {tp!r} of {key} is not supported by _coerce"
    if not ok[tp](value):
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_value_desc(value)}")
    return float(value) if tp is float else value


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, strictly: unknown keys, missing keys and wrong types raise."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a mapping of {cls.__name__} fields, got {_value_desc(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(_join(prefix, str(key)), f"unknown key in {cls.__name__}{hint}")
        kwargs[key] = _coerce(hints[key], value, _join(prefix, key))
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(_join(prefix, name), "required but missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.with_context(prefix) from None


def _apply_override(data: dict, override: str) -> str:
    """Set `a.b.c=value` in the nested dict `data`; returns the dotted key."""
    key, sep, text = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or not all(parts):
        raise ConfigError((), f"malformed override {override!r}: expected section.key=value")
    sections = {f.name for f in dataclasses.fields(Config)}
    if parts[0] not in sections:
        close = difflib.get_close_matches(parts[0], sorted(sections), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(parts[0], f"unknown section in override {override!r}{hint}")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        value = text  # e.g. an unquoted path with odd characters; the type check still applies.
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                ".".join(parts[: i + 1]),
                f"is {_value_desc(child)}, so override {override!r} cannot set a key inside it",
            )
        node = child
    node[parts[-1]] = value
    return key


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config (None: the tiny CPU default), apply `section.key=value` overrides, validate."""
    try:
        path, text = config_files.read_config_file(path)
    except config_files.ConfigFileError as e:
        raise ConfigError((), e.message, e.source) from None
    source = str(path)
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError((), f"invalid YAML: {e}", source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError((), f"top level must be a mapping of sections, got {_value_desc(data)}", source)
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'section.key=value' strings, not a single string")
    overridden = []
    for override in overrides:
        try:
            overridden.append(_apply_override(data, override))
        except ConfigError as e:
            raise e.with_context(source=source) from None
    try:
        return _from_dict(Config, data, "")
    except ConfigError as e:
        hit = [o for o in overridden if any(k == o or k.startswith(o + ".") for k in e.keys)]
        note = f" (set by override {', '.join(hit)})" if hit else ""
        raise e.with_context(source=source, note=note) from None


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of `cfg` (YAML-safe; feeds back into load_config unchanged)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML atomically (temp file in the same directory, then os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a run record should be readable like any file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
