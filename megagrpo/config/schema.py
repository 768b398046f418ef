"""The run configuration's schema: one keyword-only, frozen dataclass per component, each field documented.

A run is described by a YAML file with one section per component (``model``, ``parallel``, ``policy``,
``generation``, ``grpo``, ``sft``, ``dpo``, ``data``, ``reward``, ``eval``, ``warmup``, ``checkpoint``,
``logging``, ``cluster``) plus ``run_name``; :class:`Config` holds them. Each trainer reads the sections it
needs (GRPO: ``grpo``, SFT: ``sft``, DPO: ``dpo``; all of them ``policy`` for the optimizer and
micro-batching).
Each component checks its own fields in ``__post_init__`` (raising
:class:`~megagrpo.config.errors.ConfigError` with the field's name; the loader prefixes the section).
What spans components, and the resolution of ``parallel``'s ``"auto"`` values, is in
:mod:`megagrpo.config.rules`; reading YAML and overrides is in :mod:`megagrpo.config.load`.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from megagrpo.config import rules
from megagrpo.config.errors import ConfigError, check, positive, require

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "DPOConfig",
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PolicyConfig",
    "RewardConfig",
    "SFTConfig",
    "TinyModelConfig",
    "WarmupConfig",
]


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
        positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        positive(self, "num_query_groups", "vocab_size", "max_position_embeddings")
        require(
            self.hidden_size % self.num_attention_heads == 0,
            ("hidden_size", "num_attention_heads"),
            f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
            f"{self.num_attention_heads}",
        )
        require(
            self.num_attention_heads % self.num_query_groups == 0,
            ("num_attention_heads", "num_query_groups"),
            f"num_query_groups {self.num_query_groups} must divide num_attention_heads "
            f"{self.num_attention_heads}",
        )
        check(self, "rope_theta", self.rope_theta > 0, "> 0")
        check(self, "norm_epsilon", self.norm_epsilon > 0, "> 0")


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
    init_from: str | None = None
    """Start from an earlier run's result (a staged recipe's previous stage): its run directory, resolved
    before any worker starts to its HF export (``<run>/hf_export``) or else to the latest verified
    checkpoint of its ``checkpoint.dir``; mutually exclusive with hf_dir, megatron_ckpt and tiny."""

    def __post_init__(self) -> None:
        if self.init_from is not None:
            require(
                self.tiny is None and self.hf_dir is None and self.megatron_ckpt is None,
                ("init_from", "hf_dir", "megatron_ckpt", "tiny"),
                "set either init_from or hf_dir/megatron_ckpt/tiny, not both",
            )
            require(bool(self.init_from), "init_from", "must not be empty")
        elif self.tiny is not None:
            require(
                self.hf_dir is None and self.megatron_ckpt is None,
                ("tiny", "hf_dir", "megatron_ckpt"),
                "set either tiny or hf_dir/megatron_ckpt, not both",
            )
            require(
                self.tiny.max_position_embeddings >= self.seq_length,
                ("tiny.max_position_embeddings", "seq_length"),
                f"max_position_embeddings {self.tiny.max_position_embeddings} < seq_length {self.seq_length}",
            )
        else:
            require(
                self.hf_dir is not None,
                ("hf_dir", "megatron_ckpt", "tiny"),
                "no model given: set hf_dir (optionally with megatron_ckpt), init_from or tiny"
                if self.megatron_ckpt is None
                else "megatron_ckpt needs hf_dir too (the tokenizer and vLLM's model config come from it)",
            )
        check(self, "seq_length", self.seq_length >= 2, ">= 2")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """How the trainer's Megatron model is split over ranks; world_size = DP * TP * PP * CP."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP); must divide the number of attention heads and query groups."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (PP); must divide the number of layers."""
    context_parallel_size: int = 1
    """Context parallel size (CP); > 1 needs transformer_impl transformer_engine and grpo.loss_agg token
    (sequences are padded, cut into 2 x CP chunks, and each rank scores its own two)."""
    expert_model_parallel_size: int = 1
    """Expert parallel size (EP); must stay 1 until MoE models are supported."""
    data_parallel_size: int = 1
    """Data parallel size (DP): replicas of the TP x PP x CP model; must divide policy.mini_batch_size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (shards norms/dropout activations over TP); needs TP > 1 and
    transformer_impl torch or transformer_engine."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; "auto" picks nccl when CUDA is available, else gloo."""
    transformer_impl: Literal["auto", "local", "torch", "transformer_engine"] = "auto"
    """Megatron layer implementation: "local" (Megatron's own, unfused attention), "torch" (PyTorch's
    SDPA/varlen attention and fused RMSNorm), "transformer_engine"; "auto" picks transformer_engine when
    importable, else torch (PyTorch >= 2.5), else local."""
    resolved_backend: Literal["gloo", "nccl"] = field(init=False, compare=False)
    """Not a key: backend with "auto" decided at load, by the process that loads the config."""
    resolved_transformer_impl: Literal["local", "torch", "transformer_engine"] = field(
        init=False, compare=False
    )
    """Not a key: transformer_impl with "auto" decided at load, by the process that loads the config."""

    def __post_init__(self) -> None:
        positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        positive(self, "expert_model_parallel_size", "data_parallel_size")
        require(
            not self.sequence_parallel or self.tensor_model_parallel_size > 1,
            ("sequence_parallel", "tensor_model_parallel_size"),
            "sequence_parallel needs tensor_model_parallel_size > 1",
        )
        check(
            self,
            "expert_model_parallel_size",
            self.expert_model_parallel_size == 1,
            "1 (MoE is not supported yet)",
        )
        backend, transformer_impl = rules.resolve_parallel(self)
        object.__setattr__(self, "resolved_backend", backend)
        object.__setattr__(self, "resolved_transformer_impl", transformer_impl)

    @property
    def world_size(self) -> int:
        """Trainer ranks: DP * TP * PP * CP."""
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        return self.data_parallel_size * tp * pp * cp


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
    """"auto": with the torch or Transformer Engine layers (and CP 1), a micro-batch's sequences are laid
    end to end in one row (THD, no padding; the attention keeps them apart); "off", or with the local
    layers: right-padded [batch, seq] micro-batches."""
    micro_batch_max_tokens: int = 8192
    """Token budget of one packed micro-batch (forward/backward); must fit one model.seq_length sequence."""
    mini_batch_size: int = 64
    """Sequences per optimizer step; must divide grpo.num_prompts_per_step * grpo.num_generations."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when turning logits into log-probs, bounding the float32 vocab-sized buffer."""
    recompute: Literal["none", "core_attention", "full"] = "none"
    """Activation recompute in the backward pass: "core_attention" keeps q/k/v and recomputes the
    attention (Megatron's selective recompute; needed for long sequences on the local, unfused
    attention, little to gain with the fused ones), "full" keeps only each group of
    recompute_num_layers layers' input."""
    recompute_num_layers: int = 1
    """With recompute "full": layers per recomputed group (uniform split of each pipeline stage)."""

    def __post_init__(self) -> None:
        check(self, "lr", self.lr > 0, "> 0")
        require(0 <= self.min_lr <= self.lr, ("min_lr", "lr"), f"need 0 <= min_lr <= lr, got {self.min_lr}")
        check(self, "weight_decay", self.weight_decay >= 0, ">= 0")
        for name in ("adam_beta1", "adam_beta2"):
            check(self, name, 0 <= getattr(self, name) < 1, "in [0, 1)")
        check(self, "adam_eps", self.adam_eps > 0, "> 0")
        check(self, "clip_grad", self.clip_grad >= 0, ">= 0 (0 disables)")
        check(self, "lr_warmup_steps", self.lr_warmup_steps >= 0, ">= 0")
        positive(self, "micro_batch_max_tokens", "mini_batch_size", "logprob_chunk_size")
        positive(self, "recompute_num_layers")


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
    max_num_seqs: int | None = None
    """Sequences one engine decodes at once (vLLM's max_num_seqs). null: vLLM's default, except on its
    CPU build, whose default (256 per engine TP rank) would decode a larger step in waves: there, at
    least one step's rollouts per engine."""
    ignore_eos: bool = False
    """Training rollouts run to max_new_tokens past EOS and stop tokens (a fixed amount of work per step,
    for benchmarks; rewards score the whole text). Validation and `megagrpo eval` stop as usual."""
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    """Engines share the trainer's devices (sleeping during training), or run on devices of their own."""
    sync_bucket_mb: float = 512.0
    """Size of the buckets weights are sent to the engines in, in MiB."""
    weight_sync_path: Literal["auto", "gathered"] = "auto"
    """auto: shard-wise where the TP layouts allow it (weight_sync.shards), else gathered; gathered: always"""
    probe_max_error: float = 1.001
    """Largest trainer/engine probability ratio the post-sync probe tolerates (>= 1); catches broken syncs."""
    sync_timeout_s: float = 600.0
    """Seconds to wait for a weight sync (or a colocated engine's sleep/wake-up) before failing the run."""
    timeout_s: float = 6000.0
    """Seconds to wait for one engine's completions of a generate call before it counts as failed."""
    max_engine_restarts: int = 2
    """Engine restarts allowed per engine_restart_window_steps; one failure more checkpoints and stops."""
    engine_restart_window_steps: int = 100
    """Restarts older than this many GRPO steps no longer count against max_engine_restarts; 0 counts all."""

    def __post_init__(self) -> None:
        positive(self, "num_engines", "engine_tensor_parallel_size", "max_new_tokens")
        check(self, "max_num_seqs", self.max_num_seqs is None or self.max_num_seqs >= 1, ">= 1 or null")
        check(self, "sync_bucket_mb", self.sync_bucket_mb > 0, "> 0")
        check(self, "temperature", self.temperature > 0, "> 0")
        check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        check(self, "top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or >= 1")
        check(self, "gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]")
        check(
            self,
            "cpu_kvcache_space_gib",
            self.cpu_kvcache_space_gib is None or self.cpu_kvcache_space_gib >= 1,
            ">= 1 or null",
        )
        check(self, "probe_max_error", self.probe_max_error >= 1, ">= 1")
        check(self, "sync_timeout_s", self.sync_timeout_s > 0, "> 0")
        check(self, "timeout_s", self.timeout_s > 0, "> 0")
        check(self, "max_engine_restarts", self.max_engine_restarts >= 0, ">= 0")
        check(
            self,
            "engine_restart_window_steps",
            self.engine_restart_window_steps >= 0,
            ">= 0 (0: the whole run)",
        )


@dataclass(kw_only=True, frozen=True)
class GRPOConfig:
    """The algorithm: group sampling, advantages and the clipped surrogate loss (whose knobs are checked
    here, once: ``megagrpo.algorithms.grpo.LossConfig`` takes them as given)."""

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
    kl_clamp: float = 10.0
    """The per-token KL estimate is clamped to [-kl_clamp, kl_clamp] (k2/k3 are >= 0); finite, > 0."""
    loss_agg: Literal["token", "sequence"] = "token"
    """Average the loss over all tokens of the mini-batch (DAPO), or per sequence then over sequences."""
    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Advantage baseline: mean = the group's mean reward (GRPO; Dr. GRPO without std normalization);
    leave_one_out = the mean of the other G - 1 rewards (RLOO: G/(G-1) x the group-mean advantage)."""
    normalize_adv_std: bool = True
    """Divide advantages by the group's reward std (GRPO); false with baseline mean: Dr. GRPO's advantage."""
    filter_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (their advantages are zero) before the update."""
    overlong_policy: Literal["none", "mask", "soft_penalty"] = "none"
    """Truncated responses (finish reason "length"): train on them as is; mask = DAPO's overlong filtering
    (removed from the loss: its sum, token count and KL term); soft_penalty = DAPO's soft length penalty."""
    overlong_buffer_tokens: int = 0
    """soft_penalty: the penalty ramps from 0 to overlong_penalty over the last this-many allowed tokens."""
    overlong_penalty: float = 1.0
    """soft_penalty: reward subtracted from a response that reaches max_new_tokens."""
    tis_cap: float | None = None
    """Truncated importance sampling cap (>= 1) on the trainer/engine probability ratio; null disables it."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """Above tis_cap: weight the token by the cap, or drop it from the loss."""
    max_staleness: int = 0
    """Overlap generation with training: engines generate the next step's rollouts while the trainer
    trains on the current ones, and a rollout is trained on at most this many policy versions after the
    one that generated it (weights reach the engines between batches, every max_staleness steps at
    least). 0: the sequential loop (generate, train, sync)."""
    seed: int = 0
    """Seed for prompt order and anything random in the trainer."""

    def __post_init__(self) -> None:
        positive(self, "num_prompts_per_step", "num_steps")
        check(self, "num_generations", self.num_generations >= 2, ">= 2 (a group needs a baseline)")
        for name in ("clip_eps_low", "clip_eps_high"):
            check(self, name, 0 < getattr(self, name) < 1, "in (0, 1)")
        check(self, "dual_clip", self.dual_clip is None or self.dual_clip > 1, "> 1 or null")
        check(self, "kl_coef", math.isfinite(self.kl_coef) and self.kl_coef >= 0, "finite and >= 0")
        check(self, "kl_clamp", math.isfinite(self.kl_clamp) and self.kl_clamp > 0, "finite and > 0")
        check(self, "overlong_buffer_tokens", self.overlong_buffer_tokens >= 0, ">= 0")
        require(
            self.overlong_policy != "soft_penalty" or self.overlong_buffer_tokens >= 1,
            ("overlong_buffer_tokens", "overlong_policy"),
            "overlong_policy 'soft_penalty' needs overlong_buffer_tokens >= 1",
        )
        check(self, "overlong_penalty", self.overlong_penalty >= 0, ">= 0")
        check(self, "tis_cap", self.tis_cap is None or self.tis_cap >= 1, ">= 1 or null")
        check(self, "max_staleness", self.max_staleness >= 0, ">= 0")
        require(
            self.max_staleness <= self.num_steps,
            ("max_staleness", "num_steps"),
            f"max_staleness {self.max_staleness} is larger than the run's {self.num_steps} steps",
        )


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Prompts and reference answers."""

    train_path: str | None = None
    """Training records (.jsonl, .json array or .parquet): GRPO prompts with answers, SFT conversations
    or DPO pairs; null uses synthetic_task."""
    val_path: str | None = None
    """Validation records; null draws them from synthetic_task (or holds none if train_path is set)."""
    prompt_key: str = "problem"
    """Record field holding the question."""
    answer_key: str = "answer"
    """Record field holding the reference answer given to the reward."""
    synthetic_task: Literal["arithmetic", "math"] = "arithmetic"
    """Generated task used when train_path is null: "arithmetic" (a+b over a character vocabulary) or
    "math" (SFT only: worked solutions of generated math problems, megagrpo.data.math_problems; a tiny
    model then gets a BPE tokenizer trained on such problems)."""
    arithmetic_max_operand: int = 99
    """Synthetic arithmetic: operands are drawn uniformly from [0, arithmetic_max_operand]."""
    arithmetic_ops: str = "+-"
    """Synthetic arithmetic: operators to draw from (any of "+-*")."""
    math_terse_frac: float = 0.0
    """Synthetic math SFT: share of the worked solutions that give the boxed answer alone, without the
    steps (a model made from such data answers some problems at once and works others through; the CPU
    twin's made model uses none, see benchmarks/results/twin_sweep.md)."""
    math_unboxed_frac: float = 0.0
    """Synthetic math SFT: share of the other worked solutions that end in the answer without
    \\boxed{} (the math reward scores such a response 0: a made model then loses reward to format, as
    a real one does at first, and GRPO has a behaviour to learn)."""
    num_val_prompts: int = 0
    """Validation prompts evaluated every logging.val_every steps; 0 disables validation."""
    template: str = "{prompt}"
    """Prompt text; the literal `{prompt}` is replaced (str.replace, so braces like \\boxed{} are kept)."""
    apply_chat_template: bool = False
    """GRPO: wrap the templated prompt in the tokenizer's chat template as a single user turn. SFT/DPO:
    render conversations with the chat template (loss on assistant tokens only); false: plain prompt
    text followed by the response and EOS."""
    messages_key: str = "messages"
    """SFT/DPO: record field holding a conversation (a list of {role, content}); rows without it use
    prompt_key and response_key (SFT) or prompt_key, chosen_key and rejected_key (DPO)."""
    response_key: str = "response"
    """SFT: record field holding the response to the prompt (prompt_key)."""
    chosen_key: str = "chosen"
    """DPO: record field holding the preferred response (a string or a list of assistant messages)."""
    rejected_key: str = "rejected"
    """DPO: record field holding the dispreferred response (a string or a list of assistant messages)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A row with a missing or empty field (GRPO, eval, SFT, DPO), a pair whose chosen equals rejected, or
    an SFT/DPO sequence longer than model.seq_length stops the run naming file and row ("error"), or is
    left out and counted in the metrics ("skip"). GRPO prompts too long for the context are always
    skipped and counted (data/skipped_long_prompts)."""

    def __post_init__(self) -> None:
        require("{prompt}" in self.template, "template", f"must contain '{{prompt}}', got {self.template!r}")
        keys = ("prompt_key", "answer_key", "messages_key", "response_key", "chosen_key", "rejected_key")
        for name in keys:
            require(bool(getattr(self, name)), name, "must not be empty")
        check(self, "num_val_prompts", self.num_val_prompts >= 0, ">= 0")
        check(self, "math_terse_frac", 0.0 <= self.math_terse_frac <= 1.0, "in [0, 1]")
        check(self, "math_unboxed_frac", 0.0 <= self.math_unboxed_frac <= 1.0, "in [0, 1]")
        check(self, "arithmetic_max_operand", 1 <= self.arithmetic_max_operand <= 9999, "in [1, 9999]")
        check(
            self,
            "arithmetic_ops",
            bool(self.arithmetic_ops) and set(self.arithmetic_ops) <= set("+-*"),
            'a non-empty string of operators from "+-*"',
        )


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """pass@k evaluation (``megagrpo eval``) and the sampled part of GRPO's validation (megagrpo.evaluate)."""

    path: str | None = None
    """Problems to evaluate (.jsonl, .json or .parquet with data.prompt_key / data.answer_key); null:
    data.val_path."""
    num_problems: int = 0
    """Evaluate the first this many problems; 0: all of them."""
    num_samples: int = 16
    """Samples per problem (n): pass@1 is averaged over them, pass@k reported for k = 1, 2, 4, ... n."""
    temperature: float = 0.6
    """Sampling temperature (DeepScaleR's AIME protocol: 0.6)."""
    top_p: float = 0.95
    """Nucleus sampling mass (DeepScaleR's AIME protocol: 0.95)."""
    max_new_tokens: int | None = None
    """Response budget; null: generation.max_new_tokens."""
    seed: int = 0
    """Sampling seed (per problem, so results do not depend on batching)."""
    val_samples: int = 0
    """GRPO validation: also sample this many responses per validation prompt with the settings above
    and log val/pass@k (k = 1, 2, 4, ...); 0: only the greedy val/accuracy."""

    def __post_init__(self) -> None:
        check(self, "num_problems", self.num_problems >= 0, ">= 0 (0: all)")
        positive(self, "num_samples")
        check(self, "temperature", self.temperature > 0, "> 0")
        check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        check(self, "max_new_tokens", self.max_new_tokens is None or self.max_new_tokens >= 1, ">= 1 or null")
        check(self, "val_samples", self.val_samples >= 0, ">= 0")


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
        check(self, "steps", self.steps >= 0, ">= 0")
        check(self, "lr", self.lr > 0, "> 0")
        positive(self, "batch_size", "num_eval_prompts")


@dataclass(kw_only=True, frozen=True)
class SFTConfig:
    """Supervised fine-tuning (``megagrpo sft``): masked next-token loss on assistant tokens; the optimizer,
    LR schedule and micro-batch budget come from ``policy``."""

    num_steps: int = 100
    """Optimizer steps of the run."""
    batch_size: int = 64
    """Sequences per optimizer step (all data-parallel ranks together)."""
    val_every: int = 0
    """Validation loss every this many steps (and at the end); 0: only at the start and the end."""
    num_val_examples: int = 64
    """Validation examples (the first ones of data.val_path, or drawn from synthetic_task); 0 disables."""
    seed: int = 0
    """Seed of the data order and the model's initialisation."""

    def __post_init__(self) -> None:
        positive(self, "num_steps", "batch_size")
        check(self, "val_every", self.val_every >= 0, ">= 0")
        check(self, "num_val_examples", self.num_val_examples >= 0, ">= 0")


@dataclass(kw_only=True, frozen=True)
class DPOConfig:
    """Direct preference optimisation (``megagrpo dpo``) against the frozen initial policy; the optimizer,
    LR schedule and micro-batch budget come from ``policy``."""

    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO (Rafailov et al. 2023) with label smoothing (conservative DPO); ipo: IPO (Azar et al.)."""
    beta: float = 0.1
    """DPO's KL weight beta (sigmoid), or IPO's regularisation tau (the target margin is 1 / (2 tau))."""
    label_smoothing: float = 0.0
    """sigmoid only: assumed probability that a pair's preference label is flipped, in [0, 0.5)."""
    length_normalize: bool = False
    """Use each response's mean token logprob instead of its sum (policy and reference alike)."""
    nll_weight: float = 0.0
    """Weight of the chosen response's mean token NLL added to each pair's loss (Iterative RPO's NLL term);
    0: the plain DPO / IPO loss."""
    num_steps: int = 100
    """Optimizer steps of the run."""
    batch_size: int = 32
    """Preference pairs per optimizer step (all data-parallel ranks together)."""
    val_every: int = 0
    """Validation (loss, accuracy, margins on the validation pairs) every this many steps (and at the
    end); 0: only at the start and the end."""
    num_val_pairs: int = 64
    """Validation pairs (the first ones of data.val_path, or sampled for synthetic_task); 0 disables."""
    num_synthetic_pairs: int = 512
    """synthetic_task only: training pairs sampled from the initial policy before training."""
    synthetic_samples: int = 8
    """synthetic_task only: answers sampled per prompt (temperature 1) to find a wrong and a right one."""
    seed: int = 0
    """Seed of the data order and of the synthetic pairs' sampling."""

    def __post_init__(self) -> None:
        check(self, "beta", math.isfinite(self.beta) and self.beta > 0, "finite and > 0")
        check(self, "label_smoothing", 0 <= self.label_smoothing < 0.5, "in [0, 0.5)")
        require(
            self.label_smoothing == 0 or self.loss == "sigmoid",
            ("label_smoothing", "loss"),
            "label_smoothing applies to the sigmoid loss only",
        )
        check(self, "nll_weight", math.isfinite(self.nll_weight) and self.nll_weight >= 0, "finite and >= 0")
        positive(self, "num_steps", "batch_size", "num_synthetic_pairs")
        check(self, "synthetic_samples", self.synthetic_samples >= 2, ">= 2")
        check(self, "val_every", self.val_every >= 0, ">= 0")
        check(self, "num_val_pairs", self.num_val_pairs >= 0, ">= 0")


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """How responses are scored."""

    kind: Literal["math_verify", "arithmetic", "python"] = "math_verify"
    """math_verify: symbolic equivalence of the last \\boxed{} answer; arithmetic: exact integer match;
    python: reward.function."""
    function: str | None = None
    """kind python: "package.module:function" or "path/to/file.py:function" (relative to the working
    directory), called as function(response, answer) -> float; loaded and checked at load."""
    num_workers: int = 4
    """Worker processes scoring responses in parallel (math_verify, python)."""
    timeout_s: float = 5.0
    """Deadline of one response's scoring from when a worker starts it; past it the response scores 0 and
    the worker is killed and replaced (math_verify, python)."""
    format_reward: float = 0.0
    """math_verify: reward of a wrong answer given in a complete final \\boxed{} (a correct one scores 1,
    no box 0); in [0, 1), 0 disables it."""

    def __post_init__(self) -> None:
        positive(self, "num_workers")
        check(self, "timeout_s", math.isfinite(self.timeout_s) and self.timeout_s > 0, "finite and > 0")
        check(self, "format_reward", 0 <= self.format_reward < 1, "in [0, 1)")
        require(
            self.format_reward == 0 or self.kind == "math_verify",
            ("format_reward", "kind"),
            "format_reward applies to kind 'math_verify' only",
        )
        if self.kind != "python":
            require(self.function is None, ("function", "kind"), "function is used with kind 'python' only")
            return
        require(self.function is not None, ("function", "kind"), "kind 'python' needs a function")
        from megagrpo.rewards.user import check_function

        try:
            check_function(self.function)
        except ValueError as err:
            raise ConfigError("function", str(err)) from None


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
    on_corrupt: Literal["fallback", "error"] = "fallback"
    """Resume when the latest checkpoint fails its manifest: use the newest that passes, or stop."""
    on_error: Literal["stop", "continue"] = "stop"
    """A checkpoint that cannot be written (disk full, unwritable dir) stops the run, or it goes on."""

    def __post_init__(self) -> None:
        check(self, "save_every", self.save_every >= 0, ">= 0")
        positive(self, "keep_last")
        if self.dir is None:
            for name in ("resume", "export_hf_at_end"):
                require(not getattr(self, name), (name, "dir"), f"{name} needs dir to be set")
            require(self.save_every == 0, ("save_every", "dir"), "save_every > 0 needs dir to be set")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """Metrics and progress output."""

    dir: str = "runs"
    """Root of run outputs; a run writes config.yaml and metrics under `<dir>/<run_name>/`."""
    tensorboard: bool = False
    """Also write TensorBoard event files."""
    log_every: int = 1
    """Print the step's summary line every this many steps (and the last step); metrics.jsonl, TensorBoard
    and the progress bar get every step."""
    val_every: int = 0
    """Validate every this many steps; 0 disables validation."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""
    wandb: bool = False
    """Also log every step to Weights & Biases (needs the optional ``wandb`` package: megagrpo[wandb])."""
    wandb_project: str = "megagrpo"
    """W&B project the run is logged to."""
    wandb_mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server; offline: write the run under <run dir>/wandb for `wandb sync`."""

    def __post_init__(self) -> None:
        require(bool(self.dir), "dir", "must not be empty")
        require(bool(self.wandb_project), "wandb_project", "must not be empty")
        positive(self, "log_every")
        check(self, "val_every", self.val_every >= 0, ">= 0")


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
    cpu_threads: int | None = None
    """Intra-op threads of each trainer rank and vLLM engine (engine TP 1) without GPUs. null: in the
    sequential loop (grpo.max_staleness 0: engines and trainer take turns), the node's cores shared
    out among the trainer ranks on it, and on one node among the engines; else cpus_per_worker
    (at least 1)."""
    policy_resource: str | None = None
    """Custom Ray resource every policy rank requires: a node label (start the training nodes with
    `ray start --resources '{"NAME": 1}'`); null places ranks on any node."""
    engine_resource: str | None = None
    """Custom Ray resource every vLLM engine requires (disaggregated placement): puts engines on the
    nodes started with it; null places engines on any node."""

    def __post_init__(self) -> None:
        positive(self, "num_nodes")
        for key in ("policy_resource", "engine_resource"):
            name = getattr(self, key)
            check(
                self,
                key,
                name is None or (name != "" and name not in ("CPU", "GPU", "memory")),
                "a custom resource name",
            )
        check(self, "gpus_per_node", self.gpus_per_node >= 0, ">= 0")
        check(self, "cpus_per_worker", self.cpus_per_worker > 0, "> 0")
        check(self, "cpu_threads", self.cpu_threads is None or self.cpu_threads > 0, "> 0 or null")


@dataclass(kw_only=True, frozen=True)
class Config:
    """A whole run. Cross-component checks (megagrpo.config.rules) run in __post_init__; keys in their errors
    are fully dotted."""

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
    """GRPO (``megagrpo train``)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning (``megagrpo sft``)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Preference optimisation (``megagrpo dpo``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """pass@k evaluation (``megagrpo eval``, sampled validation)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Optional supervised warm-up before GRPO (tiny models on the synthetic task)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray resources."""

    def __post_init__(self) -> None:
        require(
            re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name) is not None,
            "run_name",
            f"must be non-empty and use only letters, digits, '.', '_' and '-', got {self.run_name!r}",
        )
        rules.check_run(self)

    @property
    def rollouts_per_step(self) -> int:
        """Sequences generated per step: num_prompts_per_step * num_generations."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations

    @property
    def mini_batches_per_step(self) -> int:
        """Optimizer steps per GRPO step."""
        return self.rollouts_per_step // self.policy.mini_batch_size

    @property
    def packs_sequences(self) -> bool:
        """Whether the policy's micro-batches are packed end to end (THD), with the layers this config
        resolved to (``rules.packs_sequences``)."""
        return rules.packs_sequences(self, self.parallel.resolved_transformer_impl)
