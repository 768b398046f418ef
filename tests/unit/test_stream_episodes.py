"""Multi-turn episodes as requests of a request stream (``megagrpo.generation.stream_episodes``,
``grpo.async_mode: partial`` with ``env.environment``), with real environment workers and a real chat
template, and a scripted stream in place of the vLLM one (the stream itself is tested on vLLM in
tests/e2e/test_stream.py): each episode's turns are stream requests whose prompts are the episode so far;
a version change between two slices lands inside a running turn and every token keeps the version that
sampled it; an environment that fails makes its episode a failed request (never a sample); an aborted
episode never finishes; a snapshot holds each unfinished episode's turns so far and the step or turn
running, through the checkpoint file, and a resume rebuilds its environment by replay and continues it
(an environment that answers otherwise on replay restarts its episode, counted).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megagrpo.config import EnvConfig, load_config
from megagrpo.data.arithmetic import EOS_ID
from megagrpo.data.tokenizer import char_tokenizer
from megagrpo.envs.base import Environment
from megagrpo.envs.chat import ChatRenderer, ToolCall, format_tool_call
from megagrpo.envs.runner import env_call
from megagrpo.generation.stream import PartialRequest, StreamCompletion, StreamRequest
from megagrpo.generation.stream_episodes import EpisodeStream
from megagrpo.rewards.pool import DeadlinePool
from megagrpo.trainers.group_buffer import load_in_flight, save_in_flight
from megagrpo.trainers.partial import partial_request, score_group, to_completion
from megagrpo.types import SamplingSettings

pytestmark = pytest.mark.unit

ECHO = f"{Path(__file__).parents[1] / 'e2e' / '_echo_env.py'}:Echo"
ECHO_STATE = f"{ECHO}State"
DIGIT0 = 3  # the character tokenizer's "0"
SETTINGS = SamplingSettings(max_tokens=64, temperature=1.0, stop_token_ids=(EOS_ID,), n=1)


class ScriptedStream:
    """A request stream that samples one token per step: a digit (from the request's seed), then EOS
    (with room for one token only: the digit). Stamps each token with its version, as the vLLM stream."""

    def __init__(self, version=0):
        self.version = version
        self.live: dict[str, dict] = {}
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    def submit(self, requests):
        for r in requests:
            assert r.settings.n == 1 and EOS_ID in r.settings.stop_token_ids and not r.settings.ignore_eos
            self.prompts[r.request_id] = list(r.prompt_ids)
            self.live[r.request_id] = {"request": r, "tokens": [], "logprobs": [], "versions": []}

    def busy(self):
        return bool(self.live)

    def __len__(self):
        return len(self.live)

    def advance(self, *, max_steps=None, max_seconds=None):
        done = []
        for rid, got in list(self.live.items()):
            r = got["request"]
            script = [DIGIT0 + r.seed % 10, EOS_ID][: r.settings.max_tokens]
            if len(got["tokens"]) < len(script):  # a continuation may hold its whole script already
                got["tokens"].append(script[len(got["tokens"])])
                got["logprobs"].append(-0.5 - 0.1 * self.version)
                got["versions"].append(self.version)
            if len(got["tokens"]) == len(script):
                del self.live[rid]
                done.append(StreamCompletion(r, got["tokens"], got["logprobs"], got["versions"], "stop"))
        return done

    def in_flight(self):
        return [
            PartialRequest(got["request"], list(got["tokens"]), list(got["logprobs"]), list(got["versions"]))
            for got in self.live.values()
        ]

    def resume_from(self, partials):
        for p in partials:
            self.submit([p.request])
            self.live[p.request.request_id] |= {
                "tokens": list(p.token_ids),
                "logprobs": list(p.logprobs),
                "versions": list(p.versions),
            }

    def take_failed(self):
        return []

    def abort(self, ids):
        self.aborted += [rid for rid in ids if self.live.pop(rid, None) is not None]

    def set_version(self, version, *, kv="keep"):
        self.version = version


@pytest.fixture(scope="module")
def pool():
    p = DeadlinePool("megagrpo.envs.runner:env_call", 2, 2.0, numeric=False, what="environment")
    yield p
    p.close()


def _stream(pool, *, version=0, log=lambda _m: None, **env):
    cfg = EnvConfig(**{"environment": ECHO, "max_turns": 4, "max_new_tokens": 4, **env})
    inner = ScriptedStream(version)
    renderer = ChatRenderer(char_tokenizer())
    episodes = EpisodeStream(inner, renderer, pool, cfg, max_context=256, log=log)
    return episodes, inner, renderer


def _request(rid: str, task: dict, seed: int) -> StreamRequest:
    return StreamRequest(rid, (), SETTINGS, seed=seed, group_id=int(rid.split(":")[0]), task=task)


def _until_done(stream, *, slices=200):
    done = []
    for _ in range(slices):
        done += stream.advance(max_steps=1)
        if not stream._unfinished():
            break
    return done


def test_turns_are_stream_requests_and_keep_their_versions_across_a_swap(pool):
    stream, inner, renderer = _stream(pool, args={"turns": 3})
    stream.submit([_request("0:0", {"start": 12}, seed=4)])
    # Until the first turn's digit is sampled, then the weights change: its EOS is version 1's.
    while not any(got["tokens"] for got in inner.live.values()):
        assert stream.advance(max_steps=1) == []
    stream.set_version(1)
    (done,) = _until_done(stream)
    comp = to_completion(done)
    opening = renderer.prompt_ids([{"role": "user", "content": "12="}])
    sampled = [[DIGIT0 + 4 + t, EOS_ID] for t in range(3)]  # turn t's seed: the episode's + t
    echo = [
        renderer.observation_ids([{"role": "user", "content": renderer.turn_text(s) + "="}])
        for s in sampled[:2]
    ]
    assert comp.prompt_ids == opening and comp.finish_reason == "stop"
    assert comp.token_ids == sampled[0] + echo[0] + sampled[1] + echo[1] + sampled[2]
    assert (
        comp.loss_mask
        == [True] * 2 + [False] * len(echo[0]) + [True] * 2 + [False] * len(echo[1]) + [True] * 2
    )
    # Turn 0: digit v0, EOS v1; its observation counts as v1; every later token v1.
    assert comp.versions == [(0, 1), (1, len(comp.token_ids) - 1)]
    # Each turn's prompt is the episode so far (token in / token out).
    turns = sorted(inner.prompts)
    assert inner.prompts[turns[0]] == opening
    assert inner.prompts[turns[1]] == opening + sampled[0] + echo[0]
    assert inner.prompts[turns[2]] == opening + comp.token_ids[: 4 + len(echo[0]) + len(echo[1])]
    assert comp.stats["turns"] == 3 and comp.reward == 0.0
    group = score_group(None, None, None, None, [comp, dataclasses.replace(comp, reward=1.0)])
    assert group.rewards.tolist() == [0.0, 1.0]  # the environments' rewards, no reward function


def test_a_failed_environment_makes_a_failed_request_never_a_sample(pool):
    stream, _, _ = _stream(pool, args={"turns": 3})
    stream.submit([_request("3:0", {"start": 5, "fault": "raise"}, 1), _request("3:1", {"start": 6}, 2)])
    done = _until_done(stream)
    assert [d.request.request_id for d in done] == ["3:1"]
    (failed,) = stream.take_failed()
    assert failed.request.request_id == "3:0" and failed.reason == "env_error"
    assert stream.take_failed() == []


def test_an_aborted_episode_never_finishes(pool):
    stream, inner, _ = _stream(pool, args={"turns": 2})
    stream.submit([_request("1:0", {"start": 1}, 1), _request("1:1", {"start": 2}, 2)])
    done = []
    for _ in range(400):  # until the first episode's turn is at the engine (whatever the second's is)
        if any(rid.startswith("ep0-") for rid in inner.live):
            break
        done += stream.advance(max_steps=1)
    dropped = stream.abort(["1:0", "unknown"])
    assert [r.request_id for r in dropped] == ["1:0"] and len(inner.aborted) == 1
    done += _until_done(stream)
    assert [d.request.request_id for d in done] == ["1:1"] and stream.take_failed() == []


def _through_checkpoint(snapshot, tmp_path):
    """A snapshot as a checkpoint saves and loads it (``rollouts_in_flight.pt``, the restricted loader)."""
    save_in_flight(
        {"buffer": {}, "partials": [dataclasses.asdict(p) for p in snapshot], "version": 0}, tmp_path
    )
    return [partial_request(row) for row in load_in_flight(tmp_path)["partials"]]


def _snapshots_mid_episode(pool, task, seed, environment=ECHO):
    """An episode played through, and its snapshots with one environment answer so far and its second
    turn's first token sampled (a turn running), and with two answers and the third step running."""
    stream, inner, _ = _stream(pool, args={"turns": 4}, max_turns=6, environment=environment)
    stream.submit([_request("2:0", task, seed)])
    at_turn = at_step = None
    done = []
    for _ in range(400):
        (p,) = stream.in_flight() or [None]
        if p is not None and p.episode is not None:
            answered, turn = len(p.episode["answers"]), p.episode["turn"]
            if answered == 1 and turn is not None and len(turn["token_ids"]) == 1 and at_turn is None:
                at_turn = p
            if answered == 2 and p.episode["pending"] is not None and at_step is None:
                at_step = p
        done += stream.advance(max_steps=1)
        if done:
            break
    assert at_turn is not None and at_step is not None
    return to_completion(done[0]), inner, at_turn, at_step


def test_a_resume_continues_an_episode_from_its_saved_turns(pool, tmp_path):
    played, _, at_turn, at_step = _snapshots_mid_episode(pool, {"start": 7}, seed=3)
    # The environment ends it (max_turns 6 would not): a resume must rebuild the turns it has seen.
    assert played.stats["turns"] == 4 and played.finish_reason == "stop"
    for saved, where in ((at_turn, "turn"), (at_step, "step")):
        (partial,) = _through_checkpoint([saved], tmp_path)
        assert partial.episode["answers"] == saved.episode["answers"]
        resumed, inner, _ = _stream(pool, version=5, args={"turns": 4}, max_turns=6)
        resumed.resume_from([partial])
        (done,) = _until_done(resumed)
        comp = to_completion(done)
        n = len(saved.token_ids)
        turn = saved.episode["turn"] or {"token_ids": [], "logprobs": [], "versions": []}
        k = n + len(turn["token_ids"])  # the saved tokens: the episode's, and a running turn's so far
        versions = [v for v, c in comp.versions for _ in range(c)]
        # The saved turns' tokens, versions and logprobs as they were, the rest under the resumed policy:
        # the environment, rebuilt by replay, ends the episode after its fourth turn as played through.
        assert comp.token_ids == played.token_ids and comp.loss_mask == played.loss_mask, where
        assert comp.prompt_ids == played.prompt_ids and comp.finish_reason == "stop"
        assert comp.token_ids[:k] == saved.token_ids + turn["token_ids"]
        assert comp.logprobs[:k] == saved.logprobs + turn["logprobs"] == played.logprobs[:k]
        assert versions[:k] == saved.versions + turn["versions"] == [0] * k
        # After them, version 5's tokens; only the observation answering the saved turn counts as its
        # version (the step that was running, answered again).
        fresh = versions.index(5)
        assert set(versions[fresh:]) == {5} and not any(comp.loss_mask[k:fresh])
        assert (fresh > k) == (where == "step") and set(comp.logprobs[fresh:]) <= {-1.0, 0.0}
        first = inner.prompts[min(inner.prompts)]
        if where == "turn":  # the turn continued from its saved token
            assert first == played.prompt_ids + saved.token_ids and len(turn["token_ids"]) == 1
        else:  # the step that was running answered again, then the next turn
            assert len(first) > len(played.prompt_ids) + n and saved.episode["turn"] is None
        assert resumed.take_restarted() == 0


def test_an_environment_that_answers_otherwise_on_replay_restarts_its_episode(pool, tmp_path):
    _, _, at_turn, _ = _snapshots_mid_episode(pool, {"start": 7, "fault": "noisy"}, seed=3)
    logged = []
    resumed, _, renderer = _stream(pool, version=5, log=logged.append, args={"turns": 4}, max_turns=6)
    resumed.resume_from(_through_checkpoint([at_turn], tmp_path))
    (done,) = _until_done(resumed)
    comp = to_completion(done)
    # Played again from its opening under the resumed policy: none of the saved tokens is in it.
    assert comp.versions == [(5, len(comp.token_ids))] and comp.stats["turns"] == 4
    assert comp.prompt_ids == renderer.prompt_ids([{"role": "user", "content": "7="}])
    assert resumed.take_restarted() == 1 and resumed.take_restarted() == 0
    assert len(logged) == 1 and "'2:0'" not in logged[0] and "2:0" in logged[0] and "noisy" in logged[0]


def test_an_environment_that_offers_its_state_is_rebuilt_from_it_without_replay(pool, tmp_path):
    # Noisy answers, which a replay would refuse; the environment's own state needs no replay.
    played, _, at_turn, at_step = _snapshots_mid_episode(pool, {"start": 7, "fault": "noisy"}, 3, ECHO_STATE)
    assert at_turn.episode["env_state"]["seen"] == [at_turn.episode["answers"][0][0]]
    for saved in (at_turn, at_step):
        resumed, _, _ = _stream(pool, version=5, args={"turns": 4}, max_turns=6, environment=ECHO_STATE)
        resumed.resume_from(_through_checkpoint([saved], tmp_path))
        (done,) = _until_done(resumed)
        comp = to_completion(done)
        n, turn = len(saved.token_ids), saved.episode["turn"] or {"token_ids": []}
        assert comp.token_ids[: n + len(turn["token_ids"])] == saved.token_ids + turn["token_ids"]
        (old, kept), (new, _) = comp.versions  # the saved tokens (and their observation), then version 5
        assert old == 0 and kept >= n + len(turn["token_ids"]) and new == 5
        # It ends after the fourth turn as played through: the loaded state held the turns seen.
        assert comp.finish_reason == "stop" and comp.stats["turns"] == 4 == played.stats["turns"]
        assert resumed.take_restarted() == 0


def _answers(spec: str, task: dict, turns: list[str], *, load_after: int | None = None, **options) -> list:
    """An environment's opening and answers to ``turns`` by the worker calls (``env_call``); with
    ``load_after``, rebuilt from its ``state_dict`` after that many turns, as a resume does."""
    blob, opening, _, state = env_call(spec, {}, "reset", task, options)
    answers = [opening]
    for i, turn in enumerate(turns):
        if i == load_after:
            blob, _, _, state = env_call(spec, {}, "load", state, options)
        blob, answer, _, state = env_call(spec, {}, "step", (blob, turn))
        answers.append(list(answer))
    return answers


def test_the_built_in_environments_offer_their_state_and_replay_when_their_answers_repeat():
    guess = "megagrpo.envs.games:GuessNumber"
    turns, task = ["3", "12", "x", "10", "9"], {"target": 9}
    first = _answers(guess, task, turns)
    assert first == _answers(guess, task, turns) == _answers(guess, task, turns, load_after=2)
    assert first[-1][1:3] == [1.0, True]
    tool, hermes = "megagrpo.envs.code_tool:PythonTool", {"tool_format": "hermes"}
    task = {"question": "37*45", "answer": "1665"}
    call = [
        format_tool_call(ToolCall("python", {"code": code}), "hermes") for code in ("print(37 * 45)", "x")
    ]
    first = _answers(tool, task, [*call, "1665"], **hermes)
    assert first == _answers(tool, task, [*call, "1665"], **hermes) and first[1][0][0]["content"] == "1665"
    clock = [format_tool_call(ToolCall("python", {"code": "import time; print(time.time_ns())"}), "hermes")]
    assert _answers(tool, task, clock, **hermes) != _answers(tool, task, clock, **hermes)  # a replay refuses
    # Its state is the answer: loaded after the clock's call, the final answer is scored as played.
    assert _answers(tool, task, [*clock, "1665"], load_after=1, **hermes)[-1][1:3] == [1.0, True]
    with pytest.raises(ValueError, match=r"_Unplain.state_dict\['when'\] is a object"):
        env_call(f"{__file__}:_Unplain", {}, "reset", {})


class _Unplain(Environment):
    def reset(self, task):
        return [{"role": "user", "content": "1="}]

    def state_dict(self):
        return {"when": object()}


def test_a_snapshot_opens_an_episode_again_whose_reset_was_running(pool):
    # The interrupted stream's reset, still running, answers into its own pool.
    own = DeadlinePool("megagrpo.envs.runner:env_call", 1, 2.0, numeric=False, what="environment")
    try:
        stream, _, _ = _stream(own, args={"turns": 2})
        stream.submit([_request("5:0", {"start": 3}, 1)])
        (opening,) = stream.in_flight()  # its reset has not answered yet: nothing of it to keep
    finally:
        own.close()
    assert opening.token_ids == [] and opening.episode is None
    resumed, _, _ = _stream(pool, args={"turns": 2})
    resumed.resume_from([opening])
    (done,) = _until_done(resumed)
    assert to_completion(done).stats["turns"] == 2
    bad = dataclasses.replace(opening, token_ids=[1], logprobs=[-1.0], versions=[0])
    with pytest.raises(ValueError, match=r"'5:0'.*without the episode's state"):
        resumed.resume_from([bad])
    partial = dataclasses.replace(bad, episode={"prompt": [1]})
    with pytest.raises(ValueError, match=r"'5:0'.*record has no"):
        resumed.resume_from([partial])
    with pytest.raises(ValueError, match="has no task"):
        resumed.submit([StreamRequest("9:0", (1,), SETTINGS, seed=1)])


def test_partial_rollouts_with_episodes_need_the_async_schedule():
    from megagrpo.config import ConfigError

    base = ["grpo.async_mode=partial", "grpo.max_staleness=1", "env.environment=guess_number"]
    base += ["env.max_episode_tokens=128", "env.max_new_tokens=16"]
    assert load_config(None, base).env.schedule == "async"
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, "env.schedule=turns"])
    assert all(k in str(info.value) for k in ("grpo.async_mode", "env.schedule"))


def test_an_episodes_routing_rows_come_with_its_completion():
    routed = torch.zeros(5, 2, 2, dtype=torch.uint8)
    from megagrpo.types import Completion

    episode = Completion(0, [1, 2, 3], [-1.0, 0.0, -1.0], "stop", loss_mask=[True, False, True], reward=1.0)
    episode = dataclasses.replace(episode, routed_experts=routed)
    done = StreamCompletion(
        _request("4:0", {}, 1), [1, 2, 3], [-1.0, 0.0, -1.0], [2, 2, 3], "stop", routed, episode
    )
    comp = to_completion(done)
    assert comp.versions == [(2, 2), (3, 1)] and comp.loss_mask == [True, False, True]
    assert comp.reward == 1.0 and comp.routed_experts is routed
