"""What an environment is: one object per episode that opens it and answers each model turn.

    env = Environment(**env.args)          # one per episode, in an environment worker process
    messages = env.reset(task)             # the opening: system/user messages
    step = env.step(turn_text)             # after every model turn: observation, reward, done

``task`` is a dataset row (every field of a ``data.train_path`` record) or one of the class's own
generated tasks (:meth:`Environment.tasks`, used without a dataset). ``turn_text`` is the decoded text of
the tokens the engine sampled for the turn, without its end-of-turn token; the environment never sees
or returns token ids: the episode runner renders its messages with the tokenizer's chat template and
appends their tokens to the episode (``megagrpo.envs.chat``), so the trainer scores exactly the tokens
that were sampled.

The episode's state lives in the object's attributes, and the object is pickled between calls (each call
may run in another worker process): keep it small and picklable. ``reset`` must depend on the task only
(not on randomness of its own), so the G episodes of a group start from the same opening; draw any
randomness from the task. A run resumed from a checkpoint rebuilds an unfinished episode's environment
by a reset and the episode's turns stepped again (``megagrpo.envs.episodes``): an environment whose
``step`` answers a turn the same way every time continues the episode; one whose answers differ (its
own randomness, the clock) restarts it from its opening. An environment that offers its state as plain
data (:meth:`Environment.state_dict`) is instead rebuilt from it (:meth:`Environment.load_state_dict`),
with no replay, whatever its answers.

A call that raises, passes ``env.step_timeout_s`` or kills its worker ends that episode with reward 0
(counted in ``episode/env_errors``); the run goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["OBSERVATION_ROLES", "ArgumentError", "Environment", "Step", "check_messages", "check_plain"]


class ArgumentError(ValueError):
    """An environment argument with a wrong value; the config check reports it as ``env.args.<name>``
    (environments do not import ``megagrpo.config``: it imports them to check them)."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


OBSERVATION_ROLES = ("user", "tool")
"""Roles an environment may answer a turn with (the opening may also have a "system" message)."""


@dataclass(frozen=True)
class Step:
    """An environment's answer to one model turn."""

    messages: list[dict] = field(default_factory=list)
    """The observation: messages with role "tool" or "user" and str content; [] when done."""
    reward: float = 0.0
    """This step's reward (``env.reward``: "final" keeps the last step's, "sum" adds them up)."""
    done: bool = False
    """The episode is over (no further model turn)."""
    tool_calls: int = 0
    """Tool calls the turn made (metrics)."""
    tool_errors: int = 0
    """Of them, calls that were malformed or failed (metrics)."""


class Environment:
    """Subclass it: implement :meth:`reset` and :meth:`step` (and :meth:`tasks` to run without a dataset)."""

    settings: tuple[str, ...] = ()
    """``env`` config keys the constructor also takes, besides ``env.args`` (e.g. "tool_format",
    "allow_unsandboxed")."""
    runs_code = False
    """True for environments that run model-written code: the config check then wants the sandbox
    (``megagrpo.envs.sandbox``) or ``env.allow_unsandboxed``."""

    @classmethod
    def check_args(cls, **args: Any) -> None:
        """Called once when the config loads, with ``env.args`` (their names already matched to the
        constructor's): raise :class:`ArgumentError` ``(name, message)`` for an argument whose value
        is wrong, and the error names ``env.args.<name>``. The default checks nothing."""

    @classmethod
    def tasks(cls, count: int, seed: int, **args: Any) -> list[dict]:
        """``count`` generated tasks, the same for the same seed (training and validation streams use
        seeds far apart). ``args``: ``env.args``. Environments without generated tasks need
        ``data.train_path``."""
        raise NotImplementedError(f"{cls.__name__} generates no tasks: set data.train_path")

    def reset(self, task: dict) -> list[dict]:
        """The opening messages of an episode on ``task`` (system and user messages, str content)."""
        raise NotImplementedError

    def step(self, turn: str) -> Step:
        """Answer one model turn (its text, without the end-of-turn token)."""
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        """Optional: the episode's state as plain data (str, numbers, bools, None, and lists and str-keyed
        dicts of them), kept with an unfinished episode in a checkpoint; a resumed run then builds the
        environment with the same arguments and calls :meth:`load_state_dict` with it, instead of
        replaying the episode's turns. Called after every reset and step: keep it small. None (the
        default): no state offered, a resume replays."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Take the state :meth:`state_dict` returned (on a fresh object, in place of ``reset``)."""
        raise NotImplementedError(f"{type(self).__name__} offers a state_dict but no load_state_dict")


def check_messages(messages: Any, roles: tuple[str, ...], where: str) -> list[dict]:
    """``messages`` as a list of {"role", "content"} dicts with roles from ``roles``; ValueError saying
    what is wrong (``where`` names the call, e.g. "GuessNumber.step")."""
    if not isinstance(messages, list):
        raise ValueError(f"{where} returned {type(messages).__name__}, not a list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in roles:
            raise ValueError(
                f"{where}: message {i} is {m!r}; expected {{'role': one of {roles}, 'content': str}}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_plain(value: Any, where: str) -> Any:
    """``value`` when it is plain data (what a checkpoint's restricted loader reads back); ValueError
    saying where it is not (``where`` names the call, e.g. "GuessNumber.state_dict")."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return value
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} is not a str")
            check_plain(item, f"{where}[{key!r}]")
        return value
    raise ValueError(f"{where} is a {type(value).__name__}: plain data only (str, numbers, lists, dicts)")
