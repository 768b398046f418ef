"""Verified run checkpoints written by real policy ranks (TP=2, Megatron's writers): the writers'
digests are the files' digests, and a damaged file of each kind is named on resume (which falls
back to the previous checkpoint) and by ``megagrpo export`` (which refuses it)."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import make_tiny_hf
from policy_cases import policy_batch, policy_config

from megagrpo.ckpt import CheckpointError, manifest
from megagrpo.ckpt import run as ckpt
from megagrpo.ckpt.megatron import read_model
from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.dist


def _save(rank: int, world_size: int, cfg, path: str) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()  # one optimizer step first: Megatron saves Adam state only once it has one
        worker.train(batch.replace(old_logprobs=worker.logprobs(batch)))
        return worker.save(path)
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """step_1 written by two TP ranks, committed with the digests their writers reported."""
    root = tmp_path_factory.mktemp("verify") / "ckpt"
    cfg = policy_config(str(make_tiny_hf("qwen2", root.parent / "qwen2")), tp=2)
    tmp = ckpt.begin(root, 1)
    reported = {}
    for rank_digests in run_local_ranks(_save, 2, cfg, str(tmp), timeout_s=300):
        reported |= rank_digests
    step = ckpt.commit(tmp, ckpt.DriverState.capture(1, 16), "run_name: t\n", keep_last=5, digests=reported)
    return root, step, reported


def test_the_checkpoint_names_tensors_as_transformer_engine_layers_ask_for_them(saved):
    """Written by the local layers on CPU, read by TE's (and the reverse): the keys are TE's spelling of
    every parameter (the fused norms under ``linear_qkv`` / ``linear_fc1``), layers stacked."""
    from megagrpo.compat.dcp_metadata import read_metadata_file
    from megagrpo.models.mapping import te_name
    from megagrpo.models.registry import ARCHITECTURES

    _, step, _ = saved
    keys = set(read_metadata_file(step / "megatron" / ".metadata").state_dict_metadata)
    tensors = {k for k in keys if "_extra_state" not in k}
    shape = read_model(step).shape
    rules = [rule for rule in ARCHITECTURES["qwen2"].rules(shape) if rule.export]
    want = {re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", te_name(rule.megatron)) for rule in rules}
    assert want <= tensors, sorted(want - tensors)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in tensors
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)


def test_writers_digest_every_shard_as_they_write_it(saved):
    _, step, reported = saved
    shards = sorted(p.relative_to(step).as_posix() for p in step.rglob("*.distcp"))
    assert len(shards) >= 4  # model and optimizer, two ranks each
    assert sorted(rel for rel in reported if rel.endswith(".distcp")) == shards
    listed = manifest.read(step)
    for rel in shards:
        assert reported[rel] == listed[rel] == manifest.digest_file(step / rel)
    assert manifest.verify(step) == sum(d.size for d in listed.values())


@pytest.mark.parametrize(
    ("rel", "damage"),
    [
        ("megatron/__0_0.distcp", "truncate"),
        ("megatron/metadata.json", "flip"),
        ("optimizer/.metadata", "truncate"),
        ("driver_state.json", "flip"),
        ("config.yaml", "flip"),
    ],
)
def test_a_damaged_file_is_named_and_resume_falls_back(rel, damage, saved, capsys):
    root, step, _ = saved
    newer = root / "step_2"
    shutil.copytree(step, newer)
    path = newer / rel
    size = path.stat().st_size
    if damage == "truncate":
        with path.open("r+b") as fh:
            fh.truncate(100)
        check = f"size 100 bytes, manifest.json says {size}"
    else:
        data = bytearray(path.read_bytes())
        data[-2] ^= 0x20
        path.write_bytes(bytes(data))
        check = "xxh3_64 checksum "
    try:
        said = []
        assert ckpt.latest_verified(root, "fallback", report=said.append) == step
        assert said[0].startswith(f"checkpoint step_2 fails verification: {newer / rel}: {check}")
        assert said[-1] == "falling back to step_1, the newest checkpoint that verifies"
        aside = root / "step_2.corrupt"
        from megagrpo import cli

        assert cli.main(["export", "--ckpt", str(aside), "--out", str(root / "hf_bad")]) == 1
        assert f"{aside / rel}: {check}" in capsys.readouterr().err
        assert not (root / "hf_bad").exists()
    finally:
        shutil.rmtree(root / "step_2.corrupt", ignore_errors=True)
        shutil.rmtree(newer, ignore_errors=True)


def test_export_verifies_a_sound_checkpoint(saved, tmp_path):
    _, step, _ = saved
    done = subprocess.run(
        [sys.executable, "-m", "megagrpo.cli", "export", "--ckpt", str(step), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"verified {step}: " in done.stdout and "match manifest.json" in done.stdout
    assert (Path(tmp_path / "hf") / "model.safetensors").is_file()


class _Payload:
    """A crafted pickle: loading it would create ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _craft(step: Path, rel: str, root: Path) -> tuple[Path, Path]:
    """A copy of ``step`` whose ``rel`` is a crafted pickle, with a manifest that matches it."""
    crafted = root / "step_1"
    shutil.copytree(step, crafted)
    marker = root / "ran"
    (crafted / rel).write_bytes(pickle.dumps(_Payload(str(marker))))
    manifest.write(crafted, manifest.build(crafted))
    return crafted, marker


def test_a_crafted_metadata_is_refused_by_export_even_with_a_matching_manifest(saved, tmp_path):
    """The manifest proves integrity, not authorship: someone handing over a checkpoint can rewrite
    it too. The metadata's unpickler still refuses what it names, before anything runs. (In a process
    of its own: an export that gets this far sets up Megatron's CPU redirection for its process.)"""
    crafted, marker = _craft(saved[1], "megatron/.metadata", tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megagrpo.cli",
            "export",
            "--ckpt",
            str(crafted),
            "--out",
            str(tmp_path / "hf"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"{crafted / 'megatron/.metadata'}: refusing to load os.makedirs" in done.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def _load(rank: int, world_size: int, cfg, paths: list[str]) -> list[str]:
    """What resuming from each of ``paths`` in turn says (one policy, as a resumed run builds it)."""
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    said = []
    try:
        for path in paths:
            try:
                worker.load(path)
                said.append("loaded")
            except CheckpointError as err:
                said.append(f"{type(err).__name__}: {err}")
    finally:
        destroy_parallel()
    return said


def _saved_bytes(value) -> bytes:
    import io

    import torch

    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _craft_extra_state(step: Path, root: Path) -> tuple[Path, Path, str]:
    """A copy of ``step`` whose first extra-state entry of the policy's weights is a crafted pickle,
    the metadata pointing at it and the manifest recomputed: (checkpoint, marker, entry)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from megagrpo.compat.dcp_metadata import read_metadata_file

    crafted = root / "extra_state" / "step_1"
    shutil.copytree(step, crafted)
    marker = root / "ran-extra-state"
    data = _saved_bytes([_Payload(str(marker))])
    (crafted / "megatron" / "__9_0.distcp").write_bytes(data)
    metadata = read_metadata_file(crafted / "megatron" / ".metadata")
    index = next(i for i in metadata.storage_data if "_extra_state" in i.fqn)
    metadata.storage_data[index] = _StorageInfo("__9_0.distcp", 0, len(data))
    (crafted / "megatron" / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest.write(crafted, manifest.build(crafted))
    return crafted, marker, index.fqn


def test_resume_loads_a_sound_checkpoint_and_refuses_each_crafted_one(saved, tmp_path):
    """Megatron's own model and optimizer state pass the checks; a crafted optimizer metadata, a
    crafted extra-state entry and a crafted optimizer ``common.pt`` are refused naming the file."""
    _, step, _ = saved
    metadata, metadata_marker = _craft(step, "optimizer/.metadata", tmp_path / "metadata")
    extra, extra_marker, entry = _craft_extra_state(step, tmp_path)
    common, common_marker = _craft(step, "optimizer/common.pt", tmp_path / "common")
    (common / "optimizer" / "common.pt").write_bytes(_saved_bytes({"x": _Payload(str(common_marker))}))
    manifest.write(common, manifest.build(common))
    cfg = policy_config(str(step.parent.parent / "qwen2"), tp=2)
    paths = [str(step), str(metadata), str(extra), str(common)]
    for said in run_local_ranks(_load, 2, cfg, paths, timeout_s=300):
        assert said[0] == "loaded", said
        assert said[1].startswith(
            f"CheckpointError: {metadata / 'optimizer/.metadata'}: refusing to load os.makedirs"
        ), said
        assert said[2].startswith(
            f"CheckpointError: {extra / 'megatron/__9_0.distcp'}: entry {entry}: refusing to load os.makedirs"
        ), said
        assert said[3].startswith(
            f"CheckpointError: {common / 'optimizer/common.pt'}: refusing to load os.makedirs"
        ), said
    for marker in (metadata_marker, extra_marker, common_marker):
        assert not marker.exists()
