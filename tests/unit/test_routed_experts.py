"""Routed experts per completion, the pure parts: rows placed by position (a recomputed request keeps its
last rows), vLLM's request ids read back, the dtype by expert count, a finished request's rows taken while
others record on, the config's replay rules with multi-turn episodes, and the router rows a context-parallel
rank replays."""

from types import SimpleNamespace

import pytest
import torch

from megagrpo.compat.vllm_routed_experts import request_key, take
from megagrpo.config import ConfigError, load_config
from megagrpo.generation.routing import place_rows, routed_experts_dtype

pytestmark = pytest.mark.unit


def _rows(first: int, count: int, value: int) -> tuple[int, torch.Tensor]:
    return first, torch.full((count, 2, 3), value, dtype=torch.uint8)  # [tokens, layers, k]


def test_rows_are_placed_by_position_and_a_recomputation_replaces_earlier_rows():
    # A 5-token prompt prefilled, two decode steps, then preempted and computed again from 0 (prompt +
    # the two generated tokens), then one more decode step: 8 positions.
    chunks = [_rows(0, 5, 1), _rows(5, 1, 2), _rows(6, 1, 3), _rows(0, 7, 4), _rows(7, 1, 5)]
    placed = place_rows(chunks, 8, "r")
    assert placed.shape == (8, 2, 3) and placed.dtype == torch.uint8
    assert placed[:, 0, 0].tolist() == [4, 4, 4, 4, 4, 4, 4, 5]
    # Never preempted: the chunks end to end, the prompt's then one per decode step.
    placed = place_rows([_rows(0, 5, 1), _rows(5, 1, 2), _rows(6, 1, 3)], 7, "r")
    assert placed.shape == (7, 2, 3) and placed[:, 1, 2].tolist() == [1, 1, 1, 1, 1, 2, 3]


def test_positions_without_rows_or_past_the_sequence_are_errors():
    with pytest.raises(RuntimeError, match="2 of 8 positions were not routed"):
        place_rows([_rows(0, 5, 1), _rows(7, 1, 2)], 8, "r")
    with pytest.raises(RuntimeError, match="rows up to position 9, expected 8"):
        place_rows([_rows(0, 9, 1)], 8, "r")


def test_vllm_request_ids_name_the_request_and_the_completion():
    assert request_key("12-0a1b2c3d") == ("12", 0)  # n = 1
    assert request_key("1_12-0a1b2c3d") == ("12", 1)  # completion 1 of a request with n > 1
    with pytest.raises(ValueError, match="unexpected vLLM request id"):
        request_key("12")


def test_expert_ids_take_one_byte_up_to_256_experts():
    assert routed_experts_dtype(8) == routed_experts_dtype(256) == torch.uint8
    assert routed_experts_dtype(257) == torch.int16


def test_routing_replay_is_accepted_with_multi_turn_episodes_and_refused_on_a_dense_model():
    moe = ["model.arch=qwen3_moe", "model.tiny.num_experts=4", "parallel.tensor_model_parallel_size=1"]
    moe += ["parallel.transformer_impl=local", "grpo.routing_replay=rollout"]
    episodes = ["env.environment=guess_number", "env.max_episode_tokens=128", "env.max_new_tokens=16"]
    assert load_config(None, [*moe, *episodes]).grpo.routing_replay == "rollout"
    with pytest.raises(ConfigError, match=r"grpo\.routing_replay"):
        load_config(None, ["grpo.routing_replay=rollout", *episodes])


def test_taking_finished_requests_leaves_the_others_recording():
    """An engine stepped request by request (multi-turn episodes) takes each finished request's rows;
    the rows of requests still running stay, and recording goes on until everything is taken."""
    rows = {f"{r}-0a1b2c3d": [_rows(0, 3, 1)] for r in ("ep0-t0-5", "ep1-t0-9", "ep2-t1-3")}
    recorder = SimpleNamespace(requests=dict(rows), recording=True)
    worker = SimpleNamespace(rank=0, megagrpo_routed_experts=recorder)
    assert sorted(take(worker, ["ep0-t0-5", "ep2-t1-3"])) == ["ep0-t0-5-0a1b2c3d", "ep2-t1-3-0a1b2c3d"]
    assert list(recorder.requests) == ["ep1-t0-9-0a1b2c3d"] and recorder.recording
    other_rank = SimpleNamespace(rank=1, megagrpo_routed_experts=recorder)
    assert take(other_rank, ["ep1-t0-9"]) == {} and recorder.requests == {}  # dropped on every rank
    recorder.requests = dict(rows)
    assert take(worker) == rows and not recorder.recording and recorder.requests == {}


@pytest.mark.parametrize(("cp", "cp_rank"), [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_router_rows_of_a_padded_micro_batch_follow_the_positions_a_context_parallel_rank_holds(cp, cp_rank):
    """A padded ``[b, s]`` micro-batch, split for context parallelism before the model: the routers see
    this rank's positions, s-major (row = s_i x b + b_i); positions past a sequence's routing (the width
    rounded up to 2 x CP chunks) get experts 0 .. k - 1. The replay rows and the mask of positions the
    engine forwarded follow the same order."""
    from megagrpo.algorithms.routing import engine_routed_rows, micro_batch_routing
    from megagrpo.policy.packing import context_parallel_positions

    b, s, layers, k = 2, 11, 3, 2
    width = 12 if cp > 1 else s  # a multiple of 2 x CP (12 for CP 2 and 3)
    lengths = torch.tensor([11, 7])
    # Position p of sequence i routed to experts (p + 20 i, layer) in layer `layer`.
    pos = torch.arange(s)[None, :, None] + 20 * torch.arange(b)[:, None, None]
    routing = torch.stack([pos.expand(b, s, layers), torch.arange(layers).expand(b, s, layers)], dim=-1)
    held = context_parallel_positions(width, cp, cp_rank) if cp > 1 else None
    rows = micro_batch_routing(
        routing.to(torch.uint8), lengths, packed_tokens=None, layers=range(1, 3), width=width, positions=held
    )
    order = held if held is not None else torch.arange(width)
    assert len(rows) == 2 and rows[0].shape == (order.shape[0] * b, k)
    for r in range(order.shape[0] * b):
        p, i = int(order[r // b]), r % b
        want = [p + 20 * i, 1] if p < s else [0, 1]
        assert rows[0][r].tolist() == want, (r, p, i)
    mask = engine_routed_rows(lengths, packed_tokens=None, width=order.shape[0], positions=held)
    assert mask.tolist() == [int(order[r // b]) < int(lengths[r % b]) - 1 for r in range(order.shape[0] * b)]
