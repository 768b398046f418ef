"""Output that is on disk when a conversion says it is done, without waiting for the disk at the end.

A conversion writes gigabytes into the page cache far faster than a disk takes them. Synced only at
the end, every byte's trip to disk would be waited for after the last one is written (for 3 GB on
our machines, an fsync of 0.5-1 s per file). So writeback is started while the data is still being
written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which queues dirty pages for the disk and
returns), and the final fsync only waits for the tail:

- ``start_writeback``: for a writer of our own, every ``WRITEBACK_STEP`` bytes, from a thread of its
  own (``background_writeback``) so that queuing the pages overlaps the writing;
- ``writeback_as_written``: for files other processes write (Megatron's forked checkpoint
  writers), a thread that follows them as they grow;
- ``publish``: the commit, every file and directory of an output synced before it is renamed into
  place. Every writer of the project commits through it: ``atomic_write`` / ``atomic_file`` for a
  file (configs, JSON states, metrics), ``atomic_output_dir`` for a directory built under a
  temporary name (HF exports, conversions), or ``publish`` directly for a directory that several
  ranks write (run and warm-up checkpoints). A crash or kill leaves the previous version or
  nothing at the destination, never a torn file, and a power loss after the commit loses nothing.

Where the system has no ``sync_file_range`` (not Linux) writeback is left to the kernel; the result
is just as durable, only the final fsync waits longer.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

# Dirty bytes written before their writeback is started: large enough that the syscalls cost
# nothing, small enough that the last fsync waits for little.
WRITEBACK_STEP = 64 * 1024**2
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_POLL_S = 0.02


@functools.cache
def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # this process's symbols: libc's
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Queue the dirty pages of ``fd``'s byte range for the disk, without waiting for them.

    False where the system cannot (the data is then written back whenever the kernel chooses).
    """
    fn = _sync_file_range()
    return fn is not None and nbytes > 0 and fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


class WritebackThread:
    """``start_writeback`` calls made by a thread of their own. Queuing dirty pages for the disk
    walks them and builds the I/O requests, CPU work (about a tenth of a second per GB here) that
    this way runs beside the writer instead of between its writes."""

    def __init__(self):
        self._requests: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="writeback", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            start_writeback(*request)
            os.close(request[0])

    def start(self, fd: int, offset: int, nbytes: int) -> None:
        """Queue ``start_writeback(fd, offset, nbytes)``. The request holds a duplicate of ``fd``:
        the writer may close its file at once and go on to the next."""
        if _sync_file_range() is not None:
            self._requests.put((os.dup(fd), offset, nbytes))

    def close(self) -> None:
        """Make every queued request, then end the thread."""
        self._requests.put(None)
        self._thread.join()


@contextlib.contextmanager
def background_writeback() -> Iterator[WritebackThread]:
    """A thread that starts writeback of the ranges given to it (``start``), for one writer."""
    thread = WritebackThread()
    try:
        yield thread
    finally:
        thread.close()


@contextlib.contextmanager
def writeback_as_written(
    directory: Path, suffix: str, step: int = WRITEBACK_STEP
) -> Iterator[dict[str, int]]:
    """Start writeback of the ``*suffix`` files in ``directory`` as other processes write them.

    A thread looks every 20 ms at the files' sizes and queues each new ``step`` of bytes for the
    disk, so the writers' own fsync at the end finds little left to wait for. Yields, per file
    name, the bytes queued so far (complete once the block has exited; empty where the system
    cannot start writeback).
    """
    queued: dict[str, int] = {}
    if _sync_file_range() is None:
        yield queued
        return
    stop = threading.Event()
    fds: dict[str, int] = {}

    def follow() -> None:
        while not stop.wait(_POLL_S):
            try:
                entries = [e for e in os.scandir(directory) if e.name.endswith(suffix)]
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.name not in fds:
                    try:
                        fds[entry.name] = os.open(entry.path, os.O_RDONLY)
                    except FileNotFoundError:
                        continue
                started = queued.get(entry.name, 0)
                size = os.fstat(fds[entry.name]).st_size
                if size - started >= step and start_writeback(fds[entry.name], started, size - started):
                    queued[entry.name] = size

    thread = threading.Thread(target=follow, name="writeback", daemon=True)
    thread.start()
    try:
        yield queued
    finally:
        stop.set()
        thread.join()
        for fd in fds.values():
            os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory under it and ``root``, inner ones first."""
    dirs = []
    for here, _, files in os.walk(root):
        dirs.append(here)
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for here in reversed(dirs):
        fsync_dir(Path(here))


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> Path:
    """Sync ``tmp`` (a file, or a directory and everything under it) and rename it to ``final``,
    replacing what is there, then sync the rename. The one commit of every writer here."""
    tmp, final = Path(tmp), Path(final)
    if tmp.is_dir():
        fsync_tree(tmp)
        if final.is_dir():  # os.replace does not replace a non-empty directory
            shutil.rmtree(final)
    else:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """A file opened for writing under a temporary name beside ``path`` and published there
    (``publish``) when the block completes; removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; outputs are read like any other file
        with os.fdopen(fd, mode) as fh:
            yield fh
        publish(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably (``atomic_file``)."""
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)
    return Path(path)


@contextlib.contextmanager
def atomic_output_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; publish it as ``out`` only if the block completes.

    A crash or kill leaves at most a ``.<name>.tmp-<pid>`` directory, never a directory at ``out``;
    and what is renamed to ``out`` is on disk first (every file and directory fsync'd), so not even
    a power loss leaves a directory at ``out`` with missing or zeroed data.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: output directory already exists; remove it or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out)
