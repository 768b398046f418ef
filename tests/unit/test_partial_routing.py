"""Rollout routing replay under partial rollouts (``grpo.async_mode: partial`` with ``grpo.routing_replay``):
each position keeps the routed-expert row of its first forward (``generation.routing.merge_rows``), the rows
travel with a finished stream request into its ``Completion`` and with an in-flight one into the checkpoint's
``rollouts_in_flight.pt``, and come back from it unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megagrpo.generation.routing import merge_rows
from megagrpo.generation.stream import PartialRequest, StreamCompletion, StreamRequest
from megagrpo.trainers.group_buffer import load_in_flight, save_in_flight
from megagrpo.trainers.partial import partial_request, to_completion
from megagrpo.types import Completion, SamplingSettings

pytestmark = pytest.mark.unit

LAYERS, K = 2, 2


def rows(values: list[int]) -> torch.Tensor:
    """[len(values), LAYERS, K] uint8 rows, each filled with its value (a row's version, say)."""
    return torch.tensor(values, dtype=torch.uint8).view(-1, 1, 1).expand(-1, LAYERS, K).clone()


def test_each_position_keeps_its_first_row():
    # Version 0 forwarded positions 0..4 (prompt 0..3 in one prefill, then 4); a "recompute" swap to
    # version 1 forwards 0..5 again, then 6: the first five keep version 0's rows.
    chunks = [(0, rows([0, 0, 0, 0])), (4, rows([0])), (0, rows([1] * 6)), (6, rows([1]))]
    got = merge_rows(None, chunks, "r")
    assert got[:, 0, 0].tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert got.shape == (7, LAYERS, K) and got.dtype == torch.uint8


def test_a_continuation_keeps_the_snapshots_rows():
    # The snapshot routed positions 0..5 (versions 0 and 1); its continuation prefills 0..6 under version 2
    # and decodes 7: positions 0..5 keep the snapshot's rows, 6 and 7 get version 2's.
    known = rows([0, 0, 0, 1, 1, 1])
    got = merge_rows(known, [(0, rows([2] * 7)), (7, rows([2]))], "r")
    assert got[:, 0, 0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    # Nothing new: the snapshot's rows as they were.
    assert torch.equal(merge_rows(known, [], "r"), known)


def test_positions_without_rows_are_an_error():
    with pytest.raises(RuntimeError, match="routed experts of request 'a': rows from position 3, none for 2"):
        merge_rows(rows([0, 0]), [(3, rows([0]))], "request 'a'")
    with pytest.raises(RuntimeError, match="no rows were recorded"):
        merge_rows(None, [], "request 'b'")


def _request(rid: str) -> StreamRequest:
    return StreamRequest(rid, (3, 4, 5), SamplingSettings(max_tokens=6, temperature=1.0), seed=7, group_id=0)


def test_a_finished_request_carries_its_rows_into_the_completion():
    routed = rows([0, 0, 0, 1, 1])  # prompt 3 + response 3 - 1
    done = StreamCompletion(_request("0:1"), [9, 8, 7], [-0.1, -0.2, -0.3], [0, 1, 1], "length", routed)
    comp = to_completion(done)
    assert comp.versions == [(0, 1), (1, 2)]
    assert comp.routed_experts is routed


def test_in_flight_rows_survive_the_checkpoint(tmp_path):
    """The state ``ContinuousRollouts.snapshot`` writes (plain data + tensors) through the checkpoint's
    file and back: a partial request's rows so far, a finished sample's rows, unchanged."""
    partial = PartialRequest(_request("4:0"), [9, 8], [-0.5, -0.25], [2, 3], rows([2, 2, 2, 3]))
    sample = Completion(0, [1, 2], [-1.0, -2.0], "stop", routed_experts=rows([1, 1, 2]), versions=[(1, 2)])
    state = {
        "buffer": {"next_position": 5, "consumed": 0, "queued": [], "ready": []},
        "samples": {4: {1: dataclasses.asdict(sample)}},
        "partials": [dataclasses.asdict(partial)],
        "version": 3,
    }
    save_in_flight(state, tmp_path)
    back = load_in_flight(tmp_path)
    resumed = partial_request(back["partials"][0])
    assert resumed.request == partial.request and resumed.versions == [2, 3]
    assert torch.equal(resumed.routed_experts, partial.routed_experts)
    assert resumed.routed_experts.dtype == torch.uint8
    kept = Completion(**back["samples"][4][1])
    assert torch.equal(kept.routed_experts, sample.routed_experts) and kept.versions == [(1, 2)]


def test_partial_rollouts_with_routing_replay_load():
    from megagrpo.config import load_config

    cfg = load_config("tiny_moe", ["grpo.async_mode=partial", "grpo.max_staleness=1"])
    assert cfg.grpo.routing_replay == "rollout" and cfg.grpo.async_mode == "partial"
