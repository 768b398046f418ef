"""Where a run's YAML config comes from: a file, or one of the configs shipped inside the package.

The recipe configs live in the repository's top-level ``configs/`` directory; ``megagrpo/configs`` is a
link to it, so they are package data of ``megagrpo`` (real files in a wheel) and an installed package
finds them without a checkout. ``--config`` takes either a path or the name of a packaged config:

- a path that exists is that file (``configs/deepscaler/8k.yaml``, ``my_run.yaml``);
- otherwise a packaged name, with or without ``.yaml`` (``tiny_cpu``, ``deepscaler/8k``);
- otherwise a :class:`ConfigFileError` naming what was asked for and the packaged names
  (:func:`megagrpo.config.load_config` raises it as a ``ConfigError``).

Nothing of megagrpo is imported here, so ``megagrpo.config`` can import this module.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "DEFAULT_CONFIG_PATH",
    "PACKAGED_CONFIG_DIR",
    "ConfigFileError",
    "packaged_config_names",
    "read_config_file",
    "resolve_config_path",
]

_SUFFIX = ".yaml"

PACKAGED_CONFIG_DIR = Path(str(resources.files("megagrpo").joinpath("configs"))).resolve()
"""The shipped configs (in a checkout, the top-level ``configs/`` directory, through the link)."""

DEFAULT_CONFIG_NAME = "tiny_cpu"
"""The embedded tiny CPU job: what ``load_config(None)`` and a command without ``--config`` run."""

DEFAULT_CONFIG_PATH = PACKAGED_CONFIG_DIR / f"{DEFAULT_CONFIG_NAME}{_SUFFIX}"


class ConfigFileError(ValueError):
    """No config file where one was asked for, or an unreadable one; `source` is the file, if known."""

    def __init__(self, message: str, source: str | None = None):
        self.message = message
        self.source = source
        super().__init__(f"{source}: {message}" if source else message)

    def __reduce__(self):
        return (type(self), (self.message, self.source))


def packaged_config_names() -> list[str]:
    """Names of the shipped configs, sorted: ``["deepscaler/8k", "tiny_cpu"]``."""
    if not PACKAGED_CONFIG_DIR.is_dir():
        return []
    return sorted(
        p.relative_to(PACKAGED_CONFIG_DIR).with_suffix("").as_posix()
        for p in PACKAGED_CONFIG_DIR.rglob(f"*{_SUFFIX}")
        if p.is_file()
    )


def resolve_config_path(spec: str | os.PathLike[str] | None) -> Path:
    """The YAML file `spec` names: an existing path, else a packaged config; None is the default."""
    if spec is None:
        return DEFAULT_CONFIG_PATH
    path = Path(spec)
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigFileError(f"config {os.fspath(spec)!r} is a directory, not a YAML file")
    name = path.as_posix()
    name = name.removesuffix(_SUFFIX)
    names = packaged_config_names()
    if name in names:
        return PACKAGED_CONFIG_DIR / f"{name}{_SUFFIX}"
    where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
    shipped = ", ".join(names) if names else "none found"
    raise ConfigFileError(
        f"config {os.fspath(spec)!r} not found: no such file{where}, and not the name of a packaged "
        f"config ({shipped})"
    )


def read_config_file(spec: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The file `spec` resolves to and its text; an unreadable file is a ConfigError naming it."""
    path = resolve_config_path(spec)
    try:
        return path, path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigFileError(f"cannot read the file: {reason}", str(path)) from None
