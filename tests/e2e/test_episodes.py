"""Multi-turn episodes on the real stack (tiny config: TP=2 Megatron over gloo, one vLLM CPU engine, an
environment loaded by file path like a user's, ``tests/e2e/_echo_env.py``), generated one step ahead
(``grpo.max_staleness: 1``) so the episodes of the next step are saved with every checkpoint:

- every episode the engine produced is token-in/token-out: its opening is the rendered opening, and each
  observation's tokens are exactly the chat template's rendering of the environment's reply to the
  decoded sampled turn before it; the trainer's sequence is the opening + these tokens, and its loss
  covers exactly the sampled ones;
- the probe passes after every sync and the trainer's logprobs of the sampled tokens agree with the
  engine's (TIS on), with observation tokens inside the sequences;
- environments that fail (raise, hang, kill their worker) end their episodes and the run goes on;
- a run resumed from a checkpoint with episodes in flight repeats the next step of the run that went on.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from _grpo_runs import DETERMINISTIC, metrics, reuse_warmup, run_overrides

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e

ECHO = Path(__file__).with_name("_echo_env.py")


def _config(root: Path, name: str, ckpt: Path, *, steps: int = 3, resume: bool = False):
    extra = [
        "grpo.max_staleness=1",
        f"env.environment={ECHO}:Echo",
        "env.args.fault_rate=0.5",
        "env.max_new_tokens=6",
        "env.max_turns=4",
        "env.max_episode_tokens=60",
        "env.num_workers=8",  # the hanging environments wait out their deadline side by side
        "env.step_timeout_s=3",
        "checkpoint.keep_last=3",
        f"checkpoint.resume={str(resume).lower()}",
    ]
    return load_config(None, run_overrides(root, name, ckpt, steps=steps, extra=extra))


@pytest.fixture(scope="module")
def episodes_run(undisturbed):
    from megagrpo.trainers.grpo import train

    root = undisturbed.root
    reuse_warmup(root, "episodes")
    cfg = _config(root, "episodes", root / "ckpt_episodes")
    return cfg, metrics(train(cfg)), root / "ckpt_episodes"


def test_episodes_are_the_sampled_tokens_and_their_observations(episodes_run):
    from transformers import AutoTokenizer

    from megagrpo.envs.chat import ChatRenderer
    from megagrpo.trainers.rollouts import Pending, to_train_batch

    cfg, _, ckpt = episodes_run
    pending = Pending.load(ckpt / "step_2")  # step 3's episodes, generated while step 2 trained
    assert pending is not None
    renderer = ChatRenderer(
        AutoTokenizer.from_pretrained(Path(cfg.logging.dir) / "episodes" / "warmup" / "ckpt" / "hf")
    )
    rollouts = pending.rollouts
    g = cfg.grpo.num_generations
    checked = 0
    for i, comp in enumerate(rollouts.completions):
        task = rollouts.prompts[i // g].task
        assert comp.prompt_ids == renderer.prompt_ids([{"role": "user", "content": f"{task['start']}="}])
        assert len(comp.loss_mask) == len(comp.token_ids) == len(comp.logprobs)
        # Runs of sampled tokens, each followed by the observation the environment answered it with.
        runs, start = [], 0
        for t in range(1, len(comp.token_ids) + 1):
            if t == len(comp.token_ids) or comp.loss_mask[t] != comp.loss_mask[start]:
                runs.append((comp.loss_mask[start], comp.token_ids[start:t], comp.logprobs[start:t]))
                start = t
        assert runs[0][0], "an episode starts with a sampled turn"
        for (sampled, ids, lps), nxt in zip(runs, [*runs[1:], None], strict=True):
            if sampled:
                assert all(lp <= 0.0 for lp in lps) and sum(lps) < 0.0
                if nxt is not None:
                    echoed = [{"role": "user", "content": renderer.turn_text(ids) + "="}]
                    assert nxt[1] == renderer.observation_ids(echoed)
                    checked += 1
            else:
                assert all(lp == 0.0 for lp in lps)
        assert comp.stats["turns"] == sum(1 for s, _, _ in runs if s)
        if comp.finish_reason == "stop":
            assert comp.stats["turns"] == 3 and renderer.closed(runs[-1][1])
    assert checked > 0
    batch = to_train_batch(cfg, rollouts)
    mask = batch.response_mask()
    for row, comp in enumerate(rollouts.completions):
        n = len(comp.prompt_ids)
        assert batch.input_ids[row, : int(batch.lengths[row])].tolist() == comp.prompt_ids + comp.token_ids
        in_loss = comp.finish_reason != "env_error"
        assert mask[row, n - 1 : n - 1 + len(comp.token_ids)].tolist() == [
            m and in_loss for m in comp.loss_mask
        ]
        assert not mask[row, : n - 1].any() and not mask[row, n - 1 + len(comp.token_ids) :].any()


def test_probe_and_importance_weights_hold_on_multi_turn_batches(episodes_run):
    _, got, _ = episodes_run
    for step in (1, 2, 3):
        row = got[step]
        assert row["episode/turns_mean"] > 1.5, row
        assert 0 < row["episode/sampled_tokens_mean"] < row["response/length_mean"]
        assert row["sync/probe_error"] < 1.001
    # Step 1 trains on episodes of the weights it starts from (later steps' are one version old): the
    # trainer scores their sampled tokens as the engine did, observations in between notwithstanding.
    assert 1.0 <= got[1]["train/token_mult_prob_error_mean"] < 1.001
    assert got[1]["train/behav_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    # Faulty environments ended their episodes (raise, hang past env.step_timeout_s, worker exit).
    assert sum(got[s]["episode/env_errors"] for s in (1, 2, 3)) > 0


def test_resume_with_episodes_in_flight_repeats_the_next_step(episodes_run, tmp_path):
    from megagrpo.trainers.grpo import train

    cfg, want, ckpt = episodes_run
    root = Path(cfg.logging.dir).parent
    resumed_ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpt / "step_2", resumed_ckpt / "step_2")
    reuse_warmup(root, "episodes_resumed")
    resumed = _config(root, "episodes_resumed", resumed_ckpt, resume=True)
    resumed = dataclasses.replace(resumed, logging=dataclasses.replace(resumed.logging, val_every=0))
    got = metrics(train(resumed))
    assert sorted(got) == [3]
    for key in (*DETERMINISTIC, "episode/turns_mean", "episode/env_errors"):
        assert got[3][key] == pytest.approx(want[3][key], rel=1e-6, abs=1e-9), key
