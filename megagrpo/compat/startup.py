"""Start-up costs that a process which only moves weights (a conversion or export rank) need not pay.

- ``deferred_compile_import``: Megatron-Core (verified 0.16.1) decorates its fused kernels with
  ``torch.compile`` when imported, which imports dynamo and inductor. If Megatron is first imported
  inside the block, ``torch.compile`` (verified torch 2.13.0) is replaced for the import only, by
  one that compiles each function when it is first called, which a conversion never does. Restored
  when the import is done; modules compiled with it keep their deferred wrapper, which compiles as
  usual if called.
- ``paused_gc``: Python's cyclic garbage collector is off for the block: Megatron's import alone
  leaves ~400K tracked objects that every full collection walks again, and a conversion creates no
  cycles worth collecting. Restored on exit.

Measured (a 600 MB bf16 Qwen2-shaped checkpoint, whole commands, medians of 6 runs paired with the
patch removed, CPU seconds: the two shared cores were too loaded for wall times to mean much, and
both costs are single-threaded, so on a quiet machine they are wall seconds): the deferred compile
saves 1.8 s of ``megagrpo export``'s 7.7 s and 2.4 s of ``tools/convert_hf/hf_to_megatron.py``'s 7.8 s;
the paused collector saves 0.8 s of hf_to_megatron's 6.3 s (0.1 s of export's 5.9 s).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import sys
from collections.abc import Iterator


def compile_on_first_call(compile_fn):
    """A ``torch.compile`` that, given a function, compiles it when it is first called."""

    def deferred(model=None, **options):
        if model is None:  # the decorator form, @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        if not inspect.isfunction(model):
            return compile_fn(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


def deferred_compile_import() -> None:
    """Import Megatron-Core with its ``torch.compile`` decorations deferred to first call (a no-op
    when it is already imported)."""
    if "megatron.core" in sys.modules:
        return
    import torch

    compile_fn = torch.compile
    torch.compile = compile_on_first_call(compile_fn)
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_fn


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def weights_only_process() -> Iterator[None]:
    """Both of the above for the block: GC paused, Megatron imported with compiles deferred."""
    with paused_gc():
        deferred_compile_import()
        yield
