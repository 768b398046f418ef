"""ConfigError, and the small helpers the schema and the rules raise it with."""

from collections.abc import Sequence

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the dotted key(s) and the source."""

    def __init__(self, keys: str | Sequence[str], message: str, source: str | None = None):
        self.keys: tuple[str, ...] = (keys,) if isinstance(keys, str) else tuple(keys)
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        what = f"{', '.join(self.keys)}: " if self.keys else ""
        super().__init__(f"{where}{what}{message}")

    def __reduce__(self):
        # The default pickling replays __init__ with the formatted string; Ray pickles exceptions.
        return (type(self), (self.keys, self.message, self.source))

    def with_context(self, prefix: str = "", source: str | None = None, note: str = "") -> "ConfigError":
        """The same error with keys under `prefix`, attributed to `source`, with `note` appended."""
        keys = tuple(join(prefix, k) for k in self.keys)
        return ConfigError(keys, self.message + note, source if source is not None else self.source)


def join(prefix: str, key: str) -> str:
    """`prefix.key`, or `key` at the top level."""
    return f"{prefix}.{key}" if prefix else key


def require(ok: bool, keys: str | Sequence[str], message: str) -> None:
    """Raise ConfigError naming `keys` with `message` unless `ok`."""
    if not ok:
        raise ConfigError(keys, message)


def check(obj: object, name: str, ok: bool, rule: str) -> None:
    """Raise ConfigError naming field `name` of `obj` unless `ok`; `rule` says what is allowed."""
    if not ok:
        raise ConfigError(name, f"must be {rule}, got {getattr(obj, name)!r}")


def positive(obj: object, *names: str) -> None:
    """Each named integer field of `obj` must be >= 1."""
    for name in names:
        check(obj, name, getattr(obj, name) >= 1, ">= 1")
