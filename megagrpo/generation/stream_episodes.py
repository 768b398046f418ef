"""Multi-turn episodes under ``grpo.async_mode: partial``: each episode a request of the engine's stream.

:class:`EpisodeStream` gives an engine's episodes the interface of its request stream
(``generation.stream.RequestStream``: submit, advance, abort, set_version, in_flight, resume_from,
take_failed, run_now), so the partial-rollout pump (``trainers.partial``) drives them as it drives single
responses. A submitted request with a ``task`` is one episode; the episode runner (``envs.episodes``) plays
it, and each of its turns is a request of the stream underneath, submitted when the episode's previous
turn is sampled and its environment has answered (the opening, the turns so far and the observation are
the turn's prompt, token in / token out). So:

- **Turns continue across weight swaps.** A turn is a stream request like any other: the weights change
  between two engine steps, under the turn's running request, and every sampled token carries the version
  that sampled it. An observation's tokens carry the version of the turn they answer (they are not
  sampled: they count for staleness as that turn). ``Completion.versions`` holds the episode's versions.
- **Routing replay.** Each turn's rows come from the stream (each position's first forward), and the
  episode keeps each position's rows from the first turn that forwarded it (``envs.episodes``).
- **Failures are never samples.** An episode whose environment fails (raises, passes its deadline, kills
  its worker) or whose turn the engine ends without a sample is a failed request (``take_failed``): the
  pump generates its group again whole, so no failed episode becomes a zero-reward sample.
- **Checkpoints.** An unfinished episode is saved as its request only, without its turns so far: a
  resumed run plays it again from its opening (the environment's reset depends on the task only; the
  turns' seeds on the episode's seed and turn), under the resumed policy. Its environment's state between
  calls and a turn's tokens so far are not kept.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

from megagrpo.envs.episodes import EpisodeRunner, Turn, _Episode
from megagrpo.generation.stream import (
    PartialRequest,
    RequestStream,
    StreamCompletion,
    StreamFailure,
    StreamRequest,
)
from megagrpo.types import SamplingSettings

__all__ = ["EpisodeStream"]


class _StreamTurns:
    """The stream as the runner's ``TurnEngine``: each turn one stream request; turns the engine ended
    without a sample are kept for the episode stream to fail their episodes."""

    def __init__(self, stream: RequestStream, stop_token_ids: Sequence[int]):
        self.stream, self.stop_token_ids = stream, tuple(stop_token_ids)
        self.settings: SamplingSettings | None = None
        """How turns sample: the episode requests' settings (a run's requests all sample alike)."""

    def add(self, request_id: str, prompt: list[int], max_tokens: int, seed: int) -> None:
        s = self.settings
        stops = tuple(sorted({*self.stop_token_ids, *s.stop_token_ids}))
        # A turn ends at its end-of-turn token whatever generation.ignore_eos says.
        turn = dataclasses.replace(s, n=1, max_tokens=max_tokens, stop_token_ids=stops, ignore_eos=False)
        self.stream.submit([StreamRequest(request_id, tuple(prompt), turn, seed)])

    def busy(self) -> bool:
        return self.stream.busy()

    def step(self) -> list[Turn]:
        return [
            Turn(c.request.request_id, c.token_ids, c.logprobs, c.routed_experts, c.versions)
            for c in self.stream.advance(max_steps=1)
        ]


class EpisodeStream:
    """An engine's episodes as requests of its stream (see the module docstring). ``renderer``: the
    model's ``ChatRenderer``; ``pool``: the environment workers; ``env_cfg``: the ``env`` section."""

    def __init__(self, stream: RequestStream, renderer, pool, env_cfg, *, max_context: int, log=print):
        self.stream = stream
        self._turns = _StreamTurns(stream, renderer.stop_token_ids)
        self.runner = EpisodeRunner(self._turns, renderer, pool, env_cfg, max_context=max_context, log=log)
        self._episodes: dict[str, tuple[StreamRequest, _Episode]] = {}
        self._failed: list[StreamFailure] = []
        self._opened = 0

    @property
    def version(self) -> int:
        return self.stream.version

    def __len__(self) -> int:
        """Turn requests in the engine (what ``LLM.generate`` would step: ``generation.stream``)."""
        return len(self.stream)

    def submit(self, requests: Iterable[StreamRequest]) -> None:
        """Open an episode per request (its environment's reset goes to a worker)."""
        opened = []
        for request in requests:
            if request.task is None:
                raise ValueError(
                    f"request {request.request_id!r} has no task (an episode stream runs episodes)"
                )
            if request.request_id in self._episodes:
                raise ValueError(f"request id {request.request_id!r} is already in flight on this stream")
            seed = request.seed if request.seed is not None else (request.settings.seed or 0)
            ep = _Episode(self._opened, seed=seed)
            self._opened += 1
            self._turns.settings = request.settings
            self._episodes[request.request_id] = (request, ep)
            opened.append((ep, request.task))
        self.runner.open(opened)

    def advance(
        self, *, max_steps: int | None = None, max_seconds: float | None = None
    ) -> list[StreamCompletion]:
        """Move the episodes on (engine steps, environment answers) for ``max_steps`` ticks or
        ``max_seconds``, or until none is left; the episodes that finished, in the order they finished."""
        start, ticks, done = time.monotonic(), 0, []
        while self._unfinished():
            left = None if max_seconds is None else max(0.0, max_seconds - (time.monotonic() - start))
            self.runner.tick(wait=left if left is None else min(left, 0.05))
            for failure in self.stream.take_failed():
                self.runner.fail_request(failure.request.request_id, f"engine_{failure.reason}")
            done += self._collect()
            ticks += 1
            if max_steps is not None and ticks >= max_steps:
                break
            if max_seconds is not None and time.monotonic() - start >= max_seconds:
                break
        return done

    def _unfinished(self) -> bool:
        return any(ep.finish is None for _, ep in self._episodes.values())

    def _collect(self) -> list[StreamCompletion]:
        """Episodes that ended: samples, or failures (an environment's or the engine's)."""
        done = []
        for rid, (request, ep) in list(self._episodes.items()):
            if ep.finish is None:
                continue
            del self._episodes[rid]
            if ep.finish not in ("stop", "length"):  # env_error, engine_abort, engine_error
                self._failed.append(StreamFailure(request, ep.finish))
                continue
            comp = ep.completion(0)
            versions = list(ep.versions or [])
            done.append(
                StreamCompletion(
                    request, comp.token_ids, comp.logprobs, versions, comp.finish_reason, ep.routed, comp
                )
            )
        return done

    def abort(self, request_ids: Iterable[str]) -> list[StreamRequest]:
        """Drop these episodes (their turn requests aborted, their environments' answers ignored)."""
        dropped = [self._episodes.pop(rid) for rid in request_ids if rid in self._episodes]
        self.stream.abort(self.runner.drop([ep for _, ep in dropped]))
        return [request for request, _ in dropped]

    def take_failed(self) -> list[StreamFailure]:
        failed, self._failed = self._failed, []
        return failed

    def set_version(self, version: int, *, kv: str = "keep") -> None:
        self.stream.set_version(version, kv=kv)

    def in_flight(self) -> list[PartialRequest]:
        """Every unfinished episode as its request alone: a resume plays it from its opening."""
        return [PartialRequest(request, [], [], []) for request, _ in self._episodes.values()]

    def resume_from(self, partials: Iterable[PartialRequest]) -> None:
        """Open the snapshot's episodes again from their openings (their turns so far are not saved)."""
        partials = list(partials)
        for p in partials:
            if p.token_ids:
                raise ValueError(
                    f"episode {p.request.request_id!r}: an episode snapshot holds no tokens, this one "
                    f"has {len(p.token_ids)}"
                )
        self.submit([p.request for p in partials])

    def run_now(self, prompts, params) -> list:
        """``RequestStream.run_now`` beside the episodes' turns (the probe, validation)."""
        return self.stream.run_now(prompts, params)
