"""``megagrpo sft`` and ``megagrpo dpo`` end to end on spawned gloo ranks: a run resumed from a checkpoint
(the straight run's own, copied) logs the same next steps as the run that went straight through; outputs of a
finished run."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from hf_models import make_tiny_hf

from megagrpo.ckpt import manifest
from megagrpo.config import load_config
from megagrpo.data.tokenizer import char_tokenizer

pytestmark = pytest.mark.dist

_SAME = ("train/loss", "train/grad_norm", "train/lr")


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def _problems(n: int, seed: int) -> list[tuple[str, str]]:
    from megagrpo.data.arithmetic import ArithmeticTask

    return [(p.prompt, p.answer) for p in ArithmeticTask(max_operand=20, ops="+").problems(n, seed=seed)]


def _run_and_resume(run, cfg_for, tmp_path: Path, run_name: str) -> tuple[dict, dict, Path]:
    """(straight run's metrics, resumed run's metrics, resumed run's directory).

    The straight run saves at steps 2 and 4; the resumed run starts from a copy of its step-2 checkpoint
    and of what it had logged by then, as a run that had stopped there would have left them.
    """
    want = _metrics(Path(run(cfg_for(tmp_path / "a", steps=4)).run_dir))
    assert sorted(p.name for p in (tmp_path / "a" / "ckpt").iterdir()) == ["step_2", "step_4"]
    # Every rank's shards are in the manifest with the digests their writers computed, and they match.
    ckpt = tmp_path / "a" / "ckpt" / "step_2"
    listed = set(json.loads((ckpt / "manifest.json").read_text())["files"])
    on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert listed == on_disk and any(name.endswith(".distcp") for name in listed)
    manifest.verify(ckpt)
    shutil.copytree(ckpt, tmp_path / "b" / "ckpt" / "step_2")
    logged = (tmp_path / "a" / run_name / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "b" / run_name).mkdir(parents=True)
    (tmp_path / "b" / run_name / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in logged if json.loads(line)["step"] <= 2)
    )
    resumed = cfg_for(tmp_path / "b", steps=4, export=True)
    resumed = dataclasses.replace(resumed, checkpoint=dataclasses.replace(resumed.checkpoint, resume=True))
    res = run(resumed)
    return want, _metrics(Path(res.run_dir)), Path(res.run_dir)


def test_sft_resume_reproduces_the_next_steps(tmp_path):
    from megagrpo.trainers.sft import run_sft

    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in _problems(48, seed=1)
    ]
    rows.insert(5, {"messages": [{"role": "user", "content": "1+1="}]})  # no assistant turn: skipped
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def cfg_for(root: Path, steps: int, export: bool = False):
        return load_config(
            "tiny_sft",
            [
                f"logging.dir={root}",
                "logging.tensorboard=false",
                "logging.progress_bar=false",
                "parallel.tensor_model_parallel_size=1",
                "parallel.data_parallel_size=2",
                "parallel.use_distributed_optimizer=true",
                f"data.train_path={data}",
                f"data.val_path={data}",
                "data.on_bad_row=skip",
                "sft.batch_size=8",
                f"sft.num_steps={steps}",
                "sft.num_val_examples=8",
                # A warm-up over 3 steps checks that the scheduler state comes back: the resumed run starts
                # inside it.
                "policy.lr_schedule=constant",
                "policy.lr_warmup_steps=3",
                f"checkpoint.dir={root / 'ckpt'}",
                "checkpoint.save_every=2",
                f"checkpoint.export_hf_at_end={str(export).lower()}",
            ],
            trainer="sft",
        )

    want, got, run_dir = _run_and_resume(run_sft, cfg_for, tmp_path, "tiny-sft")
    assert sorted(got) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key in _SAME:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6), (step, key)
    assert got[4]["val/loss"] == pytest.approx(want[4]["val/loss"], rel=1e-6)
    assert want[4]["train/loss"] < want[1]["train/loss"]
    assert got[4]["data/skipped_rows"] == 2  # the bad row, once as training and once as validation data
    export = run_dir / "hf_export"
    assert (export / "model.safetensors").is_file() and (export / "chat_template.jinja").is_file()


def test_dpo_resume_reproduces_the_next_steps(tmp_path):
    from megagrpo.trainers.dpo import run_dpo

    hf = make_tiny_hf("qwen2", tmp_path / "model", hidden_size=64)
    char_tokenizer().save_pretrained(str(hf))
    rows = []
    for q, a in _problems(40, seed=2):
        rows.append({"problem": q, "chosen": a, "rejected": str(int(a) + 1)})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def cfg_for(root: Path, steps: int, export: bool = False):
        return load_config(
            "tiny_dpo",
            [
                "model.tiny=null",
                f"model.hf_dir={hf}",
                "model.seq_length=32",
                f"logging.dir={root}",
                "logging.tensorboard=false",
                "logging.progress_bar=false",
                "parallel.tensor_model_parallel_size=1",  # TP=2 and DP=2: tests/dist/test_supervised.py
                f"data.train_path={data}",
                f"data.val_path={data}",
                "dpo.batch_size=6",
                f"dpo.num_steps={steps}",
                "dpo.num_val_pairs=6",
                "dpo.loss=ipo",
                "dpo.length_normalize=true",
                "policy.micro_batch_max_tokens=64",
                "policy.lr_warmup_steps=3",
                f"checkpoint.dir={root / 'ckpt'}",
                "checkpoint.save_every=2",
                f"checkpoint.export_hf_at_end={str(export).lower()}",
            ],
            trainer="dpo",
        )

    want, got, run_dir = _run_and_resume(run_dpo, cfg_for, tmp_path, "tiny-dpo")
    assert sorted(got) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key in (*_SAME, "train/margin_mean", "train/accuracy"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6), (step, key)
    assert want[1]["train/margin_mean"] == 0.0  # IPO's first step: policy == reference too
    assert want[4]["val/margin_mean"] > 0  # the preferred answers became likelier
    assert (run_dir / "hf_export" / "model.safetensors").is_file()
