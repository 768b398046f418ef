import os
import subprocess
import sys
import textwrap
import time

import pytest

from megagrpo.ckpt import durable
from megagrpo.ckpt.durable import atomic_output_dir

pytestmark = pytest.mark.unit

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")


@linux_only
def test_start_writeback_queues_a_written_range(tmp_path):
    path = tmp_path / "f.bin"
    with open(path, "wb", buffering=0) as fh:
        fh.write(os.urandom(1 << 20))
        assert durable.start_writeback(fh.fileno(), 0, 1 << 20)
        assert not durable.start_writeback(fh.fileno(), 0, 0)  # nothing to queue
    with open(path, "rb") as fh:
        assert durable.start_writeback(fh.fileno(), -1, 10) is False  # the kernel refuses a bad range


@linux_only
def test_writeback_follows_files_another_process_writes(tmp_path):
    step = 256 * 1024
    writer = textwrap.dedent(
        f"""
        import os, time
        with open({str(tmp_path / "a.distcp")!r}, "wb", buffering=0) as fh:
            for _ in range(8):
                fh.write(os.urandom({step}))
                time.sleep(0.05)
        open({str(tmp_path / "b.other")!r}, "wb").write(os.urandom({4 * step}))
        """
    )
    with durable.writeback_as_written(tmp_path, ".distcp", step=step) as queued:
        subprocess.run([sys.executable, "-c", writer], check=True)
        # The thread looks every 20 ms; on a loaded machine its look at the file's last bytes may come
        # much later: wait for it (the block's exit stops the thread).
        deadline = time.monotonic() + 60
        while queued.get("a.distcp", 0) < 8 * step:
            assert time.monotonic() < deadline, f"after 60 s, queued {queued} of {8 * step} bytes"
            time.sleep(0.02)
    assert set(queued) == {"a.distcp"}  # files of other suffixes are not followed
    assert queued["a.distcp"] == 8 * step


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc")
def test_atomic_output_dir_syncs_every_file_and_directory_before_the_rename(tmp_path, monkeypatch):
    synced = []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(durable.os, "fsync", fsync)
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "d" / "e").mkdir(parents=True)
        for rel in ("x", "d/y", "d/e/z"):
            (tmp / rel).write_bytes(b"data")
    inner = [str(tmp / rel) for rel in ("x", "d/y", "d/e/z", "d/e", "d", "")]
    # Files, then directories inside out (each after what it holds), then, after the rename, the
    # parent that holds the new name.
    assert sorted(synced[:3]) == sorted(inner[:3])
    assert synced[3:] == [path.rstrip("/") for path in inner[3:]] + [str(tmp_path)]
    assert (tmp_path / "out" / "d" / "e" / "z").read_bytes() == b"data"


@linux_only
def test_background_writeback_outlives_the_writers_descriptor(tmp_path):
    open_before = len(os.listdir("/proc/self/fd"))
    with durable.background_writeback() as writeback:
        for i in range(3):
            with open(tmp_path / f"{i}.bin", "wb", buffering=0) as fh:
                fh.write(os.urandom(1 << 20))
                writeback.start(fh.fileno(), 0, 1 << 20)  # the file is closed right after
    # Every request was made on a descriptor of its own, and each was closed once made.
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_atomic_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "state.json"
    durable.atomic_write(path, "first\n")
    durable.atomic_write(path, b"second\n")
    assert path.read_bytes() == b"second\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_failed_atomic_write_keeps_the_previous_version(tmp_path):
    path = tmp_path / "metrics.jsonl"
    durable.atomic_write(path, "kept\n")
    with pytest.raises(RuntimeError), durable.atomic_file(path) as fh:
        fh.write("half a line")
        raise RuntimeError("killed while writing")
    assert path.read_text() == "kept\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_publish_replaces_a_directory_and_syncs_it_first(tmp_path, monkeypatch):
    final = tmp_path / "step_3"
    (final / "old").mkdir(parents=True)
    tmp = tmp_path / ".step_3.tmp"
    (tmp / "megatron").mkdir(parents=True)
    (tmp / "megatron" / "a.distcp").write_bytes(b"x")
    synced = []
    real_fsync = durable.os.fsync
    monkeypatch.setattr(durable.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    assert durable.publish(tmp, final) == final
    assert not tmp.exists() and not (final / "old").exists()
    assert (final / "megatron" / "a.distcp").read_bytes() == b"x"
    assert len(synced) == 4  # the file, its two directories, then the parent after the rename
