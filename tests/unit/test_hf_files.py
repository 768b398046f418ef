"""The streaming safetensors writer, read back by the safetensors library itself, and our reader."""

import errno
import json
import os

import pytest
import torch
from safetensors import safe_open

from megagrpo.ckpt.files import CopyingFile, FileCopies
from megagrpo.ckpt.hf_files import INDEX_NAME, HFCheckpoint, write_sharded

pytestmark = pytest.mark.unit


def _tensors():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=gen).to(torch.bfloat16)
    return [
        ("a.weight", base[:, :4]),  # a strided view: written as its own values
        ("b.weight", base[2:4]),
        ("c.bias", torch.arange(7, dtype=torch.int64)),
        ("d.scale", torch.tensor(2.5)),
        ("e.empty", torch.zeros(0, 3)),
        ("f.mask", torch.tensor([True, False, True])),
    ]


def _specs(tensors):
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors]


@pytest.mark.parametrize("max_bytes", [10**9, 50])
def test_written_shards_read_back_exactly(tmp_path, max_bytes):
    tensors = _tensors()
    paths = write_sharded(tmp_path, _specs(tensors), iter(tensors), max_bytes)
    index = tmp_path / INDEX_NAME
    if max_bytes == 50:
        assert len(paths) > 1 and index.is_file()
        weight_map = json.loads(index.read_text())["weight_map"]
        assert sorted(weight_map) == sorted(name for name, _ in tensors)
        for path in paths:  # every shard within the cap unless a single tensor exceeds it
            with safe_open(str(path), framework="pt") as fh:
                names = fh.keys()
                sizes = [fh.get_tensor(k).numel() * fh.get_tensor(k).element_size() for k in names]
            assert sum(sizes) <= max_bytes or len(sizes) == 1
    else:
        assert [p.name for p in paths] == ["model.safetensors"] and not index.exists()
    got = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as fh:
            names = fh.keys()
            got.update({k: fh.get_tensor(k) for k in names})
    ours = HFCheckpoint(tmp_path)
    for name, tensor in tensors:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        assert torch.equal(ours.read(name), tensor), name


def test_a_tensor_out_of_plan_is_named(tmp_path):
    tensors = _tensors()
    with pytest.raises(ValueError, match=r"expected tensor b\.weight \[2, 10\] torch\.bfloat16, got c\.bias"):
        write_sharded(tmp_path, _specs(tensors), iter([tensors[0], *tensors[2:]]), 10**9)
    with pytest.raises(ValueError, match="tensor extra was not in the plan"):
        write_sharded(tmp_path, _specs(tensors), iter([*tensors, ("extra", torch.zeros(1))]), 10**9)


def test_row_ranges_are_read_into_slices_of_a_destination(tmp_path):
    tensors = _tensors()
    write_sharded(tmp_path, _specs(tensors), iter(tensors), max_shard_bytes=50)
    ckpt = HFCheckpoint(tmp_path)
    dest = torch.zeros(7, 4, dtype=torch.bfloat16)
    ckpt.read_rows_into("a.weight", 1, 4, dest[2:5])  # rows 1-3 of a shard file, into rows 2-4
    assert torch.equal(dest[2:5], tensors[0][1][1:4]) and not dest[:2].any() and not dest[5:].any()
    bias = torch.zeros(3, dtype=torch.int64)
    ckpt.read_rows_into("c.bias", 4, 7, bias)  # a 1-D tensor: rows are elements
    assert bias.tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match=r"a.weight: rows 0:2 are torch.bfloat16 \[2, 4\]"):
        ckpt.read_rows_into("a.weight", 0, 2, torch.zeros(2, 4))  # wrong dtype
    with pytest.raises(ValueError, match="contiguous=False"):
        ckpt.read_rows_into("a.weight", 0, 2, torch.zeros(4, 2, dtype=torch.bfloat16).t())
    with pytest.raises(Exception, match=r"rows 5:8 of tensor a.weight \[6, 4\]"):
        ckpt.read_rows_into("a.weight", 5, 8, torch.zeros(3, 4, dtype=torch.bfloat16))


def test_mapped_rows_view_the_file_in_place(tmp_path):
    tensors = _tensors()
    paths = write_sharded(tmp_path, _specs(tensors), iter(tensors), max_shard_bytes=50)
    ckpt = HFCheckpoint(tmp_path)
    rows = ckpt.map_rows("a.weight", 1, 4)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, tensors[0][1][1:4])
    # Its storage is exactly these rows: a checkpoint writer that copies out views takes it as is.
    assert rows.untyped_storage().size() == rows.numel() * rows.element_size()
    assert ckpt.map_rows("c.bias", 2, 5).tolist() == [2, 3, 4]
    assert ckpt.map_rows("b.weight", 1, 1).shape == (0, 10)
    # Where the rows lie in their file: those bytes are the view's.
    fd, offset, nbytes = ckpt.maps.locate(rows.data_ptr(), rows.numel() * 2)
    assert os.pread(fd, nbytes, offset) == rows.view(torch.uint8).numpy().tobytes()
    assert os.fstat(fd).st_ino == paths[0].stat().st_ino
    assert ckpt.row_piece("a.weight", 1, 4) == (fd, offset, nbytes)
    assert ckpt.maps.locate(rows.clone().data_ptr(), nbytes) is None  # not in a mapped file
    with pytest.raises(Exception, match=r"rows 4:9 of tensor b.weight \[2, 10\]"):
        ckpt.map_rows("b.weight", 4, 9)


def test_a_buffer_known_to_lie_in_files_is_copied_from_them(tmp_path):
    """``CopyingFile`` writes a buffer that ``FileCopies`` knows from the file pieces it names
    (here holding other values than the buffer, so the output shows where its bytes came from),
    and records that in memory a forked writer shares; any other buffer, and a known one not
    written whole, is written from memory."""
    stored = torch.arange(300, dtype=torch.float32)
    source = tmp_path / "source.bin"
    source.write_bytes(b"\0" * 12 + stored.numpy().tobytes())
    stand_in, other = torch.zeros(300), torch.full((8,), 5.0)
    with open(source, "rb") as fh:
        copies = FileCopies()
        # Two pieces, out of file order: values 100..299, then 0..99.
        copies.add(stand_in, [(fh.fileno(), 12 + 400, 800), (fh.fileno(), 12, 400)])
        copies.add(other, [(fh.fileno(), 12, 32)])
        copies.share()
        pid = os.fork()
        if pid == 0:  # a forked writer, as Megatron's are
            with CopyingFile(tmp_path / "out.bin", copies) as out:
                out.write(b"head")
                out.write(memoryview(stand_in.numpy()))
                out.write(memoryview(other.numpy())[:4])  # part of a known buffer: from memory
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()[4:]), dtype=torch.float32)
    assert (tmp_path / "out.bin").read_bytes()[:4] == b"head"
    assert torch.equal(got[:300], torch.cat([stored[100:], stored[:100]]))
    assert torch.equal(got[300:], torch.full((4,), 5.0))
    assert copies.written(stand_in) and not copies.written(other)
    with pytest.raises(ValueError, match="pieces of 8 bytes for a tensor of 1200"):
        copies.add(stand_in, [(0, 0, 8)])


def test_tensors_placed_in_a_file_are_copied_from_it(tmp_path):
    """With ``copies``, a tensor's bytes come from the file place they are known at (the kernel
    copies them file to file): here that place holds other values, which the output must then hold."""
    stored = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    source = tmp_path / "source.bin"
    source.write_bytes(b"\0" * 12 + stored.numpy().tobytes())
    stand_in = torch.zeros(6, 4)  # what would be written from memory
    tensors = [("a.weight", stand_in), ("b.bias", torch.ones(3))]
    with open(source, "rb") as fh:
        copies = FileCopies()
        copies.add(stand_in, [(fh.fileno(), 12, 96)])
        out = tmp_path / "out"
        out.mkdir()
        write_sharded(out, _specs(tensors), iter(tensors), 10**9, copies=copies)
    back = HFCheckpoint(out)
    assert torch.equal(back.read("a.weight"), stored) and torch.equal(back.read("b.bias"), torch.ones(3))


def test_where_the_kernel_cannot_copy_the_pieces_are_read_and_written(tmp_path, monkeypatch):
    def refuse(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    stored = torch.arange(64, dtype=torch.float32)
    source = tmp_path / "source.bin"
    source.write_bytes(stored.numpy().tobytes())
    stand_in = torch.zeros(64)
    with open(source, "rb") as fh:
        copies = FileCopies()
        copies.add(stand_in, [(fh.fileno(), 128, 128), (fh.fileno(), 0, 128)])
        with CopyingFile(tmp_path / "out.bin", copies) as out:
            assert out.write(memoryview(stand_in.numpy())) == 256
    got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32)
    assert torch.equal(got, torch.cat([stored[32:], stored[:32]]))
