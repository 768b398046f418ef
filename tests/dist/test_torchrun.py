"""The trainer-only commands (``megagrpo sft``, ``dpo``, ``warmup``) launched by a real ``torchrun`` of two
gloo ranks, as ``launch/torchrun.sh`` does: each rank is one of torchrun's processes (not spawned by
megagrpo), only rank 0 reports, logs metrics and commits checkpoints, and the command exits 0 on every rank.

torchrun's ``--redirects 3`` writes each rank's stdout and stderr to its own file, which is how these tests
tell what rank 0 printed from what rank 1 did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megagrpo.ckpt import manifest

pytestmark = pytest.mark.dist

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
DEADLINE_S = 900  # generous: a hung rendezvous or collective fails the test with every rank's log


def _torchrun(tmp_path: Path, command: str, *args: str) -> dict[int, str]:
    """``torchrun --standalone --nproc_per_node 2 -m megagrpo.cli <command> <args>``; asserts exit status 0
    and returns each rank's stdout by rank."""
    logs = tmp_path / "torchrun_logs"
    cmd = [
        TORCHRUN,
        "--standalone",  # a free rendezvous port: tests may run side by side
        "--nproc_per_node",
        "2",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        "-m",
        "megagrpo.cli",
        command,
        *args,
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {command} still running after {DEADLINE_S}s\n{out}\n{_rank_logs(logs)}")
    assert proc.returncode == 0, f"torchrun {command} exited {proc.returncode}\n{out}\n{_rank_logs(logs)}"
    stdout = {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stdout.log")}
    assert sorted(stdout) == [0, 1], _rank_logs(logs)
    return stdout


def _rank_logs(logs: Path) -> str:
    return "\n".join(f"--- {p.relative_to(logs)}\n{p.read_text()}" for p in sorted(logs.rglob("*.log")))


def _metric_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _common(root: Path) -> list[str]:
    return [f"logging.dir={root / 'runs'}", "logging.tensorboard=false", "logging.progress_bar=false"]


def _committed(ckpt_dir: Path) -> list[str]:
    """The checkpoint directory's entries, once every listed step matches its manifest."""
    names = sorted(p.name for p in ckpt_dir.iterdir())
    for name in names:
        manifest.verify(ckpt_dir / name)
    return names


def test_sft_under_torchrun_checkpoints_and_exports_from_rank_0(tmp_path):
    stdout = _torchrun(
        tmp_path,
        "sft",
        "--config",
        "tiny_sft",
        *_common(tmp_path),
        "sft.num_steps=2",
        "sft.batch_size=8",
        "sft.val_every=2",
        "sft.num_val_examples=8",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.save_every=2",
        "checkpoint.export_hf_at_end=true",
    )
    run = tmp_path / "runs" / "tiny-sft"
    assert _metric_steps(run / "metrics.jsonl") == [0, 1, 2]  # one writer: no step twice
    assert _committed(tmp_path / "ckpt") == ["step_2"]
    # The export at the end spawns a converter rank from inside torchrun's rank 0; it finished and was
    # published (no staging directory left behind).
    assert (run / "hf_export" / "model.safetensors").is_file()
    assert sorted(p.name for p in run.iterdir() if "hf_export" in p.name) == ["hf_export"]
    assert stdout[0].count("megagrpo sft: validation before -> after") == 1
    assert "step 2/2" in stdout[0]
    assert "step " not in stdout[1] and "megagrpo sft" not in stdout[1]


def test_dpo_under_torchrun_warms_up_then_trains_on_both_ranks(tmp_path):
    """``megagrpo dpo`` on the tiny model warms it up first (``warmed_up_model``, where rank 1 gets no
    warm-up result), then samples pairs and trains."""
    stdout = _torchrun(
        tmp_path,
        "dpo",
        "--config",
        "tiny_dpo",
        *_common(tmp_path),
        "warmup.steps=2",
        "warmup.batch_size=8",
        "warmup.num_eval_prompts=8",
        "data.num_val_prompts=8",
        "dpo.num_steps=2",
        "dpo.batch_size=4",
        "dpo.num_val_pairs=4",
        "dpo.num_synthetic_pairs=8",
        "dpo.synthetic_samples=2",
        "dpo.val_every=2",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.save_every=2",
        "checkpoint.export_hf_at_end=false",
    )
    run = tmp_path / "runs" / "tiny-dpo"
    assert (run / "warmup" / "ckpt" / "warmup_config.yaml").is_file()  # the warm-up is stamped for reuse
    assert _metric_steps(run / "warmup" / "metrics.jsonl") == [0, 1, 2]
    assert _metric_steps(run / "metrics.jsonl") == [0, 1, 2]
    assert len((run / "data" / "train.jsonl").read_text().splitlines()) == 8
    assert _committed(tmp_path / "ckpt") == ["step_2"]
    assert stdout[0].count("warm-up: greedy accuracy") == 1
    assert stdout[0].count("megagrpo dpo: validation before -> after") == 1
    assert "warm-up" not in stdout[1] and "megagrpo dpo" not in stdout[1]


def test_warmup_command_under_torchrun_reports_from_rank_0(tmp_path):
    stdout = _torchrun(
        tmp_path,
        "warmup",
        "--config",
        "tiny_cpu",
        *_common(tmp_path),
        "warmup.steps=2",
        "warmup.batch_size=8",
        "warmup.num_eval_prompts=8",
    )
    run = tmp_path / "runs" / "tiny-cpu" / "warmup"
    assert _metric_steps(run / "metrics.jsonl") == [0, 1, 2]
    assert stdout[0].count("warm-up done in") == 1
    assert f"metrics: {run / 'metrics.jsonl'}" in stdout[0]
    assert "warm-up done" not in stdout[1]
