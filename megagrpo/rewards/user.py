"""User reward functions named by ``reward.function``: ``"package.module:function"`` or
``"path/to/file.py:function"``.

The function is called as ``function(response: str, answer: str) -> float`` (a bool or int is taken as
its float) in the reward pool's worker processes, under the same deadline as math-verify. The config
loads it once, at load (:func:`check_function`), so a missing module, file or name, or an object that is
not a two-argument callable, is a ConfigError naming ``reward.function`` before anything starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

__all__ = ["check_function", "load_function", "resolve_spec"]


def _split(spec: str) -> tuple[str, str]:
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{spec!r} is not 'package.module:function' or 'path/to/file.py:function'")
    return target, name


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target


def resolve_spec(spec: str) -> str:
    """``spec`` with a file path made absolute (relative paths are relative to the working directory
    of the process that loads the config), so worker processes find the same file."""
    target, name = _split(spec)
    if _is_path(target):
        return f"{Path(target).expanduser().absolute()}:{name}"
    return spec


def load_function(spec: str) -> Callable:
    """The object ``spec`` names; ValueError saying what is missing."""
    target, name = _split(spec)
    if _is_path(target):
        path = Path(target).expanduser().absolute()
        if not path.is_file():
            raise ValueError(f"file {str(path)!r} does not exist")
        module_name = f"megagrpo_user_reward_{zlib.crc32(str(path).encode()):08x}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            raise ValueError(f"module {target!r} cannot be imported: {err}") from None
    if not hasattr(module, name):
        raise ValueError(f"{target!r} has no attribute {name!r}")
    return getattr(module, name)


def check_function(spec: str) -> None:
    """Load ``spec`` and check that it takes (response, answer); ValueError otherwise."""
    try:
        fn = load_function(spec)
    except ValueError:
        raise
    except Exception as err:  # the user's module raised while being imported
        raise ValueError(f"loading {spec!r} raised {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise ValueError(f"{spec!r} is a {type(fn).__name__}, not callable")
    try:
        inspect.signature(fn).bind("response", "answer")
    except TypeError as err:
        raise ValueError(f"{spec!r} must accept (response, answer): {err}") from None
    except ValueError:
        pass  # a builtin without a signature: it is called and its errors counted
