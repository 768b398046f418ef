"""GRPO's rollouts, from sampled groups to a training batch: generation with dynamic sampling, scoring,
the advantages and the loss's inputs, the rollouts generated ahead of their step (``Pending``), and the
step's rollout metrics. Functions of their inputs: the engines are reached only through the ``generate``
callable a caller passes (``EnginePool.generate`` with the step's arguments bound).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.algorithms.grpo import group_advantages, overlong_penalty, zero_variance_groups
from megagrpo.algorithms.off_policy import judge_staleness
from megagrpo.algorithms.routing import expert_load_max, routing_rows
from megagrpo.ckpt import CheckpointError
from megagrpo.compat.safe_load import load_file, refusals_as
from megagrpo.config import Config
from megagrpo.data.prompts import Prompt, PromptSource
from megagrpo.types import PAD_ID, Completion, SamplingSettings, TrainBatch, TrainMetrics

Generate = Callable[[Sequence[Prompt], SamplingSettings, Sequence[int]], list[Completion]]
"""Completions for prompts (``settings.n`` each, in prompt order) with their seeds."""


@dataclass
class Rollouts:
    prompts: list[Prompt]
    """One entry per group (prompt), G completions each."""
    completions: list[Completion]
    """[P * G], group after group."""
    rewards: torch.Tensor
    """[P * G] float32."""
    reward_timeouts: int = 0
    """Responses of the step (every dynamic-sampling round) whose scoring was cut at reward.timeout_s."""
    reward_errors: int = 0
    """Responses of the step whose scoring failed (raised, or its worker died)."""
    reward_seconds: float = 0.0
    """Time spent decoding and scoring them (every dynamic-sampling round; not saved with them)."""


@dataclass(frozen=True)
class Pending:
    """Scored rollouts produced before the step that trains them, and the policy version that
    generated them (``grpo.max_staleness``; in the sequential loop, the step's own rollouts)."""

    rollouts: Rollouts
    position: int
    """Data position after their prompts."""
    filtered: int
    """Groups dropped by dynamic sampling while producing them."""
    version: int
    """The policy version (GRPO steps trained) whose weights the engines held."""
    seconds: float
    """Time spent generating and scoring them."""

    FILE = "rollouts_ahead.pt"

    def save(self, directory: Path) -> None:
        """Into a checkpoint being written (its manifest covers the file)."""
        r = self.rollouts
        data = {
            "prompts": [{"token_ids": p.token_ids, "answer": p.answer, "task": p.task} for p in r.prompts],
            "completions": [dataclasses.asdict(c) for c in r.completions],
            "rewards": r.rewards,
            "reward_timeouts": r.reward_timeouts,
            "reward_errors": r.reward_errors,
            "position": self.position,
            "filtered": self.filtered,
            "version": self.version,
            "seconds": self.seconds,
        }
        torch.save(data, directory / self.FILE)

    @classmethod
    def load(cls, checkpoint: Path) -> Pending | None:
        path = checkpoint / cls.FILE
        if not path.is_file():
            return None
        with refusals_as(CheckpointError):
            data = load_file(path)  # torch.load(weights_only=True), its globals checked first
        try:
            rollouts = Rollouts(
                [Prompt(**p) for p in data["prompts"]],
                [Completion(**c) for c in data["completions"]],
                data["rewards"],
                data["reward_timeouts"],
                data["reward_errors"],
            )
        except (TypeError, KeyError, ValueError) as err:  # ValueError: a Completion's own checks
            raise CheckpointError(f"{path}: not the rollouts a checkpoint saves ({err!r})") from None
        return cls(rollouts, data["position"], data["filtered"], data["version"], data["seconds"])


def staleness_metrics(rollouts: Rollouts, version: int, *, trained_version: int) -> dict[str, float]:
    """How many policy versions older than the trained policy the step's rollouts were: per sample, from
    its oldest token (``staleness/mean``, ``/max``), and the share of tokens some older policy sampled;
    ``version``: the one their batch was generated with (that of every token without its own)."""
    oldest = [c.oldest_version(version) for c in rollouts.completions]
    verdict = judge_staleness(oldest, trained_version, max_staleness=0, num_generations=1)
    versions = [v for c in rollouts.completions for v in c.token_versions(version)]
    old_tokens = sum(v < trained_version for v in versions)
    return {
        "staleness/generator_version": float(version),
        "staleness/mean": verdict.metrics()["staleness/mean"],
        "staleness/max": verdict.metrics()["staleness/max"],
        "staleness/off_policy_token_frac": old_tokens / len(versions) if versions else 0.0,
    }


def group_seed(cfg: Config, position: int) -> int:
    """The sampling seed of the group (prompt) at data ``position``, in every rollout mode."""
    return cfg.generation.seed * 1_000_003 + position


def generate_groups(cfg: Config, generate: Generate, source: PromptSource, scorer, position: int):
    """``num_prompts_per_step`` groups of G scored completions; with dynamic sampling, groups whose
    rewards are all equal are replaced by fresh prompts (up to 3 extra rounds)."""
    g, want = cfg.grpo.num_generations, cfg.grpo.num_prompts_per_step
    settings = SamplingSettings.from_config(cfg, stop_token_ids=source.stop_token_ids, n=g)
    kept_prompts, kept_comps, kept_rewards, filtered = [], [], [], 0
    timeouts = errors = 0
    reward_seconds = 0.0
    for _ in range(4 if cfg.grpo.filter_zero_variance_groups else 1):
        need = want - len(kept_prompts)
        prompts = source.batch(position, need)
        seeds = [group_seed(cfg, position + i) for i in range(need)]
        position += need
        comps = generate(prompts, settings, seeds)
        if comps and all(c.reward is not None for c in comps):  # episodes: their environments scored them
            rewards = torch.tensor([c.reward for c in comps], dtype=torch.float32)
        else:
            scoring = time.perf_counter()
            texts = [source.decode(c.token_ids) for c in comps]
            scored = scorer.score(texts, [prompts[c.prompt_index].answer for c in comps])
            reward_seconds += time.perf_counter() - scoring
            rewards = torch.tensor(scored.scores, dtype=torch.float32)
            timeouts, errors = timeouts + scored.timeouts, errors + scored.errors
        flat = (
            zero_variance_groups(rewards, g)
            if cfg.grpo.filter_zero_variance_groups
            else torch.zeros(need, dtype=torch.bool)
        )
        for p in range(need):
            if not flat[p]:
                kept_prompts.append(prompts[p])
                kept_comps += comps[p * g : (p + 1) * g]
                kept_rewards.append(rewards[p * g : (p + 1) * g])
        filtered += int(flat.sum())
        if len(kept_prompts) == want:
            break
        last = (prompts, comps, rewards, flat)
    else:
        # Not enough groups with signal: fill up with flat ones (zero advantage, still valid data).
        prompts, comps, rewards, flat = last
        for p in torch.nonzero(flat).flatten().tolist()[: want - len(kept_prompts)]:
            kept_prompts.append(prompts[p])
            kept_comps += comps[p * g : (p + 1) * g]
            kept_rewards.append(rewards[p * g : (p + 1) * g])
    rollouts = Rollouts(kept_prompts, kept_comps, torch.cat(kept_rewards), timeouts, errors, reward_seconds)
    return rollouts, position, filtered


def to_train_batch(cfg: Config, rollouts: Rollouts) -> TrainBatch:
    """Prompt + response sequences with advantages and the generator's logprobs aligned to positions."""
    grpo, g = cfg.grpo, cfg.grpo.num_generations
    rewards = rollouts.rewards.clone()
    lengths = torch.tensor([len(c.token_ids) for c in rollouts.completions])
    truncated = torch.tensor([c.finish_reason == "length" for c in rollouts.completions])
    # An episode's length counts its observations too: its budget is env.max_episode_tokens.
    budget = cfg.env.max_episode_tokens if cfg.env.enabled else cfg.generation.max_new_tokens
    if grpo.overlong_policy == "soft_penalty":
        rewards += overlong_penalty(lengths, budget, grpo.overlong_buffer_tokens, grpo.overlong_penalty)
    advantages = group_advantages(rewards, g, baseline=grpo.baseline, normalize_std=grpo.normalize_adv_std)
    # DAPO's overlong filtering: truncated responses leave the loss (sum, token count, KL), not only their
    # advantage; they still count in their group's baseline. An episode whose environment failed leaves
    # the loss as well (reward 0 is not the policy's doing), and also counts in its group's baseline.
    failed = torch.tensor([c.finish_reason == "env_error" for c in rollouts.completions])
    in_loss = ~truncated if grpo.overlong_policy == "mask" else None
    if bool(failed.any()):
        in_loss = ~failed if in_loss is None else in_loss & ~failed
    seqs, prompt_lens, unopened = [], [], []
    for i, comp in enumerate(rollouts.completions):
        prompt = comp.prompt_ids if comp.prompt_ids is not None else rollouts.prompts[i // g].token_ids
        if not prompt:  # an episode whose environment failed to open it: no tokens, out of the loss
            prompt = [PAD_ID]
            unopened.append(i)
        seqs.append(prompt + comp.token_ids)
        prompt_lens.append(len(prompt))
    batch = TrainBatch.from_sequences(seqs, prompt_lens)
    gen = torch.zeros(batch.size, batch.input_ids.shape[1] - 1)
    sampled = None
    if any(c.loss_mask is not None for c in rollouts.completions):
        sampled = torch.zeros(batch.size, batch.input_ids.shape[1] - 1, dtype=torch.bool)
    for row, comp in enumerate(rollouts.completions):
        start = prompt_lens[row] - 1
        gen[row, start : start + len(comp.logprobs)] = torch.tensor(comp.logprobs)
        if sampled is not None:
            mask = comp.loss_mask if comp.loss_mask is not None else [True] * len(comp.token_ids)
            sampled[row, start : start + len(mask)] = torch.tensor(mask, dtype=torch.bool)
    routing = None
    if cfg.grpo.routing_replay == "rollout":
        routed = [c.routed_experts for c in rollouts.completions]
        routing = routing_rows(routed, batch.input_ids.shape[1], unrouted=unopened)
    return batch.replace(
        advantages=advantages, gen_logprobs=gen, in_loss=in_loss, sampled=sampled, routing=routing
    )


def step_metrics(
    cfg: Config, rollouts: Rollouts, batch: TrainBatch, train: dict, probe_error: float, filtered: int
) -> dict:
    """The step's reward, response-length, filtering, probe and train metrics."""
    lengths = torch.tensor([len(c.token_ids) for c in rollouts.completions], dtype=torch.float32)
    rewards = rollouts.rewards
    routed = [c.routed_experts for c in rollouts.completions if c.routed_experts is not None]
    moe = {"moe/expert_load_max": expert_load_max(routed)} if routed else {}
    return moe | {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/accuracy": float((rewards >= 1.0).float().mean()),
        "reward/timeouts": rollouts.reward_timeouts,
        "reward/errors": rollouts.reward_errors,
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": sum(c.finish_reason == "length" for c in rollouts.completions)
        / len(lengths),
        "data/filtered_groups": filtered,
        **episode_metrics(rollouts.completions),
        "sync/probe_error": probe_error,
        # The optimizer steps' metrics under train/; the trainer's other step metrics (moe/*) as named.
        **{k if "/" in k else f"train/{k}": v for k, v in train.items()},
    }


def episode_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """Multi-turn episodes' means per episode (``episode/*``); {} for single-turn completions."""
    stats = [c.stats for c in completions if c.stats is not None]
    if not stats:
        return {}
    mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
    sampled = [sum(c.loss_mask) for c in completions if c.loss_mask is not None]
    # Routing replay: token-layer rows a later turn computed again and routed to other experts than the
    # turn that first forwarded them (the episode keeps the first: megagrpo.generation.routing).
    recomputed = sum(s.get("recomputed", 0.0) for s in stats)
    rerouted = sum(s.get("rerouted", 0.0) for s in stats)
    replay = {"moe/episode_rerouted_frac": rerouted / recomputed} if recomputed else {}
    return replay | {
        "episode/turns_mean": mean["turns"],
        "episode/tool_calls_mean": mean["tool_calls"],
        "episode/tool_errors_mean": mean["tool_errors"],
        "episode/tool_use_frac": sum(s["tool_calls"] > 0 for s in stats) / len(stats),
        "episode/env_s_mean": mean["env_s"],
        "episode/env_errors": sum(s["env_failed"] for s in stats),
        "episode/truncated_frac": mean["truncated"],
        "episode/sampled_tokens_mean": sum(sampled) / len(sampled),
    }


def mean_metrics(history: list[TrainMetrics]) -> dict[str, float]:
    """Average per-optimizer-step metrics over the step's mini-batches."""
    rows = [h.as_dict() for h in history]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
