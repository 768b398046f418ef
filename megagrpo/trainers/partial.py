"""``grpo.async_mode: partial``: engines that keep generating while the trainer trains, weights swapped into
requests in flight, and steps that take finished groups as they come.

The driver keeps every engine's request stream (``generation.stream``) fed with groups (a prompt's G
samples, one request each, seeded by the prompt's data position as in the batch modes) and advances the
streams in short slices from a thread of its own. A finished group is scored there and put in the buffer;
a step takes ``grpo.num_prompts_per_step`` finished groups from the buffer in the order they finished.
After the step trains, the pump is paused between two slices (no engine step runs: a token boundary), the
weights are sent and probed while the requests stay in the engines, the engines' policy version is
raised, and the pump resumes: a response's tokens record the version that sampled each of them.

Staleness is per sample: a group is trained only if the oldest token of every response in it is at most
``grpo.max_staleness`` versions older than the policy being trained; otherwise the whole group is dropped
(counted), so that no group baseline is computed over a subset of its samples. New groups start only while
the groups started so far number at most ``(version + max_staleness + 1) * num_prompts_per_step`` (AReaL's
bound, ``GroupBuffer.room``), so a group is dropped only when it outlives groups started after it.

An engine that dies or does not answer a slice within ``generation.timeout_s`` never contributes a sample:
its groups go back to the queue whole (generated again from their prompts, with their seeds, on the
engines still running), and it is replaced at the next sync point, where the trainer's weights are not
changing (``EnginePool.replace``: restarted, every engine re-synced and probed).

What depends on timing (and so is not reproduced by a resumed run): which groups finish first and thus
make up a step, and which version sampled each token. What does not: each group's prompt and seed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megagrpo.config import Config
from megagrpo.data.prompts import PromptSource
from megagrpo.generation.stream import PartialRequest, StreamRequest
from megagrpo.trainers.group_buffer import (
    BufferCounts,
    FinishedGroup,
    GroupBuffer,
    GroupRequest,
    request_from,
    rollouts_of,
)
from megagrpo.trainers.rollouts import group_seed, staleness_metrics
from megagrpo.types import Completion, SamplingSettings


def score_group(
    cfg: Config, source: PromptSource, scorer, request: GroupRequest, completions: Sequence[Completion]
) -> FinishedGroup:
    """A finished group's rewards (the reward function on its decoded responses; episodes: the rewards
    their environments gave)."""
    if completions and all(c.reward is not None for c in completions):
        rewards = torch.tensor([c.reward for c in completions], dtype=torch.float32)
        return FinishedGroup(request, list(completions), rewards)
    texts = [source.decode(c.token_ids) for c in completions]
    scored = scorer.score(texts, [request.prompt.answer] * len(texts))
    rewards = torch.tensor(scored.scores, dtype=torch.float32)
    return FinishedGroup(request, list(completions), rewards, scored.timeouts, scored.errors)


def settings_for(cfg: Config, source: PromptSource) -> SamplingSettings:
    """The sampling settings of every group request (G samples each)."""
    return SamplingSettings.from_config(cfg, stop_token_ids=source.stop_token_ids, n=cfg.grpo.num_generations)


@dataclass
class Taken:
    """A step's groups and what the pump did while they were made."""

    groups: list[FinishedGroup]
    counts: BufferCounts
    wait_s: float
    """How long the step waited for them."""
    engine_busy_s: float
    """Seconds the engines spent in generation steps since the last step took its groups (summed)."""
    elapsed_s: float
    """Wall time since the last step took its groups."""
    engines: int
    """Engines running meanwhile (for the busy fraction)."""
    episodes_restarted: int | None = None
    """Multi-turn episodes resumed from the checkpoint that restarted from their openings since the last
    step (``generation.stream_episodes``); None: no episodes."""


class EngineStreams:
    """The engines' side of the pump: Ray calls to each engine's request stream (``StreamingEngine``).
    A group's G samples are G requests, ``"<position>:<sample>"``, all on one engine.

    ``actors`` is the pool's live list (a replacement engine appears at its index)."""

    def __init__(self, actors: list, settings: SamplingSettings, slice_s: float):
        self.actors, self.slice_s = actors, slice_s
        self.settings = dataclasses.replace(settings, n=1)
        self.num_generations = settings.n

    def requests(self, group: GroupRequest) -> list[StreamRequest]:
        prompt = tuple(group.prompt.token_ids)
        return [
            StreamRequest(
                f"{group.position}:{k}",
                prompt,
                self.settings,
                sample_seed(group.seed, k),
                group.position,
                group.prompt.task,  # episodes: the environment's task (generation.stream_episodes)
            )
            for k in range(self.num_generations)
        ]

    def submit(self, engine: int, groups: Sequence[GroupRequest]):
        return self.actors[engine].submit.remote([r for g in groups for r in self.requests(g)])

    def advance(self, engine: int):
        return self.actors[engine].advance.remote(self.slice_s)

    def abort(self, engine: int, position: int):
        return self.actors[engine].abort.remote([f"{position}:{k}" for k in range(self.num_generations)])

    def set_version(self, engine: int, version: int):
        return self.actors[engine].set_version.remote(version)

    def in_flight(self, engine: int):
        return self.actors[engine].in_flight.remote()

    def resume_from(self, engine: int, partials: list):
        return self.actors[engine].resume_from.remote(partials)


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of the group seeded ``seed`` (one request per sample)."""
    return (seed * 1_000_003 + sample) % (2**63 - 1)


def request_key(request_id: str) -> tuple[int, int]:
    """(group position, sample index) of a stream request id."""
    position, _, sample = request_id.partition(":")
    return int(position), int(sample)


def to_completion(done) -> Completion:
    """A finished stream request (``StreamCompletion``) as the pipeline's record, its versions in runs
    (and its routed experts under ``grpo.routing_replay``: the rows of every version, per position)."""
    runs: list[tuple[int, int]] = []
    for v in done.versions:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    if done.episode is not None:  # an episode's record: opening, loss mask, reward, stats
        return dataclasses.replace(done.episode, prompt_index=0, versions=runs)
    return Completion(
        0,
        list(done.token_ids),
        list(done.logprobs),
        done.finish_reason,
        routed_experts=done.routed_experts,
        versions=runs,
    )


class ContinuousRollouts:
    """The pump: keeps the engines' streams fed and advancing from a thread, and hands finished groups
    to the steps (see the module docstring).

    The main thread calls ``take`` at the start of a step, ``pause`` before a weight sync, ``set_version``
    once the weights are in (before the probe), ``resume`` after it. While paused no engine step runs
    but those the probe and validation make (``StreamingEngine``), so the engines are at a token boundary
    when the weights load."""

    def __init__(
        self,
        cfg: Config,
        pool,
        source: PromptSource,
        scorer,
        *,
        version: int,
        position: int,
        state: dict | None = None,
    ):
        """``pool``: the run's ``EnginePool``; ``version``: the policy version its engines hold;
        ``position``: the data position of the first new group; ``state``: a checkpoint's (``snapshot``)."""
        g = cfg.grpo
        self.cfg, self.pool, self.source, self.scorer = cfg, pool, source, scorer
        self.buffer = GroupBuffer(
            g.num_generations,
            g.num_prompts_per_step,
            g.max_staleness,
            filter_flat=g.filter_zero_variance_groups,
            next_position=position,
            consumed=version * g.num_prompts_per_step,
        )
        self.streams = EngineStreams(pool.actors, settings_for(cfg, source), cfg.generation.stream_slice_s)
        self.version = version
        self.timeout_s = cfg.generation.timeout_s
        self._cond = threading.Condition()
        self._paused, self._stop = True, False
        self._refs: dict[int, tuple[object, float]] = {}
        """Engine -> (its outstanding advance, when it was issued)."""
        self._samples: dict[int, dict[int, Completion]] = {}
        """Group position -> its finished samples, by index, until all G are in."""
        self.dead: dict[int, BaseException] = {}
        """Engines that failed, by index, with their error; replaced at the next sync point."""
        self.failed_requests = 0
        """Requests an engine ended without a sample (their groups were generated again)."""
        self._restarted = 0
        """Resumed episodes restarted from their openings since the last step took its groups."""
        self._error: BaseException | None = None
        self._busy_s, self._since = 0.0, time.perf_counter()
        self._resumed: dict[int, list] = {}
        if state is not None:
            self._restore(state)
        self._thread = threading.Thread(target=self._run, name="partial-rollouts", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- main thread

    def take(self, step: int) -> Taken:
        """The groups step ``step`` trains on (it trains policy version ``step - 1``): waits until the
        buffer has ``grpo.num_prompts_per_step`` fresh ones. Engines that failed meanwhile are replaced
        here (the trainer's weights are those the engines hold)."""
        g, start = self.cfg.grpo, time.perf_counter()
        while True:
            with self._cond:
                self._raise_error()
                taken = self.buffer.take(g.num_prompts_per_step, step - 1, g.max_staleness)
                if taken is not None:
                    counts = self.buffer.take_counts()
                    busy, self._busy_s = self._busy_s, 0.0
                    now = time.perf_counter()
                    elapsed, self._since = now - self._since, now
                    engines = len(self.pool.actors) - len(self.dead)
                    restarted, self._restarted = self._restarted, 0
                    self._cond.notify_all()  # room for new groups
                    episodes = restarted if self.cfg.env.enabled else None
                    return Taken(taken, counts, now - start, busy, elapsed, engines, episodes)
                if not self.dead:
                    self._cond.wait(0.5)
                    continue
            self.pause()
            self.replace_dead(step - 1)
            self.resume()

    def pause(self) -> None:
        """Stop issuing slices and wait for those in flight (a failure then is handled as any other)."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            while self._refs and self._error is None:
                self._cond.wait(0.5)
            self._raise_error()

    def set_version(self, version: int) -> None:
        """Paused, the new weights loaded: the engines' tokens from now on carry ``version``."""
        import ray

        with self._cond:
            self.version = version
            ray.get([self.streams.set_version(i, version) for i in self._live()], timeout=self.timeout_s)

    def resume(self) -> None:
        """Generation goes on."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def replace_dead(self, version: int):
        """Paused: restart every failed engine (``EnginePool.replace``: the trainer's weights, policy
        ``version``, re-synced to every engine and probed). The last replacement's sync outcome, or None
        when none failed."""
        outcome = None
        for index, err in sorted(self.dead.items()):
            outcome = self.pool.replace(
                index, err, step=version + 1, after_load=lambda: self.set_version(version)
            )
            del self.dead[index]
        return outcome

    def snapshot(self) -> dict:
        """Paused: the buffer's groups, the samples of unfinished groups and every engine's partial
        requests, as plain data for a checkpoint."""
        import ray

        with self._cond:
            assert self._paused and not self._refs, "snapshot while the pump runs"
            live = self._live()
            partials = ray.get([self.streams.in_flight(i) for i in live], timeout=self.timeout_s)
            return {
                "buffer": self.buffer.state(),
                "samples": {
                    pos: {k: dataclasses.asdict(c) for k, c in got.items()}
                    for pos, got in self._samples.items()
                },
                "partials": [dataclasses.asdict(p) for per_engine in partials for p in per_engine],
                "version": self.version,
            }

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=max(5.0, self.streams.slice_s * 4))

    # ------------------------------------------------------------------------------- pump thread

    def _live(self) -> list[int]:
        return [i for i in range(len(self.pool.actors)) if i not in self.dead]

    def _run(self) -> None:
        import ray

        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                    if not self._paused:
                        self._feed()
                    refs = {i: ref for i, (ref, _) in self._refs.items()}
                    if not refs:
                        self._cond.notify_all()  # quiet: a pause waiting for it may go on
                        self._cond.wait(0.5)
                        continue
                done, _ = ray.wait(list(refs.values()), num_returns=1, timeout=0.5)
                for engine, ref in refs.items():
                    if ref in done:
                        self._collect(engine, ref)
                self._check_deadlines()
        except BaseException as err:  # handed to the main thread, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _feed(self) -> None:
        """Under the lock: new groups while there is room, each live engine topped up to its share and
        given a slice to run if it has requests."""
        live = self._live()
        if not live:
            return
        room = self.buffer.room(self.version)
        if room:
            self.buffer.open(self._request, room)
        share = -(-self.buffer.in_flight_limit() // len(live))
        for engine in live:
            resumed = self._resumed.pop(engine, None)
            if resumed:
                self.streams.resume_from(engine, resumed)
            mine = self.buffer.on_engine.get(engine, {})
            groups = self.buffer.assign(engine, share - len(mine))
            if groups:
                self.streams.submit(engine, groups)
            if self.buffer.on_engine.get(engine) and engine not in self._refs:
                self._refs[engine] = (self.streams.advance(engine), time.perf_counter())

    def _request(self, position: int) -> GroupRequest:
        prompt = self.source.batch(position, 1)[0]
        return GroupRequest(position, prompt, group_seed(self.cfg, position))

    def _collect(self, engine: int, ref) -> None:
        """An engine's slice returned: its samples join their groups; complete groups are scored (outside
        the lock) and buffered; a group with a failed request is generated again."""
        import ray

        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            with self._cond:
                self._lose(engine, err)
            return
        complete = []
        with self._cond:
            self._refs.pop(engine, None)
            self._busy_s += result.busy_s
            self._restarted += result.restarted
            mine = self.buffer.on_engine.get(engine, {})
            for failure in result.failed:
                position, _ = request_key(failure.request.request_id)
                if position in mine:
                    self.failed_requests += 1
                    self.streams.abort(engine, position)
                    self._samples.pop(position, None)
                    self.buffer.requeue(engine, position)
            for done in result.finished:
                position, sample = request_key(done.request.request_id)
                if position not in mine:  # its group was generated again meanwhile
                    continue
                got = self._samples.setdefault(position, {})
                got[sample] = to_completion(done)
                if len(got) == self.buffer.num_generations:
                    del self._samples[position]
                    complete.append((mine[position], [got[k] for k in sorted(got)]))
        groups = [score_group(self.cfg, self.source, self.scorer, r, c) for r, c in complete]
        with self._cond:
            for group in groups:
                self.buffer.finished(engine, group)
            self._cond.notify_all()

    def _check_deadlines(self) -> None:
        """An engine whose slice has not returned within ``generation.timeout_s`` is killed and lost."""
        import ray

        now = time.perf_counter()
        with self._cond:
            late = [i for i, (_, issued) in self._refs.items() if now - issued > self.timeout_s]
            for engine in late:
                ray.kill(self.pool.actors[engine], no_restart=True)
                self._lose(engine, TimeoutError(f"a slice did not return within {self.timeout_s:.0f}s"))

    def _lose(self, engine: int, err: BaseException) -> None:
        """Under the lock: ``engine`` failed; its groups are queued again whole."""
        self._refs.pop(engine, None)
        self._resumed.pop(engine, None)
        for request in self.buffer.engine_lost(engine):
            self._samples.pop(request.position, None)
        self.dead[engine] = err
        print(
            f"vLLM engine {engine} failed while generating ({err}); its groups are queued again", flush=True
        )
        self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the partial-rollout pump failed: {self._error!r}") from self._error

    def _restore(self, state: dict) -> None:
        """A checkpoint's groups back in the buffer; each unfinished group's partial requests handed to
        one engine (groups dealt round the engines) to be continued."""
        buf = state["buffer"]
        self.buffer.next_position, self.buffer.consumed = buf["next_position"], buf["consumed"]
        for row in buf["ready"]:
            completions = [Completion(**c) for c in row["completions"]]
            group = request_from(row["request"])
            self.buffer.ready.append(
                FinishedGroup(group, completions, row["rewards"], row["timeouts"], row["errors"])
            )
        self._samples = {
            int(pos): {int(k): Completion(**c) for k, c in got.items()}
            for pos, got in state["samples"].items()
        }
        partials: dict[int, list] = {}
        for row in state["partials"]:
            partial = partial_request(row)
            partials.setdefault(request_key(partial.request.request_id)[0], []).append(partial)
        engines = len(self.pool.actors)
        for n, row in enumerate(buf["queued"]):
            request = request_from(row)
            if request.position not in partials and request.position not in self._samples:
                self.buffer.queued.append(request)
                continue
            engine = n % engines
            self.buffer.on_engine.setdefault(engine, {})[request.position] = request
            self._resumed.setdefault(engine, []).extend(partials.get(request.position, []))


def partial_request(row: dict) -> PartialRequest:
    """A checkpoint's partial request (plain data) as the stream takes it."""
    request = dict(row["request"])
    request["settings"] = SamplingSettings(**request["settings"])
    request["prompt_ids"] = tuple(request["prompt_ids"])
    fields = {k: v for k, v in row.items() if k != "request"}
    return PartialRequest(StreamRequest(**request), **fields)


def partial_metrics(taken: Taken, trained_version: int) -> dict[str, float]:
    """Per-sample staleness (from each response's oldest token) and the off-policy token fraction
    (``rollouts.staleness_metrics``), what the buffer dropped or re-queued, and the engines' busy
    fraction since the last step."""
    rollouts = rollouts_of(taken.groups)
    comps = rollouts.completions
    staleness = staleness_metrics(rollouts, trained_version, trained_version=trained_version)
    del staleness["staleness/generator_version"]  # one per token here
    engines = max(1, taken.engines)
    if taken.episodes_restarted is not None:
        staleness["async/episodes_restarted"] = taken.episodes_restarted
    return staleness | {
        "async/stale_groups": taken.counts.stale,
        "async/requeued_groups": taken.counts.requeued,
        "async/failed_groups": taken.counts.failed,
        "async/engine_failures": taken.counts.engine_failures,
        "async/mixed_version_frac": sum(len(c.versions or ()) > 1 for c in comps) / len(comps),
        "async/engine_busy_frac": taken.engine_busy_s / max(1e-9, taken.elapsed_s * engines),
        "timing/wait_rollouts_s": taken.wait_s,
    }
