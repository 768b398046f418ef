"""The GRPO loop: one controller process driving Megatron policy ranks and vLLM engines through Ray.

    prompts -> G generations each -> rewards -> advantages -> old/reference logprobs
            -> mini-batch optimizer steps -> weight sync + probe -> validation -> checkpoint

``GRPOSteps.step`` reads top to bottom as one step of that loop; the run around it (resume, Ctrl-C,
checkpoints, validation cadence, export) is the skeleton every trainer shares
(``megagrpo.trainers.run``). What it adds to the GRPO paper, each chosen by config: the advantage
baseline (``grpo.baseline``: GRPO's group mean, which without std normalization is Dr. GRPO, or RLOO's
leave-one-out), clip-higher, dynamic sampling, overlong filtering and the soft overlong penalty (DAPO),
truncated importance correction against the generator's logprobs, and a probe after every weight sync.
With ``grpo.max_staleness: k >= 1`` the engines generate the next step's rollouts while the trainer
trains on the current ones (``megagrpo.trainers.overlap``).
Launch: ``megagrpo train --config FILE`` (local Ray), or on a cluster see ``launch/``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path

import ray

from megagrpo.algorithms.distill import reverse_kl_advantages
from megagrpo.algorithms.routing import routing_sample
from megagrpo.ckpt import run as ckpt_io
from megagrpo.config import Config, save_config
from megagrpo.data.prompts import PromptSource, build_source
from megagrpo.data.tokenizer import check_same_tokenizer
from megagrpo.evaluate import completion_scores, evaluate
from megagrpo.policy.teacher import TeacherWorker
from megagrpo.policy.worker import PolicyWorker
from megagrpo.rewards import RewardScorer
from megagrpo.runtime.engines import EnginePool, launch_engines, placement_summary
from megagrpo.runtime.groups import RankGroup
from megagrpo.runtime.ray_session import shutdown_ray, start_ray
from megagrpo.trainers.checkpoints import check_checkpoint_dir, resolve_init_from, verified_resume_point
from megagrpo.trainers.group_buffer import load_in_flight, rollouts_of, save_in_flight
from megagrpo.trainers.overlap import RolloutSchedule
from megagrpo.trainers.partial import ContinuousRollouts, partial_metrics
from megagrpo.trainers.rollouts import (
    Pending,
    episode_metrics,
    generate_groups,
    mean_metrics,
    staleness_metrics,
    step_metrics,
    to_train_batch,
)
from megagrpo.trainers.run import Cadence, Due, Trained, prefixed, run_steps, timed, wandb_settings
from megagrpo.types import SamplingSettings, TrainBatch
from megagrpo.weight_sync.ipc import check_colocated_allocator


def train(cfg: Config) -> Path:
    """Run GRPO as configured (resuming when ``checkpoint.resume``); returns the run directory. A run
    stopped by an error leaves no Ray behind in the calling process (a later run there starts a fresh
    one); one stopped by Ctrl-C raises KeyboardInterrupt once its checkpoint is saved."""
    run_dir = Path(cfg.logging.dir) / cfg.run_name
    cfg = resolve_init_from(cfg)  # a staged recipe's previous stage, checked before anything starts
    check_checkpoint_dir(cfg)
    check_colocated_allocator(cfg)  # the CUDA IPC handoff to colocated engines, before any worker starts
    resume_from = verified_resume_point(cfg)  # checked before any worker starts
    if cfg.distill.teacher_hf_dir is not None:
        check_same_tokenizer(cfg)  # student and teacher: the same token ids, before any actor starts
    source, scorer = build_source(cfg), RewardScorer(cfg.reward)  # validates data before any actor starts
    try:
        wandb_settings(cfg)  # logging.wandb without the package: a config error now, not after the actors
        cfg, model_dir = prepare_initial_model(cfg, run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        start_ray(cfg.cluster, cfg=cfg)
        trainer = GRPOSteps(cfg, source, scorer, model_dir, resume_from)
    except BaseException:
        scorer.close()
        shutdown_ray()
        raise
    cadence = Cadence(cfg.grpo.num_steps, cfg.logging.val_every)
    outcome = run_steps(cfg, trainer.policy, trainer, run_dir, cadence, trainer.start_step)
    if outcome.interrupted:
        raise KeyboardInterrupt
    return run_dir


def prepare_initial_model(cfg: Config, run_dir: Path) -> tuple[Config, str]:
    """(config whose model is loadable by policy and vLLM, the HF directory vLLM reads): a tiny model is
    warmed up first (or its earlier warm-up reused), see ``megagrpo.trainers.warmup.warmed_up_model``;
    for multi-turn episodes its tokenizer is saved beside it."""
    from megagrpo.trainers.warmup import warmed_up_model

    made, model_dir = warmed_up_model(cfg, run_dir)
    if cfg.env.enabled and cfg.model.tiny is not None:
        # Episodes render the environments' messages with the model's chat template, in the engines:
        # the tiny model's in-memory tokenizer goes beside its weights.
        from megagrpo.data.tokenizer import load_tokenizer, save_tokenizer

        save_tokenizer(load_tokenizer(cfg), Path(model_dir))
    return made, model_dir


class GRPOSteps:
    """GRPO's steps as the run skeleton drives them: the policy ranks, the engine pool, the rollout
    schedule, and what the policy holds (for checkpoints)."""

    save_method = staticmethod(PolicyWorker.save)  # the function itself: a class attribute would bind it
    partial: ContinuousRollouts | None = None
    """grpo.async_mode partial: the pump of the engines' request streams."""

    def __init__(self, cfg: Config, source: PromptSource, scorer, model_dir: str, resume_from: Path | None):
        """Start the policy ranks and the engines, restore ``resume_from`` (if any) and send the policy's
        weights to the engines. Whatever started is stopped by ``close`` (also when this fails)."""
        self.cfg, self.source, self.scorer = cfg, source, scorer
        self.policy, self.engines, self.schedule, self.teacher = None, None, None, None
        self._in_flight: dict | None = None  # the partial-rollout state the next checkpoint saves
        try:
            self.policy, self.engines = start_workers(cfg, model_dir, Path(cfg.logging.dir) / cfg.run_name)
            print_layout(self.policy, self.engines)
            self.teacher = start_teacher(cfg)
            self.engines.sleep(step=0)  # colocated: a checkpoint is loaded beside sleeping engines
            step, position, pending, in_flight = restore(self.policy, resume_from)
            self.start_step, self._trained, self.position = step, Trained(step, position), position
            self.initial_timings: dict = {}
            with timed(self.initial_timings, "sync_s"):
                self.engines.sync_weights(step=step)
            if cfg.grpo.async_mode == "partial":  # started, paused: the first step lets it run
                self.partial = ContinuousRollouts(
                    cfg, self.engines, source, scorer, version=step, position=position, state=in_flight
                )
                return
            self.schedule = RolloutSchedule(
                self.produce,
                max_staleness=cfg.grpo.max_staleness,
                num_steps=cfg.grpo.num_steps,
                engine_version=step,  # the policy version whose weights the engines hold
                pending=pending,
            )
        except BaseException:
            self.close()
            raise

    def start_metrics(self) -> dict | None:
        if not self.cfg.logging.val_every:
            return None
        return {**self.validate(0), **prefixed("timing", self.initial_timings)}

    def step(self, step: int, due: Due) -> dict:
        if self.partial is not None:
            return self.partial_step(step, due)
        cfg, timings, t0 = self.cfg, {}, time.perf_counter()
        colocated = cfg.generation.placement == "colocated"
        if colocated and self.engines.asleep:  # a checkpoint was written beside sleeping engines
            with timed(timings, "wake_sync_s"):
                self.engines.sync_weights(step=step)
        current, generated_now = self.schedule.rollouts_for(step, self.position)
        if generated_now:
            timings["generation_s"] = current.seconds
            timings["reward_s"] = current.rollouts.reward_seconds  # part of generation_s
        self.position = current.position
        self.schedule.start_ahead(step, self.position)  # overlapped: the next step's rollouts, meanwhile
        batch = to_train_batch(cfg, current.rollouts)
        if colocated:  # the engines sleep, the trainer's states come back (runtime.colocated)
            with timed(timings, "reload_s"):
                self.engines.hand_to_trainer(step=step)
        batch, distill_metrics = distill(cfg, self.teacher, batch, timings)
        batch, train_metrics = train_on(cfg, self.policy, batch, timings)
        self._trained = Trained(step, self.position)
        trainer_busy = timings["logprobs_s"] + timings["train_s"] + timings.get("teacher_s", 0.0)
        engine_busy = timings.get("generation_s", 0.0)
        with timed(timings, "wait_generation_s"):
            ahead = self.schedule.wait_ahead()
        if ahead is None:
            del timings["wait_generation_s"]
        else:
            timings["generation_ahead_s"] = engine_busy = ahead.seconds
        probe_error = float("nan")
        if self.schedule.needs_sync(step, due.validate or due.save):
            with timed(timings, "sync_s"):  # colocated: the trainer parks and the engines wake, in turns
                synced = self.engines.sync_weights(step=step)
            timings["probe_s"] = synced.probe_s  # part of sync_s
            probe_error = synced.probe.error
            self.schedule.synced(step)
        metrics = step_metrics(cfg, current.rollouts, batch, train_metrics, probe_error, current.filtered)
        if not math.isnan(probe_error):
            metrics["sync/verified_buckets"] = synced.probe.verified_buckets
            metrics |= synced.metrics
            if colocated:
                metrics["memory/offloaded_gib"] = synced.offloaded / 2**30  # the largest of any rank
        metrics |= distill_metrics
        metrics |= staleness_metrics(current.rollouts, current.version, trained_version=step - 1)
        metrics |= self.source.counts
        if due.validate:
            with timed(timings, "validation_s"):
                metrics |= self.validate(step)
        timings["step_s"] = time.perf_counter() - t0
        metrics |= prefixed("timing", with_idle_times(timings, engine_busy, trainer_busy))
        metrics["throughput/tokens_per_s"] = batch.num_tokens / timings["step_s"]
        return metrics

    def partial_step(self, step: int, due: Due) -> dict:
        """``grpo.async_mode: partial``: train on the first finished groups while the engines go on
        generating, then swap the new weights into their running requests (``trainers.partial``)."""
        cfg, timings, t0 = self.cfg, {}, time.perf_counter()
        if step == self.start_step + 1:
            self.partial.resume()  # the engines hold the resumed (or initial) policy
        taken = self.partial.take(step)
        rollouts = rollouts_of(taken.groups)
        batch = to_train_batch(cfg, rollouts)
        batch, distill_metrics = distill(cfg, self.teacher, batch, timings)
        batch, train_metrics = train_on(cfg, self.policy, batch, timings)
        with timed(timings, "pause_s"):  # the engines' current slices end: a token boundary
            self.partial.pause()
        with timed(timings, "sync_s"):  # a failed engine's replacement re-syncs every engine
            new_version = functools.partial(self.partial.set_version, step)  # before the probe's tokens
            synced = self.partial.replace_dead(step) or self.engines.sync_weights(
                step=step, after_load=new_version
            )
        timings["probe_s"] = synced.probe_s
        self._trained = Trained(step, self.partial.buffer.next_position)
        metrics = step_metrics(cfg, rollouts, batch, train_metrics, synced.probe.error, taken.counts.filtered)
        metrics["sync/verified_buckets"] = synced.probe.verified_buckets
        metrics |= synced.metrics
        metrics |= distill_metrics | partial_metrics(taken, trained_version=step - 1) | self.source.counts
        if due.validate:
            with timed(timings, "validation_s"):
                metrics |= self.validate(step)
        self._in_flight = self.partial.snapshot() if due.save else None
        self.partial.resume()
        timings["step_s"] = time.perf_counter() - t0
        metrics |= prefixed("timing", timings)
        metrics["throughput/tokens_per_s"] = batch.num_tokens / timings["step_s"]
        return metrics

    def produce(self, step: int, position: int, version: int, restartable: bool) -> Pending:
        """The rollouts ``step`` trains on, generated by the engines (holding policy ``version``)."""
        start = time.perf_counter()
        generate = functools.partial(self.engines.generate, step=step, restartable=restartable)
        rollouts, position, filtered = generate_groups(self.cfg, generate, self.source, self.scorer, position)
        return Pending(rollouts, position, filtered, version, time.perf_counter() - start)

    def validate(self, step: int) -> dict[str, float]:
        return validate(
            self.cfg, functools.partial(self.engines.generate, step=step), self.source, self.scorer
        )

    def trained(self) -> Trained:
        return self._trained

    def checkpoint_files(self):
        """The rollouts generated ahead for the next step, when there are any; partial rollouts: the
        groups in the buffer and the engines' partial responses (as the step's end left them, or as
        they are now when the run stops between its checkpoints)."""
        if self.partial is not None:
            state = self._in_flight
            if state is None:
                self.partial.pause()
                state = self.partial.snapshot()
                self.partial.resume()
            return functools.partial(save_in_flight, state)
        pending = self.schedule.pending if self.schedule else None
        return pending.save if pending is not None else None

    def before_save(self) -> None:
        """Colocated: the engines sleep while the checkpoint is written (the next step's sync wakes
        them); engines that died hold nothing."""
        self.engines.sleep(step=self._trained.step, tolerate_dead=True)
        self.engines.record(self._trained.step, "checkpoint")

    def finish(self) -> None:
        pass

    def close(self) -> None:
        """Stop the generation thread, the reward workers and Ray (engines and ranks with it)."""
        if self.schedule is not None:
            self.schedule.close()
        if self.partial is not None:
            self.partial.close()
        self.scorer.close()
        shutdown_ray()


# --------------------------------------------------------------------------------------- set-up


def start_workers(cfg: Config, model_dir: str, run_dir: Path | None = None) -> tuple[RankGroup, EnginePool]:
    """The policy ranks and the engine pool. The engines start while the ranks set up (before them
    where ``starts_engines_first``), except beside them on one GPU (colocated): vLLM sizes its cache
    from the memory free at its start. Colocated, the GPUs' hand-overs are logged in ``run_dir``."""
    early = launch_engines(cfg, model_dir) if starts_engines_first(cfg) else None
    policy = RankGroup(cfg, PolicyWorker, wait=cfg.generation.placement == "colocated")
    return policy, EnginePool.start(cfg, model_dir, policy, launched=early, log_dir=run_dir)


def start_teacher(cfg: Config) -> RankGroup | None:
    """The distillation teacher's ranks (``megagrpo distill``), or None."""
    if cfg.distill.teacher_hf_dir is None:
        return None
    from megagrpo.config.teacher import teacher_config

    teacher = RankGroup(teacher_config(cfg), TeacherWorker, name="teacher")
    print(
        f"teacher: {cfg.distill.teacher_hf_dir} on {teacher.world_size} rank(s): {', '.join(teacher.nodes)}"
    )
    return teacher


def starts_engines_first(cfg: Config) -> bool:
    """Whether the engines are started before the policy ranks: on one node with engines of their own
    (their start-up, vLLM's imports and set-up, is the longest: it then overlaps the ranks' own).
    Colocated engines go into the ranks' placement group, and on several nodes the ranks' group
    is placed first, so that the engines do not split it."""
    return cfg.generation.placement == "disaggregated" and cfg.cluster.num_nodes == 1


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
    print(f"weight sync transport: {sync.transport}")


def restore(policy: RankGroup, checkpoint: Path | None) -> tuple[int, int, Pending | None, dict | None]:
    """(last completed step, data position, rollouts generated ahead, partial-rollout state): from
    ``checkpoint`` when resuming, else (0, 0, None, None)."""
    if checkpoint is None:
        return 0, 0, None, None
    policy.call_all(PolicyWorker.load, str(checkpoint))
    state = ckpt_io.load_driver_state(checkpoint)
    state.restore_rng()
    pending, in_flight = Pending.load(checkpoint), load_in_flight(checkpoint)
    ahead = f", with the rollouts of step {state.step + 1} generated ahead" if pending else ""
    if in_flight is not None:
        ahead = f", with {len(in_flight['partials'])} partial request(s) to continue"
    print(f"resume: continuing after step {state.step} from {checkpoint}{ahead}")
    return state.step, state.data_position, pending, in_flight


# ----------------------------------------------------------------------------------- the step parts


def train_on(cfg: Config, policy: RankGroup, batch: TrainBatch, timings: dict) -> tuple[TrainBatch, dict]:
    """(the batch with its reference logprobs when the loss has a KL term, the step's mean train
    metrics): the policy's optimizer steps on ``batch`` (old logprobs are ``train``'s own), timed
    into ``timings`` (``logprobs_s``, ``train_s``, and ``train_rank_s`` inside the ranks)."""
    with timed(timings, "logprobs_s"):
        if cfg.grpo.kl_coef > 0:
            batch = batch.replace(ref_logprobs=policy.call_first(PolicyWorker.reference_logprobs, batch))
    checked = {}
    if batch.routing is not None:
        with timed(timings, "routing_check_s"):
            sample = routing_sample(batch, cfg.parallel.data_parallel_size)
            checked = policy.call_first(PolicyWorker.routing_check, sample)
    with timed(timings, "train_s"):
        metrics = mean_metrics(policy.call_first(PolicyWorker.train, batch))
    timings["train_rank_s"] = policy.last_call_s  # inside the ranks: the rest is Ray
    return batch, metrics | checked


def distill(
    cfg: Config, teacher: RankGroup | None, batch: TrainBatch, timings: dict
) -> tuple[TrainBatch, dict]:
    """With a teacher: the batch with per-token advantages (teacher - student logprob, plus the task's
    advantage times ``distill.task_reward_weight``) and the ``distill/*`` metrics; else as given."""
    if teacher is None:
        return batch, {}
    with timed(timings, "teacher_s"):
        teacher_lp = teacher.call_first(TeacherWorker.logprobs, batch)
    d = cfg.distill
    signal = reverse_kl_advantages(
        batch.gen_logprobs,
        teacher_lp,
        batch.response_mask(),
        reverse_kl_coef=d.reverse_kl_coef,
        task_advantages_B=batch.advantages,
        task_reward_weight=d.task_reward_weight,
        norm=d.advantage_norm,
    )
    metrics = {
        "distill/reverse_kl": signal.reverse_kl_mean,
        "distill/teacher_logprob": signal.teacher_logprob_mean,
    }
    return batch.replace(advantages=signal.advantages_BT), metrics


def with_idle_times(timings: dict, engine_busy: float, trainer_busy: float) -> dict:
    """``timings`` with each side's idle time in the step (``step_s`` less its busy time and the sync)."""
    sync_s = timings.get("sync_s", 0.0)
    timings["engine_idle_s"] = max(0.0, timings["step_s"] - engine_busy - sync_s)
    timings["trainer_idle_s"] = max(0.0, timings["step_s"] - trainer_busy - sync_s)
    return timings


def validate(cfg: Config, generate, source: PromptSource, scorer) -> dict[str, float]:
    """``val/accuracy``: greedy accuracy on the validation prompts (a reward >= 1 is a correct answer:
    a format reward is partial credit, not accuracy; multi-turn episodes add their ``val/*`` episode
    metrics: turns, tool use); with ``eval.val_samples``, also ``val/pass@k`` of
    that many samples per prompt (``megagrpo.evaluate``, as ``megagrpo eval``). ``generate``: the
    engines' generate with the step bound."""
    if not source.val:
        return {"val/accuracy": float("nan")}
    settings = dataclasses.replace(
        SamplingSettings.from_config(cfg, stop_token_ids=source.stop_token_ids),
        temperature=0.0,
        n=1,
        ignore_eos=False,  # validation answers stop where the model stops
    )
    comps = generate(source.val, settings, [0] * len(source.val))
    texts = [source.decode(c.token_ids) for c in comps]
    scores = completion_scores(comps, texts, source.val, scorer)
    out = {"val/accuracy": sum(s >= 1.0 for s in scores) / len(comps)}
    out |= {
        k.replace("episode/", "val/"): v
        for k, v in episode_metrics(comps).items()
        if k.startswith("episode/")
    }
    if cfg.eval.val_samples:
        ev = cfg.eval
        sampled = SamplingSettings(
            max_tokens=ev.max_new_tokens or cfg.generation.max_new_tokens,
            temperature=ev.temperature,
            top_p=ev.top_p,
            stop_token_ids=source.stop_token_ids,
            n=ev.val_samples,
        )
        report = evaluate(generate, source.val, sampled, scorer, source.decode, seed=ev.seed)
        out |= report.metrics("val")
    return out
