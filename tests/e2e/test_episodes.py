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
- a run resumed from a checkpoint with episodes in flight repeats the next step of the run that went on;
- under ``grpo.async_mode: partial`` the episodes, requests of the engine's stream, are token-in/token-out
  as above, their tokens stamped with the versions that sampled them; the probe passes after every swap
  into turns in flight, staleness stays within its bound, failed environments' groups are generated again
  and no failed episode is trained.
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


def _config(root: Path, name: str, ckpt: Path, *, steps: int = 3, resume: bool = False, more=()):
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
        *more,  # later overrides win
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
    from megagrpo.trainers.rollouts import Pending

    cfg, _, ckpt = episodes_run
    pending = Pending.load(ckpt / "step_2")  # step 3's episodes, generated while step 2 trained
    assert pending is not None
    renderer = _renderer(cfg, "episodes")
    rollouts = pending.rollouts
    g = cfg.grpo.num_generations
    checked = sum(
        _assert_episode(renderer, rollouts.prompts[i // g].task, comp)
        for i, comp in enumerate(rollouts.completions)
    )
    assert checked > 0
    _assert_batch(cfg, rollouts)


def _renderer(cfg, run_name: str):
    from transformers import AutoTokenizer

    from megagrpo.envs.chat import ChatRenderer

    return ChatRenderer(
        AutoTokenizer.from_pretrained(Path(cfg.logging.dir) / run_name / "warmup" / "ckpt" / "hf")
    )


def _assert_episode(renderer, task: dict, comp) -> int:
    """``comp`` is the opening of ``task``, then sampled turns, each followed by the chat template's
    rendering of the echo of its decoded text; returns how many observations were checked."""
    assert comp.prompt_ids == renderer.prompt_ids([{"role": "user", "content": f"{task['start']}="}])
    assert len(comp.loss_mask) == len(comp.token_ids) == len(comp.logprobs)
    # Runs of sampled tokens, each followed by the observation the environment answered it with.
    runs, start = [], 0
    for t in range(1, len(comp.token_ids) + 1):
        if t == len(comp.token_ids) or comp.loss_mask[t] != comp.loss_mask[start]:
            runs.append((comp.loss_mask[start], comp.token_ids[start:t], comp.logprobs[start:t]))
            start = t
    assert runs[0][0], "an episode starts with a sampled turn"
    checked = 0
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
    return checked


def _assert_batch(cfg, rollouts) -> None:
    """The trainer's sequences are the openings + the episodes' tokens; the loss covers the sampled ones."""
    from megagrpo.trainers.rollouts import to_train_batch

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


# Partial rollouts (grpo.async_mode partial): each episode a request of an engine's stream, its turns
# requests of the stream underneath, weights swapped between engine steps. A failed environment fails its
# episode's request and its group is generated again whole, with the same task, until its last try
# (trainers.group_buffer.MAX_GROUP_FAILURES). At fault_rate 0.1 positions 2 and 10 hang and 15 and 19 kill
# their worker; a hang costs its try env.step_timeout_s.
PARTIAL = [
    "grpo.async_mode=partial",
    "grpo.max_staleness=2",
    "env.args.fault_rate=0.1",
    "env.step_timeout_s=1",
    "checkpoint.keep_last=3",
]


def test_partial_rollouts_play_episodes_across_weight_swaps(undisturbed):
    from megagrpo.trainers.group_buffer import FinishedGroup, load_in_flight, request_from, rollouts_of
    from megagrpo.trainers.grpo import train
    from megagrpo.types import Completion

    root = undisturbed.root
    reuse_warmup(root, "episodes_partial")
    cfg = _config(root, "episodes_partial", root / "ckpt_episodes_partial", more=PARTIAL)
    got = metrics(train(cfg))
    assert set(got) >= {1, 2, 3}
    for step in (1, 2, 3):
        row = got[step]
        assert 1.0 <= row["sync/probe_error"] <= 1.001, (step, row["sync/probe_error"])
        assert row["staleness/max"] <= 2, (step, row)
        # A failed environment's episode is never a sample (its group was generated again).
        assert row["episode/env_errors"] == 0 and row["episode/turns_mean"] > 1.5, (step, row)
        assert row["async/episodes_restarted"] == 0  # none resumed in this run
    assert sum(got[s]["async/requeued_groups"] for s in (1, 2, 3)) > 0

    # The episodes every checkpoint saved (finished groups not yet trained on, finished samples of groups
    # still in flight) are token-in/token-out, every token stamped with the version that sampled it.
    renderer, groups, checked, unfinished = _renderer(cfg, "episodes_partial"), [], 0, []
    for step in (1, 2, 3):
        state = load_in_flight(Path(cfg.checkpoint.dir) / f"step_{step}")
        assert state is not None and state["version"] == step
        tasks = {r["position"]: r["prompt"]["task"] for r in state["buffer"]["queued"]}
        saved = [
            (row["request"]["prompt"]["task"], c)
            for row in state["buffer"]["ready"]
            for c in row["completions"]
        ]
        saved += [
            (tasks[int(pos)], c) for pos, by_sample in state["samples"].items() for c in by_sample.values()
        ]
        for task, row in saved:
            comp = Completion(**row)
            assert comp.finish_reason in ("stop", "length"), comp.finish_reason
            checked += _assert_episode(renderer, task, comp)
            versions = [v for v, n in comp.versions for _ in range(n)]
            assert len(versions) == len(comp.token_ids) and versions == sorted(versions)
            assert versions[0] >= 0 and versions[-1] <= step
        groups += [
            FinishedGroup(
                request_from(row["request"]), [Completion(**c) for c in row["completions"]], row["rewards"]
            )
            for row in state["buffer"]["ready"]
        ]
        unfinished += [
            _assert_saved_episode(renderer, row, step) for row in state["partials"] if row["episode"]
        ]
    assert checked > 0 and unfinished
    if groups:
        _assert_batch(cfg, rollouts_of(groups))


def _assert_saved_episode(renderer, row: dict, step: int) -> str:
    """A checkpoint's unfinished episode: its tokens so far token-in/token-out, the environment's answers
    those of its turns' texts, and the step or turn running; returns which was."""
    from megagrpo.types import Completion

    saved = row["episode"]
    assert saved["opening"] == [{"role": "user", "content": f"{row['request']['task']['start']}="}]
    for text, (messages, _, done, _, _) in saved["answers"]:
        assert messages == [{"role": "user", "content": f"{text}="}] and not done
    if not row["token_ids"]:  # its first turn at the engine
        assert saved["answers"] == [] and saved["turn"] is not None
        return "turn"
    comp = Completion(
        0,
        row["token_ids"],
        row["logprobs"],
        "length",
        loss_mask=saved["mask"],
        prompt_ids=saved["prompt"],
        stats={"turns": float(saved["turns"])},
    )
    _assert_episode(renderer, row["request"]["task"], comp)
    texts, start = [], 0
    for t in range(1, len(comp.token_ids) + 1):
        if t == len(comp.token_ids) or comp.loss_mask[t] != comp.loss_mask[start]:
            if comp.loss_mask[start]:
                texts.append(renderer.turn_text(comp.token_ids[start:t]))
            start = t
    assert row["versions"] == sorted(row["versions"]) and row["versions"][-1] <= step
    if saved["pending"] is not None:  # its last turn's step was running
        assert comp.loss_mask[-1] and [text for text, _ in saved["answers"]] + [saved["pending"]] == texts
        return "step"
    turn = saved["turn"]
    assert not comp.loss_mask[-1] and [text for text, _ in saved["answers"]] == texts
    assert len(turn["token_ids"]) == len(turn["versions"]) == len(turn["logprobs"])
    assert all(v >= row["versions"][-1] for v in turn["versions"])
    return "turn"
