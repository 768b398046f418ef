"""Generation overlapped with training (``grpo.max_staleness: 1``) on the real stack (tiny config:
TP=2 Megatron over gloo, one vLLM CPU engine):
- after the first step every trained rollout is exactly one policy version old, the probe passes
  after every sync, and a run stopped by Ctrl-C and resumed (the rollouts generated ahead are saved
  with its checkpoint) logs the same next steps as the run that went straight through;
- an engine killed while it generates ahead of a training step ends the run with a clear error and
  a checkpoint of what was trained.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
from _grpo_runs import DETERMINISTIC, metrics, reuse_warmup, run_overrides
from test_faults import EngineKiller

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e


def _with_resume(cfg):
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))


def _overlapped(root, name, ckpt, steps=4, extra=()):
    return load_config(
        None, run_overrides(root, name, ckpt, steps=steps, extra=["grpo.max_staleness=1", *extra])
    )


def test_one_step_off_policy_versions_and_resume(undisturbed, tmp_path, capsys, monkeypatch):
    from megagrpo.trainers.grpo import train

    root = undisturbed.root
    reuse_warmup(root, "overlap")
    want = metrics(train(_overlapped(root, "overlap", tmp_path / "ckpt_a")))
    assert sorted(want) == [0, 1, 2, 3, 4]
    assert want[1]["staleness/max"] == 0 and want[1]["staleness/generator_version"] == 0
    for step in (2, 3, 4):
        assert want[step]["staleness/mean"] == want[step]["staleness/max"] == 1
        assert want[step]["staleness/generator_version"] == step - 2
        assert want[step]["staleness/off_policy_token_frac"] == 1.0
    for step in (1, 2, 3, 4):  # k = 1 syncs after every step
        assert 1.0 <= want[step]["sync/probe_error"] <= 1.001
    assert all(want[step]["timing/generation_ahead_s"] > 0 for step in (1, 2, 3))  # none after the last
    # Step 1 trains the same rollouts as the sequential loop (generated from the same weights).
    assert want[1]["reward/mean"] == undisturbed.metrics[1]["reward/mean"]

    # Ctrl-C once step 2 is logged: the step running then finishes, a checkpoint with the rollouts
    # generated ahead is saved, and --resume continues exactly as the run that was not stopped.
    reuse_warmup(root, "overlap_resumed")
    cfg = _overlapped(root, "overlap_resumed", tmp_path / "ckpt_b")
    _interrupt_once_logged(monkeypatch, step=2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    stopped = max(metrics(root / "runs" / "overlap_resumed"))
    assert stopped < 4
    capsys.readouterr()
    got = metrics(train(_with_resume(cfg)))
    assert f"with the rollouts of step {stopped + 1} generated ahead" in capsys.readouterr().out
    for step in range(stopped + 1, 5):
        for key in (*DETERMINISTIC, "staleness/generator_version"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-9), (step, key)


def _interrupt_once_logged(monkeypatch, step: int) -> None:
    """Ctrl-C right after the metrics of ``step`` are written, at that point of the run whatever the
    machine's load (a thread watching the file could see it steps later)."""
    from megagrpo.metrics import MetricsLogger

    log = MetricsLogger.log

    def log_then_interrupt(self, logged_step, *args, **kwargs):
        log(self, logged_step, *args, **kwargs)
        if logged_step == step:
            os.kill(os.getpid(), signal.SIGINT)  # the driver's handler runs in the main thread

    monkeypatch.setattr(MetricsLogger, "log", log_then_interrupt)


def test_engine_killed_while_generating_ahead_stops_the_run(undisturbed, tmp_path):
    from megagrpo.ckpt import run as ckpt_io
    from megagrpo.runtime.faults import EngineFailure
    from megagrpo.trainers.grpo import train

    root = undisturbed.root
    reuse_warmup(root, "overlap_killed")
    killer = EngineKiller(root / "runs" / "overlap_killed" / "metrics.jsonl", after_step=1)
    killer.start()
    # Without validation every generate call after step 1 is one that runs ahead of a training step
    # (validation generates between steps, where an engine that dies is restarted).
    extra = ["generation.timeout_s=120", "logging.val_every=0"]
    with pytest.raises(EngineFailure) as info:
        train(_overlapped(root, "overlap_killed", tmp_path / "ckpt", extra=extra))
    killer.join(timeout=10)
    assert killer.error is None, killer.error
    assert killer.killed is not None
    message = str(info.value)
    assert "failed while generating the next step's rollouts during training" in message
    assert "continue with --resume" in message
    assert ckpt_io.latest(tmp_path / "ckpt").name == "step_2"  # step 2 trained before the failure surfaced
