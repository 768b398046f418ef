"""Megatron-Core's torch_dist checkpoint writer (``dist_checkpointing.strategies.filesystem_async``).

Verified with megatron-core 0.16.1.

- ``writers_open_with``: the writer processes (forked during a save, so they inherit the patch)
  open each file with the builtin ``open(name, "wb")``; a module-level ``open`` in
  ``filesystem_async`` shadows it, so a checkpoint writer can be handed a file of ours (one that
  copies mapped weights file to file). Reason: a conversion's weights need never pass through a
  process. Restored on exit; where the module already defines ``open`` (another Megatron version),
  nothing is patched and ``writers_can_open_with`` says so.
- ``in_process_results_queue``: the writer's results queue is a ``multiprocessing.Manager`` in a
  spawned Python process (~1.5 s to start on two cores), there so that an asynchronous save's proxy
  process can report back; a synchronous save runs the writers' coordinator in this process, so a
  plain queue carries the results. Restored on exit; left alone where the module has no
  ``_results_queue`` slot or it is already set.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Iterator


def _module():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async


def writers_can_open_with() -> bool:
    """Whether ``writers_open_with`` can take effect with this Megatron version."""
    return "open" not in vars(_module())


@contextlib.contextmanager
def writers_open_with(opener: Callable) -> Iterator[bool]:
    """Megatron's checkpoint writers call ``opener`` where they call ``open``; yields whether the
    patch is in effect."""
    module = _module()
    if not writers_can_open_with():
        yield False
        return
    module.open = opener
    try:
        yield True
    finally:
        del module.open


@contextlib.contextmanager
def in_process_results_queue() -> Iterator[None]:
    """A synchronous save's writer results go through an in-process queue (no spawned Manager)."""
    module = _module()
    swap = getattr(module, "_results_queue", False) is None
    if swap:
        module._results_queue = queue.Queue()
    try:
        yield
    finally:
        if swap:
            module._results_queue = None
