"""The episode runner's bookkeeping (``megagrpo.envs.episodes``) with real environment workers and a real
chat template, and a scripted engine in place of vLLM (the e2e tests run it on vLLM): tokens, masks and
logprobs of each turn and observation, the three ways an episode is truncated, environments that raise,
hang or kill their worker, and the two schedules. Also the built-in guess-the-number game, the worker
call's checks of what an environment returns, the ``env`` config keys, and the train batch of episodes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megagrpo.config import ConfigError, EnvConfig, load_config
from megagrpo.data.arithmetic import EOS_ID
from megagrpo.data.tokenizer import char_tokenizer
from megagrpo.envs.base import Environment, Step
from megagrpo.envs.chat import ChatRenderer
from megagrpo.envs.episodes import EpisodeRunner, Turn
from megagrpo.envs.games import GuessNumber
from megagrpo.envs.runner import env_call
from megagrpo.rewards.pool import DeadlinePool

pytestmark = pytest.mark.unit

ECHO = f"{Path(__file__).parents[1] / 'e2e' / '_echo_env.py'}:Echo"
DIGIT0 = 3  # the character tokenizer's "0"
FITS = ["env.environment=guess_number", "env.max_episode_tokens=128", "env.max_new_tokens=16"]


class ScriptedEngine:
    """Samples one digit (from the request's seed) and EOS; a request with room for one token only gets
    the digit (a turn cut at its limit). Logs every request and every step's finished turns."""

    def __init__(self):
        self.queue: list[tuple[str, list[int], int, int]] = []
        self.log: list[tuple[str, str]] = []
        self.prompts: dict[str, list[int]] = {}

    def add(self, request_id, prompt, max_tokens, seed):
        self.queue.append((request_id, prompt, max_tokens, seed))
        self.prompts[request_id] = list(prompt)
        self.log.append(("add", request_id))

    def busy(self):
        return bool(self.queue)

    def step(self):
        turns = []
        for request_id, _prompt, max_tokens, seed in self.queue:
            ids = [DIGIT0 + seed % 10, EOS_ID][:max_tokens]
            turns.append(Turn(request_id, ids, [-0.5, -0.25][: len(ids)]))
            self.log.append(("done", request_id))
        self.queue = []
        return turns


@pytest.fixture(scope="module")
def pool():
    p = DeadlinePool("megagrpo.envs.runner:env_call", 2, 2.0, numeric=False, what="environment")
    yield p
    p.close()


def _run(pool, tasks, *, n=1, engine=None, **env):
    cfg = EnvConfig(environment=ECHO, **{"max_turns": 4, "max_new_tokens": 4, **env})
    engine = engine or ScriptedEngine()
    renderer = ChatRenderer(char_tokenizer())
    runner = EpisodeRunner(engine, renderer, pool, cfg, max_context=256, log=lambda _m: None)
    return runner.run(tasks, n, list(range(len(tasks)))), engine, renderer


def test_episode_tokens_are_turns_and_observations(pool):
    (comp,), engine, renderer = _run(pool, [{"start": 12}], args={"turns": 3})
    opening = renderer.prompt_ids([{"role": "user", "content": "12="}])
    assert comp.prompt_ids == opening
    digits = [engine.prompts[r] for r in sorted(engine.prompts)]  # each request's whole prompt
    sampled = [[DIGIT0 + d, EOS_ID] for d in _turn_digits(comp)]
    echo = [
        renderer.observation_ids([{"role": "user", "content": renderer.turn_text(s) + "="}]) for s in sampled
    ]
    assert comp.token_ids == sampled[0] + echo[0] + sampled[1] + echo[1] + sampled[2]
    assert (
        comp.loss_mask
        == [True] * 2 + [False] * len(echo[0]) + [True] * 2 + [False] * len(echo[1]) + [True] * 2
    )
    assert comp.logprobs == [-0.5, -0.25] + [0.0] * len(echo[0]) + [-0.5, -0.25] + [0.0] * len(echo[1]) + [
        -0.5,
        -0.25,
    ]
    # Turn t's prompt is exactly the opening and every token before it.
    assert digits[1] == opening + sampled[0] + echo[0]
    assert digits[2] == opening + sampled[0] + echo[0] + sampled[1] + echo[1]
    assert comp.finish_reason == "stop" and comp.stats["turns"] == 3 and comp.stats["truncated"] == 0.0


class RoutingEngine(ScriptedEngine):
    """The scripted engine, returning routed experts as an engine with ``grpo.routing_replay`` does: a
    row for every position of the request before its last sampled token. Position p routes to experts
    (p % 8, 8) in both layers, except that every turn after the first routes position 0 to (1, 2)."""

    def step(self):
        turns = []
        for turn in super().step():
            rows = len(self.prompts[turn.request_id]) + len(turn.token_ids) - 1
            routed = torch.stack([torch.arange(rows) % 8, torch.full((rows,), 8)], dim=-1)
            if turn.request_id.split("-")[1] != "t0":
                routed[0] = torch.tensor([1, 2])
            routed = routed[:, None, :].expand(rows, 2, 2).to(torch.uint8)
            turns.append(dataclasses.replace(turn, routed_experts=routed))
        return turns


def test_an_episode_keeps_each_positions_routing_from_the_first_turn_that_forwarded_it(pool):
    (comp,), engine, _ = _run(pool, [{"start": 12}], engine=RoutingEngine(), args={"turns": 3})
    prompts = [engine.prompts[r] for r in sorted(engine.prompts)]
    n = len(comp.prompt_ids) + len(comp.token_ids)
    assert comp.routed_experts.shape == (n - 1, 2, 2)  # every position but the last sampled token
    assert comp.routed_experts[:, 0, 0].tolist() == [p % 8 for p in range(n - 1)]  # turn 0's row 0 kept
    # Turns 1 and 2 computed the positions turns 0 and 1 had routed (each turn's prompt and its two sampled
    # tokens but the last) again: each routed position 0 otherwise.
    again = (len(prompts[0]) + 1 + len(prompts[1]) + 1) * 2  # token-layer pairs
    assert comp.stats["recomputed"] == again and comp.stats["rerouted"] == 2 * 2

    from megagrpo.trainers.rollouts import episode_metrics

    assert episode_metrics([comp])["moe/episode_rerouted_frac"] == pytest.approx(4 / again)
    plain, _, _ = _run(pool, [{"start": 12}], args={"turns": 3})
    assert plain[0].routed_experts is None and "moe/episode_rerouted_frac" not in episode_metrics(plain)


def test_a_turn_with_routing_of_the_wrong_length_names_its_episode_and_turn(pool):
    class Short(RoutingEngine):
        def step(self):
            return [dataclasses.replace(t, routed_experts=t.routed_experts[:-1]) for t in super().step()]

    with pytest.raises(RuntimeError, match=r"episode 0 turn 0: .* routed-expert rows, expected"):
        _run(pool, [{"start": 12}], engine=Short(), args={"turns": 2})


def _turn_digits(comp) -> list[int]:
    return [t - DIGIT0 for t, m in zip(comp.token_ids, comp.loss_mask, strict=True) if m and t != EOS_ID]


def test_truncation_max_turns_episode_tokens_and_cut_turns(pool):
    (by_turns,), _, _ = _run(pool, [{"start": 1}], args={"turns": 9}, max_turns=2)
    assert by_turns.finish_reason == "length" and by_turns.stats["turns"] == 2
    assert by_turns.loss_mask[-1] is True  # the last turn was sampled; no observation after it
    (by_tokens,), _, _ = _run(pool, [{"start": 1}], args={"turns": 9}, max_episode_tokens=8, max_new_tokens=2)
    assert by_tokens.finish_reason == "length" and len(by_tokens.token_ids) <= 8
    (cut,), _, _ = _run(pool, [{"start": 1}], args={"turns": 9}, max_new_tokens=1)
    assert cut.finish_reason == "length" and cut.token_ids == cut.token_ids[:1] and cut.stats["turns"] == 1


@pytest.mark.parametrize("fault", ["raise", "hang", "die"])
def test_failing_environment_ends_its_episode_only(pool, fault):
    tasks = [{"start": 5, "fault": fault}, {"start": 6}]
    (bad, good), _, _ = _run(pool, tasks, args={"turns": 3})
    assert bad.finish_reason == "env_error" and bad.reward == 0.0 and bad.stats["env_failed"] == 1.0
    assert bad.stats["turns"] == 2  # the second step failed
    assert good.finish_reason == "stop" and good.stats["turns"] == 3
    assert pool.alive() == 2  # a killed or dead worker was replaced


def test_async_schedule_does_not_wait_for_a_slow_environment(pool):
    tasks = [{"start": 1, "fault": "slow"}, {"start": 2}, {"start": 3}]
    a, async_engine, _ = _run(pool, tasks, args={"turns": 3})
    t, turns_engine, _ = _run(pool, tasks, args={"turns": 3}, schedule="turns")
    assert [c.token_ids for c in a] == [c.token_ids for c in t]  # same episodes either way
    # async: the fast episodes sampled their last turn while the slow one's first step was running;
    # turns: nobody's turn 2 was requested before every turn-1 step had answered.
    order = [event for kind, event in async_engine.log if kind == "add"]
    assert order.index("ep1-t2-1000003") < order.index("ep0-t1-0")
    order = [event for kind, event in turns_engine.log if kind == "add"]
    assert max(order.index(f"ep{i}-t1-{s}") for i, s in ((0, 0), (1, 1000003), (2, 2000006))) < min(
        order.index(f"ep{i}-t2-{s}") for i, s in ((1, 1000003), (2, 2000006))
    )


def test_guess_number_hints_and_binary_search():
    assert GuessNumber.tasks(5, seed=3) == GuessNumber.tasks(5, seed=3)
    env = GuessNumber(low=0, high=15)
    env.reset({"target": 11})
    low, high, turns = 0, 15, 0
    while True:
        guess = (low + high) // 2
        step = env.step(str(guess))
        turns += 1
        if step.done:
            break
        hint = step.messages[0]["content"]
        low, high = (guess + 1, high) if hint == "Higher." else (low, guess - 1)
    assert step.reward == 1.0 and turns <= 4
    symbols = GuessNumber(style="symbols")
    assert symbols.reset({"target": 3}) == [{"role": "user", "content": "0 15="}]
    assert symbols.step("x").messages[0]["content"] == "*"
    assert symbols.step("9").messages[0]["content"] == "-"


class _Bad(Environment):
    def __init__(self, mode: str = "role"):
        self.mode = mode

    def reset(self, task):
        return [{"role": "system", "content": "hi"}]

    def step(self, turn):
        if self.mode == "type":
            return {"reward": 1}
        if self.mode == "role":
            return Step(messages=[{"role": "assistant", "content": "x"}])
        return Step(messages=[], done=False)


@pytest.mark.parametrize(
    ("mode", "message"),
    [("type", "not megagrpo.envs.base.Step"), ("role", "message 0"), ("empty", "no observation")],
)
def test_worker_call_names_what_the_environment_got_wrong(mode, message):
    spec = f"{__file__}:_Bad"
    blob, messages, *_ = env_call(spec, {"mode": mode}, "reset", {})
    assert messages == [{"role": "system", "content": "hi"}]
    with pytest.raises(ValueError, match=message):
        env_call(spec, {"mode": mode}, "step", (blob, "turn"))


def test_pool_submit_and_poll_report_values_errors_and_deadlines():
    pool = DeadlinePool("time:sleep", 2, 1.0, numeric=False, what="test")
    try:
        fast, slow = pool.submit((0.0,)), pool.submit((30.0,))
        bad = pool.submit(("x",))
        outcomes = {}
        while pool.pending:
            outcomes.update(pool.poll())
        assert outcomes[fast].ok and outcomes[fast].value is None
        assert outcomes[slow].timed_out and not outcomes[slow].ok
        assert "TypeError" in outcomes[bad].error
        assert pool.poll(0) == []
    finally:
        pool.close()


def test_env_config_errors_name_their_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"env\.environment"):
        load_config(None, ["env.environment=no_such_module_xyz:Env"])
    with pytest.raises(ConfigError, match=r"env\.environment"):
        load_config(None, ["env.environment=megagrpo.envs.base:Step"])  # not an Environment
    with pytest.raises(ConfigError, match=r"env\.tool_format"):
        load_config(None, [*FITS, "env.tool_format=xml"])
    with pytest.raises(ConfigError, match=r"env\.max_episode_tokens"):
        load_config(
            None, ["env.environment=guess_number", "env.max_episode_tokens=4096", "env.max_new_tokens=8"]
        )
    with pytest.raises(ConfigError, match=r"env\.args"):
        load_config(None, [*FITS, "env.args=3"])
    # An argument the constructor does not take, named before any worker would fail on it.
    with pytest.raises(
        ConfigError, match=r"env\.args\.hihg: GuessNumber takes no such argument; did you mean 'high'"
    ):
        load_config(None, [*FITS, "env.args.hihg=31"])
    cfg = load_config(None, [*FITS, "env.args.high=31", "env.args.style=symbols"])
    assert (
        cfg.env.args == {"high": 31, "style": "symbols"} and cfg.env.spec == "megagrpo.envs.games:GuessNumber"
    )


def test_train_batch_of_episodes_masks_observations_and_failed_episodes():
    from megagrpo.data.prompts import Prompt
    from megagrpo.trainers.rollouts import Rollouts, to_train_batch
    from megagrpo.types import Completion

    cfg = load_config(None, [*FITS, "grpo.num_generations=3", "policy.mini_batch_size=3"])
    stats = dict.fromkeys(("turns", "tool_calls", "tool_errors", "env_s", "env_failed", "truncated"), 0.0)
    comps = [
        Completion(
            0,
            [5, 2, 9, 9, 6, 2],
            [-1.0, -0.1, 0.0, 0.0, -0.5, -0.2],
            "stop",
            loss_mask=[True, True, False, False, True, True],
            prompt_ids=[1, 4],
            reward=1.0,
            stats=stats,
        ),
        Completion(
            0,
            [7, 2, 9],
            [-1.0, -0.1, 0.0],
            "env_error",
            loss_mask=[True, True, False],
            prompt_ids=[1, 4, 4],
            reward=0.0,
            stats=stats,
        ),
    ]
    failed_reset = Completion(0, [], [], "env_error", loss_mask=[], prompt_ids=[], reward=0.0, stats=stats)
    rollouts = Rollouts(
        [Prompt([], "", {"target": 3})], [*comps, failed_reset], torch.tensor([1.0, 0.0, 0.0])
    )
    batch = to_train_batch(cfg, rollouts)
    assert batch.input_ids[0, :8].tolist() == [1, 4, 5, 2, 9, 9, 6, 2]
    assert batch.prompt_lengths.tolist() == [2, 3, 1]
    mask = batch.response_mask()
    assert mask[0].tolist() == [False, True, True, False, False, True, True]
    assert not mask[1].any() and not mask[2].any()  # failed episodes leave the loss
    assert batch.lengths[2] == 1 and batch.prompt_lengths[2] == 1  # one placeholder token, nothing to score
    assert batch.gen_logprobs[0, 1:7].tolist() == pytest.approx([-1.0, -0.1, 0.0, 0.0, -0.5, -0.2])
    sub = batch.select([0])
    assert sub.response_mask()[0].tolist() == mask[0].tolist()
    assert dataclasses.replace(batch, sampled=None).response_mask()[0].tolist() == [False] + [True] * 6

    # With routing replay: the episodes' rows, and none for the one whose environment failed to open it.
    moe = ["model.arch=qwen3_moe", "model.tiny.num_experts=4", "parallel.tensor_model_parallel_size=1"]
    moe += ["parallel.transformer_impl=local", "grpo.routing_replay=rollout"]
    cfg = load_config(None, [*FITS, *moe, "grpo.num_generations=3", "policy.mini_batch_size=3"])
    rows = [torch.full((n - 1, 2, 2), 3, dtype=torch.uint8) for n in (8, 6)]
    routed = [dataclasses.replace(c, routed_experts=r) for c, r in zip(comps, rows, strict=True)]
    routing = to_train_batch(cfg, dataclasses.replace(rollouts, completions=[*routed, failed_reset])).routing
    assert routing.shape == (3, 8, 2, 2)
    assert (routing[0] == 3).all() and (routing[1, :6] == 3).all()  # the last token repeats its row
    assert routing[2, :, :, 0].eq(0).all() and routing[2, :, :, 1].eq(1).all()  # filler: experts 0, 1
    with pytest.raises(ValueError, match=r"sequences \[1\] have no routed experts"):
        to_train_batch(cfg, dataclasses.replace(rollouts, completions=[routed[0], comps[1], failed_reset]))


def test_eval_and_validation_tasks_of_an_environment(tmp_path):
    from megagrpo.data.prompts import build_source, eval_prompts

    char_tokenizer().save_pretrained(str(tmp_path))
    cfg = load_config(None, [*FITS, "data.num_val_prompts=6", "eval.num_problems=4"])
    tasks, decode, stops = eval_prompts(cfg, str(tmp_path))
    assert [t.task for t in tasks] == GuessNumber.tasks(6, seed=7_919_011)[:4] and stops == ()
    assert all(t.token_ids == [] for t in tasks) and decode([4, 5]) == "12"
    source = build_source(cfg)
    assert [t.task for t in source.val] == GuessNumber.tasks(6, seed=7_919_011)
    assert source.batch(3, 2) == source.batch(3, 2) and source.batch(3, 1)[0].task["target"] in range(16)
    rows = tmp_path / "tasks.jsonl"
    rows.write_text('{"target": 3, "answer": "3"}\n{"target": 9, "answer": "9"}\n')
    from_file = load_config(None, [*FITS, f"data.train_path={rows}"])
    assert [p.task for p in build_source(from_file).batch(0, 2)] in (
        [{"target": 3, "answer": "3"}, {"target": 9, "answer": "9"}],
        [{"target": 9, "answer": "9"}, {"target": 3, "answer": "3"}],
    )
