"""--config lookup: an existing file, else a config shipped in the package by name, else one clear error."""

import json
from pathlib import Path

import pytest
from hf_models import R1_DISTILL_QWEN_1_5B

from megagrpo import config_files
from megagrpo.cli import main
from megagrpo.config import DEFAULT_CONFIG_PATH, ConfigError, load_config
from megagrpo.config_files import (
    PACKAGED_CONFIG_DIR,
    ConfigFileError,
    packaged_config_names,
    read_config_file,
    resolve_config_path,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_the_packaged_configs_are_the_top_level_configs_directory():
    # megagrpo/configs is a link to configs/, so the documented paths and the package data are one set
    # of files; in a checkout the packaged directory resolves to the top-level one.
    link = REPO / "megagrpo" / "configs"
    assert link.is_symlink()
    assert link.resolve() == REPO / "configs"
    assert PACKAGED_CONFIG_DIR == REPO / "configs"
    on_disk = sorted(
        p.relative_to(REPO / "configs").with_suffix("").as_posix() for p in REPO.glob("configs/**/*.yaml")
    )
    assert packaged_config_names() == on_disk
    assert {"tiny_cpu", "deepscaler/8k"} <= set(on_disk)


def test_default_is_the_packaged_tiny_cpu():
    assert resolve_config_path(None) == DEFAULT_CONFIG_PATH == PACKAGED_CONFIG_DIR / "tiny_cpu.yaml"
    assert DEFAULT_CONFIG_PATH.is_file()


@pytest.mark.parametrize(
    ("spec", "rel"),
    [
        ("tiny_cpu", "tiny_cpu.yaml"),
        ("tiny_cpu.yaml", "tiny_cpu.yaml"),
        ("deepscaler/8k", "deepscaler/8k.yaml"),
        ("deepscaler/8k.yaml", "deepscaler/8k.yaml"),
        (Path("deepscaler/8k"), "deepscaler/8k.yaml"),
    ],
)
def test_packaged_names(spec, rel, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of that name here
    assert resolve_config_path(spec) == PACKAGED_CONFIG_DIR / rel


def test_an_existing_file_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_cpu.yaml").write_text("run_name: mine\n")
    assert resolve_config_path("tiny_cpu.yaml") == Path("tiny_cpu.yaml")
    assert resolve_config_path("tiny_cpu") == PACKAGED_CONFIG_DIR / "tiny_cpu.yaml"  # no file "tiny_cpu"
    other = tmp_path / "elsewhere.yml"
    other.write_text("run_name: x\n")
    assert resolve_config_path(other) == other
    assert resolve_config_path(str(other)) == other


def test_the_documented_paths_still_work_from_the_checkout(monkeypatch):
    monkeypatch.chdir(REPO)
    for rel in ("configs/tiny_cpu.yaml", "configs/deepscaler/8k.yaml"):
        assert resolve_config_path(rel) == Path(rel)


@pytest.mark.parametrize(
    "spec", ["does-not-exist", "deepscaler/../tiny_cpu", "configs/nope.yaml", "/no/such.yaml"]
)
def test_unknown_config_is_one_clear_error(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigFileError) as info:
        resolve_config_path(spec)
    msg = str(info.value)
    assert repr(spec) in msg
    assert "deepscaler/8k, deepscaler/cpu_twin_1" in msg and "tiny_cpu" in msg
    assert (str(tmp_path) in msg) == (not spec.startswith("/"))  # where a relative path was looked for


def test_a_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigFileError, match="is a directory"):
        resolve_config_path(tmp_path)


def test_an_unreadable_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run_name: caf\xe9\n")
    with pytest.raises(ConfigFileError) as info:
        read_config_file(path)
    assert info.value.source == str(path)
    assert "cannot read" in str(info.value)
    with pytest.raises(ConfigError) as info:  # what load_config and the CLI report
        load_config(path)
    assert info.value.source == str(path)
    assert str(info.value).startswith(f"{path}: cannot read the file")


def test_load_config_takes_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("deepscaler/8k") == load_config(REPO / "configs" / "deepscaler" / "8k.yaml")
    assert load_config("tiny_cpu") == load_config(None)
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", ["grpo.num_generationz=4"])
    assert info.value.source == str(PACKAGED_CONFIG_DIR / "tiny_cpu.yaml")


COMMAND_OF = {
    "tiny_sft": "sft",
    "tiny_dpo": "dpo",
    "tiny_distill": "distill",
    "deepscaler/cpu_twin_model": "sft",
    "agent/model": "sft",
}
"""The packaged configs that are not GRPO runs (``megagrpo train``), and the command each one is for."""


@pytest.mark.parametrize("name", packaged_config_names())
def test_every_packaged_config_loads_for_its_command(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = COMMAND_OF.get(name)
    if command is not None:  # its header says which command runs it
        header = (PACKAGED_CONFIG_DIR / f"{name}.yaml").read_text().splitlines()[0]
        assert f"megagrpo {command} --config {name}" in header
    if command == "distill":  # its teacher is the GRPO demo's export, made here as make demo would
        from hf_models import make_tiny_teacher

        make_tiny_teacher(tmp_path / "runs" / "tiny-cpu" / "hf_export", num_layers=2)
    cfg = load_config(name, trainer=command or "grpo")
    assert cfg.resolved.backend in ("gloo", "nccl")


def test_cli_plan_with_a_packaged_name_and_a_missing_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # The packaged config's model.hf_dir is a placeholder: the plan needs a config.json for the shape.
    assert main(["plan", "--config", "deepscaler/8k"]) == 1
    assert (
        "model.hf_dir: /path/to/DeepSeek-R1-Distill-Qwen-1.5B/config.json not found"
        in capsys.readouterr().err
    )
    (tmp_path / "config.json").write_text(json.dumps(R1_DISTILL_QWEN_1_5B))
    hf = ["--hf-config", str(tmp_path / "config.json"), "--transformer-engine", "yes"]
    assert main(["plan", "--config", "deepscaler/8k", *hf]) == 0
    assert "run            deepscaler-8k" in capsys.readouterr().out
    assert main(["plan", "--config", "does-not-exist"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("megagrpo plan: config error: config 'does-not-exist' not found")
    assert "deepscaler/8k, deepscaler/cpu_twin_1" in err and "tiny_cpu" in err


def test_no_packaged_configs_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(config_files, "PACKAGED_CONFIG_DIR", tmp_path / "absent")
    assert packaged_config_names() == []
    with pytest.raises(ConfigFileError, match="none found"):
        resolve_config_path(tmp_path / "x")
