"""Links that leave a model directory: refused before any of its files is read or copied.

A model directory we are handed (a checkpoint's ``hf/``, ``model.hf_dir``, ``eval --model``) is copied
into checkpoints and exports, which users publish. A file in it that is a symbolic link to
``~/.ssh/id_rsa`` or ``/proc/self/environ`` would be copied as a plain file with the secret's bytes; so
every entry is checked first, and a link that resolves outside the directory is an error naming the
file and where it points.

Allowed: links that stay inside the directory, and a Hugging Face cache snapshot's links into its own
repository folder (``models--org--name/snapshots/<rev>/config.json -> ../../blobs/<hash>``: the
directory is a snapshot, so the folder that holds ``snapshots/`` and ``blobs/`` is the bound).

Hard links have no target to read: a regular file with more than one name is the same file as each of
its other names, wherever they are on that filesystem. Such a file is allowed only when every one of
its names (``st_nlink``) is found inside the bound; otherwise one may be a secret hard-linked into the
directory, and it is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from megagrpo.ckpt import CheckpointError

__all__ = ["check_no_outside_links", "link_bound"]


def link_bound(directory: Path) -> Path:
    """The folder links in ``directory`` may point into: the directory itself (resolved), or, for a
    Hugging Face cache snapshot (``.../models--org--name/snapshots/<rev>``), its repository folder."""
    real = Path(os.path.realpath(directory))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real.parent.parent
    return real


def check_no_outside_links(directory: str | Path, *, within: str | Path | None = None) -> None:
    """Refuse ``directory`` when a file or folder in it (at any depth) is a symbolic link that resolves
    outside :func:`link_bound`, or a hard link with a name outside it; CheckpointError naming the file
    and where it points. ``within``: a folder the directory itself must lie in (a checkpoint's ``hf/``
    in its checkpoint), so a directory that is itself a link out is refused too."""
    directory = Path(directory)
    if within is not None:
        _check_inside(directory, Path(os.path.realpath(within)), "the directory")
    if not directory.is_dir():
        return  # the caller's own check names a missing directory
    bound = link_bound(directory)
    shared: list[tuple[Path, os.stat_result]] = []
    for here, dirs, files in os.walk(directory):  # never descends through a link (followlinks=False)
        for name in [*dirs, *files]:
            path = Path(here) / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                _check_inside(path, bound, f"a symbolic link to {os.readlink(path)}")
            elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                shared.append((path, info))
    if shared:
        _check_hard_links(shared, bound)


def _check_inside(path: Path, bound: Path, what: str) -> None:
    target = Path(os.path.realpath(path))
    if target != bound and not target.is_relative_to(bound):
        raise CheckpointError(
            f"{path}: {what}, which resolves to {target}, outside {bound}; a file reached through a link "
            "out of the model directory is refused (its bytes would be copied into checkpoints and "
            "exports): copy the file itself into the directory"
        )


def _check_hard_links(shared: list[tuple[Path, os.stat_result]], bound: Path) -> None:
    """Each multiply-linked file must have all of its names inside ``bound`` (counted by inode)."""
    wanted = {(info.st_dev, info.st_ino) for _, info in shared}
    found: dict[tuple[int, int], int] = dict.fromkeys(wanted, 0)
    for here, _, files in os.walk(bound):
        for name in files:
            info = (Path(here) / name).lstat()
            key = (info.st_dev, info.st_ino)
            if key in found:
                found[key] += 1
    for path, info in shared:
        inside = found[(info.st_dev, info.st_ino)]
        if inside < info.st_nlink:
            raise CheckpointError(
                f"{path}: a hard link with {info.st_nlink} names, {info.st_nlink - inside} of them outside "
                f"{bound} (where is not recorded: it may be any file of that filesystem); a file shared "
                "with a name out of the model directory is refused (its bytes would be copied into "
                "checkpoints and exports): copy the file itself into the directory"
            )
