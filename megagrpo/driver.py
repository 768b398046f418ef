"""The GRPO loop: one controller process driving Megatron policy ranks and vLLM engines through Ray.

    prompts -> G generations each -> rewards -> advantages -> old/reference logprobs
            -> mini-batch optimizer steps -> weight sync + probe -> validation -> checkpoint

``train`` reads top to bottom as that loop; the helpers below it do one thing each. What it adds
to the GRPO paper, each chosen by config: the advantage baseline (``grpo.baseline``: GRPO's group
mean, which without std normalization is Dr. GRPO, or RLOO's leave-one-out), clip-higher, dynamic
sampling, overlong filtering and the soft overlong penalty (DAPO), truncated importance correction
against the generator's logprobs, and a probe after every weight sync.
With ``grpo.max_staleness: k >= 1`` the engines generate the next step's rollouts (in a thread of
this process) while the trainer trains on the current ones, from weights at most k versions older
than the policy that trains on them; the weights reach the engines between batches.
Launch: ``megagrpo train --config FILE`` (local Ray), or on a cluster see ``launch/``.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
import yaml

from megagrpo.algorithms.grpo import group_advantages, overlong_penalty, zero_variance_groups
from megagrpo.ckpt import run as ckpt_io
from megagrpo.cluster import (
    EngineFailure,
    EnginePool,
    RankGroup,
    launch_engines,
    placement_summary,
    shutdown_ray,
    start_engines,
    start_ray,
    wait_for_engines,
)
from megagrpo.config import Config, config_to_dict, save_config
from megagrpo.data.prompts import Prompt, PromptSource, build_source
from megagrpo.evaluate import evaluate
from megagrpo.models.description import describe_model
from megagrpo.policy.worker import PolicyWorker
from megagrpo.rewards import RewardScorer
from megagrpo.runs import (
    check_checkpoint_dir,
    export_final,
    metrics_logger,
    prefixed,
    resolve_init_from,
    verified_resume_point,
    wandb_settings,
)
from megagrpo.types import Completion, SamplingSettings, TrainBatch, TrainMetrics
from megagrpo.weight_sync.sync import WeightSync


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


def train(cfg: Config, *, resume: bool = False) -> Path:
    """Run GRPO as configured; returns the run directory. A run stopped by an error leaves no Ray
    behind in the calling process (a later run there starts a fresh one)."""
    try:
        return _train(cfg, resume=resume)
    except BaseException:
        shutdown_ray()
        raise


def _train(cfg: Config, *, resume: bool) -> Path:
    run_dir = Path(cfg.logging.dir) / cfg.run_name
    cfg = resolve_init_from(cfg)  # a staged recipe's previous stage, checked before anything starts
    check_checkpoint_dir(cfg, resume)
    resume_from = verified_resume_point(cfg, resume)  # checked before any worker starts
    source, scorer = build_source(cfg), RewardScorer(cfg.reward)  # validates data before any actor starts
    wandb_settings(cfg)  # logging.wandb without the package: a config error now, not after the actors
    cfg, model_dir = prepare_initial_model(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    start_ray(cfg.cluster, cfg=cfg)
    policy, engines = start_workers(cfg, model_dir)
    print_layout(policy, engines)
    step, position, pending = restore(cfg, policy, resume_from)
    timings = {}
    with timed(timings, "sync_s"):
        engines.sync_weights()
    engine_version = step  # the policy version (GRPO steps trained) whose weights the engines hold
    ahead = ThreadPoolExecutor(1, thread_name_prefix="rollouts-ahead") if cfg.grpo.max_staleness else None
    with metrics_logger(cfg, run_dir, cfg.grpo.num_steps, step) as log:
        if step == 0 and cfg.logging.val_every:
            log.log(0, {**validate(cfg, engines, source, scorer), **prefixed("timing", timings)})
        with (
            graceful_interrupt() as stop,
            checkpoint_if_engines_fail(cfg, policy, step, position, pending) as trained,
        ):
            while step < cfg.grpo.num_steps and not stop.requested:
                step += 1
                engines.step = step
                t0 = time.perf_counter()
                timings = {}
                if pending is None:  # sequential loop, or the first step of an overlapped run
                    pending = produce(cfg, engines, source, scorer, position, step, engine_version)
                    timings["generation_s"] = pending.seconds
                    timings["reward_s"] = pending.rollouts.reward_seconds  # part of generation_s
                current, pending = pending, None
                position = current.position
                next_batch = None
                if ahead is not None and step < cfg.grpo.num_steps:
                    # The next step's rollouts, from the weights the engines hold, while this one trains.
                    engines.restartable = False  # a restart would sync weights the trainer is changing
                    next_batch = ahead.submit(
                        produce, cfg, engines, source, scorer, position, step + 1, engine_version
                    )
                rollouts, filtered = current.rollouts, current.filtered
                batch = to_train_batch(cfg, rollouts)
                set_engines_awake(cfg, engines, False)  # colocated: hand the GPUs to the trainer
                batch, train_metrics = train_on(cfg, policy, batch, timings)
                trained.update(step, position, None)
                trainer_busy = timings["logprobs_s"] + timings["train_s"]
                engine_busy = timings.get("generation_s", 0.0)
                if next_batch is not None:
                    with timed(timings, "wait_generation_s"):
                        pending = next_batch.result()
                    engines.restartable = True
                    timings["generation_ahead_s"] = pending.seconds
                    engine_busy = pending.seconds
                trained.update(step, position, pending)
                validating = bool(cfg.logging.val_every) and step % cfg.logging.val_every == 0
                saving = bool(cfg.checkpoint.dir and cfg.checkpoint.save_every) and (
                    step % cfg.checkpoint.save_every == 0
                )
                probe_error = float("nan")
                if needs_sync(cfg, step, engine_version, validating or saving):
                    with timed(timings, "sync_s"):
                        set_engines_awake(cfg, engines, True)
                        probe_error = engines.sync_weights().error
                    timings["probe_s"] = engines.last_probe_s  # part of sync_s
                    engine_version = step
                metrics = step_metrics(cfg, rollouts, batch, train_metrics, probe_error, filtered)
                metrics |= staleness_metrics(rollouts, current.version, trained_version=step - 1)
                metrics |= source.counts
                if validating:
                    with timed(timings, "validation_s"):
                        metrics |= validate(cfg, engines, source, scorer)
                timings["step_s"] = time.perf_counter() - t0
                metrics |= prefixed("timing", with_idle_times(timings, engine_busy, trainer_busy))
                metrics["throughput/tokens_per_s"] = batch.num_tokens / timings["step_s"]
                log.log(step, metrics)
                if saving:
                    save_checkpoint(cfg, policy, step, position, pending)
        scorer.close()
        curves = log.write_curves()
    if ahead is not None:
        ahead.shutdown()
    final = save_checkpoint(cfg, policy, step, position, pending) if cfg.checkpoint.dir else None
    shutdown_ray()
    if stop.requested:
        print(
            f"\ninterrupted after step {step}" + (f": saved {final}; continue with --resume" if final else "")
        )
        raise KeyboardInterrupt
    export = export_final(final, run_dir / "hf_export") if final and cfg.checkpoint.export_hf_at_end else None
    print(f"\nrun directory: {run_dir}\n  metrics: {run_dir / 'metrics.jsonl'}\n  curves:  {curves}")
    if export:
        print(f"  HF export: {export}")
    return run_dir


# --------------------------------------------------------------------------------------- set-up


def prepare_initial_model(cfg: Config, run_dir: Path) -> tuple[Config, str]:
    """(config whose model is loadable by policy and vLLM, the HF directory vLLM reads): a tiny model is
    warmed up first (or its earlier warm-up reused), see ``megagrpo.warmup.warmed_up_model``."""
    from megagrpo.warmup import warmed_up_model

    return warmed_up_model(cfg, run_dir)


def start_workers(cfg: Config, model_dir: str) -> tuple[RankGroup, EnginePool]:
    """The policy ranks and the engine pool. The engines start while the ranks set up (before them
    where ``starts_engines_first``), except beside them on one GPU (colocated): vLLM sizes its cache
    from the memory free at its start."""
    early = launch_engines(cfg, model_dir) if starts_engines_first(cfg) else None
    policy = RankGroup(cfg, PolicyWorker, wait=cfg.generation.placement == "colocated")
    return policy, start_engine_pool(cfg, model_dir, policy, launched=early)


def starts_engines_first(cfg: Config) -> bool:
    """Whether the engines are started before the policy ranks: on one node with engines of their own
    (their start-up, vLLM's imports and set-up, is the longest: it then overlaps the ranks' own).
    Colocated engines go into the ranks' placement group, and on several nodes the ranks' group
    is placed first, so that the engines do not split it."""
    return cfg.generation.placement == "disaggregated" and cfg.cluster.num_nodes == 1


def start_engine_pool(
    cfg: Config, model_dir: str, policy: RankGroup, launched: list | None = None
) -> EnginePool:
    """The vLLM engines and their weight sync with the policy (engines that fail are replaced); a
    policy still setting up is waited for once its engines are up. ``launched``: the engines,
    already started by ``launch_engines`` (replacements are started anew)."""
    vocab_size = describe_model(cfg).shape.vocab_size

    def start(indices: list[int]) -> list:
        nonlocal launched
        if launched is not None:
            engines, launched = launched, None
            return wait_for_engines(engines)
        return start_engines(cfg, model_dir, policy=policy, indices=indices)

    return EnginePool(
        cfg,
        start=start,
        connect=lambda actors: WeightSync(cfg, policy.ready(), actors, vocab_size=vocab_size),
    )


def print_layout(policy: RankGroup, engines: EnginePool) -> None:
    """Where the ranks and engines run, their CPU threads, and the weight-sync path."""
    sync, count = engines.sync, len(engines.actors)
    print(f"placement: {placement_summary(policy, engines.actors)}")
    if policy.cpu_threads[0] is not None:
        engine_threads = sorted(set(ray.get([e.cpu_threads.remote() for e in engines.actors])))
        print(
            f"trainer: {'/'.join(map(str, sorted(set(policy.cpu_threads))))} CPU thread(s) per rank; "
            f"engines: {'/'.join(map(str, engine_threads))} each"
        )
    print(
        f"weight sync: {sync.backend}, {sync.path.kind} ({sync.path.reason}); {count} engine(s), "
        f"{sync.total_bytes / 2**20:.1f} MiB sent, {max(sync.worker_bytes) / 2**20:.1f} MiB per vLLM worker"
    )


def restore(cfg: Config, policy: RankGroup, checkpoint: Path | None) -> tuple[int, int, Pending | None]:
    """(last completed step, data position, rollouts generated ahead): from ``checkpoint`` when
    resuming, else (0, 0, None)."""
    if checkpoint is None:
        return 0, 0, None
    policy.call_all(PolicyWorker.load, str(checkpoint))
    state = ckpt_io.load_driver_state(checkpoint)
    state.restore_rng()
    pending = Pending.load(checkpoint)
    ahead = f", with the rollouts of step {state.step + 1} generated ahead" if pending else ""
    print(f"resume: continuing after step {state.step} from {checkpoint}{ahead}")
    return state.step, state.data_position, pending


def save_checkpoint(
    cfg: Config, policy: RankGroup, step: int, position: int, pending: Pending | None = None
) -> Path | None:
    """Checkpoint ``step`` (policy, optimizer, driver state, config, the rollouts generated ahead for
    the next step when there are any, manifest).

    A write that fails (disk full, unwritable directory) is removed, the previous checkpoint stays
    the latest, and the run stops (CheckpointWriteError) or, with ``checkpoint.on_error:
    continue``, goes on without this one (None).
    """
    root = Path(cfg.checkpoint.dir).absolute()
    tmp = None
    try:
        tmp = ckpt_io.begin(root, step)
        digests = {}
        for rank_digests in policy.call_all(PolicyWorker.save, str(tmp)):
            digests |= rank_digests
        if pending is not None:
            pending.save(tmp)
        config_yaml = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
        state = ckpt_io.DriverState.capture(step, position)
        return ckpt_io.commit(tmp, state, config_yaml, cfg.checkpoint.keep_last, digests)
    except (OSError, ray.exceptions.RayTaskError) as err:
        if tmp is not None:
            ckpt_io.abort(tmp)
        latest = ckpt_io.latest(root)
        message = (
            f"checkpoint step_{step} could not be written to {root}: {error_summary(err)}; "
            f"the latest checkpoint is still {latest.name if latest else '(none)'}"
        )
        if cfg.checkpoint.on_error == "stop":
            raise ckpt_io.CheckpointWriteError(f"{message} (checkpoint.on_error: stop)") from err
        print(f"{message}; continuing without it (checkpoint.on_error: continue)", flush=True)
        return None


class _Trained:
    """The last step the policy has trained, the data position after it, and the rollouts generated
    ahead for the next step (if any)."""

    def __init__(self, step: int, position: int, pending: Pending | None):
        self.update(step, position, pending)

    def update(self, step: int, position: int, pending: Pending | None = None) -> None:
        self.step, self.position, self.pending = step, position, pending


@contextmanager
def checkpoint_if_engines_fail(
    cfg: Config, policy: RankGroup, step: int, position: int, pending: Pending | None = None
):
    """Engines failing past ``generation.max_engine_restarts``: checkpoint what the policy has
    trained, then stop (the EngineFailure goes on to the caller, saying where to resume)."""
    trained = _Trained(step, position, pending)
    try:
        yield trained
    except EngineFailure as err:
        saved = None
        if cfg.checkpoint.dir:
            saved = save_checkpoint(cfg, policy, trained.step, trained.position, trained.pending)
        where = f"; saved {saved}, continue with --resume" if saved else ""
        raise EngineFailure(f"{err}{where}", err.engine) from err


def error_summary(err: BaseException) -> str:
    """The message of an error raised in an actor (its cause) or here, without tracebacks."""
    cause = getattr(err, "cause", None) or err
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__


# ----------------------------------------------------------------------------------- the step parts


def train_on(cfg: Config, policy: RankGroup, batch: TrainBatch, timings: dict) -> tuple[TrainBatch, dict]:
    """(the batch with its reference logprobs when the loss has a KL term, the step's mean train
    metrics): the policy's optimizer steps on ``batch`` (old logprobs are ``train``'s own), timed
    into ``timings`` (``logprobs_s``, ``train_s``, and ``train_rank_s`` inside the ranks)."""
    with timed(timings, "logprobs_s"):
        if cfg.grpo.kl_coef > 0:
            batch = batch.replace(ref_logprobs=policy.call_first(PolicyWorker.reference_logprobs, batch))
    with timed(timings, "train_s"):
        metrics = mean_metrics(policy.call_first(PolicyWorker.train, batch))
    timings["train_rank_s"] = policy.last_call_s  # inside the ranks: the rest is Ray
    return batch, metrics


def with_idle_times(timings: dict, engine_busy: float, trainer_busy: float) -> dict:
    """``timings`` with each side's idle time in the step (``step_s`` less its busy time and the sync)."""
    sync_s = timings.get("sync_s", 0.0)
    timings["engine_idle_s"] = max(0.0, timings["step_s"] - engine_busy - sync_s)
    timings["trainer_idle_s"] = max(0.0, timings["step_s"] - trainer_busy - sync_s)
    return timings


def generate(
    cfg: Config, engines: EnginePool, prompts: list[Prompt], settings: SamplingSettings, seeds
) -> list[Completion]:
    """Completions for ``prompts`` (``settings.n`` each, in prompt order), split across engines
    (``EnginePool.generate``: an engine that fails is replaced and its share generated again)."""
    return engines.generate(prompts, settings, seeds)


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
            "prompts": [{"token_ids": p.token_ids, "answer": p.answer} for p in r.prompts],
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
        data = torch.load(path, weights_only=True)
        rollouts = Rollouts(
            [Prompt(**p) for p in data["prompts"]],
            [Completion(**c) for c in data["completions"]],
            data["rewards"],
            data["reward_timeouts"],
            data["reward_errors"],
        )
        return cls(rollouts, data["position"], data["filtered"], data["version"], data["seconds"])


def produce(cfg: Config, engines, source: PromptSource, scorer, position: int, step: int, version: int):
    """The rollouts step ``step`` trains on, generated by the engines (holding policy ``version``)."""
    start = time.perf_counter()
    rollouts, position, filtered = generate_groups(cfg, engines, source, scorer, position, step)
    return Pending(rollouts, position, filtered, version, time.perf_counter() - start)


def needs_sync(cfg: Config, step: int, engine_version: int, forced: bool) -> bool:
    """Whether the weights of ``step`` go to the engines now, at the end of that step.

    Sequential loop: always. Overlapped: the rollouts the engines generate during step + 1 are
    trained at step + 2 by policy version step + 1, so the engines' version may lag that by at most
    ``max_staleness``; validation and checkpoints (``forced``) always see the trained weights, so a
    resumed run's engines hold what the uninterrupted run's did.
    """
    k = cfg.grpo.max_staleness
    return k == 0 or forced or engine_version < step + 1 - k


def staleness_metrics(rollouts: Rollouts, version: int, *, trained_version: int) -> dict[str, float]:
    """How many policy versions older than the trained policy the step's rollouts were, and which
    version generated them (one per batch: weights reach the engines only between batches)."""
    staleness = trained_version - version
    tokens = sum(len(c.token_ids) for c in rollouts.completions)
    return {
        "staleness/generator_version": float(version),
        "staleness/mean": float(staleness),
        "staleness/max": float(staleness),
        "staleness/off_policy_token_frac": 1.0 if staleness > 0 and tokens else 0.0,
    }


def generate_groups(cfg: Config, engines, source: PromptSource, scorer, position: int, step: int):
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
        seeds = [cfg.generation.seed * 1_000_003 + position + i for i in range(need)]
        position += need
        comps = generate(cfg, engines, prompts, settings, seeds)
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
    if grpo.overlong_policy == "soft_penalty":
        rewards += overlong_penalty(
            lengths, cfg.generation.max_new_tokens, grpo.overlong_buffer_tokens, grpo.overlong_penalty
        )
    advantages = group_advantages(rewards, g, baseline=grpo.baseline, normalize_std=grpo.normalize_adv_std)
    # DAPO's overlong filtering: truncated responses leave the loss (sum, token count, KL), not only their
    # advantage; they still count in their group's baseline.
    in_loss = ~truncated if grpo.overlong_policy == "mask" else None
    seqs, prompt_lens = [], []
    for i, comp in enumerate(rollouts.completions):
        prompt = rollouts.prompts[i // g].token_ids
        seqs.append(prompt + comp.token_ids)
        prompt_lens.append(len(prompt))
    batch = TrainBatch.from_sequences(seqs, prompt_lens)
    gen = torch.zeros(batch.size, batch.input_ids.shape[1] - 1)
    for row, comp in enumerate(rollouts.completions):
        start = prompt_lens[row] - 1
        gen[row, start : start + len(comp.logprobs)] = torch.tensor(comp.logprobs)
    return batch.replace(advantages=advantages, gen_logprobs=gen, in_loss=in_loss)


def validate(cfg: Config, engines, source: PromptSource, scorer) -> dict[str, float]:
    """``val/accuracy``: greedy accuracy on the validation prompts (a reward >= 1 is a correct answer:
    a format reward is partial credit, not accuracy); with ``eval.val_samples``, also ``val/pass@k`` of
    that many samples per prompt (``megagrpo.evaluate``, as ``megagrpo eval``)."""
    if not source.val:
        return {"val/accuracy": float("nan")}
    settings = dataclasses.replace(
        SamplingSettings.from_config(cfg, stop_token_ids=source.stop_token_ids),
        temperature=0.0,
        n=1,
        ignore_eos=False,  # validation answers stop where the model stops
    )
    comps = generate(cfg, engines, source.val, settings, [0] * len(source.val))
    texts = [source.decode(c.token_ids) for c in comps]
    scores = scorer(texts, [source.val[c.prompt_index].answer for c in comps])
    out = {"val/accuracy": sum(s >= 1.0 for s in scores) / len(comps)}
    if cfg.eval.val_samples:
        ev = cfg.eval
        sampled = SamplingSettings(
            max_tokens=ev.max_new_tokens or cfg.generation.max_new_tokens,
            temperature=ev.temperature,
            top_p=ev.top_p,
            stop_token_ids=source.stop_token_ids,
            n=ev.val_samples,
        )
        report = evaluate(engines.generate, source.val, sampled, scorer, source.decode, seed=ev.seed)
        out |= report.metrics("val")
    return out


# -------------------------------------------------------------------------------------- bookkeeping


def step_metrics(cfg, rollouts: Rollouts, batch: TrainBatch, train: dict, probe_error: float, filtered: int):
    lengths = torch.tensor([len(c.token_ids) for c in rollouts.completions], dtype=torch.float32)
    rewards = rollouts.rewards
    return {
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
        "sync/probe_error": probe_error,
        **prefixed("train", train),
    }


def set_engines_awake(cfg: Config, engines: EnginePool, awake: bool) -> None:
    """Colocated placement: engines release their GPU memory while the trainer runs and take it
    back before receiving the new weights. Disaggregated engines stay up."""
    if cfg.generation.placement != "colocated":
        return
    calls = [(e.wake_up if awake else e.sleep).remote() for e in engines.actors]
    ray.get(calls, timeout=cfg.generation.sync_timeout_s)


def mean_metrics(history: list[TrainMetrics]) -> dict[str, float]:
    """Average per-optimizer-step metrics over the step's mini-batches."""
    rows = [h.as_dict() for h in history]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


class _StopRequest:
    requested = False


@contextmanager
def graceful_interrupt():
    """First Ctrl-C: finish the current step, checkpoint, shut down. Second Ctrl-C: stop at once."""
    import signal

    stop = _StopRequest()

    def on_sigint(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt
        stop.requested = True
        print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def timed(timings: dict, key: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = time.perf_counter() - start
