"""No file leaves a model directory through a link: a checkpoint's ``hf/`` or an HF directory holding a
symbolic or hard link to a file outside it is refused by export, eval, init and the checkpoint writer,
naming the file and where it points; a Hugging Face cache snapshot's links into its own blobs pass."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from hf_models import TINY_QWEN2_CONFIG as SHAPE

from megagrpo.ckpt import CheckpointError, manifest
from megagrpo.ckpt import run as ckpt_io
from megagrpo.ckpt.links import check_no_outside_links, link_bound
from megagrpo.ckpt.manifest import CheckpointCorrupt, verify
from megagrpo.ckpt.megatron import write_checkpoint_meta
from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.models.registry import ARCHITECTURES, shape_from_hf_config
from megagrpo.trainers.checkpoints import resolve_init_from

pytestmark = pytest.mark.unit

SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- not for export"


@pytest.fixture(params=["secret_file", "proc_environ"])
def target(request, tmp_path) -> Path:
    """What the planted link points at: a private file beside the model, or this process's environment."""
    if request.param == "proc_environ":
        return Path("/proc/self/environ")
    secret = tmp_path / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_text(SECRET)
    return secret


def _hf_dir(path: Path, link_to: Path | None = None) -> Path:
    """An HF directory (config.json and a tokenizer file); ``link_to``: its tokenizer_config.json is a
    symbolic link there."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(SHAPE))
    (path / "tokenizer.json").write_text("{}")
    if link_to is not None:
        (path / "tokenizer_config.json").symlink_to(link_to)
    return path


def _refusal(link: Path, points_to: Path) -> str:
    return rf"{link}: a symbolic link to {points_to}, which resolves to .*, outside "


def _checkpoint_with(ckpt: Path, link_to: Path | None) -> Path:
    """A megagrpo checkpoint (megagrpo.json, hf/, an empty megatron/) whose hf/ holds the link."""
    _hf_dir(ckpt / "hf", link_to)
    (ckpt / "megatron").mkdir()
    (ckpt / "megatron" / "metadata.json").write_text("{}")
    (ckpt / "megagrpo.json").write_text(json.dumps({"format": 1, "arch": "qwen2", "dtype": "float32"}))
    return ckpt


def test_export_refuses_a_checkpoint_whose_hf_links_out(tmp_path, target, capsys):
    ckpt = _checkpoint_with(tmp_path / "ckpt", target)
    out = tmp_path / "export"
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    link = ckpt / "hf" / "tokenizer_config.json"
    assert f"{link}: a symbolic link to {target}" in err and f"outside {ckpt.resolve() / 'hf'}" in err
    assert not out.exists()


def test_a_run_checkpoint_with_a_link_fails_its_manifest(tmp_path, target):
    tmp = ckpt_io.begin(tmp_path / "ckpts", 3)
    _hf_dir(tmp / "hf")
    step = ckpt_io.commit(tmp, ckpt_io.DriverState.capture(3, 0), "run_name: r\n", keep_last=2)
    (step / "hf" / "tokenizer_config.json").symlink_to(target)
    manifest.write(step, manifest.build(step))  # the manifest recomputed: it proves integrity, not origin
    with pytest.raises(CheckpointCorrupt, match=r"hf/tokenizer_config.json: a link to /proc/|id_ed25519"):
        verify(step)


def test_a_file_added_to_hf_after_the_manifest_is_refused(tmp_path):
    tmp = ckpt_io.begin(tmp_path / "ckpts", 1)
    _hf_dir(tmp / "hf")
    step = ckpt_io.commit(tmp, ckpt_io.DriverState.capture(1, 0), "run_name: r\n", keep_last=2)
    assert verify(step) > 0  # every hf/ file is listed and verified
    (step / "hf" / "chat_template.jinja").write_text("{{ planted }}")
    with pytest.raises(CheckpointCorrupt, match=r"hf/chat_template.jinja: not listed in manifest.json"):
        verify(step)


def test_eval_refuses_a_model_directory_that_links_out(tmp_path, target, capsys):
    model = _hf_dir(tmp_path / "model", target)
    assert main(["eval", "--model", str(model), f"logging.dir={tmp_path / 'runs'}"]) == 1
    err = capsys.readouterr().err
    assert f"{model / 'tokenizer_config.json'}: a symbolic link to {target}" in err


def test_eval_refuses_a_run_checkpoint_whose_hf_links_out(tmp_path, target, capsys):
    tmp = ckpt_io.begin(tmp_path / "ckpts", 3)
    _checkpoint_with(tmp, None)
    step = ckpt_io.commit(tmp, ckpt_io.DriverState.capture(3, 0), "run_name: r\n", keep_last=2)
    (step / "hf" / "tokenizer_config.json").symlink_to(target)
    manifest.write(step, manifest.build(step))
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(step), "--out", str(out)]) == 1
    assert f"{step / 'hf' / 'tokenizer_config.json'}: a link to " in capsys.readouterr().err
    assert not (out / "hf").exists()


def test_eval_refuses_a_run_whose_export_links_out(tmp_path, target, capsys):
    export = _hf_dir(tmp_path / "run" / "hf_export", target)
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), f"logging.dir={tmp_path / 'runs'}"]) == 1
    assert f"{export / 'tokenizer_config.json'}: a symbolic link to {target}" in capsys.readouterr().err


def test_init_refuses_a_previous_stage_whose_export_links_out(tmp_path, target):
    _hf_dir(tmp_path / "stage1" / "hf_export", target)
    cfg = load_config(
        None, ["model.tiny=null", f"model.init_from={tmp_path / 'stage1'}", f"logging.dir={tmp_path}"]
    )
    link = tmp_path / "stage1" / "hf_export" / "tokenizer_config.json"
    with pytest.raises(CheckpointError, match=_refusal(link, target)):
        resolve_init_from(cfg)


def test_init_refuses_an_hf_dir_that_links_out(tmp_path, target):
    model = _hf_dir(tmp_path / "model", target)
    cfg = load_config(None, ["model.tiny=null", f"model.hf_dir={model}", f"logging.dir={tmp_path}"])
    with pytest.raises(CheckpointError, match=_refusal(model / "tokenizer_config.json", target)):
        resolve_init_from(cfg)


def test_init_refuses_a_checkpoint_hf_that_is_itself_a_link_out(tmp_path):
    elsewhere = _hf_dir(tmp_path / "elsewhere")
    run, ckpts = tmp_path / "stage1", tmp_path / "ckpts"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"checkpoint": {"dir": str(ckpts)}}))
    tmp = ckpt_io.begin(ckpts, 2)
    (tmp / "hf").symlink_to(elsewhere)
    step = ckpt_io.commit(tmp, ckpt_io.DriverState.capture(2, 0), "run_name: s1\n", keep_last=2)
    # hf/ itself is a link: checked as the directory, inside its checkpoint
    with pytest.raises(
        CheckpointError, match=rf"{step / 'hf'}: the directory, which resolves to {elsewhere}"
    ):
        check_no_outside_links(step / "hf", within=step)


def test_the_writer_refuses_to_copy_a_source_model_that_links_out(tmp_path, target):
    source = _hf_dir(tmp_path / "model", target)
    arch, shape = shape_from_hf_config(SHAPE, "config.json")
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=_refusal(source / "tokenizer_config.json", target)):
        write_checkpoint_meta(ckpt, arch, shape, torch.float32, tp=1, pp=1, hf_files=source)
    assert not (ckpt / "hf" / "tokenizer_config.json").exists()


def test_a_hard_link_to_a_file_outside_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    model = _hf_dir(tmp_path / "model")
    os.link(secret, model / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: a hard link with 2 names, 1 of them"):
        check_no_outside_links(model)
    arch, shape = shape_from_hf_config(SHAPE, "config.json")
    with pytest.raises(CheckpointError, match="a hard link"):
        write_checkpoint_meta(tmp_path / "ckpt", arch, shape, torch.float32, tp=1, pp=1, hf_files=model)


def test_links_that_stay_inside_the_directory_pass(tmp_path):
    model = _hf_dir(tmp_path / "model")
    (model / "tokenizer_config.json").symlink_to("tokenizer.json")  # relative, inside
    os.link(model / "config.json", model / "config.copy.json")  # both names inside
    (model / "sub").mkdir()
    (model / "sub" / "merges.txt").symlink_to(model / "tokenizer.json")
    check_no_outside_links(model)


def _hf_cache_repo(root: Path, name: str) -> Path:
    """``root/models--org--<name>``: a snapshot whose files link into the repo's blobs/, as the HF hub lays
    out its cache."""
    repo = root / f"models--org--{name}"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file, body in (("config.json", json.dumps(SHAPE)), ("tokenizer.json", "{}")):
        blob = repo / "blobs" / f"{abs(hash(name + file)):x}"
        blob.write_text(body)
        (snapshot / file).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


def test_an_hf_cache_snapshot_links_into_its_own_blobs(tmp_path):
    snapshot = _hf_cache_repo(tmp_path / "hub", "tiny")
    assert link_bound(snapshot) == (tmp_path / "hub" / "models--org--tiny").resolve()
    check_no_outside_links(snapshot)
    cfg = load_config(None, ["model.tiny=null", f"model.hf_dir={snapshot}", f"logging.dir={tmp_path}"])
    assert resolve_init_from(cfg).model.hf_dir == str(snapshot)
    arch, shape = shape_from_hf_config(SHAPE, "config.json")
    ckpt = tmp_path / "ckpt"
    write_checkpoint_meta(ckpt, arch, shape, torch.float32, tp=1, pp=1, hf_files=snapshot)
    # the checkpoint holds plain files with the blobs' bytes
    assert not (ckpt / "hf" / "config.json").is_symlink()
    assert json.loads((ckpt / "hf" / "config.json").read_text()) == SHAPE
    assert ARCHITECTURES["qwen2"] is arch


def test_an_hf_cache_snapshot_linking_into_another_repo_is_refused(tmp_path):
    snapshot = _hf_cache_repo(tmp_path / "hub", "tiny")
    other = _hf_cache_repo(tmp_path / "hub", "private")
    blob = (other / "tokenizer.json").resolve()
    (snapshot / "tokenizer_config.json").symlink_to(
        Path("..") / ".." / ".." / "models--org--private" / "blobs" / blob.name
    )
    with pytest.raises(
        CheckpointError, match=r"tokenizer_config.json: a symbolic link to .*models--org--private"
    ):
        check_no_outside_links(snapshot)
