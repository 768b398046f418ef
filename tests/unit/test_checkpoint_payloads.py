"""A checkpoint someone hands over cannot run code: each crafted payload (a weight re-typed as bytes, a
layer's extra state, a tensor chunk, ``common.pt``, ``rollouts_ahead.pt``, metadata records with
attributes of their own or entries outside the directory), with the manifest recomputed as an
attacker would, is refused naming the file, by export and by the load that starting from
(``model.megatron_ckpt`` / ``init_from``) and resuming a checkpoint go through, and nothing runs."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import make_tiny_hf
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from megagrpo.ckpt import CheckpointError, manifest
from megagrpo.ckpt.convert import hf_to_megatron
from megagrpo.compat.dcp_metadata import read_metadata_file
from megagrpo.compat.safe_load import UntrustedCheckpointError, check_extra_state, load_archive
from megagrpo.parallel.local import run_local_ranks
from megagrpo.trainers.rollouts import Pending

pytestmark = pytest.mark.unit

WEIGHT = "output_layer.weight"
EXTRA = "decoder.layers.mlp.linear_fc2._extra_state/shard_0_2"


class _Payload:
    """Unpickling it would create ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _saved(value) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _rewrite_metadata(megatron: Path, edit) -> None:
    metadata = read_metadata_file(megatron / ".metadata")
    edit(metadata)
    (megatron / ".metadata").write_bytes(pickle.dumps(metadata))


def _entry_in_new_file(megatron: Path, fqn: str, data: bytes, *, as_bytes: bool) -> None:
    """Point entry ``fqn`` at ``data`` in a file of its own (bytes entries are indexed by name only;
    a re-typed weight's chunks are dropped)."""
    (megatron / "__0_9.distcp").write_bytes(data)
    info = _StorageInfo("__0_9.distcp", 0, len(data))

    def edit(metadata):
        if as_bytes:
            metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
            for index in [i for i in metadata.storage_data if i.fqn == fqn]:
                del metadata.storage_data[index]
            metadata.storage_data[MetadataIndex(fqn)] = info
        else:
            index = next(i for i in metadata.storage_data if i.fqn == fqn)
            metadata.storage_data[index] = info

    _rewrite_metadata(megatron, edit)


def _retyped(megatron, marker):
    _entry_in_new_file(megatron, WEIGHT, _saved([_Payload(marker)]), as_bytes=True)


def _retyped_with_size(megatron, marker):
    """Re-typed, with the size Megatron's shape check reads set on the bytes record."""
    _entry_in_new_file(megatron, WEIGHT, _saved([_Payload(marker)]), as_bytes=True)

    def add_size(metadata):
        metadata.state_dict_metadata[WEIGHT].size = torch.Size([384, 64])

    _rewrite_metadata(megatron, add_size)


def _extra_state(megatron, marker):
    _entry_in_new_file(megatron, EXTRA, _saved([_Payload(marker)]), as_bytes=False)


def _extra_state_fp8_pickle(megatron, marker):
    """Extra state as Transformer Engine 2.x stores it: a byte tensor that TE would ``pickle.loads``."""
    blob = torch.frombuffer(bytearray(pickle.dumps(_Payload(marker))), dtype=torch.uint8)
    _entry_in_new_file(megatron, EXTRA, _saved([blob]), as_bytes=False)


def _tensor_chunk(megatron, marker):
    _entry_in_new_file(megatron, WEIGHT, _saved(_Payload(marker)), as_bytes=False)


def _common(megatron, marker):
    (megatron / "common.pt").write_bytes(_saved({"x": _Payload(marker)}))


def _outside(megatron, marker):
    (megatron.parent / "elsewhere.distcp").write_bytes(_saved(_Payload(marker)))

    def edit(metadata):
        index = next(i for i in metadata.storage_data if i.fqn == WEIGHT)
        metadata.storage_data[index] = _StorageInfo("../elsewhere.distcp", 0, 10)

    _rewrite_metadata(megatron, edit)


def _stray_attribute(megatron, marker):
    def edit(metadata):
        next(iter(metadata.storage_data.values())).note = _saved(_Payload(marker))

    _rewrite_metadata(megatron, edit)


# payload -> (the file named, what the refusal says)
PAYLOADS = {
    "retyped": (
        ".metadata",
        f"entry {WEIGHT}: the model loads it as a tensor, the metadata stores it as bytes",
    ),
    "retyped_with_size": (".metadata", "a BytesStorageMetadata record carries 'size'"),
    "extra_state": ("__0_9.distcp", f"entry {EXTRA}: refusing to load os.makedirs"),
    "extra_state_fp8_pickle": ("__0_9.distcp", f"entry {EXTRA}: extra state holds ['Tensor']"),
    "tensor_chunk": ("__0_9.distcp", f"entry {WEIGHT}: refusing to load os.makedirs"),
    "common": ("common.pt", "refusing to load os.makedirs"),
    "outside": (".metadata", "its bytes are said to be in '../elsewhere.distcp'"),
    "stray_attribute": (".metadata", "a _StorageInfo record carries 'note'"),
}
CRAFT = {
    "retyped": _retyped,
    "retyped_with_size": _retyped_with_size,
    "extra_state": _extra_state,
    "extra_state_fp8_pickle": _extra_state_fp8_pickle,
    "tensor_chunk": _tensor_chunk,
    "common": _common,
    "outside": _outside,
    "stray_attribute": _stray_attribute,
}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """A real converted checkpoint, then a copy of it per payload with a manifest recomputed to match
    (the manifest proves integrity, not authorship): name -> (checkpoint, marker)."""
    root = tmp_path_factory.mktemp("payloads")
    pristine = hf_to_megatron(make_tiny_hf("qwen2", root / "hf"), root / "pristine", tp=1)
    found = {}
    for name, craft in CRAFT.items():
        ckpt = Path(shutil.copytree(pristine, root / name))
        marker = root / f"ran-{name}"
        craft(ckpt / "megatron", str(marker))
        manifest.write(ckpt, manifest.build(ckpt))
        found[name] = (ckpt, marker)
    return found


def _each_load(rank: int, world_size: int, ckpts: dict[str, str], out: str) -> dict[str, dict[str, str]]:
    """For each checkpoint: what export's rank and a model's load from it (the load a policy starting
    from ``model.megatron_ckpt`` or resuming runs: ``load_megatron``) say."""
    from megagrpo.ckpt.convert import _export_stage, _rank_groups
    from megagrpo.ckpt.megatron import load_megatron, read_model
    from megagrpo.models.builder import build_stage
    from megagrpo.parallel import ParallelSizes

    said = {}
    for name, ckpt in ckpts.items():
        said[name] = {}
        target = Path(out) / name
        target.mkdir()
        try:
            _export_stage(ckpt, str(target), 1 << 30, False)
            said[name]["export"] = "exported"
        except CheckpointError as err:
            said[name]["export"] = f"CheckpointError: {err}"
        source = read_model(Path(ckpt))
        with _rank_groups(ParallelSizes(), False) as ctx:
            model = build_stage(ctx, source.shape, source.dtype)
            try:
                load_megatron(model, Path(ckpt) / "megatron")
                said[name]["load"] = "loaded"
            except CheckpointError as err:
                said[name]["load"] = f"CheckpointError: {err}"
    return said


def test_every_payload_is_refused_naming_the_file_by_export_and_by_load(crafted, tmp_path):
    ckpts = {name: str(ckpt) for name, (ckpt, _) in crafted.items()}
    pristine = crafted["common"][0].parent / "pristine"
    [said] = run_local_ranks(
        _each_load, 1, {"pristine": str(pristine), **ckpts}, str(tmp_path), timeout_s=600
    )
    # The checkpoint they were made from passes every check, on both paths.
    assert said["pristine"] == {"export": "exported", "load": "loaded"}
    for name, (ckpt, marker) in crafted.items():
        file, message = PAYLOADS[name]
        for path in ("export", "load"):
            got = said[name][path]
            assert got.startswith(f"CheckpointError: {ckpt / 'megatron' / file}"), (name, path, got)
            assert message in got, (name, path, got)
        assert not marker.exists(), name


def test_the_command_line_says_one_line_and_exits_non_zero(crafted, tmp_path):
    ckpt, marker = crafted["extra_state"]
    done = subprocess.run(
        [sys.executable, "-m", "megagrpo.cli", "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("megagrpo export: error:")]
    assert errors == [
        f"megagrpo export: error: {ckpt / 'megatron' / '__0_9.distcp'}: entry {EXTRA}: refusing to load "
        "os.makedirs: this entry of a checkpoint holds only tensors and plain values (a crafted pickle "
        "can run code when loaded)"
    ], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_real_checkpoint_still_loads_and_holds_the_extra_state_of_the_local_layers(crafted, tmp_path):
    """The allow-list admits what the layers built here store: ``[None]`` per extra-state entry."""
    megatron = crafted["common"][0].parent / "pristine" / "megatron"
    metadata = read_metadata_file(megatron / ".metadata")
    extra = [(i, s) for i, s in metadata.storage_data.items() if "_extra_state" in i.fqn]
    assert len(extra) == 8
    for index, info in extra:
        with (megatron / info.relative_path).open("rb") as file:
            file.seek(info.offset)
            value = load_archive(file.read(info.length), index.fqn, frozenset())
        assert value == [None]
        check_extra_state(value, index.fqn)


@pytest.mark.parametrize(
    "value",
    [
        [None],
        [torch.empty(0, dtype=torch.uint8)],
        [torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)],
    ],
)
def test_transformer_engine_extra_state_without_fp8_is_admitted(value):
    check_extra_state(value, "x")


@pytest.mark.parametrize(
    "value",
    [
        None,
        [{"scale_fwd": torch.ones(2)}],
        [torch.ones(2)],
        [torch.frombuffer(bytearray(b"\x80\x02K\x01."), dtype=torch.uint8)],
    ],
)
def test_other_extra_state_is_refused_naming_the_entry(value):
    with pytest.raises(UntrustedCheckpointError, match=r"^f: entry e: extra state holds"):
        check_extra_state(value, "f: entry e")


def test_crafted_rollouts_ahead_are_refused_on_resume(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / Pending.FILE).write_bytes(_saved({"prompts": [_Payload(str(marker))]}))
    with pytest.raises(CheckpointError, match=f"^{tmp_path / Pending.FILE}: refusing to load os.makedirs"):
        Pending.load(tmp_path)
    assert not marker.exists()
    (tmp_path / Pending.FILE).write_bytes(_saved({"prompts": [{"unknown": 1}]}))
    with pytest.raises(
        CheckpointError, match=f"^{tmp_path / Pending.FILE}: not the rollouts a checkpoint saves"
    ):
        Pending.load(tmp_path)
