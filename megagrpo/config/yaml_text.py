"""YAML as megagrpo reads it (config files, overrides, a finished run's saved config): PyYAML's safe loader
plus three checks on the composed document before any value is built from it.

- A key given twice in one mapping is refused naming the key and both lines (YAML itself keeps the last
  one silently: an edited ``lr`` that does not take effect).
- Aliases (``*name``) may not expand the document past :data:`MAX_VALUES` values: a few lines of nested
  aliases (the "billion laughs") make a structure of 10^9 values that anything walking it (the config's
  type checks, a dump, a copy) never finishes. The expanded size is counted on the composed nodes, each
  once, so the check itself is linear in the text.
- A mapping or list that contains itself through an alias is refused.

Errors are :class:`~megagrpo.config.errors.ConfigError` naming the dotted key and the file.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from megagrpo.config.errors import ConfigError, join

__all__ = ["MAX_VALUES", "Loader", "read_yaml"]

MAX_VALUES = 100_000
"""Most values (mappings, lists and scalars, counted after expanding aliases) a YAML document may hold; a
run's config holds a few hundred."""

_MERGE = "tag:yaml.org,2002:merge"


class Loader(yaml.SafeLoader):
    """safe_load, plus YAML 1.2 floats: PyYAML reads `1e-6` (no dot) as a string, a classic lr trap."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(text: str, source: str | None = None, *, key: str = "") -> Any:
    """The value of a YAML document (None when empty); ``key`` is the dotted key the document is the value
    of (an override's), for the errors. yaml.YAMLError when it is not YAML; ConfigError when it repeats a
    key, expands past MAX_VALUES or contains itself."""
    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_keys(node, key, source, set())
        _check_size(node, key, source)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(key or (), "YAML nested too deeply to read", source) from None
    finally:
        loader.dispose()


def _children(node: yaml.Node) -> list[tuple[str | None, yaml.Node]]:
    """(key name or None, node) of each value a collection node holds (a mapping's keys included)."""
    if isinstance(node, yaml.MappingNode):
        out = []
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE else None
            out += [(None, k), (name, v)]
        return out
    if isinstance(node, yaml.SequenceNode):
        return [(None, item) for item in node.value]
    return []


def _check_keys(node: yaml.Node, path: str, source: str | None, seen: set[int]) -> None:
    if id(node) in seen:  # an alias of a node checked already (or being checked: see _check_size)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for k, _ in node.value:
            if not isinstance(k, yaml.ScalarNode) or k.tag == _MERGE:
                continue
            line = k.start_mark.line + 1
            if k.value in lines:
                raise ConfigError(
                    join(path, k.value),
                    f"duplicate key (lines {lines[k.value]} and {line}): YAML would keep the last one "
                    "silently; remove one",
                    source,
                )
            lines[k.value] = line
    for name, child in _children(node):
        _check_keys(child, join(path, name) if name is not None else path, source, seen)


def _check_size(root: yaml.Node, path: str, source: str | None) -> None:
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node, where: str) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in active:
            raise ConfigError(where or (), "contains itself through a YAML alias", source)
        active.add(id(node))
        total = 1 + sum(size(c, join(where, n) if n is not None else where) for n, c in _children(node))
        active.discard(id(node))
        sizes[id(node)] = total
        return total

    if size(root, path) <= MAX_VALUES:
        return
    # Name the deepest key whose value alone is past the limit (the alias bomb, not its section).
    node, where = root, path
    while True:
        big = [(n, c) for n, c in _children(node) if n is not None and sizes[id(c)] > MAX_VALUES]
        if not big:
            break
        name, node = big[0]
        where = join(where, name)
    raise ConfigError(
        where or (),
        f"expands to {sizes[id(node)]:,} values through YAML aliases (*name); a config holds at most "
        f"{MAX_VALUES:,}",
        source,
    )
