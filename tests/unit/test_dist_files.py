"""Chunks of a PyTorch distributed checkpoint (the format under Megatron's torch_dist), viewed in place."""

import io
import os
import pickle
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megagrpo.ckpt.dist_files import MappedDistCheckpoint, _TensorRecord

pytestmark = pytest.mark.unit


@pytest.fixture
def saved(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int64),
        "n": torch.randn(3, generator=gen),
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return tmp_path, state


def test_regions_are_views_of_the_files(saved):
    path, state = saved
    before = {name: (path / name).read_bytes() for name in os.listdir(path)}
    files = MappedDistCheckpoint(path)
    w = files.read("w", (0, 0), (6, 4))
    assert w.dtype == torch.bfloat16 and torch.equal(w, state["w"])
    assert w.untyped_storage().size() == w.numel() * w.element_size()  # exactly the chunk's bytes
    assert torch.equal(files.read("w", (2, 0), (3, 4)), state["w"][2:5])  # rows within one chunk
    assert files.read("b", (0,), (5,)).tolist() == list(range(5))
    assert torch.equal(files.read("n", (0,), (3,)), state["n"])
    # Each view is a place in a file: the bytes there are the tensor's, and the files are unchanged.
    fd, offset, nbytes = files.maps.locate(w.data_ptr(), w.numel() * 2)
    assert os.pread(fd, nbytes, offset) == w.view(torch.uint8).numpy().tobytes()
    assert files.maps.locate(state["w"].data_ptr(), nbytes) is None  # not from the files
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before


def test_what_cannot_be_viewed_is_none(saved):
    files = MappedDistCheckpoint(saved[0])
    assert files.read("w", (0, 1), (6, 3)) is None  # part of a row: not whole rows of the chunk
    assert files.read("w", (4, 0), (4, 4)) is None  # beyond the tensor
    assert files.read("missing", (0,), (1,)) is None
    assert files.read("w", (0,), (6,)) is None  # wrong rank


def _data_pkl(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


def test_the_record_reader_takes_one_tensor_and_nothing_else():
    tensor = torch.zeros(3, 5, dtype=torch.float16)[1:]
    key, dtype, offset, size, stride = _TensorRecord(io.BytesIO(_data_pkl(tensor))).tensor()
    assert (dtype, offset, size, stride) == (torch.float16, 5, (2, 5), (5, 1))
    assert isinstance(key, str)
    with pytest.raises(pickle.UnpicklingError, match=r"unexpected (posix|os)\.system"):
        _TensorRecord(io.BytesIO(pickle.dumps(os.system, protocol=2))).tensor()
    with pytest.raises(pickle.UnpicklingError, match="holds dict, not one tensor"):
        _TensorRecord(io.BytesIO(_data_pkl({"a": torch.zeros(1), "b": [1]}))).tensor()
