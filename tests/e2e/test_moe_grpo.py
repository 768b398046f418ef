"""GRPO on a mixture-of-experts model, on the real stack: the tiny Qwen3-MoE of ``configs/tiny_moe.yaml``
(8 experts, top-2) trained by Megatron over gloo with its experts split over expert-parallel ranks, one vLLM
CPU engine generating, the weights synced into the engine after every step:

- at EP 2 with rollout routing replay: the engine returns every sampled token's experts, the trainer
  replays them, the probe passes after every sync, the trainer's logprobs of the sampled tokens are the
  engine's (fp32: within 1e-3 per token on average, as the probe's bound), and the routing metrics are
  logged;
- at TP 2 x EP 2 (4 ranks: sequence parallel, the torch layers) without replay, on the gathered path (two
  expert senders, each gathering its experts over its TP pair): the probe passes after every sync;
- at TP 2 x EP 2 folded onto 2 ranks (ETP 1: each rank holds half the experts whole and sends them
  itself) with replay (each TP rank replays its sequence-parallel slice), shard-wise (in delta sync mode),
  and gathered over
  multi-turn episodes (an environment's observations between the engine's turns; each episode's routing
  put together from its turns' requests): the probe passes and the trainer's logprobs are the engine's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _grpo_runs import metrics, reuse_warmup, run_overrides

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e


def _overrides(root, name: str, *extra: str) -> list[str]:
    """The e2e runs' overrides for two steps, a shorter warm-up and no checkpoints. DAPO's soft length
    penalty over every length a response may have (buffer 7 of 8 tokens) makes the rewards differ within
    a group even where no answer is right yet, so that every optimizer step moves the weights."""
    short = [
        "warmup.steps=20",
        "warmup.num_eval_prompts=8",
        "data.num_val_prompts=8",
        "checkpoint.save_every=0",
        "grpo.overlong_policy=soft_penalty",
        "grpo.overlong_buffer_tokens=7",
    ]
    return run_overrides(root, name, root / name / "ckpt", steps=2, extra=[*short, *extra])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A directory whose ``runs/reference/warmup`` holds the runs' one warm-up (it does not depend on the
    parallel layout: ``warmup.warmup_stamp``); each run starts from a copy."""
    from megagrpo.trainers.warmup import warmed_up_model

    root = tmp_path_factory.mktemp("moe_grpo")
    warmed_up_model(load_config("tiny_moe", _overrides(root, "reference")), root / "runs" / "reference")
    return root


def _train(root, name: str, *layout: str) -> dict:
    from megagrpo.trainers.grpo import train

    reuse_warmup(root, name)
    return metrics(train(load_config("tiny_moe", _overrides(root, name, *layout))))


def _assert_synced(run: dict) -> None:
    for step in (1, 2):
        assert 1.0 <= run[step]["sync/probe_error"] <= 1.001, (step, run[step]["sync/probe_error"])
        assert run[step]["train/update_applied"] == 1.0
        assert run[step]["train/grad_norm"] > 0  # the synced weights are new ones


def test_grpo_at_ep2_with_routing_replay(root):
    _assert_replayed(_train(root, "moe-ep2"))


def _assert_replayed(run: dict) -> None:
    _assert_synced(run)
    for step in (1, 2):
        m = run[step]
        # Replayed: the trainer's logprobs of the sampled tokens are the engine's (both fp32).
        assert m["train/token_mult_prob_error_mean"] <= 1.001
        assert m["train/token_mult_prob_error_mean"] <= m["moe/token_mult_prob_error_no_replay"] + 1e-6
        assert 0.0 <= m["moe/routing_agreement"] <= 1.0
        assert 1 / 8 <= m["moe/expert_load_max"] <= 1 / 2
        assert m["timing/routing_check_s"] > 0


def test_grpo_at_tp2_ep2_without_replay(root):
    layout = [
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "parallel.transformer_impl=torch",
        "grpo.routing_replay=none",
        "generation.weight_sync_path=gathered",
    ]
    run = _train(root, "moe-tp2-ep2", *layout)
    _assert_synced(run)
    assert "moe/routing_agreement" not in run[1]


FOLDED = [
    "parallel.tensor_model_parallel_size=2",
    "parallel.data_parallel_size=1",
    "parallel.expert_tensor_parallel_size=1",
    "parallel.sequence_parallel=true",
    "parallel.transformer_impl=torch",
]


def test_grpo_at_tp2_ep2_folded_with_routing_replay(root):
    """With ``generation.sync_mode: delta``: each step's sync sends the experts' changed elements."""
    with pytest.warns(UserWarning, match="buys little"):  # the tiny MoE is fp32
        run = _train(root, "moe-tp2-ep2-etp1", *FOLDED, "generation.sync_mode=delta")
    _assert_replayed(run)
    for step in (1, 2):  # every sync's digests matched (a mismatch stops the run)
        assert 0 < run[step]["sync/changed_fraction"] <= 1, run[step]["sync/changed_fraction"]
        assert run[step]["sync/bytes"] > 0


def test_grpo_folded_gathered_with_routing_replay_over_multi_turn_episodes(root):
    """Episodes of up to three turns (``tests/e2e/_echo_env.py``): each turn's request re-sends the
    episode so far, and the episode's routing is put together from its turns; the trainer's forward of
    the whole episode, observations included, replays it and scores the sampled tokens as the engine
    did. The weights go by the gathered path (each rank sends its four experts whole)."""
    episodes = [
        f"env.environment={Path(__file__).with_name('_echo_env.py')}:Echo",
        "env.max_new_tokens=6",
        "env.max_turns=3",
        "env.max_episode_tokens=60",
        "env.num_workers=2",
        "grpo.overlong_buffer_tokens=50",  # lengths 10..60 penalised apart: rewards differ in a group
    ]
    layout = [*FOLDED, "generation.weight_sync_path=gathered"]
    run = _train(root, "moe-tp2-ep2-etp1-episodes", *layout, *episodes)
    _assert_replayed(run)
    for step in (1, 2):
        assert run[step]["episode/turns_mean"] > 1.5, run[step]["episode/turns_mean"]
        assert 0.0 <= run[step]["moe/episode_rerouted_frac"] <= 1.0
