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
- **Checkpoints** (:meth:`EpisodeStream.in_flight`). An unfinished episode is saved with its tokens so
  far (sampled and observation tokens, their versions and logprobs, its routing rows), the environment's
  opening and answers with the turn text each answered, and where it was: a step running (the turn's
  text) or a turn at the engine (that turn's sample so far, as the stream's snapshot has it). A resume
  (:meth:`EpisodeStream.resume_from`) rebuilds its environment by a reset and the saved turns replayed,
  each answer checked (``envs.episodes``), then reruns the step or continues the turn under the resumed
  policy: the saved tokens keep their versions. An environment that offers its state as plain data
  (``Environment.state_dict``) is rebuilt from it instead, with no replay. An environment that answers
  otherwise on replay, or whose state does not load, restarts its episode from the opening
  (:meth:`EpisodeStream.take_restarted`). An episode whose reset was
  running is saved as its request only and opened again.
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

_SAVED = (
    "prompt",
    "mask",
    "turns",
    "reward",
    "tool_calls",
    "tool_errors",
    "env_s",
    "budget",
    "greedy",
    "routed",
    "recomputed",
    "rerouted",
    "opening",
    "answers",
    "env_state",
)
"""``_Episode`` fields an episode's checkpoint record holds besides its tokens, logprobs and versions."""

__all__ = ["EpisodeStream"]


class _StreamTurns:
    """The stream as the runner's ``TurnEngine``: each turn one stream request; turns the engine ended
    without a sample are kept for the episode stream to fail their episodes."""

    def __init__(self, stream: RequestStream, stop_token_ids: Sequence[int]):
        self.stream, self.stop_token_ids = stream, tuple(stop_token_ids)
        self.settings: SamplingSettings | None = None
        """How turns sample: the episode requests' settings (a run's requests all sample alike)."""

    def add(self, request_id: str, prompt: list[int], max_tokens: int, seed: int) -> None:
        self.stream.submit([self._request(request_id, prompt, max_tokens, seed)])

    def resume(self, request_id: str, prompt: list[int], max_tokens: int, seed: int, so_far: dict) -> None:
        """A checkpoint's turn, continued from its sample so far (``RequestStream.resume_from``)."""
        request = self._request(request_id, prompt, max_tokens, seed)
        self.stream.resume_from([PartialRequest(request, **so_far)])

    def _request(self, request_id: str, prompt: list[int], max_tokens: int, seed: int) -> StreamRequest:
        s = self.settings
        stops = tuple(sorted({*self.stop_token_ids, *s.stop_token_ids}))
        # A turn ends at its end-of-turn token whatever generation.ignore_eos says.
        turn = dataclasses.replace(s, n=1, max_tokens=max_tokens, stop_token_ids=stops, ignore_eos=False)
        return StreamRequest(request_id, tuple(prompt), turn, seed)

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
            opened.append((self._episode(request), request.task))
        self.runner.open(opened)

    def _episode(self, request: StreamRequest) -> _Episode:
        seed = request.seed if request.seed is not None else (request.settings.seed or 0)
        ep = _Episode(self._opened, seed=seed, label=request.request_id)
        self._opened += 1
        self._turns.settings = request.settings
        self._episodes[request.request_id] = (request, ep)
        return ep

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

    def take_restarted(self) -> int:
        """Resumed episodes restarted from their openings since the last call (their environment
        answered otherwise on replay)."""
        restarted, self.runner.restarted = self.runner.restarted, 0
        return restarted

    def in_flight(self) -> list[PartialRequest]:
        """Every unfinished episode with its tokens so far and what its resume needs (module docstring);
        one whose reset is running: its request alone."""
        turns = {p.request.request_id: p for p in self.stream.in_flight()}
        at_engine = self.runner.in_engine()
        return [self._saved(request, ep, turns, at_engine) for request, ep in self._episodes.values()]

    def _saved(self, request: StreamRequest, ep: _Episode, turns: dict, at_engine: dict) -> PartialRequest:
        if ep.rebuild is not None:  # resumed and not rebuilt yet: saved as it was restored
            pending, turn = ep.rebuild.pending, ep.rebuild.turn
        elif ep.at_env is not None:
            pending, turn = ep.at_env, None
        elif id(ep) in at_engine and at_engine[id(ep)] in turns:
            p = turns[at_engine[id(ep)]]
            fields = ("token_ids", "logprobs", "versions", "routed_experts")
            pending, turn = None, {k: getattr(p, k) for k in fields}
        elif id(ep) in at_engine or not ep.prompt:
            # Its reset is running, or the engine ended its turn beside the probe without a sample (the
            # next advance fails it): nothing to keep, it is opened again.
            return PartialRequest(request, [], [], [])
        else:
            raise RuntimeError(
                f"episode {request.request_id!r} is between ticks (a snapshot needs the async schedule)"
            )
        # Copies: the episode plays on after the snapshot (appending to its lists).
        state = {k: _copied(getattr(ep, k)) for k in _SAVED} | {"pending": pending, "turn": turn}
        return PartialRequest(
            request, list(ep.tokens), list(ep.logprobs), list(ep.versions or []), episode=state
        )

    def resume_from(self, partials: Iterable[PartialRequest]) -> None:
        """Continue the snapshot's episodes (module docstring); one saved without its turns (its reset
        was running) is opened again."""
        partials = list(partials)
        for p in partials:
            _check_saved(p)
        self.submit([p.request for p in partials if p.episode is None])
        for p in partials:
            if p.episode is not None:
                ep = self._episode(p.request)
                for key in _SAVED:
                    setattr(ep, key, _copied(p.episode[key]))
                ep.tokens, ep.logprobs = list(p.token_ids), list(p.logprobs)
                ep.versions = list(p.versions) if p.versions else None
                turn = p.episode["turn"]
                self.runner.resume(ep, p.request.task, pending=p.episode["pending"], turn=turn)

    def run_now(self, prompts, params) -> list:
        """``RequestStream.run_now`` beside the episodes' turns (the probe, validation)."""
        return self.stream.run_now(prompts, params)


def _copied(value):
    return list(value) if isinstance(value, list) else value


def _check_saved(p: PartialRequest) -> None:
    """ValueError naming the episode and what is wrong with a checkpoint's record of it."""
    rid = p.request.request_id
    if p.episode is None:
        if p.token_ids:
            raise ValueError(
                f"episode {rid!r}: {len(p.token_ids)} tokens saved without the episode's state "
                "(turns, environment answers)"
            )
        return
    missing = sorted({*_SAVED, "pending", "turn"} - set(p.episode))
    if missing:
        raise ValueError(f"episode {rid!r}: the checkpoint's record has no {', '.join(missing)}")
    n = len(p.token_ids)
    if len(p.episode["mask"]) != n or len(p.versions) not in (0, n) or not p.episode["prompt"]:
        raise ValueError(
            f"episode {rid!r}: {n} tokens, {len(p.episode['mask'])} loss-mask entries and "
            f"{len(p.versions)} versions do not line up, or no opening"
        )
    if (p.episode["pending"] is None) == (p.episode["turn"] is None):
        raise ValueError(f"episode {rid!r}: the record needs one of a running step or a running turn")
