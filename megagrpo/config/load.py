"""Reading a run configuration: YAML, dotted overrides, strict type checks; and writing it back.

:func:`load_config` reads a YAML file (one section per component of :class:`~megagrpo.config.schema.Config`),
applies command-line overrides with dotted keys (``grpo.num_generations=8``), builds the config, decides
its ``auto`` values (:func:`~megagrpo.config.resolution.resolve`) and validates it for the command about
to run (:func:`~megagrpo.config.rules.validate`). Unknown keys, wrong types and inconsistent settings raise
:class:`~megagrpo.config.errors.ConfigError`, whose message names the dotted key at fault and the file it
came from; values are checked for their type here (ints widen to float, nothing else is converted), for
their range by the sections as they are built, and across sections by the validation. Paths are only
checked for type; they are opened (and fail) where they are used.
"""

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from megagrpo import config_files
from megagrpo.config.errors import ConfigError, join
from megagrpo.config.resolution import resolve
from megagrpo.config.rules import Trainer, validate
from megagrpo.config.schema import Config, key_fields
from megagrpo.config.yaml_text import read_yaml

__all__ = ["DEFAULT_CONFIG_PATH", "config_to_dict", "load_config", "save_config"]

# The default file and --config's names are found by megagrpo.config_files (package data, not the checkout).
DEFAULT_CONFIG_PATH = config_files.DEFAULT_CONFIG_PATH
"""The tiny CPU config, used when no file is given."""

_RENAMED = {"generation.backend": "generation.engine"}
"""Keys that were renamed: a config still using the old name is told the new one."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return tp.__name__


def _value_desc(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints are widened to float, nothing else is converted."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            try:
                return _coerce(options[0], value, key)
            except ConfigError as e:
                if e.keys != (key,):
                    raise  # An error inside a nested mapping is more precise than "expected X or null".
        else:
            for option in options:
                try:
                    return _coerce(option, value, key)
                except ConfigError:
                    pass
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_value_desc(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_value_desc(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return _from_dict(tp, value, key)
    if tp is dict:
        return _mapping_leaf(value, key)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }
    assert tp in ok, f"config annotation {tp!r} of {key} is not supported by _coerce"
    if not ok[tp](value):
        raise ConfigError(key, f"expected {_type_name(tp)}, got {_value_desc(value)}")
    return float(value) if tp is float else value


def _mapping_leaf(value: Any, key: str) -> dict:
    """A ``dict`` key (e.g. ``env.args``): a mapping of names to YAML scalars and lists of them."""
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {_value_desc(value)}")

    def plain(v: Any) -> bool:
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str))

    for name, item in value.items():
        if not isinstance(name, str) or not plain(item):
            raise ConfigError(join(key, str(name)), f"expected a scalar or a list, got {_value_desc(item)}")
    return dict(value)


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, strictly: unknown keys, missing keys and wrong types raise."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix, f"expected a mapping of {cls.__name__} fields, got {_value_desc(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in key_fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key in getattr(cls, "REPLACED_KEYS", {}):
            raise ConfigError(join(prefix, str(key)), f"no longer a key: {cls.REPLACED_KEYS[key]}")
        if key not in fields:
            where = join(prefix, str(key))
            if where in _RENAMED:
                raise ConfigError(where, f"renamed to {_RENAMED[where]}")
            close = difflib.get_close_matches(str(key), list(fields), n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(join(prefix, str(key)), f"unknown key in {cls.__name__}{hint}")
        kwargs[key] = _coerce(hints[key], value, join(prefix, key))
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(join(prefix, name), "required but missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.with_context(prefix) from None


def _apply_override(data: dict, override: str) -> str:
    """Set `a.b.c=value` in the nested dict `data`; returns the dotted key."""
    key, sep, text = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or not all(parts):
        raise ConfigError((), f"malformed override {override!r}: expected section.key=value")
    sections = {f.name for f in key_fields(Config)}
    if parts[0] not in sections:
        close = difflib.get_close_matches(parts[0], sorted(sections), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(parts[0], f"unknown section in override {override!r}{hint}")
    try:
        value = read_yaml(text, key=key)
    except yaml.YAMLError:
        value = text  # e.g. an unquoted path with odd characters; the type check still applies.
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                ".".join(parts[: i + 1]),
                f"is {_value_desc(child)}, so override {override!r} cannot set a key inside it",
            )
        node = child
    node[parts[-1]] = value
    return key


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, trainer: Trainer = "grpo"
) -> Config:
    """Read a YAML config (None: the tiny CPU default), apply `section.key=value` overrides, decide its
    ``auto`` values here (``cfg.resolved``) and validate it for ``trainer`` (the command about to run:
    "grpo", "sft", "dpo", "eval" or "warmup")."""
    try:
        path, text = config_files.read_config_file(path)
    except config_files.ConfigFileError as e:
        raise ConfigError((), e.message, e.source) from None
    source = str(path)
    try:
        data = read_yaml(text, source)  # duplicate keys and alias bombs are ConfigErrors naming the key
    except yaml.YAMLError as e:
        raise ConfigError((), f"invalid YAML: {e}", source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError((), f"top level must be a mapping of sections, got {_value_desc(data)}", source)
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'section.key=value' strings, not a single string")
    overridden = []
    for override in overrides:
        try:
            overridden.append(_apply_override(data, override))
        except ConfigError as e:
            raise e.with_context(source=source) from None
    try:
        cfg = resolve(_from_dict(Config, data, ""))
        validate(cfg, trainer)
        return cfg
    except ConfigError as e:
        hit = [o for o in overridden if any(k == o or k.startswith(o + ".") for k in e.keys)]
        note = f" (set by override {', '.join(hit)})" if hit else ""
        raise e.with_context(source=source, note=note) from None


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of `cfg`'s keys (YAML-safe; feeds back into load_config unchanged).

    The ``auto`` decisions (``cfg.resolved``) are not keys and are left out: the process that loads the
    dict decides them again.
    """
    return _keys_of(cfg)


def _keys_of(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _keys_of(getattr(value, f.name)) for f in key_fields(type(value))}
    if isinstance(value, dict):
        return dict(value)
    return value  # a bool, int, float, str or None (the other leaf types the schema allows)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML, atomically and durably (``megagrpo.ckpt.durable.atomic_file``)."""
    from megagrpo.ckpt.durable import atomic_file

    with atomic_file(path) as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)
