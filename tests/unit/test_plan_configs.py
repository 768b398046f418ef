"""``megagrpo plan`` for every shipped config, before anything has run: each planned by the trainer that runs
it (``--trainer``), a later stage shaped by ``--hf-config`` while the run it starts from does not exist yet.

The configs are enumerated from the package (``packaged_config_names``), so a new config is planned here
as soon as it ships. A model that an earlier run leaves (``model.init_from``, a distillation teacher under
a run's directory) is shaped as the shipped config that makes that run builds it; a recipe's real HF model
as its published config.json's shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_models import R1_DISTILL_QWEN_1_5B

from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.config_files import packaged_config_names
from megagrpo.models.description import describe_model
from megagrpo.models.registry import hf_config_for

pytestmark = pytest.mark.unit

TRAINER = {  # the command each config's header names (`megagrpo sft --config tiny_sft`, ...); else train
    "tiny_sft": "sft",
    "tiny_dpo": "dpo",
    "tiny_distill": "distill",
    "agent/model": "sft",
    "deepscaler/cpu_twin_model": "sft",
}


def _trainer(name: str) -> str:
    return TRAINER.get(name, "grpo")


def _load(name: str):
    """The shipped config ``name`` as its trainer reads it; a distillation config without its teacher (the
    teacher's directory is an earlier run's result: see the test), as GRPO reads the rest."""
    if _trainer(name) == "distill":
        return load_config(name, ["distill.teacher_hf_dir=null"], trainer="grpo")
    return load_config(name, trainer=_trainer(name))


def _run_dirs() -> dict[Path, str]:
    """Each shipped config's run directory (``logging.dir/run_name``) -> the config's name."""
    runs = {}
    for name in packaged_config_names():
        cfg = _load(name)
        runs[Path(cfg.logging.dir) / cfg.run_name] = name
    return runs


def _model_config_json(name: str, runs: dict[Path, str]) -> dict:
    """The config.json of the model the shipped config ``name`` trains (and leaves as its result)."""
    cfg = _load(name)
    m = cfg.model
    if m.tiny is not None:
        d = describe_model(cfg)
        return hf_config_for(d.arch, d.shape, d.dtype)
    if m.init_from is not None:
        return _made_by(Path(m.init_from), runs, f"{name}: model.init_from")
    assert "R1-Distill-Qwen-1.5B" in m.hf_dir, f"{name}: model.hf_dir {m.hf_dir}: no known shape for it"
    return R1_DISTILL_QWEN_1_5B


def _made_by(path: Path, runs: dict[Path, str], what: str) -> dict:
    """The config.json of the model the run holding ``path`` leaves (its directory or a file in it)."""
    for run, name in runs.items():
        if path == run or run in path.parents:
            return _model_config_json(name, runs)
    raise AssertionError(f"{what} {path}: no shipped config makes that run ({sorted(map(str, runs))})")


def _write(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    return d / "config.json"


SHIPPED = packaged_config_names()


def test_the_shipped_configs_are_found():
    # The ones named here must exist: a renamed config would otherwise fall back to GRPO unnoticed.
    assert set(TRAINER) <= set(SHIPPED)
    assert {"tiny_cpu", "deepscaler/8k", "deepscaler/16k", "deepscaler/24k"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_passes_for_every_shipped_config(name, tmp_path, capsys):
    runs, cfg = _run_dirs(), _load(name)
    args, m = ["plan", "--trainer", _trainer(name), "--config", name], cfg.model
    if m.init_from is not None or (m.hf_dir is not None and not Path(m.hf_dir).is_dir()):
        args += ["--hf-config", str(_write(tmp_path, "model", _model_config_json(name, runs)))]
    if _trainer(name) == "distill":
        teacher = load_config(name, trainer="sft").distill.teacher_hf_dir  # sft reads no teacher
        made = _made_by(Path(teacher), runs, f"{name}: distill.teacher_hf_dir")
        args.append(f"distill.teacher_hf_dir={_write(tmp_path, 'teacher', made).parent}")
    code = main(args)
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert out.out.rstrip().endswith("plan OK")
    assert f"({_trainer(name)})" in out.out  # the run line names the trainer planned for
    if m.init_from is not None:
        assert f"the result of run {m.init_from} (checked at start)" in out.out
    if _trainer(name) in ("sft", "dpo"):
        assert "no vLLM engines" in out.out and "weight sync" not in out.out
    else:
        assert f"{cfg.generation.num_engines} vLLM engine(s)" in out.out and "weight sync" in out.out


def test_a_later_stage_without_its_run_or_hf_config_names_both(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    assert main(["plan", "--config", "deepscaler/16k"]) == 1
    err = capsys.readouterr().err
    assert "model.init_from: runs/deepscaler-8k is not a directory" in err
    assert "--hf-config FILE" in err


def test_an_sft_config_planned_as_grpo_fails_on_a_grpo_rule(capsys):
    # The default trainer is GRPO's (megagrpo train): tiny_sft leaves no room for GRPO's rollouts.
    assert main(["plan", "--config", "tiny_sft"]) == 1
    assert "generation.max_new_tokens" in capsys.readouterr().err
    assert main(["plan", "--trainer", "sft", "--config", "tiny_sft"]) == 0
