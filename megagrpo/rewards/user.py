"""User reward functions named by ``reward.function``: ``"package.module:function"`` or
``"path/to/file.py:function"``.

The function is called as ``function(response: str, answer: str) -> float`` (a bool or int is taken as
its float) in the reward pool's worker processes, under the same deadline as math-verify. The config
loads it once, at load (:func:`check_function`), so a missing module, file or name, or an object that is
not a two-argument callable, is a ConfigError naming ``reward.function`` before anything starts.

User code is first imported in a child process (:func:`check_in_child`): a fresh interpreter with this
one's ``sys.path`` and working directory, given a deadline. A module that raises, calls ``sys.exit`` or
``os._exit``, or does not finish importing in time is then refused naming the module, and the process that
loads the config (``megagrpo plan``, ``train``, ``eval``) never runs it. The later imports in process (the
driver's environment tasks, the pool's workers) are of a module that has imported cleanly once; they still
turn a ``sys.exit`` at import into a ValueError naming the module (:func:`load_function`). megagrpo's own
modules (the built-in rewards and environments) are checked in process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

__all__ = ["check_callable", "check_function", "check_in_child", "load_function", "resolve_spec"]


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
    """The object ``spec`` names; ValueError saying what is missing, or that its module called
    ``sys.exit`` while being imported."""
    target, name = _split(spec)
    try:
        module = _import(target)
    except SystemExit as err:
        raise ValueError(f"importing {target!r} called sys.exit({err.code!r})") from None
    if not hasattr(module, name):
        raise ValueError(f"{target!r} has no attribute {name!r}")
    return getattr(module, name)


def _import(target: str):
    if not _is_path(target):
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as err:
            raise ValueError(f"module {target!r} cannot be imported: {err}") from None
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
    return module


def check_function(spec: str, deadline_s: float = 120.0) -> None:
    """Load ``spec`` (in a child process within ``deadline_s`` unless it is megagrpo's own) and check
    that it takes (response, answer); ValueError otherwise."""
    check_in_child(spec, "megagrpo.rewards.user:check_callable", deadline_s, "reward.import_timeout_s")


def check_callable(spec: str) -> None:
    """Load ``spec`` in this process and check that it takes (response, answer); ValueError otherwise."""
    fn = load_function(spec)
    if not callable(fn):
        raise ValueError(f"{spec!r} is a {type(fn).__name__}, not callable")
    try:
        inspect.signature(fn).bind("response", "answer")
    except TypeError as err:
        raise ValueError(f"{spec!r} must accept (response, answer): {err}") from None
    except ValueError:
        pass  # a builtin without a signature: it is called and its errors counted


def check_in_child(spec: str, check: str, deadline_s: float, deadline_key: str) -> Any:
    """``check(spec)`` (``check``: a "module:function" of megagrpo returning plain data) run in a child
    process that imports the user's module, killed at ``deadline_s``; its value. ValueError naming the
    module when the import or the check raises, exits or passes the deadline. The deadline starts once the
    child has started (its interpreter and megagrpo's modules loaded), so a busy machine does not charge
    the user's module for them. A spec of megagrpo's own modules is checked in this process."""
    target, _ = _split(spec)
    if not _is_path(target) and target.split(".")[0] == "megagrpo":
        return _run_check(spec, check)
    read, write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(write), json.dumps([spec, check, sys.path])],
        pass_fds=(write,),
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: what the module started goes with it
    )
    os.close(write)  # the child holds the only writer: its end is EOF here
    answers = Connection(read, writable=False)
    try:
        late = f"the process importing {target!r} did not start within {_START_LIMIT_S:g} s"
        kind, value = _answer(answers, child, _START_LIMIT_S, late, target)
        if kind == "started":
            late = (
                f"importing {target!r} did not finish within {deadline_s:g} s ({deadline_key}): does it run, "
                "wait or loop at import?"
            )
            kind, value = _answer(answers, child, deadline_s, late, target)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # the child (ended or not) and anything it started
        child.wait()
        answers.close()
    if kind != "ok":
        raise ValueError(value)
    return value


_START_LIMIT_S = 120.0
"""How long a checking child may take to start (a fresh interpreter importing megagrpo's modules)."""


def _answer(conn: Connection, child: subprocess.Popen, timeout_s: float, late: str, target: str) -> tuple:
    """The child's next message, or ValueError ``late`` after ``timeout_s``, or one saying it died."""
    if not conn.poll(timeout_s):
        raise ValueError(late)
    try:
        return conn.recv()
    except EOFError:
        raise ValueError(
            f"the process importing {target!r} ended with exit status {child.wait()} and no answer "
            "(os._exit or a crash at import)"
        ) from None


# A fresh interpreter (not multiprocessing's spawn, which imports the caller's __main__ again: a script
# that loads a config at top level would recurse) with this process's sys.path; cwd and environment are
# inherited.
_CHILD = (
    "import json, sys; spec, check, path = json.loads(sys.argv[2]); sys.path[:] = path; "
    "from megagrpo.rewards.user import _child_check; _child_check(int(sys.argv[1]), spec, check)"
)


def _run_check(spec: str, check: str) -> Any:
    try:
        return load_function(check)(spec)
    except ValueError:
        raise
    except Exception as err:  # the user's module raised while being imported
        raise ValueError(f"loading {spec!r} raised {type(err).__name__}: {err}") from None


def _child_check(fd: int, spec: str, check: str) -> None:
    """The child of :func:`check_in_child`: ("started", None) once megagrpo's check is loaded, then ("ok",
    value) or ("error", message) on the pipe ``fd``; then the process ends at once (a thread the user's
    module started does not keep it)."""
    conn = Connection(fd, readable=False)
    try:
        load_function(check)  # megagrpo's own module, imported before the user's module's clock starts
        conn.send(("started", None))
        reply = ("ok", _run_check(spec, check))
    except ValueError as err:
        reply = ("error", str(err))
    except BaseException as err:  # SystemExit is turned into ValueError already; KeyboardInterrupt, ...
        reply = ("error", f"loading {spec!r} raised {type(err).__name__}: {err}")
    try:
        conn.send(reply)
    except Exception as err:  # the check's value does not pickle: a megagrpo bug, said plainly
        conn.send(("error", f"checking {spec!r} gave an answer that cannot be sent back: {err}"))
    conn.close()
    sys.stdout.flush()
    os._exit(0)
