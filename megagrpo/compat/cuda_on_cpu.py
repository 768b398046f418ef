"""Run Megatron-Core unmodified on machines without CUDA (gloo backend).

Verified with torch 2.13.0 and megatron-core 0.16.1. Megatron-Core assumes a CUDA device in a few
dozen places that have nothing to do with the math: it asks for ``torch.cuda.current_device()``,
allocates scratch buffers with ``device="cuda"``, moves tensors with ``.cuda()``, forks the CUDA
RNG for tensor-parallel dropout, and synchronizes streams. On a CPU-only machine every one of those
raises. Rather than patching call sites one by one (there are ~60 in ``pipeline_parallel/``,
``distributed/`` and ``optimizer/`` alone), this module redirects the CUDA surface to the CPU in
one place:

1. A ``TorchFunctionMode`` rewrites any CUDA device argument (``"cuda"``, ``"cuda:N"``,
   ``torch.device("cuda")`` or a bare device index) to ``cpu`` for every torch function and tensor
   method, and turns ``Tensor.cuda()`` / ``Tensor.pin_memory()`` into no-ops. This covers tensor
   factories, ``.to(...)``, ``new_*`` and friends without knowing who calls them.
2. ``torch.cuda`` stream, event, synchronize and NVTX helpers become no-ops: CPU ops execute in
   program order, so there is nothing to wait for.
3. The "CUDA" RNG is the CPU default generator. Megatron's ``CudaRNGStatesTracker`` forks it for
   tensor-parallel regions (dropout inside TP layers must differ per TP rank); mapping the CUDA
   state functions (torch's, and ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` in
   ``megatron.core.tensor_parallel.random``) onto the CPU generator keeps those semantics.
   Megatron's warning that the CPU RNG changed inside a CUDA fork is then expected, and is filtered.
4. Megatron's optimizers (and gradient clipping) dispatch on ``tensor.type()`` strings such as
   ``"torch.cuda.FloatTensor"``; under the mode a CPU tensor reports the CUDA type name, which is
   the same statement as 1. made for type strings: "the CUDA device" is the CPU.
5. The autograd engine runs backward passes without the caller's torch-function modes, so the
   Python ``backward`` of Megatron's autograd functions would see no redirection: sequence
   parallelism's reduce-scatter buffers are allocated there with ``torch.cuda.current_device()``.
   ``torch.autograd.function.BackwardCFunction.apply`` (the engine's entry into a Python
   ``backward``) enters the mode around each call.

Nothing here runs when CUDA is present: ``activate()`` returns ``False`` and changes nothing, so
the GPU path is exactly upstream Megatron. Without CUDA it first checks that every attribute it
replaces (``hooks()``) exists; if one is missing (another torch or Megatron) it raises before
changing anything. Call it once per process, before building models
(``megagrpo.parallel.init_parallel`` does); it stays for the life of the process, since Megatron
allocates CUDA buffers lazily, long after model construction. ``uninstall()`` puts every original
back (and leaves the mode): for tests, and for a process done with Megatron.
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_MISSING = object()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "CUDA device N" to torch; bool is an int subclass but never a device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type:
            return _tensor_type(args, kwargs)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _tensor_type(args: tuple, kwargs: dict) -> Any:
    # Megatron's optimizers dispatch on type strings ("torch.cuda.FloatTensor"): a CPU tensor
    # answers with the CUDA name, and a request to convert to a CUDA type stays on the CPU.
    tensor, *rest = args
    target = rest[0] if rest else kwargs.get("dtype")
    if target is None:
        name = torch.Tensor.type(tensor)
        return name.replace("torch.", "torch.cuda.", 1) if tensor.device.type == "cpu" else name
    if isinstance(target, str):
        target = target.replace("torch.cuda.", "torch.", 1)
    return torch.Tensor.type(tensor, target, *rest[1:], **{k: v for k, v in kwargs.items() if k != "dtype"})


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is already complete when recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: there is one in-order stream on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event or _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _noop_fn(name: str):
    # One function object per patched name: torch._dynamo keeps a map keyed by torch's own
    # functions and rejects one object registered under two names.
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    noop.__name__ = noop.__qualname__ = name
    return noop


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    torch.default_generator.manual_seed(int(seed))


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _python_backward_redirected(self, *args):
    """Item 5 of the module docstring: a Python ``backward`` runs under the redirection too."""
    with _CudaToCpuMode():
        return _installed().backward_apply(self, *args)


def _replacements() -> dict[tuple[Any, str], Any]:
    """(owner, attribute) -> what ``activate`` puts there: every attribute of another library it replaces."""
    from megatron.core.tensor_parallel import random as mcore_random
    from torch.autograd.function import BackwardCFunction

    cuda = torch.cuda
    return {
        (cuda, "current_device"): lambda: 0,
        (cuda, "set_device"): _noop_fn("set_device"),
        (cuda, "synchronize"): _noop_fn("synchronize"),
        (cuda, "empty_cache"): _noop_fn("empty_cache"),
        (cuda, "Stream"): _NullStream,
        (cuda, "Event"): _NullEvent,
        (cuda, "current_stream"): lambda *a, **k: _NullStream(),
        (cuda, "default_stream"): lambda *a, **k: _NullStream(),
        (cuda, "set_stream"): _noop_fn("set_stream"),
        (cuda, "stream"): lambda *a, **k: contextlib.nullcontext(),
        (cuda.nvtx, "range_push"): _noop_fn("nvtx.range_push"),
        (cuda.nvtx, "range_pop"): _noop_fn("nvtx.range_pop"),
        (cuda.nvtx, "range"): lambda *a, **k: contextlib.nullcontext(),
        (cuda, "get_rng_state"): _get_rng_state,
        (cuda.random, "get_rng_state"): _get_rng_state,
        (cuda, "set_rng_state"): _set_rng_state,
        (cuda, "manual_seed"): _manual_seed,
        (cuda, "manual_seed_all"): _noop_fn("manual_seed_all"),
        (mcore_random, "_get_cuda_rng_state"): _get_rng_state,
        (mcore_random, "_set_cuda_rng_state"): _set_rng_state,
        (BackwardCFunction, "apply"): _python_backward_redirected,
    }


def hooks() -> list[str]:
    """The dotted names of every attribute ``activate`` replaces."""
    return [_dotted(owner, name) for owner, name in _replacements()]


def _dotted(owner: Any, name: str) -> str:
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


@dataclass
class _Installed:
    mode: _CudaToCpuMode
    originals: dict[tuple[Any, str], Any]
    """(owner, attribute) -> the owner's own value before ``activate`` (``_MISSING``: inherited)."""
    log_filter: tuple[logging.Logger, logging.Filter]
    backward_apply: Any
    """``BackwardCFunction.apply`` as it was: what the redirected one calls."""


_INSTALLED: _Installed | None = None


def _installed() -> _Installed:
    assert _INSTALLED is not None, "the CUDA -> CPU redirection is not active"
    return _INSTALLED


def is_active() -> bool:
    """True when this process runs Megatron through the CPU redirection."""
    return _INSTALLED is not None


def activate() -> bool:
    """Install the CPU redirection if CUDA is absent. Idempotent; returns whether it is active.

    Raises ``RuntimeError`` (having changed nothing) when an attribute it replaces does not exist."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED is not None:
        return True
    replacements = _replacements()
    missing = [_dotted(owner, name) for owner, name in replacements if not hasattr(owner, name)]
    if missing:
        from megagrpo.compat import installed_version

        raise RuntimeError(
            f"cannot run Megatron-Core without CUDA: {', '.join(missing)} does not exist in torch "
            f"{installed_version('torch')} / megatron-core {installed_version('megatron-core')} "
            "(megagrpo.compat.cuda_on_cpu was verified with torch 2.13.0 and megatron-core 0.16.1)"
        )
    from megatron.core.tensor_parallel import random as mcore_random
    from torch.autograd.function import BackwardCFunction

    originals = {(owner, name): vars(owner).get(name, _MISSING) for owner, name in replacements}
    logger, log_filter = logging.getLogger(mcore_random.__name__), _DropForkWarning()
    _INSTALLED = _Installed(_CudaToCpuMode(), originals, (logger, log_filter), BackwardCFunction.apply)
    for (owner, name), replacement in replacements.items():
        setattr(owner, name, replacement)
    logger.addFilter(log_filter)
    # Entered for the life of the process: Megatron allocates CUDA buffers lazily, long after
    # model construction (DDP buckets, pipeline receive buffers, optimizer state).
    _INSTALLED.mode.__enter__()
    return True


def uninstall() -> None:
    """Undo ``activate``: every replaced attribute is its original object again, the log filter is
    removed and the mode left. A no-op when not active. The mode must be the innermost torch
    function mode (``RuntimeError`` otherwise: one entered since would be left in its place)."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    if torch.overrides._get_current_function_mode() is not _INSTALLED.mode:
        raise RuntimeError(
            "cannot leave the CUDA -> CPU mode: a torch function mode entered after it is open"
        )
    _INSTALLED.mode.__exit__(None, None, None)
    for (owner, name), original in _INSTALLED.originals.items():
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    logger, log_filter = _INSTALLED.log_filter
    logger.removeFilter(log_filter)
    _INSTALLED = None
