"""The model and its split over the trainer's ranks: ``model`` (with ``model.tiny``) and ``parallel``."""

import math
from dataclasses import dataclass
from typing import Literal

from megagrpo.config.errors import check, positive, require

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "TinyModelConfig",
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
    num_experts: int = 0
    """Routed experts of every MLP (model.arch qwen3_moe or qwen2_moe); 0: a dense model."""
    moe_ffn_hidden_size: int = 64
    """Width of one expert's MLP (mixture-of-experts models)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (mixture-of-experts models)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE does, Qwen2-MoE does not)."""
    moe_shared_expert_ffn_hidden_size: int | None = None
    """Width of the gated shared expert (model.arch qwen2_moe); null: none."""

    def __post_init__(self) -> None:
        positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
        check(self, "num_experts", self.num_experts >= 0, ">= 0")
        if self.num_experts:
            positive(self, "moe_ffn_hidden_size", "moe_router_topk")
            require(
                self.moe_router_topk <= self.num_experts,
                ("moe_router_topk", "num_experts"),
                f"moe_router_topk {self.moe_router_topk} is more than num_experts {self.num_experts}",
            )
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
    arch: Literal["qwen2", "qwen3_moe", "qwen2_moe"] = "qwen2"
    """Architecture of the tiny model (an HF checkpoint's architecture is read from its config); the
    mixture-of-experts ones need tiny.num_experts."""
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
            moe = self.arch in ("qwen3_moe", "qwen2_moe")
            require(
                moe == (self.tiny.num_experts > 0),
                ("arch", "tiny.num_experts"),
                f"arch {self.arch} needs tiny.num_experts > 0"
                if moe
                else f"tiny.num_experts needs arch qwen3_moe or qwen2_moe, got {self.arch}",
            )
            require(
                self.tiny.moe_shared_expert_ffn_hidden_size is None or self.arch == "qwen2_moe",
                ("tiny.moe_shared_expert_ffn_hidden_size", "arch"),
                f"a shared expert is Qwen2-MoE's (arch qwen2_moe), got arch {self.arch}",
            )
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
    """Expert parallel size (EP, mixture-of-experts models): each rank of an EP group holds
    num_experts / EP of every MoE layer's experts, tokens reach them by all-to-all. Must divide the
    model's num_experts; EP x ETP must divide the ranks of one pipeline stage (TP x DP x CP)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallel size of the experts' MLPs (ETP); null: tensor_model_parallel_size. Must divide TP
    and the expert width; 1 under TP > 1 keeps each expert whole on its rank and folds EP over the TP
    ranks (Megatron's parallel folding)."""
    data_parallel_size: int = 1
    """Data parallel size (DP): replicas of the TP x PP x CP model; must divide policy.mini_batch_size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (shards norms/dropout activations over TP); needs TP > 1 and
    transformer_impl torch or transformer_engine."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's DistributedOptimizer)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; "auto" picks nccl when CUDA is available, else gloo (decided once:
    ``cfg.resolved.backend``)."""
    collective_timeout_s: float = 600.0
    """Seconds one collective of the trainer's process groups may take (torch.distributed's, and
    Megatron's, whose timeout is in whole minutes: rounded up) before the backend fails it."""
    transformer_impl: Literal["auto", "local", "torch", "transformer_engine"] = "auto"
    """Megatron layer implementation: "local" (Megatron's own, unfused attention), "torch" (PyTorch's
    SDPA/varlen attention and fused RMSNorm), "transformer_engine"; "auto" picks transformer_engine when
    Megatron-Core imports it (its HAVE_TE), else torch (PyTorch >= 2.5), else local (decided once:
    ``cfg.resolved.transformer_impl``)."""

    def __post_init__(self) -> None:
        positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        positive(self, "expert_model_parallel_size", "data_parallel_size")
        check(
            self,
            "collective_timeout_s",
            math.isfinite(self.collective_timeout_s) and self.collective_timeout_s > 0,
            "finite and > 0",
        )
        require(
            not self.sequence_parallel or self.tensor_model_parallel_size > 1,
            ("sequence_parallel", "tensor_model_parallel_size"),
            "sequence_parallel needs tensor_model_parallel_size > 1",
        )
        if self.expert_tensor_parallel_size is not None:
            positive(self, "expert_tensor_parallel_size")

    @property
    def world_size(self) -> int:
        """Trainer ranks: DP * TP * PP * CP."""
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        return self.data_parallel_size * tp * pp * cp
