"""Multi-turn episodes on one engine, token in / token out, with no episode waiting for another.

An episode alternates engine turns and environment steps (``megagrpo.envs.base``):

    prompt_0 = render(opening)                        # the environment's reset
    turn_t   = sample(prompt_t)                       # the engine; ends with the end-of-turn token
    prompt_{t+1} = prompt_t + turn_t + render(observation_t)

so every prompt is the previous prompt's tokens, the tokens the engine sampled and the observation's
tokens (``ChatRenderer.observation_ids``: the chat template's rendering of the environment's messages,
delta-tokenized); decoded text goes to the environment only, never back into the sequence. The trainer
trains on exactly these tokens, with loss on the sampled ones (``Completion.loss_mask``).

Scheduling (``env.schedule``): "async" adds an episode's next request to the engine the moment its
observation is ready and sends a turn to an environment worker the moment it is sampled, so the engine
decodes whatever episodes are ready (vLLM's continuous batching) while environments step; "turns" is the
turn-synchronous baseline: every episode's turn t, then every environment step, then turn t + 1.

An episode ends when the environment says done, or truncated (``finish_reason`` "length") when a turn
reaches ``env.max_new_tokens`` without its end-of-turn token, after ``env.max_turns`` turns, or when the
next observation would pass ``env.max_episode_tokens``; an environment call that raises, passes its
deadline or kills its worker ends it with reward 0 (``finish_reason`` "env_error").

Resuming an episode (:meth:`EpisodeRunner.resume`, a checkpoint's unfinished episode under
``grpo.async_mode: partial``): its tokens so far are restored as saved, and its environment is rebuilt
through the workers. An environment that offers its state as plain data (``Environment.state_dict``) is
built with its arguments and given it (``load_state_dict``). Any other is rebuilt the way it was built:
a reset on its task, then each saved turn's text stepped in order, every answer checked against the
saved one (messages, reward, done, tool counts) for equality. The pickled environment object itself is
never saved: unpickling it would run code from the checkpoint file. An environment that answers
differently on replay (it draws randomness of its own, reads the clock, or its code changed), or whose
state does not load, cannot continue the saved turns: the episode restarts from its opening, counted in
``EpisodeRunner.restarted``; its saved tokens are dropped, never trained beside the new ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megagrpo.types import Completion

__all__ = ["EpisodeRunner", "Turn", "TurnEngine"]


@dataclass(frozen=True)
class Turn:
    """One finished engine request: its sampled tokens and their sampling logprobs (and, from an engine
    returning routed experts, its ``[prompt + sampled - 1, MoE layers, k]`` rows)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    routed_experts: Any = None
    versions: list[int] | None = None
    """The policy version that sampled each token (an engine whose weights change under running
    requests: ``grpo.async_mode`` partial); None: one version for the whole call."""


class TurnEngine(Protocol):
    """What the runner needs of an engine (``generation.vllm.vllm_turn_engine`` adapts vLLM's
    ``LLMEngine``): ``add`` a request, whether any is unfinished, and ``step`` the engine once, returning
    the requests that finished in that step."""

    def add(self, request_id: str, prompt: list[int], max_tokens: int, seed: int) -> None: ...

    def busy(self) -> bool: ...

    def step(self) -> list[Turn]: ...


@dataclass
class _Episode:
    index: int
    """Position among the call's episodes (task-major: task i's samples are n * i .. n * i + n - 1)."""
    seed: int
    prompt: list[int] = field(default_factory=list)
    """The opening prompt's tokens."""
    tokens: list[int] = field(default_factory=list)
    """Everything after the opening: sampled and observation tokens."""
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env: bytes = b""
    """The environment, pickled (it lives in the worker processes between calls)."""
    env_state: dict | None = None
    """The environment's ``state_dict()`` after its last call (plain data); None: it offers none."""
    turns: int = 0
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    budget: int = 0
    """Tokens the episode may still add after its opening."""
    finish: str | None = None
    greedy: bool = False
    """Sampled at temperature 0: the engine reported no logprobs (the completion then has none)."""
    routed: Any = None
    """Routed experts of every position forwarded so far, each from the first turn that forwarded it."""
    recomputed: int = 0
    """Token-layer pairs a later turn forwarded again."""
    rerouted: int = 0
    """Of those, the pairs it routed to other experts."""
    versions: list[int] | None = None
    """Per token of ``tokens``, the policy version that sampled it (an observation's tokens: the version
    of the turn before them), from turns that report versions; else None."""
    task: dict | None = None
    label: str = ""
    """Names the episode in messages (its stream request's id)."""
    opening: list[dict] | None = None
    """The environment's opening messages (its reset's answer)."""
    answers: list[list] = field(default_factory=list)
    """Per environment step so far: ``[turn text, [messages, reward, done, tool calls, tool errors]]``
    (what a resume replays and checks)."""
    at_env: str | None = None
    """The text of the turn an environment step is answering now; None: no step running."""
    rebuild: _Rebuild | None = None
    """A resumed episode whose environment is being rebuilt; None: none."""

    def completion(self, task: int) -> Completion:
        stats = {
            "turns": float(self.turns),
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(self.tool_errors),
            "env_s": self.env_s,
            "env_failed": float(self.finish == "env_error"),
            "truncated": float(self.finish == "length"),
            "rerouted": float(self.rerouted),
            "recomputed": float(self.recomputed),
        }
        return Completion(
            task,
            self.tokens,
            [] if self.greedy else self.logprobs,
            self.finish or "length",
            loss_mask=self.mask,
            prompt_ids=self.prompt,
            reward=self.reward,
            stats=stats,
            routed_experts=self.routed,
            versions=version_runs(self.versions) if self.versions is not None else None,
        )

    def add_routing(self, rows) -> None:
        """A turn's routed experts (every position before its last sampled token, already added): the
        episode keeps the rows it has and takes the new positions'; rows computed again are compared."""
        want = len(self.prompt) + len(self.tokens) - 1
        if rows.shape[0] != want:
            raise RuntimeError(
                f"episode {self.index} turn {self.turns}: {rows.shape[0]} routed-expert rows, expected {want}"
            )
        if self.routed is None:
            self.routed = rows
            return
        kept = self.routed.shape[0]
        again, _ = rows[:kept].sort(dim=-1)
        first, _ = self.routed.sort(dim=-1)
        self.rerouted += int((again != first).any(dim=-1).sum())
        self.recomputed += again.shape[0] * again.shape[1]
        self.routed = torch.cat([self.routed, rows[kept:]])


@dataclass
class _Rebuild:
    """A resumed episode's environment rebuilt call by call (the module docstring), then the episode goes
    on where its checkpoint left it: the step that was running (``pending``: its turn's text) or the
    turn at the engine (``turn``: its tokens so far, continued)."""

    pending: str | None = None
    turn: dict | None = None
    """``token_ids``, ``logprobs``, ``versions``, ``routed_experts`` of the turn's sample so far."""
    loading: bool = False
    """Rebuilt from the environment's own saved state (``Environment.load_state_dict``): no replay."""
    calls: int = 0
    """Calls answered so far (the reset, then one per saved step)."""


def version_runs(versions: Sequence[int]) -> list[tuple[int, int]]:
    """Per-token versions as ``Completion.versions`` holds them: ``[(version, count), ...]`` runs."""
    runs: list[tuple[int, int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


class EpisodeRunner:
    """Runs episodes on one engine with a pool of environment workers (``DeadlinePool`` of
    ``megagrpo.envs.runner:env_call``).

    ``renderer``: a ``megagrpo.envs.chat.ChatRenderer`` of the model's tokenizer; ``env_cfg``: the
    ``env`` config section; ``max_context``: model.seq_length (opening + episode must fit it)."""

    def __init__(
        self, engine: TurnEngine, renderer, pool, env_cfg, *, max_context: int, log: Callable = print
    ):
        self.engine, self.renderer, self.pool, self.cfg = engine, renderer, pool, env_cfg
        self.max_context, self.log = max_context, log
        self.errors_logged = 0
        self.restarted = 0
        """Resumed episodes whose environment could not be rebuilt as saved (restarted from the opening)."""
        self._restart_logged = False
        self.spec = env_cfg.spec
        self.options = {"tool_format": env_cfg.tool_format, "allow_unsandboxed": env_cfg.allow_unsandboxed}
        # Between ticks: episodes at an environment (by pool ticket) or at the engine (by request id),
        # turns sampled and waiting for an environment, episodes waiting for the engine.
        self._calls: dict[int, _Episode] = {}
        self._requests: dict[str, _Episode] = {}
        self._sampled: list[tuple[_Episode, Turn]] = []
        self._observed: list[_Episode] = []

    def run(self, tasks: Sequence[dict], n: int, seeds: Sequence[int]) -> list[Completion]:
        """``n`` episodes per task (task-major order), episode j of task i seeded from ``seeds[i]`` and j
        (and its turn), so results do not depend on how episodes interleave."""
        episodes = [
            _Episode(i * n + j, seed=seeds[i] * 1_000_003 + j * 7_919)
            for i in range(len(tasks))
            for j in range(n)
        ]
        self.open([(ep, tasks[ep.index // n]) for ep in episodes])
        while any(ep.finish is None for ep in episodes):
            self.tick(wait=None)
        return [ep.completion(ep.index // n) for ep in episodes]

    def open(self, episodes: Sequence[tuple[_Episode, dict]]) -> None:
        """Start ``(episode, task)`` pairs: each environment's reset goes to a worker."""
        for ep, task in episodes:
            ep.task = task
            self._call(ep, "reset", dict(task))

    def resume(self, ep: _Episode, task: dict, *, pending: str | None, turn: dict | None) -> None:
        """Continue a checkpoint's episode, its fields restored: its environment rebuilt (module
        docstring), then the step ``pending`` (a turn's text) or the turn ``turn`` (its sample so far)
        goes on, whichever was running at the checkpoint."""
        ep.task, ep.rebuild = task, _Rebuild(pending, turn, loading=ep.env_state is not None)
        if ep.env_state is not None:
            self._call(ep, "load", ep.env_state)
        else:
            self._call(ep, "reset", dict(task))

    def _call(self, ep: _Episode, op: str, payload) -> None:
        """An environment call of ``ep`` to a worker (its deadline: ``env.step_timeout_s``)."""
        options = (self.options,) if op in ("reset", "load") else ()
        self._calls[self.pool.submit((self.spec, self.cfg.args, op, payload, *options))] = ep

    def tick(self, *, wait: float | None) -> None:
        """One engine step (if the engine has requests) and the environments' answers so far, each
        episode moved on; with the engine idle, waits up to ``wait`` seconds for an environment to answer
        (None: until one does)."""
        calls, requests = self._calls, self._requests
        assert calls or requests or self._sampled or self._observed, "an unfinished episode is nowhere"
        if self.engine.busy():
            for turn in self.engine.step():
                ep = requests.pop(turn.request_id, None)
                if ep is not None:  # else dropped meanwhile
                    self._sampled.append((ep, turn))
            outcomes = self.pool.poll(0)
        else:
            idle = self.pool.pending and not self._sampled
            outcomes = self.pool.poll(wait if idle else 0)
        for ticket, outcome in outcomes:
            ep = calls.pop(ticket)
            if ep.finish is not None:
                continue
            if ep.rebuild is not None:
                self._replayed(ep, outcome)
            elif self._observed_outcome(ep, outcome):
                self._observed.append(ep)
        # The turn-synchronous baseline moves a whole wave at once: turns to the environments once the
        # engine has sampled every one, requests to the engine once every environment has answered.
        synchronous = self.cfg.schedule == "turns"
        if self._sampled and not (synchronous and self.engine.busy()):
            for ep, turn in self._sampled:
                if self._add_turn(ep, turn):
                    ep.at_env = self._text(turn)
                    self._call(ep, "step", (ep.env, ep.at_env))
            self._sampled = []
        if self._observed and not (synchronous and self.pool.pending):
            for ep in self._observed:
                self._next_turn(ep)
            self._observed = []

    def _next_turn(self, ep: _Episode, so_far: dict | None = None) -> None:
        """``ep``'s next turn to the engine; ``so_far``: a resumed turn's sample so far, continued."""
        request = f"ep{ep.index}-t{ep.turns}-{ep.seed}"
        self._requests[request] = ep
        max_tokens = min(self.cfg.max_new_tokens, ep.budget)
        if so_far is None:
            self.engine.add(request, ep.prompt + ep.tokens, max_tokens, ep.seed + ep.turns)
        else:  # only an engine that continues partial requests resumes (generation.stream_episodes)
            self.engine.resume(request, ep.prompt + ep.tokens, max_tokens, ep.seed + ep.turns, so_far)

    def in_engine(self) -> dict[int, str]:
        """The turn request at the engine of each episode that has one, by ``id(episode)``."""
        return {id(ep): rid for rid, ep in self._requests.items()}

    def fail_request(self, request_id: str, reason: str) -> None:
        """The engine ended the turn request ``request_id`` without a sample: its episode ends
        (``finish_reason`` ``reason``)."""
        ep = self._requests.pop(request_id, None)
        if ep is not None:
            ep.finish = reason

    def drop(self, episodes: Sequence[_Episode]) -> list[str]:
        """Forget ``episodes`` (each ends "dropped"; an environment call of theirs still running is
        ignored when it answers); returns the engine requests of theirs to abort."""
        gone = {id(ep) for ep in episodes}
        for ep in episodes:
            ep.finish = "dropped"
        self._sampled = [(ep, turn) for ep, turn in self._sampled if id(ep) not in gone]
        self._observed = [ep for ep in self._observed if id(ep) not in gone]
        dropped = [rid for rid, ep in self._requests.items() if id(ep) in gone]
        for rid in dropped:
            del self._requests[rid]
        return dropped

    def _text(self, turn: Turn) -> str:
        return self.renderer.turn_text(turn.token_ids)

    def _add_turn(self, ep: _Episode, turn: Turn) -> bool:
        """Add a sampled turn to its episode; True when an environment step should follow."""
        ep.tokens += turn.token_ids
        ep.mask += [True] * len(turn.token_ids)
        ep.logprobs += turn.logprobs
        ep.greedy |= bool(turn.token_ids) and not turn.logprobs
        if turn.versions is not None:
            ep.versions = (ep.versions or []) + list(turn.versions)
        if turn.routed_experts is not None:
            ep.add_routing(turn.routed_experts)
        ep.turns += 1
        ep.budget -= len(turn.token_ids)
        if not self.renderer.closed(turn.token_ids):  # cut at its token limit
            ep.finish = "length"
            return False
        return True

    def _replayed(self, ep: _Episode, outcome: Any) -> None:
        """A rebuilding episode's call answered: checked against the saved answer; the next saved step,
        or the episode goes on as its checkpoint left it; an answer that differs restarts it."""
        r = ep.rebuild
        if r.loading and not outcome.ok:  # its saved state does not load (the environment changed?)
            self._restart(ep, f"did not take its saved state ({outcome.error})")
            return
        if not outcome.ok:  # a failure as in play: the episode fails (its group is generated again)
            self._env_failed(ep, outcome.error)
            return
        env, answer, _, ep.env_state = outcome.value
        want = ep.opening if r.calls == 0 else ep.answers[r.calls - 1][1]
        if not r.loading and (answer if r.calls == 0 else list(answer)) != want:
            where = "its opening" if r.calls == 0 else f"step {r.calls}"
            self._restart(ep, f"answered otherwise than saved at {where} when replayed")
            return
        ep.env, r.calls = env, r.calls + 1
        if not r.loading and r.calls <= len(ep.answers):
            self._call(ep, "step", (ep.env, ep.answers[r.calls - 1][0]))
            return
        ep.rebuild = None
        if r.pending is not None:
            ep.at_env = r.pending
            self._call(ep, "step", (ep.env, r.pending))
        else:
            self._next_turn(ep, r.turn)

    def _restart(self, ep: _Episode, why: str) -> None:
        """A resumed episode whose environment could not be rebuilt as saved: played again from its
        opening (its saved tokens dropped)."""
        self.restarted += 1
        if not self._restart_logged:  # once: the metric counts the rest
            self._restart_logged = True
            self.log(
                f"environment {self.cfg.environment}: resumed episode {ep.label} (task {ep.task!r:.200}) "
                f"{why}; it restarts from its opening (async/episodes_restarted counts these)"
            )
        ep.__dict__.update(_Episode(ep.index, ep.seed, task=ep.task, label=ep.label).__dict__)
        self._call(ep, "reset", dict(ep.task))

    def _env_failed(self, ep: _Episode, error: str) -> None:
        if self.errors_logged < 3:  # the first few, not one line per failed episode
            self.errors_logged += 1
            self.log(f"environment {self.cfg.environment}: episode {ep.index} ended: {error}")
        ep.finish, ep.reward = "env_error", 0.0

    def _observed_outcome(self, ep: _Episode, outcome: Any) -> bool:
        """Apply an environment call's outcome; True when the episode's next turn should be sampled."""
        if not outcome.ok:
            self._env_failed(ep, outcome.error)
            return False
        if not ep.prompt:  # the reset
            ep.env, messages, seconds, ep.env_state = outcome.value
            ep.opening = messages
            ep.env_s += seconds
            ep.prompt = self.renderer.prompt_ids(messages)
            ep.budget = min(self.cfg.max_episode_tokens, self.max_context - len(ep.prompt))
            if ep.budget < 1:
                ep.finish = "length"
                return False
            return True
        ep.env, answer, seconds, ep.env_state = outcome.value
        messages, reward, done, tool_calls, tool_errors = answer
        ep.answers.append([ep.at_env, list(answer)])
        ep.at_env = None
        ep.env_s += seconds
        ep.reward = ep.reward + reward if self.cfg.reward == "sum" else reward
        ep.tool_calls += tool_calls
        ep.tool_errors += tool_errors
        if done:
            ep.finish = "stop"
            return False
        observation = self.renderer.observation_ids(messages)
        # The next turn needs room for its observation and at least one sampled token.
        if ep.turns >= self.cfg.max_turns or len(observation) + 1 > ep.budget:
            ep.finish = "length"
            return False
        ep.tokens += observation
        ep.mask += [False] * len(observation)
        ep.logprobs += [0.0] * len(observation)
        if ep.versions:  # not sampled: no older than the turn they answer
            ep.versions += [ep.versions[-1]] * len(observation)
        ep.budget -= len(observation)
        return True
