"""The trainers' sections: ``policy`` (optimizer and batching, every trainer), ``grpo``, ``sft``, ``dpo``
and ``warmup``.
"""

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megagrpo.config.errors import check, positive, require

__all__ = [
    "DPOConfig",
    "DistillConfig",
    "GRPOConfig",
    "LoraConfig",
    "PolicyConfig",
    "SFTConfig",
    "WarmupConfig",
]


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_EXPERT_TARGETS = ("experts.linear_fc1", "experts.linear_fc2")


@dataclass(kw_only=True, frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA): only they train; the base weights stay frozen and are the KL reference."""

    rank: int | None = 0
    """Adapter rank r; 0 or null: no adapters, every weight trains."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training, in [0, 1)."""
    target_modules: str = ",".join(LORA_TARGETS)
    """Comma-separated Megatron layers that get an adapter: linear_qkv (fused Q/K/V), linear_proj
    (attention out), linear_fc1 (gate/up), linear_fc2 (down); on a mixture-of-experts model
    experts.linear_fc1 / experts.linear_fc2 (every routed expert's)."""

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.target_modules.split(",") if t.strip())

    def __post_init__(self) -> None:
        check(self, "rank", self.rank is None or self.rank >= 0, ">= 0 (0 or null: off)")
        check(self, "alpha", self.alpha > 0, "> 0")
        check(self, "dropout", 0 <= self.dropout < 1, "in [0, 1)")
        known = LORA_TARGETS + LORA_EXPERT_TARGETS
        unknown = [t for t in self.targets if t not in known]
        check(self, "target_modules", not unknown and bool(self.targets), f"a list of {', '.join(known)}")
        require(len(set(self.targets)) == len(self.targets), "target_modules", "names a layer twice")


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
    offload: Literal["none", "optimizer", "all"] = "none"
    """Colocated placement: what the trainer moves to host memory while the engines run (the free blocks
    of its allocator go back either way). "optimizer": Adam's moments and fp32 master weights, before
    the engines wake; "all": those and the gradient buffers, then the weights once they are synced.
    Brought back, bit for bit, before the trainer's next forward."""

    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the router's load-balancing loss (Switch-style, per layer,
    added to the policy loss); 0 (the default for RL, which keeps the router close to the rollouts')
    leaves it out."""
    freeze_router: bool = False
    """Mixture-of-experts models: keep the routers' weights as loaded (no gradient, no update)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (``policy.lora.rank`` > 0): train them only, on the frozen base."""

    def __post_init__(self) -> None:
        check(self, "lr", self.lr > 0, "> 0")
        check(self, "moe_aux_loss_coeff", self.moe_aux_loss_coeff >= 0, ">= 0")
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
class GRPOConfig:
    """The algorithm: group sampling, advantages and the clipped surrogate loss (whose knobs are checked
    here, once: ``megagrpo.algorithms.grpo.LossConfig`` takes them as given)."""

    num_prompts_per_step: int = 32
    """Prompts sampled per step."""
    num_generations: int = 8
    """Responses per prompt (the group size); >= 2 so that a group has a baseline."""
    num_steps: int = 100
    """Rollout-and-update steps in the run."""
    loss: Literal["grpo", "gspo", "gspo_token", "cispo"] = "grpo"
    """Policy-gradient term: grpo = PPO's clipped token ratio; gspo / gspo_token = GSPO's clipped sequence
    ratio (needs loss_agg sequence; the paper clips at 3e-4 / 4e-4); cispo = CISPO's clipped,
    stop-gradient token weight times the token's logprob (MiniMax-M1)."""
    clip_eps_low: float = 0.2
    """Clip below: ratios under 1 - clip_eps_low are clipped; in (0, 1), and for cispo in (0, 1] (1: no
    lower bound on the weight)."""
    clip_eps_high: float = 0.2
    """Clip above: ratios over 1 + clip_eps_high are clipped (DAPO's clip-higher sets 0.28); in (0, 1), and
    for cispo > 0 (.inf: no upper bound)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens (loss grpo); null disables it."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy; 0 needs no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman): k1 = log-ratio, k2 = squared log-ratio / 2, k3 = low-variance, >= 0."""
    kl_clamp: float = 10.0
    """The per-token KL estimate is clamped to [-kl_clamp, kl_clamp] (k2/k3 are >= 0); finite, > 0."""
    loss_agg: Literal["token", "sequence"] = "token"
    """Average the loss over all tokens of the mini-batch (DAPO), or per sequence then over sequences."""
    baseline: Literal["mean", "leave_one_out", "reinforce_pp", "reinforce_pp_baseline"] = "mean"
    """Advantage baseline: mean = the group's mean reward (GRPO; Dr. GRPO without std normalization);
    leave_one_out = the mean of the other G - 1 rewards (RLOO: G/(G-1) x the group-mean advantage);
    reinforce_pp = the whole batch's mean reward (REINFORCE++); reinforce_pp_baseline = the group's mean,
    then normalised over the whole batch (REINFORCE++ with baseline)."""
    normalize_adv_std: bool = True
    """Divide advantages by the std of their population: the group's rewards (mean, leave_one_out; false
    with mean: Dr. GRPO's advantage), or the whole batch's centred rewards (reinforce_pp*, as published)."""
    filter_zero_variance_groups: bool = False
    """Drop groups whose rewards are all equal (their advantages are zero) before the update."""
    overlong_policy: Literal["none", "mask", "soft_penalty"] = "none"
    """Truncated responses (finish reason "length"): train on them as is; mask = DAPO's overlong filtering
    (removed from the loss: its sum, token count and KL term); soft_penalty = DAPO's soft length penalty."""
    overlong_buffer_tokens: int = 0
    """soft_penalty: the penalty ramps from 0 to overlong_penalty over the last this-many allowed tokens."""
    overlong_penalty: float = 1.0
    """soft_penalty: reward subtracted from a response that reaches max_new_tokens."""
    off_policy_correction: Literal["none", "decoupled_ppo", "tis", "mis"] = "none"
    """What multiplies each token's policy-gradient term, from its behaviour weight w = pi_old / pi_gen
    (trainer before the step / the engine that sampled it): none = 1; decoupled_ppo = w (decoupled PPO,
    Hilton et al. 2022, as AReaL uses it); tis = min(w, behav_weight_cap) (truncated IS, Yao et al. 2025);
    mis = w inside [behav_weight_floor, behav_weight_cap], else 0 (masked IS; IcePop with a floor)."""
    behav_weight_cap: float | None = None
    """tis: the truncation cap; mis: the upper bound of the kept band; >= 1, required by both, null
    otherwise."""
    behav_weight_floor: float | None = None
    """mis: the lower bound of the kept band, in (0, 1] (IcePop's alpha); null: no lower bound."""
    routing_replay: Literal["none", "rollout"] = "none"
    """Mixture-of-experts models: "rollout" routes every token the engine sampled through the experts the
    engine chose for it (rollout routing replay): the engines return each sampled token's top-k experts
    per MoE layer, and every trainer forward of those tokens (old logprobs, reference, update, probe)
    replays them through Megatron's router replay; "none": the trainer's routers pick their own."""
    max_staleness: int = 0
    """Overlap generation with training: engines generate the next step's rollouts while the trainer
    trains on the current ones, and a rollout is trained on at most this many policy versions after the
    one that generated it (weights reach the engines between batches, every max_staleness steps at
    least). 0: the sequential loop (generate, train, sync). A response's staleness is counted from its
    oldest token (``Completion.versions``); with async_mode partial a group with a member staler than this
    is dropped whole (``trainers.group_buffer``; the overlap schedule never lets a batch get that old)."""
    async_mode: Literal["batch", "partial"] = "batch"
    """batch: a step's rollouts are generated whole by one policy version (max_staleness 0: generate,
    train, sync in turns; >= 1: the next batch is generated while the trainer trains). partial: the
    engines never stop generating; weights are swapped into running requests at a token boundary,
    each token records the version that sampled it, and a step takes the first finished groups whose
    oldest token is at most max_staleness (>= 1) versions old (``megagrpo.trainers.partial``)."""
    seed: int = 0
    """Seed for prompt order and anything random in the trainer."""

    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        "tis_cap": "the behaviour weight is set by grpo.off_policy_correction now: tis_cap C (tis_mode "
        "truncate) is off_policy_correction tis with behav_weight_cap C; tis_cap null is "
        "off_policy_correction none",
        "tis_mode": "the behaviour weight is set by grpo.off_policy_correction now: tis_mode truncate is "
        "off_policy_correction tis; tis_mode mask (weight 1 up to the cap, 0 above) is closest to "
        "off_policy_correction mis, which keeps the weight w itself up to behav_weight_cap",
    }
    """Keys of earlier releases: a config that sets one is refused with this message."""

    def __post_init__(self) -> None:
        positive(self, "num_prompts_per_step", "num_steps")
        check(self, "num_generations", self.num_generations >= 2, ">= 2 (a group needs a baseline)")
        self._check_loss()
        check(self, "kl_coef", math.isfinite(self.kl_coef) and self.kl_coef >= 0, "finite and >= 0")
        check(self, "kl_clamp", math.isfinite(self.kl_clamp) and self.kl_clamp > 0, "finite and > 0")
        check(self, "overlong_buffer_tokens", self.overlong_buffer_tokens >= 0, ">= 0")
        require(
            self.overlong_policy != "soft_penalty" or self.overlong_buffer_tokens >= 1,
            ("overlong_buffer_tokens", "overlong_policy"),
            "overlong_policy 'soft_penalty' needs overlong_buffer_tokens >= 1",
        )
        check(self, "overlong_penalty", self.overlong_penalty >= 0, ">= 0")
        self._check_off_policy()
        check(self, "max_staleness", self.max_staleness >= 0, ">= 0")
        require(
            self.baseline != "reinforce_pp" or not self.filter_zero_variance_groups,
            ("filter_zero_variance_groups", "baseline"),
            "baseline 'reinforce_pp' has no group baseline, so a group of equal rewards still has nonzero "
            "advantages: filtering those groups would drop signal (use reinforce_pp_baseline)",
        )
        require(
            self.max_staleness <= self.num_steps,
            ("max_staleness", "num_steps"),
            f"max_staleness {self.max_staleness} is larger than the run's {self.num_steps} steps",
        )
        require(
            self.async_mode != "partial" or self.max_staleness >= 1,
            ("async_mode", "max_staleness"),
            "async_mode 'partial' trains tokens sampled by earlier versions: max_staleness must be >= 1 "
            f"(got {self.max_staleness})",
        )

    def _check_loss(self) -> None:
        """The clip range each loss allows, and the knobs a loss does not define."""
        if self.loss == "cispo":
            check(self, "clip_eps_low", 0 < self.clip_eps_low <= 1, "in (0, 1] with loss cispo")
            check(self, "clip_eps_high", self.clip_eps_high > 0, "> 0 with loss cispo")
        else:
            for name in ("clip_eps_low", "clip_eps_high"):
                check(self, name, 0 < getattr(self, name) < 1, "in (0, 1)")
        check(self, "dual_clip", self.dual_clip is None or self.dual_clip > 1, "> 1 or null")
        require(
            self.dual_clip is None or self.loss == "grpo",
            ("dual_clip", "loss"),
            f"dual_clip bounds PPO's token surrogate (loss grpo); loss {self.loss!r} does not define it",
        )
        if self.loss in ("gspo", "gspo_token"):
            require(
                self.loss_agg == "sequence",
                ("loss_agg", "loss"),
                f"loss {self.loss!r} is defined as a mean over sequences (GSPO); set loss_agg: sequence",
            )
            require(
                self.off_policy_correction == "none",
                ("off_policy_correction", "loss"),
                f"off_policy_correction {self.off_policy_correction!r} weights single tokens; loss "
                f"{self.loss!r} clips a sequence-level ratio, and a token weight inside it is not defined",
            )

    def _check_off_policy(self) -> None:
        """The bounds each off_policy_correction takes."""
        cap, floor, correction = self.behav_weight_cap, self.behav_weight_floor, self.off_policy_correction
        bounded = correction in ("tis", "mis")
        takes = "needs" if bounded else "takes no"
        takes += " behav_weight_cap (tis truncates the weight at it, mis masks the weights above it)"
        require(
            (cap is not None) == bounded,
            ("behav_weight_cap", "off_policy_correction"),
            f"off_policy_correction {correction!r} {takes}",
        )
        finite_cap = cap is None or (math.isfinite(cap) and cap >= 1)
        check(self, "behav_weight_cap", finite_cap, "finite, >= 1 or null")
        require(
            floor is None or correction == "mis",
            ("behav_weight_floor", "off_policy_correction"),
            f"behav_weight_floor bounds mis's band; off_policy_correction {correction!r} does not take it",
        )
        check(self, "behav_weight_floor", floor is None or 0 < floor <= 1, "in (0, 1] or null")


@dataclass(kw_only=True, frozen=True)
class DistillConfig:
    """On-policy distillation (``megagrpo distill``): the GRPO loop, whose per-token advantage is the
    teacher's logprob minus the sampling policy's on each sampled token (the negative per-token reverse KL),
    optionally plus the task reward's group advantage."""

    teacher_hf_dir: str | None = None
    """HF directory of the teacher (any supported architecture, any size); it must use the student's
    tokenizer. Required by ``megagrpo distill``, refused by ``megagrpo train``."""
    teacher_tensor_parallel_size: int = 1
    """TP of the teacher's own Megatron ranks (forward passes only: no gradients, no optimizer)."""
    teacher_pipeline_parallel_size: int = 1
    """PP of the teacher's ranks."""
    teacher_data_parallel_size: int = 1
    """DP of the teacher's ranks: each scores its share of a step's sequences."""
    reverse_kl_coef: float = 1.0
    """Weight of the per-token advantage teacher logprob - student logprob (> 0)."""
    task_reward_weight: float = 0.0
    """Weight of the task reward's advantage (grpo.baseline over reward.*) added on every token; 0: pure
    distillation (rewards are still computed and logged)."""
    advantage_norm: Literal["none", "center", "standardize"] = "none"
    """The reverse-KL advantages over a step's response tokens: as they are (``none``), less their mean
    (``center``: a constant baseline), or less their mean and over their standard deviation
    (``standardize``)."""
    teacher_temperature: float | None = None
    """Temperature of the teacher's logprobs; null: generation.temperature (the student's, the published
    recipe). Below it, the student is drawn towards a sharpened teacher."""

    @property
    def teacher_world_size(self) -> int:
        """The teacher's ranks: TP x PP x DP."""
        tp, pp = self.teacher_tensor_parallel_size, self.teacher_pipeline_parallel_size
        return tp * pp * self.teacher_data_parallel_size

    def __post_init__(self) -> None:
        for name in ("teacher_tensor_parallel_size", "teacher_pipeline_parallel_size"):
            positive(self, name)
        positive(self, "teacher_data_parallel_size")
        check(
            self, "reverse_kl_coef", math.isfinite(self.reverse_kl_coef) and self.reverse_kl_coef > 0, "> 0"
        )
        ok = math.isfinite(self.task_reward_weight) and self.task_reward_weight >= 0
        check(self, "task_reward_weight", ok, "finite and >= 0")
        t = self.teacher_temperature
        check(self, "teacher_temperature", t is None or (math.isfinite(t) and t > 0), "null or > 0")


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
class WarmupConfig:
    """Supervised warm-up on the synthetic task, so a random tiny model has a reward signal for GRPO
    (``megagrpo train`` and ``megagrpo dpo`` warm a tiny model up; ``megagrpo warmup`` runs it alone)."""

    steps: int = 0
    """Optimizer steps of supervised training before GRPO or DPO on a tiny model; 0 still runs a one-step
    warm-up, only to save the (nearly random) model where the policy ranks and vLLM load it from."""
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
