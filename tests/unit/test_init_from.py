"""model.init_from: a staged recipe's later stage starts from the previous stage's result, checked at load."""

from __future__ import annotations

import json

import pytest
import yaml
from hf_models import TINY_QWEN2_CONFIG as SHAPE

from megagrpo.ckpt import run as ckpt_io
from megagrpo.config import ConfigError, load_config
from megagrpo.trainers.checkpoints import resolve_init_from

pytestmark = pytest.mark.unit


def _stage2(tmp_path, previous):
    return load_config(None, ["model.tiny=null", f"model.init_from={previous}", f"logging.dir={tmp_path}"])


def test_init_from_excludes_the_other_model_keys():
    with pytest.raises(ConfigError, match=r"model\.init_from"):
        load_config(None, ["model.init_from=runs/x"])  # the default config has model.tiny


def test_a_run_with_an_hf_export_resolves_to_it(tmp_path):
    export = tmp_path / "stage1" / "hf_export"
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps(SHAPE))
    cfg = resolve_init_from(_stage2(tmp_path, tmp_path / "stage1"))
    assert cfg.model.hf_dir == str(export) and cfg.model.megatron_ckpt is None and cfg.model.init_from is None


def _checkpoint(root, step):
    tmp = ckpt_io.begin(root, step)
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text(json.dumps(SHAPE))
    return ckpt_io.commit(tmp, ckpt_io.DriverState.capture(step, 0), "run_name: s1\n", keep_last=3)


def test_a_run_without_export_resolves_to_its_latest_verified_checkpoint(tmp_path):
    run, ckpts = tmp_path / "stage1", tmp_path / "ckpts"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"checkpoint": {"dir": str(ckpts)}}))
    _checkpoint(ckpts, 2)
    latest = _checkpoint(ckpts, 4)
    cfg = resolve_init_from(_stage2(tmp_path, run))
    assert cfg.model.megatron_ckpt == str(latest) and cfg.model.hf_dir == str(latest / "hf")
    (latest / "hf" / "config.json").write_text("{}")  # damaged: fails its manifest, the older one is taken
    cfg = resolve_init_from(_stage2(tmp_path, run))
    assert cfg.model.megatron_ckpt == str(ckpts / "step_2")


@pytest.mark.parametrize("state", ["missing", "empty", "no checkpoint"])
def test_a_previous_stage_without_result_is_a_clear_error(tmp_path, state):
    run = tmp_path / "stage1"
    if state != "missing":
        run.mkdir()
    if state == "no checkpoint":
        (run / "config.yaml").write_text(yaml.safe_dump({"checkpoint": {"dir": str(tmp_path / "none")}}))
    with pytest.raises(ConfigError) as info:
        resolve_init_from(_stage2(tmp_path, run))
    message = str(info.value)
    assert message.startswith("model.init_from") and str(run) in message
    want = {
        "missing": "run the stage it names first",
        "empty": "neither an HF export",
        "no checkpoint": "did that run finish",
    }
    assert want[state] in message


def test_twin_stages_chain_with_growing_context():
    cfgs = [load_config(f"deepscaler/cpu_twin_{i}") for i in (1, 2, 3)]
    assert [c.model.init_from for c in cfgs] == ["runs/cpu-twin-model", "runs/cpu-twin-1", "runs/cpu-twin-2"]
    assert [c.model.seq_length for c in cfgs] == [96, 160, 256]
    assert all(c.reward.kind == "math_verify" for c in cfgs)
    assert [f"{c.logging.dir}/{c.run_name}" for c in cfgs[:2]] == [c.model.init_from for c in cfgs[1:]]
