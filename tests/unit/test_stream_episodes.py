"""Multi-turn episodes as requests of a request stream (``megagrpo.generation.stream_episodes``,
``grpo.async_mode: partial`` with ``env.environment``), with real environment workers and a real chat
template, and a scripted stream in place of the vLLM one (the stream itself is tested on vLLM in
tests/e2e/test_stream.py): each episode's turns are stream requests whose prompts are the episode so far;
a version change between two slices lands inside a running turn and every token keeps the version that
sampled it; an environment that fails makes its episode a failed request (never a sample); an aborted
episode never finishes; a snapshot holds each unfinished episode's request, and a resume plays it again
from its opening.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megagrpo.config import EnvConfig, load_config
from megagrpo.data.arithmetic import EOS_ID
from megagrpo.data.tokenizer import char_tokenizer
from megagrpo.envs.chat import ChatRenderer
from megagrpo.generation.stream import StreamCompletion, StreamRequest
from megagrpo.generation.stream_episodes import EpisodeStream
from megagrpo.rewards.pool import DeadlinePool
from megagrpo.trainers.partial import score_group, to_completion
from megagrpo.types import SamplingSettings

pytestmark = pytest.mark.unit

ECHO = f"{Path(__file__).parents[1] / 'e2e' / '_echo_env.py'}:Echo"
DIGIT0 = 3  # the character tokenizer's "0"
SETTINGS = SamplingSettings(max_tokens=64, temperature=1.0, stop_token_ids=(EOS_ID,), n=1)


class ScriptedStream:
    """A request stream that samples one token per step: a digit (from the request's seed), then EOS
    (with room for one token only: the digit). Stamps each token with its version, as the vLLM stream."""

    def __init__(self):
        self.version = 0
        self.live: dict[str, dict] = {}
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    def submit(self, requests):
        for r in requests:
            assert r.settings.n == 1 and EOS_ID in r.settings.stop_token_ids and not r.settings.ignore_eos
            self.prompts[r.request_id] = list(r.prompt_ids)
            self.live[r.request_id] = {"request": r, "tokens": [], "versions": []}

    def busy(self):
        return bool(self.live)

    def __len__(self):
        return len(self.live)

    def advance(self, *, max_steps=None, max_seconds=None):
        done = []
        for rid, got in list(self.live.items()):
            r = got["request"]
            script = [DIGIT0 + r.seed % 10, EOS_ID][: r.settings.max_tokens]
            got["tokens"].append(script[len(got["tokens"])])
            got["versions"].append(self.version)
            if len(got["tokens"]) == len(script):
                del self.live[rid]
                n = len(got["tokens"])
                done.append(StreamCompletion(r, got["tokens"], [-0.5] * n, got["versions"], "stop"))
        return done

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


def _stream(pool, **env):
    cfg = EnvConfig(environment=ECHO, **{"max_turns": 4, "max_new_tokens": 4, **env})
    inner = ScriptedStream()
    renderer = ChatRenderer(char_tokenizer())
    episodes = EpisodeStream(inner, renderer, pool, cfg, max_context=256, log=lambda _m: None)
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
    while len(inner.live) < 2:
        stream.advance(max_steps=1)
    dropped = stream.abort(["1:0", "unknown"])
    assert [r.request_id for r in dropped] == ["1:0"] and len(inner.aborted) == 1
    done = _until_done(stream)
    assert [d.request.request_id for d in done] == ["1:1"] and stream.take_failed() == []


def test_a_snapshot_holds_the_requests_and_a_resume_plays_them_from_the_opening(pool):
    requests = [_request("2:0", {"start": 7}, 3), _request("2:1", {"start": 8}, 5)]
    whole, _, _ = _stream(pool, args={"turns": 3})
    whole.submit(requests)
    uninterrupted = {d.request.request_id: d.token_ids for d in _until_done(whole)}
    # The interrupted stream's environment calls still running answer into its own pool.
    own = DeadlinePool("megagrpo.envs.runner:env_call", 1, 2.0, numeric=False, what="environment")
    try:
        first, inner, _ = _stream(own, args={"turns": 3})
        first.submit(requests)
        while len(inner.prompts) < 3:  # some second turns under way
            first.advance(max_steps=1)
        snapshot = first.in_flight()
    finally:
        own.close()
    assert sorted(p.request.request_id for p in snapshot) == ["2:0", "2:1"]
    assert all(p.token_ids == [] and p.request.task is not None for p in snapshot)
    resumed, _, _ = _stream(pool, args={"turns": 3})
    resumed.resume_from(snapshot)
    again = {d.request.request_id: d.token_ids for d in _until_done(resumed)}
    assert again == uninterrupted
    bad = dataclasses.replace(snapshot[0], token_ids=[1], logprobs=[-1.0], versions=[0])
    with pytest.raises(ValueError, match=r"'2:0'.*holds no tokens"):
        resumed.resume_from([bad])
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
