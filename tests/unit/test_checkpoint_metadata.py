"""A distributed checkpoint's ``.metadata`` is read through an allow-list: a real one loads as torch
reads it, a crafted pickle is refused naming the file, and nothing it names runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from megagrpo.compat.dcp_metadata import UntrustedCheckpointError, read_metadata_file, restricted_metadata

pytestmark = pytest.mark.unit


class _Payload:
    """What a crafted .metadata holds: unpickling it would call os.makedirs(marker)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


@pytest.fixture
def saved(tmp_path):
    state = {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    return tmp_path / "ckpt"


def test_a_real_checkpoint_reads_as_torch_reads_it(saved):
    plain = FileSystemReader(str(saved)).read_metadata()
    with restricted_metadata():
        checked = FileSystemReader(str(saved)).read_metadata()
    assert checked.state_dict_metadata == plain.state_dict_metadata
    assert checked.storage_data == plain.storage_data
    assert read_metadata_file(saved / ".metadata").state_dict_metadata == plain.state_dict_metadata
    # ... and the weights load through it
    out = {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}
    with restricted_metadata():
        dcp.load(out, checkpoint_id=str(saved), no_dist=True)
    assert torch.equal(out["w"], torch.arange(12, dtype=torch.float32).view(3, 4))


def test_a_crafted_metadata_is_refused_naming_the_file_and_runs_nothing(saved, tmp_path):
    marker = tmp_path / "ran"
    (saved / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with restricted_metadata(), pytest.raises(UntrustedCheckpointError) as err:
        FileSystemReader(str(saved)).read_metadata()
    assert str(saved / ".metadata") in str(err.value) and "os.makedirs" in str(err.value)
    assert not marker.exists()
    with pytest.raises(UntrustedCheckpointError):
        read_metadata_file(saved / ".metadata")
    assert not marker.exists()


def test_the_original_reader_is_put_back_after_nested_blocks():
    original = FileSystemReader.read_metadata
    with restricted_metadata():
        inner = FileSystemReader.read_metadata
        assert inner is not original
        with restricted_metadata():
            assert FileSystemReader.read_metadata is inner
        assert FileSystemReader.read_metadata is inner
    assert FileSystemReader.read_metadata is original


def _rewrite(saved, edit):
    metadata = read_metadata_file(saved / ".metadata")
    edit(metadata)
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["/etc/passwd.distcp", "../x.distcp", "sub/x.distcp", ".metadata", "x.pt"])
def test_an_entry_outside_the_directory_is_refused(saved, where):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def edit(metadata):
        index = next(i for i in metadata.storage_data if i.fqn == "w")
        metadata.storage_data[index] = _StorageInfo(where, 0, 10)

    _rewrite(saved, edit)
    with pytest.raises(UntrustedCheckpointError, match=f"entry w: its bytes are said to be in '{where}'"):
        read_metadata_file(saved / ".metadata")


def test_a_link_out_of_the_directory_is_refused(saved, tmp_path):
    (tmp_path / "secret").write_bytes(b"x")
    name = next(p.name for p in saved.iterdir() if p.suffix == ".distcp")
    (saved / name).unlink()
    (saved / name).symlink_to(tmp_path / "secret")
    with restricted_metadata(), pytest.raises(UntrustedCheckpointError, match="a link out of the checkpoint"):
        FileSystemReader(str(saved)).read_metadata()


def test_a_bytes_entry_loads_through_the_allow_list(tmp_path):
    """Plain torch checkpoints too: a bytes entry that names a function is refused naming the file and the
    entry (torch would load it with weights_only=False), a plain one loads."""
    marker = tmp_path / "ran"
    state = {"meta": "step 3", "evil": _Payload(str(marker))}
    dcp.save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    out = {"meta": None}
    with restricted_metadata():
        dcp.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert out["meta"] == "step 3"
    with restricted_metadata() as refused, pytest.raises(BaseException):  # noqa: B017 torch wraps it
        dcp.load({"evil": None}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert len(refused) == 1 and ": entry evil: refusing to load os.makedirs" in refused[0], refused
    assert refused[0].startswith(str(tmp_path / "c" / "__0_0.distcp"))
    assert not marker.exists()


def test_a_record_with_a_stray_attribute_is_refused(saved):
    def edit(metadata):
        metadata.state_dict_metadata["b"].extra = 1

    _rewrite(saved, edit)
    with pytest.raises(UntrustedCheckpointError, match="a TensorStorageMetadata record carries 'extra'"):
        read_metadata_file(saved / ".metadata")
