"""Config checks that load the user's code (an environment class, a reward function), each in a child
process with a deadline first; part of :func:`megagrpo.config.rules.validate`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megagrpo.config.errors import ConfigError, require

if TYPE_CHECKING:
    from megagrpo.config.schema import Config

__all__ = ["check_env", "check_reward"]


def check_env(cfg: Config) -> None:
    """Multi-turn episodes: the environment class imports and is an Environment, the tool-call format is
    known, an episode fits the context, a code-running environment has its sandbox (or is allowed to run
    without one)."""
    env = cfg.env
    if not env.enabled:
        return
    from megagrpo.envs.chat import TOOL_CALL_FORMATS
    from megagrpo.envs.runner import check_environment, load_environment

    try:  # the user's module is imported in a child process with a deadline (megagrpo.rewards.user)
        traits = check_environment(env.spec, env.import_timeout_s)
        cls = load_environment(env.spec)  # it imported cleanly there: its arguments are checked here
    except ValueError as err:
        raise ConfigError("env.environment", str(err)) from None
    _check_env_args(cls, env.args, cls.settings)
    require(
        env.tool_format in TOOL_CALL_FORMATS,
        "env.tool_format",
        f"{env.tool_format!r} is not one of {', '.join(TOOL_CALL_FORMATS)}",
    )
    seq = cfg.model.seq_length
    require(
        env.max_episode_tokens < seq,
        ("env.max_episode_tokens", "model.seq_length"),
        f"max_episode_tokens {env.max_episode_tokens} leaves no room for an opening in seq_length {seq}",
    )
    if traits["runs_code"] and not env.allow_unsandboxed:
        from megagrpo.envs.sandbox import sandbox_problem

        problem = sandbox_problem()
        require(
            problem is None,
            ("env.environment", "env.allow_unsandboxed"),
            f"{env.environment} runs model-written code and the sandbox cannot run here ({problem}); install "
            "bubblewrap (apt-get install bubblewrap) or set env.allow_unsandboxed=true to run it with "
            "resource limits only",
        )


def _check_env_args(cls: type, args: dict, settings: tuple[str, ...]) -> None:
    """``env.args`` are arguments the environment's constructor takes, and its ``check_args`` accepts
    their values; each error names the argument."""
    import difflib
    import inspect

    params = inspect.signature(cls).parameters
    named = [p for p in params if params[p].kind in (params[p].KEYWORD_ONLY, params[p].POSITIONAL_OR_KEYWORD)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key in args:
        if key in settings:
            raise ConfigError(f"env.args.{key}", f"is set by env.{key}, not env.args")
        if key not in named and not takes_any:
            close = difflib.get_close_matches(str(key), named, n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            accepted = ", ".join(p for p in named if p not in settings)
            raise ConfigError(
                f"env.args.{key}", f"{cls.__name__} takes no such argument{hint} (it takes: {accepted})"
            )
    from megagrpo.envs.base import ArgumentError

    try:
        cls.check_args(**args)
    except ArgumentError as err:
        raise ConfigError(f"env.args.{err.name}", err.message) from None


def check_reward(cfg: Config) -> None:
    """Import the user's reward function (kind python) and check that it takes (response, answer)."""
    if cfg.reward.kind != "python":
        return
    from megagrpo.rewards.user import check_function

    try:
        check_function(cfg.reward.function, cfg.reward.import_timeout_s)  # in a child, with a deadline
    except ValueError as err:
        raise ConfigError("reward.function", str(err)) from None
