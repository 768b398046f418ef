"""The CPU twin's path end to end: the project-made model (BPE tokenizer, ChatML, SFT warm-up) loaded as an
HF model, GRPO stage 1 -> stage 2 chained through model.init_from, and ``megagrpo eval`` on vLLM.

Short versions of ``make twin``: the made model gets 40 SFT steps, each stage 1-2 GRPO steps on 4 prompts; the
two evaluations (a checkpoint and its export, the same weights) are also the same-seed-twice check.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from megagrpo.config import load_config
from megagrpo.data.math_problems import math_records, write_math_dataset

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def twin(tmp_path_factory) -> Path:
    """A root holding the made model's run (``cpu-twin-model``, as cpu_twin_model.yaml makes it, with
    fewer steps and every solution boxed, so that 40 steps make a model whose answers sometimes
    score) and the data (``train.parquet``, ``val.jsonl``); made once per session."""
    from megagrpo.trainers.sft import run_sft

    root = tmp_path_factory.mktemp("twin")
    write_math_dataset(root / "train.parquet", math_records(200, seed=1))
    write_math_dataset(root / "val.jsonl", math_records(8, seed=2))
    cfg = load_config(
        "deepscaler/cpu_twin_model",
        [
            f"logging.dir={root}",
            f"checkpoint.dir={root / 'model-ckpt'}",
            "sft.num_steps=40",
            "data.math_unboxed_frac=0",
            "sft.val_every=0",
            "sft.num_val_examples=8",
        ],
        trainer="sft",
    )
    run_sft(cfg)
    return root


def _stage(root: Path, n: int, init_from: Path, *extra: str) -> list[str]:
    return [
        f"logging.dir={root}",
        f"model.init_from={init_from}",
        f"data.train_path={root / 'train.parquet'}",
        f"data.val_path={root / 'val.jsonl'}",
        "data.num_val_prompts=8",
        "grpo.num_prompts_per_step=4",
        "policy.mini_batch_size=16",
        "eval.val_samples=2",
        f"checkpoint.dir={root / f'ckpt{n}'}",
        *extra,
    ]


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def _weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out |= load_file(f)
    return out


def _stage_2(root: Path, run1: Path) -> list[str]:
    """Stage 2 with a longer context but stage 1's response budget, so its greedy and seeded samples of the
    validation problems can be compared; an lr so small its one step leaves the weights as loaded."""
    extra = ("grpo.num_steps=1", "logging.val_every=1", "generation.max_new_tokens=48")
    return [*_stage(root, 2, run1, *extra), "policy.lr=1.0e-12", "policy.min_lr=1.0e-12"]


@pytest.fixture(scope="module")
def stages(twin) -> tuple[Path, Path]:
    """(stage 1's run directory, stage 2's): 2 GRPO steps from the made model, then 1 from stage 1's."""
    from megagrpo.trainers.grpo import train

    made = twin / "cpu-twin-model"
    # The 40-step model's rollouts of these prompts at temperature 0.6 include right and wrong answers,
    # so stage 1's steps have a signal (sampled at the stage's 1.0 they happen to be all wrong: every
    # advantage 0, no update to see).
    sampling = ["generation.temperature=0.6", "grpo.kl_coef=0.001"]
    run1 = train(
        load_config(
            "deepscaler/cpu_twin_1",
            _stage(twin, 1, made, "grpo.num_steps=2", "logging.val_every=2", *sampling),
        )
    )
    run2 = train(load_config("deepscaler/cpu_twin_2", _stage_2(twin, run1)))
    return run1, run2


def test_stage_2_starts_from_stage_1s_result(twin, stages):
    run1, run2 = stages
    made = twin / "cpu-twin-model"
    assert run1 == twin / "cpu-twin-1"
    assert load_config("deepscaler/cpu_twin_2", _stage_2(twin, run1)).model.seq_length == 160
    saved = yaml.safe_load((run2 / "config.yaml").read_text())["model"]
    assert saved["hf_dir"] == str(run1 / "hf_export") and saved["init_from"] is None

    m1, m2 = _metrics(run1), _metrics(run2)
    for key in ("val/accuracy", "val/pass@1", "val/pass@2"):
        assert m2[0][key] == m1[2][key], key  # the same model answers the same problems the same way
    assert m1[2]["data/skipped_rows"] == 0 and "data/skipped_long_prompts" in m2[1]
    assert max(m1[step]["reward/std"] for step in (1, 2)) > 0  # stage 1 had something to learn

    made_w, w1, w2 = (_weights(d / "hf_export") for d in (made, run1, run2))
    assert made_w.keys() == w1.keys() == w2.keys()
    trained = max(float((w1[k] - made_w[k]).abs().max()) for k in w1)
    kept = max(float((w2[k] - w1[k]).abs().max()) for k in w1)
    assert trained > 1e-5  # stage 1 moved away from the made model (Adam steps of ~lr = 1e-4)
    assert kept < 1e-7  # stage 2 began where stage 1 ended


@pytest.fixture(scope="module")
def evals(twin, stages) -> dict[str, dict]:
    """``megagrpo eval`` of stage 1's step-2 checkpoint (``eval_ckpt``) and of its HF export
    (``eval_export``): the same weights, the same seed, 4 samples per problem. By output directory: its
    ``eval.json`` (``json``), ``eval.md`` (``md``), the evaluated model's path (``model``) and what the
    command printed (``printed``)."""
    from megagrpo.cli import main

    run1, _ = stages
    common = ["eval", "--config", "deepscaler/cpu_twin_1", "--samples", "4", f"logging.dir={twin}"]
    common.append(f"data.val_path={twin / 'val.jsonl'}")  # the evaluated model replaces the config's
    models = {"eval_ckpt": twin / "eval_ckpt" / "hf", "eval_export": run1 / "hf_export"}
    given = {
        "eval_ckpt": ["--checkpoint", str(twin / "ckpt1" / "step_2")],
        "eval_export": ["--model", str(run1 / "hf_export")],
    }
    out = {}
    for name, model in models.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main([*common, *given[name], "--out", str(twin / name)]) == 0
        out[name] = {
            "json": json.loads((twin / name / "eval.json").read_text()),
            "md": (twin / name / "eval.md").read_text(),
            "model": str(model),
            "printed": printed.getvalue(),
        }
    return out


def test_eval_of_a_checkpoint_scores_what_its_export_scores(twin, evals):
    """`eval --checkpoint step_N` verifies and exports that checkpoint, then scores what the run's own
    HF export (the same weights) scores."""
    by_ckpt, by_export = evals["eval_ckpt"]["json"], evals["eval_export"]["json"]
    assert (twin / "eval_ckpt" / "hf" / "config.json").is_file()
    assert evals["eval_ckpt"]["json"]["settings"]["model"] == evals["eval_ckpt"]["model"]
    assert by_ckpt["summary"] == by_export["summary"] and by_ckpt["problems"] == by_export["problems"]


def test_eval_twice_with_the_same_seed_gives_the_same_table(evals):
    """The two evaluations of the same weights with the same seed: the same report and table, but for the
    path each loaded the model from."""
    a, b = evals["eval_ckpt"], evals["eval_export"]
    assert {**a["json"], "settings": {**a["json"]["settings"], "model": b["model"]}} == b["json"]
    assert a["md"].replace(a["model"], b["model"]) == b["md"]
    summary, problems = b["json"]["summary"], b["json"]["problems"]
    assert list(summary) == ["pass@1", "pass@2", "pass@4"]
    assert len(problems) == 8 and all(p["samples"] == 4 for p in problems)
    assert summary["pass@1"] == pytest.approx(sum(p["correct"] for p in problems) / 32)
    for run in (a, b):
        assert "| pass@1 | pass@2 | pass@4 |" in run["printed"]
