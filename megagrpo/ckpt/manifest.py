"""Checkpoint manifests: every file of a checkpoint with its size and xxh3-64 checksum, written last.

``manifest.json`` lists each file of a checkpoint directory (paths relative to it) with its size
and its xxh3-64 digest (xxHash's 64-bit XXH3, ~25 GB/s on one core here: a digest costs far less
than the disk write it covers). It is the last file written before the directory is published, so
a checkpoint with a manifest was written completely; ``verify`` re-reads every listed file and
names the first one whose size or checksum differs (a truncated shard, a bit flip, a file missing).

Digests are computed while the bytes are written where the writer lets us see them: Megatron's
checkpoint writers (forked processes) write through ``HashingWriter``s that report to a
``DigestCollector`` in the process that forked them; files written any other way (small JSON and
metadata files) are read back once when the manifest is built.

Any trainer that checkpoints through ``megagrpo.ckpt.run`` gets a manifest with its checkpoints
(``run.commit``) and verified resumes (``run.latest_verified``); ``megagrpo export`` verifies a
checkpoint that has one.
"""

from __future__ import annotations

import io
import json
import mmap
import multiprocessing
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from megagrpo.ckpt import CheckpointError
from megagrpo.ckpt.durable import atomic_write

MANIFEST_NAME = "manifest.json"
ALGORITHM = "xxh3_64"
FORMAT_VERSION = 1
_THREADS = 4  # xxhash and file reads release the GIL: a few files are digested at once


@dataclass(frozen=True)
class FileDigest:
    size: int
    """Bytes in the file."""
    xxh3_64: str
    """xxh3-64 digest of the file's bytes, 16 hex digits."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint that fails verification: ``file`` (relative to ``ckpt``) failed ``check``."""

    def __init__(self, ckpt: Path, file: str, check: str):
        self.ckpt, self.file, self.check = Path(ckpt), file, check
        super().__init__(f"{self.ckpt / file}: {check}")

    def __reduce__(self):
        return (type(self), (self.ckpt, self.file, self.check))


# ------------------------------------------------------------------------------ digests as written


class HashingWriter(io.FileIO):
    """A file opened for writing that digests the bytes written to it and, when closed, reports
    ``(absolute path, FileDigest)`` to ``report``. A writer that seeks back (rewriting bytes) makes
    the digest unknown: nothing is reported and the file is read back instead.

    A write that fails (a full disk) fails again at ``close``: ``torch.save`` turns its writer's
    error into one of its own that no longer says why ("unexpected pos 576 vs 534"), and a file
    closed as its ``with`` block unwinds then raises the OS error in its place."""

    def __init__(self, path: str | os.PathLike, report: Callable[[str, FileDigest], None]):
        super().__init__(path, "wb")
        self._path = os.path.abspath(path)
        self._report = report
        self._hash = xxhash.xxh3_64()
        self._size = 0
        self._sequential = True
        self._failed: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = 0
        while written < view.nbytes:  # whole writes: a writer such as torch.save ignores short counts
            try:
                written += super().write(view[written:])
            except OSError as err:
                self._failed = self._failed or OSError(err.errno, err.strerror, self._path)
                raise
        self._hash.update(view)
        self._size += view.nbytes
        return view.nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = super().seek(offset, whence)
        if position != self._size:
            self._sequential = False
        return position

    def close(self) -> None:
        failed, self._failed = self._failed, None
        if not self.closed and self._sequential and failed is None:
            self._report(self._path, FileDigest(self._size, self._hash.hexdigest()))
        super().close()
        if failed is not None:
            raise failed


class DigestCollector:
    """Digests reported by ``HashingWriter``s in this process or in processes forked from it
    (Megatron's checkpoint writers), by absolute path. A thread of this process reads the reports
    as they arrive, so a writer never blocks on a full pipe."""

    def __init__(self):
        self._queue = multiprocessing.get_context("fork").SimpleQueue()
        self.digests: dict[str, FileDigest] = {}
        self._thread = threading.Thread(target=self._drain, name="digests", daemon=True)
        self._thread.start()

    def report(self, path: str, digest: FileDigest) -> None:
        self._queue.put((path, digest.size, digest.xxh3_64))

    def writer(self, path: str | os.PathLike) -> io.BufferedWriter:
        """``open(path, "wb")`` whose bytes are digested as written."""
        return io.BufferedWriter(HashingWriter(path, self.report))

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            path, size, digest = item
            self.digests[path] = FileDigest(size, digest)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._queue.close()

    def under(self, root: Path) -> dict[str, FileDigest]:
        """The digests of files under ``root``, keyed by their path relative to it."""
        root = Path(os.path.abspath(root))
        return {
            Path(path).relative_to(root).as_posix(): d
            for path, d in self.digests.items()
            if Path(path).is_relative_to(root)
        }

    def __enter__(self) -> DigestCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def digest_file(path: Path) -> FileDigest:
    """Size and xxh3-64 of a file, hashed where it is mapped (no copy of its bytes into this
    process: from the page cache, several times faster than reading it)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return FileDigest(0, xxhash.xxh3_64().hexdigest())
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            return FileDigest(size, xxhash.xxh3_64(mapped).hexdigest())


# ----------------------------------------------------------------------------------- the manifest


def _files(directory: Path) -> Iterator[str]:
    for here, _, names in os.walk(directory):
        for name in names:
            rel = (Path(here) / name).relative_to(directory).as_posix()
            if rel != MANIFEST_NAME:
                yield rel


def build(directory: Path, known: Mapping[str, FileDigest] | None = None) -> dict[str, FileDigest]:
    """Every file under ``directory`` with its digest: taken from ``known`` (digests reported while
    writing, by relative path) where the file still has that size, else read back."""
    known = known or {}
    files = sorted(_files(directory))
    result = {
        rel: known[rel]
        for rel in files
        if rel in known and (directory / rel).stat().st_size == known[rel].size
    }
    missing = [rel for rel in files if rel not in result]
    with ThreadPoolExecutor(_THREADS) as pool:
        result.update(zip(missing, pool.map(lambda rel: digest_file(directory / rel), missing), strict=True))
    return {rel: result[rel] for rel in files}


def write(directory: Path, files: Mapping[str, FileDigest]) -> Path:
    """``directory/manifest.json`` listing ``files`` (written atomically: the directory's last file)."""
    body = {
        "format": FORMAT_VERSION,
        "algorithm": ALGORITHM,
        "files": {rel: {"size": d.size, ALGORITHM: d.xxh3_64} for rel, d in sorted(files.items())},
    }
    return atomic_write(directory / MANIFEST_NAME, json.dumps(body, indent=1) + "\n")


def read(ckpt: Path) -> dict[str, FileDigest]:
    """The files ``ckpt/manifest.json`` lists; CheckpointCorrupt when it is absent or unreadable."""
    path = ckpt / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointCorrupt(ckpt, MANIFEST_NAME, "missing (a completely written checkpoint has one)")
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT_VERSION or body.get("algorithm") != ALGORITHM:
            raise ValueError(
                f"format {body.get('format')} / {body.get('algorithm')} is not {FORMAT_VERSION} / {ALGORITHM}"
            )
        return {rel: FileDigest(int(e["size"]), str(e[ALGORITHM])) for rel, e in body["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointCorrupt(ckpt, MANIFEST_NAME, f"unreadable ({err})") from None


def _check_hf_listed(ckpt: Path, listed: Mapping[str, FileDigest]) -> None:
    """Every entry of ``ckpt/hf/`` is in the manifest: an added one would reach exports unverified."""
    for here, dirs, files in os.walk(ckpt / "hf"):
        for name in [*files, *(d for d in dirs if (Path(here) / d).is_symlink())]:
            rel = (Path(here) / name).relative_to(ckpt).as_posix()
            if rel not in listed:
                why = "hf/ is copied into exports: all of it is verified"
                raise CheckpointCorrupt(ckpt, rel, f"not listed in {MANIFEST_NAME} ({why})")


def verify(ckpt: Path) -> int:
    """Check every file ``ckpt/manifest.json`` lists: present, of its size, with its checksum.

    Raises CheckpointCorrupt naming the first file that fails and the check (sizes are checked
    before any checksum, so a truncated file is named at once). Returns the bytes verified. A listed
    entry must be a regular file inside ``ckpt`` (a writer never makes links: a link, a device or a
    path out of the checkpoint was put there); every file of ``hf/`` must be listed (exports copy
    them); other files the manifest does not list are not checked.
    """
    ckpt = Path(ckpt)
    listed = read(ckpt)
    _check_hf_listed(ckpt, listed)
    for rel, want in listed.items():
        path = ckpt / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointCorrupt(ckpt, rel, f"a path out of the checkpoint (listed in {MANIFEST_NAME})")
        if not path.is_file():
            raise CheckpointCorrupt(ckpt, rel, f"missing (listed in {MANIFEST_NAME})")
        if not stat.S_ISREG(path.lstat().st_mode):
            raise CheckpointCorrupt(
                ckpt, rel, f"a link to {os.path.realpath(path)}, not a file (listed in {MANIFEST_NAME})"
            )
        size = path.stat().st_size
        if size != want.size:
            raise CheckpointCorrupt(ckpt, rel, f"size {size} bytes, {MANIFEST_NAME} says {want.size}")
    names = sorted(listed, key=lambda rel: -listed[rel].size)  # largest first: they set the pace
    with ThreadPoolExecutor(_THREADS) as pool:
        for rel, got in zip(names, pool.map(lambda rel: digest_file(ckpt / rel), names), strict=True):
            if got.xxh3_64 != listed[rel].xxh3_64:
                raise CheckpointCorrupt(
                    ckpt,
                    rel,
                    f"{ALGORITHM} checksum {got.xxh3_64}, {MANIFEST_NAME} says {listed[rel].xxh3_64}",
                )
    return sum(d.size for d in listed.values())
