"""What an environment worker process runs (``megagrpo.rewards.pool.DeadlinePool`` with
``megagrpo.envs.runner:env_call``): one reset or step of one episode's environment.

The environment object travels pickled, as bytes, both ways: a worker loads the user's class itself
(``env.environment``) before unpickling, and the engine process that runs the episodes never imports it.
Replies are plain data (lists, dicts, numbers), so nothing of the user's module crosses back either.
"""

from __future__ import annotations

import math
import pickle
import time
from typing import Any

from megagrpo.envs.base import OBSERVATION_ROLES, Environment, Step, check_messages, check_plain
from megagrpo.rewards.user import check_in_child, load_function

__all__ = ["check_environment", "env_call", "environment_traits", "load_environment"]


def load_environment(spec: str) -> type[Environment]:
    """The environment class ``spec`` names; ValueError when it is not an Environment subclass."""
    cls = load_function(spec)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{spec!r} is not a subclass of megagrpo.envs.base.Environment")
    return cls


def check_environment(spec: str, deadline_s: float) -> dict:
    """:func:`environment_traits` of ``spec``, the user's module imported in a child process within
    ``deadline_s`` (``megagrpo.rewards.user.check_in_child``); ValueError naming the module otherwise."""
    return check_in_child(spec, "megagrpo.envs.runner:environment_traits", deadline_s, "env.import_timeout_s")


def environment_traits(spec: str) -> dict:
    """What the config's checks need of an environment class, as plain data (it crosses from a child)."""
    return {"runs_code": bool(getattr(load_environment(spec), "runs_code", False))}


def env_call(spec: str, args: dict, op: str, payload: Any, options: dict | None = None) -> tuple:
    """``op`` "reset" (payload: the task): (pickled env, opening messages, seconds, state);
    "step" (payload: (pickled env, turn text)): (pickled env, (messages, reward, done, tool calls,
    tool errors), seconds, state); "load" (payload: a state): (pickled env, None, seconds, state).
    ``state``: the environment's ``state_dict()`` after the call (None: it offers none). Raises on a bad
    answer of the environment (the episode then ends). ``options``: the ``env`` settings an environment
    class may ask for (``Environment.settings``)."""
    cls = load_environment(spec)
    start = time.perf_counter()
    if op in ("reset", "load"):
        wanted = {k: v for k, v in (options or {}).items() if k in cls.settings}
        env = cls(**args, **wanted)
        if op == "load":
            env.load_state_dict(payload)
            return pickle.dumps(env), None, time.perf_counter() - start, _state(env, cls)
        messages = check_messages(env.reset(payload), ("system", *OBSERVATION_ROLES), f"{cls.__name__}.reset")
        if not messages:
            raise ValueError(f"{cls.__name__}.reset returned no messages")
        return pickle.dumps(env), messages, time.perf_counter() - start, _state(env, cls)
    blob, turn = payload
    env = pickle.loads(blob)
    step = env.step(turn)
    if not isinstance(step, Step):
        raise ValueError(f"{cls.__name__}.step returned {type(step).__name__}, not megagrpo.envs.base.Step")
    messages = check_messages(list(step.messages), OBSERVATION_ROLES, f"{cls.__name__}.step")
    reward = float(step.reward)
    if not math.isfinite(reward):
        raise ValueError(f"{cls.__name__}.step returned a non-finite reward {step.reward!r}")
    if not step.done and not messages:
        raise ValueError(f"{cls.__name__}.step returned no observation for an episode that goes on")
    answer = (messages, reward, bool(step.done), int(step.tool_calls), int(step.tool_errors))
    return pickle.dumps(env), answer, time.perf_counter() - start, _state(env, cls)


def _state(env: Environment, cls: type) -> dict | None:
    """The environment's offered state (``Environment.state_dict``), checked to be plain data."""
    state = env.state_dict()
    if state is not None and not isinstance(state, dict):
        raise ValueError(f"{cls.__name__}.state_dict returned {type(state).__name__}, not a dict or None")
    return check_plain(state, f"{cls.__name__}.state_dict")
