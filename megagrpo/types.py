"""Data the GRPO loop exchanges with its actors, as frozen dataclasses whose fields spell out shapes.

Controller -> policy ranks: :class:`TrainBatch`; policy ranks -> controller: :class:`TrainMetrics`, one
per optimizer step (and ``[B, S - 1]`` logprob tensors). SFT and DPO: :class:`SequenceBatch` in,
:class:`SFTMetrics` / :class:`DPOMetrics` out. Controller -> vLLM engines:
:class:`SamplingSettings` and token-id prompts; engines -> controller: :class:`Completion`. The weight
sync's own wire format (bucket plans, what a sender reports) lives with it, in
``megagrpo.weight_sync.buckets``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megagrpo.config import Config

PAD_ID = 0


@dataclass(frozen=True)
class TrainBatch:
    """B sequences (prompt + response token ids) and per-position data for the policy.

    Position ``t`` of every ``[B, S - 1]`` tensor refers to predicting ``input_ids[:, t + 1]``
    from ``input_ids[:, : t + 1]``; only response positions (``response_mask``) carry meaning.
    """

    input_ids: torch.Tensor
    """[B, S] int64, right-padded with PAD_ID."""
    lengths: torch.Tensor
    """[B] int64: prompt + response tokens of each sequence."""
    prompt_lengths: torch.Tensor
    """[B] int64: prompt tokens of each sequence (>= 1)."""
    advantages: torch.Tensor | None = None
    """[B] float32: one advantage per sequence (GRPO), or [B, S - 1]: one per position (distillation),
    laid out as the logprobs."""
    old_logprobs: torch.Tensor | None = None
    """[B, S - 1] float32: trainer logprobs before this step's updates (PPO ratio denominator)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, S - 1] float32: reference-policy logprobs (KL penalty)."""
    gen_logprobs: torch.Tensor | None = None
    """[B, S - 1] float32: the generator's sampling logprobs (importance correction, metrics)."""
    in_loss: torch.Tensor | None = None
    """[B] bool: sequences the loss counts (None: all); a False row is out of the loss's sum, its token
    count and the KL term (DAPO's overlong filtering), not just given a zero advantage."""
    sampled: torch.Tensor | None = None
    """[B, S - 1] bool: positions whose target token the engine sampled (None: every response token);
    multi-turn episodes have observation tokens between their turns, which are context, not loss."""
    routing: torch.Tensor | None = None
    """[B, S, MoE layers, top-k] integer (uint8, or int16 past 256 experts): the experts the engine
    routed each input position to (rollout routing replay; None: the trainer's routers choose).
    Positions past a sequence's length, and its last token, which the engine never forwarded, hold
    experts too (any valid ones: no logprob depends on them)."""

    def __post_init__(self) -> None:
        batch, seq = self.input_ids.shape
        if self.lengths.shape != (batch,) or self.prompt_lengths.shape != (batch,):
            raise ValueError(
                f"lengths/prompt_lengths must be [{batch}] for input_ids of shape [{batch}, {seq}]"
            )
        if batch and (int(self.lengths.max()) > seq or bool((self.prompt_lengths < 1).any())):
            raise ValueError("every sequence needs 1 <= prompt_length and length <= input_ids.shape[1]")
        for name in ("old_logprobs", "ref_logprobs", "gen_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != (batch, seq - 1):
                raise ValueError(f"{name} must be [{batch}, {seq - 1}], got {list(value.shape)}")
        if self.advantages is not None and self.advantages.shape not in ((batch,), (batch, seq - 1)):
            shape = list(self.advantages.shape)
            raise ValueError(f"advantages must be [{batch}] or [{batch}, {seq - 1}], got {shape}")
        if self.in_loss is not None and (self.in_loss.shape != (batch,) or self.in_loss.dtype != torch.bool):
            shape, dtype = list(self.in_loss.shape), self.in_loss.dtype
            raise ValueError(f"in_loss must be [{batch}] bool, got {shape} {dtype}")
        if self.sampled is not None and (
            self.sampled.shape != (batch, seq - 1) or self.sampled.dtype != torch.bool
        ):
            shape, dtype = list(self.sampled.shape), self.sampled.dtype
            raise ValueError(f"sampled must be [{batch}, {seq - 1}] bool, got {shape} {dtype}")
        if self.routing is not None and (self.routing.dim() != 4 or self.routing.shape[:2] != (batch, seq)):
            raise ValueError(
                f"routing must be [{batch}, {seq}, layers, top-k], got {list(self.routing.shape)}"
            )

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def token_advantages(self) -> bool:
        """Whether the advantages are per position ([B, S - 1]) rather than per sequence."""
        return self.advantages is not None and self.advantages.dim() == 2

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def response_mask(self) -> torch.Tensor:
        """[B, S - 1] bool: positions whose target is a response token of a sequence in the loss."""
        pos = torch.arange(self.input_ids.shape[1] - 1)
        mask = (pos >= self.prompt_lengths[:, None] - 1) & (pos < self.lengths[:, None] - 1)
        if self.sampled is not None:
            mask &= self.sampled
        return mask if self.in_loss is None else mask & self.in_loss[:, None]

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The sub-batch of ``indices``, trimmed to its own longest sequence."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        seq = int(self.lengths[idx].max()) if len(idx) else 1

        def take(t: torch.Tensor | None, width: int | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[idx]
            return t[:, :width] if width is not None else t

        return TrainBatch(
            input_ids=take(self.input_ids, seq),
            lengths=self.lengths[idx],
            prompt_lengths=self.prompt_lengths[idx],
            advantages=take(self.advantages, seq - 1 if self.token_advantages else None),
            old_logprobs=take(self.old_logprobs, seq - 1),
            ref_logprobs=take(self.ref_logprobs, seq - 1),
            gen_logprobs=take(self.gen_logprobs, seq - 1),
            in_loss=take(self.in_loss, None),
            sampled=take(self.sampled, seq - 1),
            routing=take(self.routing, seq),
        )

    def replace(self, **fields) -> TrainBatch:
        return dataclasses.replace(self, **fields)

    @staticmethod
    def from_sequences(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> TrainBatch:
        lengths = [len(s) for s in sequences]
        ids = torch.full((len(sequences), max(lengths)), PAD_ID, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        return TrainBatch(
            input_ids=ids,
            lengths=torch.as_tensor(lengths, dtype=torch.long),
            prompt_lengths=torch.as_tensor(list(prompt_lengths), dtype=torch.long),
        )


@dataclass(frozen=True, kw_only=True)
class TrainMetrics:
    """What one optimizer step reports (``PolicyWorker.train`` returns one per mini-batch).

    Loss terms are reduced over the mini-batch's micro-batches and data-parallel ranks (see
    ``megagrpo.algorithms.grpo.reduce_metrics``): ``*_mean`` and ``*_frac`` are per valid (response)
    token. Fields that are None were not computed for this run's inputs and are left out of
    :meth:`as_dict`. The field order is the key order of the ``train/*`` metrics in ``metrics.jsonl``.
    """

    loss: float
    """The step's loss: sum of per-token (or per-sequence) losses / their count; NaN without any."""
    token_mult_prob_error_mean: float | None = None
    """Mean exp|old - gen| logprob (1.0: trainer and generator agree); with the generator's logprobs."""
    behav_ratio_min: float | None = None
    """Smallest behaviour weight w = trainer (before the step) / generator probability; with the
    generator's logprobs."""
    behav_ratio_max: float | None = None
    """Largest behaviour weight w, before truncation or masking; with the generator's logprobs."""
    behav_weight_mean: float | None = None
    """Mean weight applied to the policy-gradient term (grpo.off_policy_correction not none)."""
    behav_truncated_frac: float | None = None
    """Tokens whose weight was truncated to grpo.behav_weight_cap (off_policy_correction tis)."""
    behav_masked_frac: float | None = None
    """Tokens whose weight was outside [behav_weight_floor, behav_weight_cap] and left out of the
    policy-gradient term (off_policy_correction mis)."""
    kl_mean: float | None = None
    """Mean clamped KL(policy || reference) estimate; with reference logprobs."""
    tokens: float
    """Valid tokens of the mini-batch (all DP ranks)."""
    sequences: float
    """Sequences of the mini-batch with at least one valid token."""
    pg_loss_mean: float
    """Policy-gradient term (after dual clip and the behaviour weight, before KL)."""
    clip_low_frac: float
    """Tokens with A < 0 and ratio < 1 - clip_eps_low."""
    clip_high_frac: float
    """Tokens with A > 0 and ratio > 1 + clip_eps_high."""
    dual_clip_frac: float
    """Tokens where the dual-clip bound -c A was active."""
    ratio_mean: float
    """Mean policy/old probability ratio (1.0 on the first step of a batch)."""
    ratio_min: float
    """Smallest ratio over valid tokens."""
    ratio_max: float
    """Largest ratio over valid tokens."""
    entropy_mean: float
    """Mean entropy of the policy's next-token distribution at the sampling temperature."""
    grad_norm: float
    """Gradient norm before clipping (NaN when the optimizer reported none)."""
    lr: float
    """Learning rate this step was taken with."""
    update_applied: float
    """1.0 when the optimizer applied the update, 0.0 when it skipped it (non-finite gradients)."""

    def as_dict(self) -> dict[str, float]:
        """{name: value} of the computed fields, in field order (the keys ``train`` used to return)."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: value for name, value in values if value is not None}


@dataclass(frozen=True)
class SequenceBatch:
    """B sequences with the positions that are trained (SFT) or scored (DPO); for DPO, pairs in order:
    row 2i is pair i's chosen sequence, row 2i + 1 its rejected one.

    Position ``t`` of every ``[B, S - 1]`` tensor refers to predicting ``input_ids[:, t + 1]``.
    """

    input_ids: torch.Tensor
    """[B, S] int64, right-padded with PAD_ID."""
    lengths: torch.Tensor
    """[B] int64: tokens of each sequence."""
    loss_mask: torch.Tensor
    """[B, S - 1] bool: positions whose target token is trained / scored (assistant tokens)."""
    ref_logps: torch.Tensor | None = None
    """[B] float32: DPO's reference-policy sequence logprob (sum, or mean when length-normalised)."""

    def __post_init__(self) -> None:
        batch, seq = self.input_ids.shape
        if self.lengths.shape != (batch,) or self.loss_mask.shape != (batch, seq - 1):
            raise ValueError(
                f"lengths must be [{batch}] and loss_mask [{batch}, {seq - 1}] for input_ids "
                f"[{batch}, {seq}], got {list(self.lengths.shape)} and {list(self.loss_mask.shape)}"
            )
        if self.ref_logps is not None and self.ref_logps.shape != (batch,):
            raise ValueError(f"ref_logps must be [{batch}], got {list(self.ref_logps.shape)}")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def token_advantages(self) -> bool:
        """Whether the advantages are per position ([B, S - 1]) rather than per sequence."""
        return self.advantages is not None and self.advantages.dim() == 2

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def response_mask(self) -> torch.Tensor:
        """[B, S - 1] bool: the trained / scored positions (the name the policy ranks read)."""
        return self.loss_mask

    def select(self, indices: Sequence[int]) -> SequenceBatch:
        """The sub-batch of ``indices``, trimmed to its own longest sequence."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        seq = int(self.lengths[idx].max()) if len(idx) else 1
        return SequenceBatch(
            input_ids=self.input_ids[idx, :seq],
            lengths=self.lengths[idx],
            loss_mask=self.loss_mask[idx, : seq - 1],
            ref_logps=None if self.ref_logps is None else self.ref_logps[idx],
        )

    def replace(self, **fields) -> SequenceBatch:
        return dataclasses.replace(self, **fields)

    @staticmethod
    def from_examples(examples: Sequence) -> SequenceBatch:
        """From objects with ``input_ids`` [N] and ``loss_mask`` [N] (True: the token is trained)."""
        lengths = [len(e.input_ids) for e in examples]
        width = max(lengths)
        ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros(len(examples), width, dtype=torch.bool)
        for row, e in enumerate(examples):
            ids[row, : lengths[row]] = torch.as_tensor(e.input_ids, dtype=torch.long)
            mask[row, : lengths[row]] = torch.as_tensor(e.loss_mask, dtype=torch.bool)
        return SequenceBatch(ids, torch.as_tensor(lengths, dtype=torch.long), mask[:, 1:])

    @staticmethod
    def from_pairs(pairs: Sequence) -> SequenceBatch:
        """Pairs (``chosen``, ``rejected`` examples) as rows 2i and 2i + 1."""
        return SequenceBatch.from_examples([e for p in pairs for e in (p.chosen, p.rejected)])


@dataclass(frozen=True, kw_only=True)
class SFTMetrics:
    """One SFT optimizer step (or a validation pass: no grad_norm, lr, update_applied)."""

    loss: float
    """Mean cross-entropy per trained token (all micro-batches and DP ranks); NaN without any."""
    tokens: float
    """Trained tokens."""
    sequences: float
    """Sequences."""
    grad_norm: float | None = None
    """Gradient norm before clipping."""
    lr: float | None = None
    """Learning rate this step was taken with."""
    update_applied: float | None = None
    """1.0 when the optimizer applied the update, 0.0 when it skipped it (non-finite gradients)."""

    def as_dict(self) -> dict[str, float]:
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: value for name, value in values if value is not None}


@dataclass(frozen=True, kw_only=True)
class DPOMetrics:
    """One DPO optimizer step (or a validation pass: no grad_norm, lr, update_applied); means per pair."""

    loss: float
    """Mean preference loss per pair."""
    pairs: float
    """Pairs."""
    accuracy: float
    """Pairs whose implicit reward margin is > 0."""
    margin_mean: float
    """beta ((chosen - ref) - (rejected - ref)) logprob: the implicit reward margin."""
    chosen_reward_mean: float
    """beta (chosen - ref chosen) logprob."""
    rejected_reward_mean: float
    """beta (rejected - ref rejected) logprob."""
    chosen_logp_mean: float
    """Policy logprob of the chosen response (mean per token when length-normalised)."""
    rejected_logp_mean: float
    """Policy logprob of the rejected response."""
    chosen_nll_mean: float
    """Mean token NLL of the chosen response (the term dpo.nll_weight weighs)."""
    grad_norm: float | None = None
    lr: float | None = None
    update_applied: float | None = None

    def as_dict(self) -> dict[str, float]:
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: value for name, value in values if value is not None}


@dataclass(frozen=True)
class SamplingSettings:
    """How an engine samples (controller -> vLLM engine, with the token-id prompts)."""

    max_tokens: int
    """Response tokens at most (stop tokens included)."""
    temperature: float = 1.0
    """0.0: greedy (no sampling logprobs are reported)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1: no top-k cut."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Seed of requests without a per-prompt seed."""
    n: int = 1
    """Completions per prompt."""
    ignore_eos: bool = False
    """Generate ``max_tokens`` every time, past EOS and ``stop_token_ids`` (a fixed amount of work)."""

    @staticmethod
    def from_config(cfg: Config, stop_token_ids: tuple[int, ...] = (), n: int = 1) -> SamplingSettings:
        gen = cfg.generation
        return SamplingSettings(
            max_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            stop_token_ids=stop_token_ids,
            seed=gen.seed,
            ignore_eos=gen.ignore_eos,
            n=n,
        )


@dataclass(frozen=True)
class Completion:
    """One sampled response (vLLM engine -> controller); N = ``len(token_ids)``."""

    prompt_index: int
    """Index of the prompt in the request."""
    token_ids: list[int]
    """[N] sampled response tokens (stop tokens included when they ended the response)."""
    logprobs: list[float]
    """[N] sampling logprob of each response token, after temperature (vLLM "processed" logprobs);
    [] for greedy requests (temperature 0), which report no sampling distribution."""
    finish_reason: str
    """"stop" (a stop token; an episode: the environment said done), "length" (max_tokens; an episode:
    truncated) or "env_error" (an episode whose environment failed)."""
    loss_mask: list[bool] | None = None
    """[N] multi-turn episodes: True on the tokens the engine sampled, False on the observations' tokens
    between turns; None: every token was sampled."""
    prompt_ids: list[int] | None = None
    """Episodes: the opening prompt the environment gave this episode; None: its group's prompt."""
    reward: float | None = None
    """Episodes: the reward the environment gave; None: the reward function scores the response."""
    stats: dict[str, float] | None = None
    """Episodes: turns, tool_calls, tool_errors, env_s (environment seconds), env_failed, truncated."""
    routed_experts: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    """[P + N - 1, L, k] (P prompt tokens, L the model's MoE layers in order, k experts per token) uint8,
    int16 past 256 experts; with grpo.routing_replay "rollout" (``generation.routing``). Row t: the
    experts token t of prompt + response was routed to in each MoE layer, as the engine's router listed
    them; the last response token is never fed forward, so it has none. P + N - 1 rows x L x k bytes:
    384 KB per 1K tokens for Qwen3-30B-A3B (48 layers, top-8). None: not asked for (or an episode)."""
    versions: list[tuple[int, int]] | None = None
    """The policy version (GRPO steps trained) whose weights produced each of the N tokens, run-length
    encoded in token order: [(version, count), ...] with counts > 0 summing to N (weights swapped into a
    running request start a new run). None: every token came from one version, the one its batch was
    generated with (``Pending.version``; what engines that hold one version per batch, and checkpoints
    written before this field existed, give)."""

    def __post_init__(self) -> None:
        if self.versions is None:
            return
        counts = [count for _, count in self.versions]
        if any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != len(self.token_ids):
            raise ValueError(
                f"Completion.versions must be (version, count) runs with counts >= 1 summing to the "
                f"{len(self.token_ids)} tokens, got {self.versions!r}"
            )

    def oldest_version(self, default: int) -> int:
        """The version of the response's oldest token (``default``: the batch's version, for ``versions``
        None); a response without tokens is ``default``'s."""
        return min((v for v, _ in self.versions), default=default) if self.versions else default

    def token_versions(self, default: int) -> list[int]:
        """[N] the version of each token (``default`` for all of them when ``versions`` is None)."""
        if self.versions is None:
            return [default] * len(self.token_ids)
        return [v for v, count in self.versions for _ in range(count)]


def balanced_shards(lengths: Sequence[int], num_shards: int) -> list[list[int]]:
    """Split sequence indices into ``num_shards`` groups of near-equal token counts (deterministic).

    Longest first onto the least-loaded shard; each shard keeps ascending index order.
    """
    loads = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(num_shards), key=lambda s: (loads[s], len(shards[s]), s))
        shards[target].append(i)
        loads[target] += lengths[i]
    return [sorted(s) for s in shards]
