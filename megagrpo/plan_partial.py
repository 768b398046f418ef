"""``megagrpo plan`` under ``grpo.async_mode: partial``: the group buffer's host memory and the engines' KV
cache for the requests they hold in flight (``megagrpo.trainers.partial``).

The buffer never holds more than ``(grpo.max_staleness + 1) * grpo.num_prompts_per_step`` groups
(``GroupBuffer.in_flight_limit``), each of ``grpo.num_generations`` responses; the plan counts each at its
longest, ``generation.max_new_tokens`` tokens, as the driver holds them: Python lists, per token a token id
(an 8-byte list slot and a 28-byte int), a sampling logprob (an 8-byte slot and a 24-byte float) and a
version (an 8-byte slot: one int object is shared by every token of a version). Under
``grpo.routing_replay`` each response also carries its routed experts: a row per position of prompt +
response but the last, at most ``model.seq_length - 1``, of MoE layers x top-k ids of 1 byte (2 past 256
experts). An upper bound: a checkpoint's ``rollouts_in_flight.pt`` holds the same records.

Each engine holds ``ceil(in-flight groups / generation.num_engines)`` groups, one request per response;
vLLM decodes ``generation.max_num_seqs`` of them at once (vLLM's default when null) and queues the rest,
so the KV cache must hold that many sequences of ``model.seq_length`` beside the engine's weights.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megagrpo.config import Config
    from megagrpo.models.shape import GPTShape

PY_INT_IN_LIST = 8 + 28
"""A token id in a Python list: its slot and its int object (ids below 257 are shared: an upper bound)."""
PY_FLOAT_IN_LIST = 8 + 24
PY_SHARED_IN_LIST = 8
"""A version in a list: the slot only (the stream repeats one int object per version)."""
TOKEN_BYTES = PY_INT_IN_LIST + PY_FLOAT_IN_LIST + PY_SHARED_IN_LIST


def groups_held(cfg: Config) -> int:
    """The most groups the buffer holds (queued, on engines, finished): ``GroupBuffer.in_flight_limit``."""
    return (cfg.grpo.max_staleness + 1) * cfg.grpo.num_prompts_per_step


def routing_row_bytes(cfg: Config, shape: GPTShape) -> int:
    """One position's routed experts under ``grpo.routing_replay`` (every layer is an MoE layer); 0 else."""
    if cfg.grpo.routing_replay == "none" or not shape.is_moe:
        return 0
    id_bytes = 1 if shape.num_experts <= 256 else 2  # generation.routing.routed_experts_dtype
    return shape.num_layers * shape.moe_router_topk * id_bytes


def requests_per_engine(cfg: Config) -> int:
    """The requests one engine holds in flight: its share of the groups, one request per response."""
    return math.ceil(groups_held(cfg) / cfg.generation.num_engines) * cfg.grpo.num_generations


def partial_plan(cfg: Config, shape: GPTShape, engine: dict[str, int]) -> dict[str, int]:
    """The buffer's bytes and one engine worker's KV cache for the requests it decodes at once.
    ``engine``: ``plan._engine_worker``'s numbers (weights, claimed, kv_per_token)."""
    g, gen = cfg.grpo, cfg.generation
    responses = groups_held(cfg) * g.num_generations
    row_bytes = routing_row_bytes(cfg, shape)
    rows = cfg.model.seq_length - 1 if row_bytes else 0
    per_response = gen.max_new_tokens * TOKEN_BYTES + rows * row_bytes
    in_flight = requests_per_engine(cfg)
    running = min(in_flight, engine["max_num_seqs"])
    kv = engine["kv_per_token"] * cfg.model.seq_length * running
    return {
        "groups": groups_held(cfg),
        "responses": responses,
        "bytes_per_response": per_response,
        "routing_bytes_per_response": rows * row_bytes,
        "buffer_bytes": responses * per_response,
        "requests_per_engine": in_flight,
        "running_per_engine": running,
        "kv_in_flight": int(kv),
        "kv_headroom": int(engine["claimed"] - engine["weights"] - kv),
    }
