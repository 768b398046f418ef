"""Routed experts per completion, the pure parts: rows placed by position (a recomputed request keeps its
last rows), vLLM's request ids read back, the dtype by expert count, and the config's refusal of
routing replay with multi-turn episodes."""

import pytest
import torch

from megagrpo.compat.vllm_routed_experts import request_key
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


def test_routing_replay_with_multi_turn_episodes_is_refused_naming_both_keys():
    moe = ["model.arch=qwen3_moe", "model.tiny.num_experts=4", "parallel.tensor_model_parallel_size=1"]
    moe += ["parallel.transformer_impl=local", "grpo.routing_replay=rollout"]
    load_config(None, moe)  # single-turn rollouts: fine
    with pytest.raises(ConfigError, match=r"grpo\.routing_replay.*env\.environment.*multi-turn episodes"):
        load_config(None, [*moe, "env.environment=guess_number"])
