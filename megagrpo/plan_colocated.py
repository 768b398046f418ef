"""``megagrpo plan``'s colocated phases: the bytes on one GPU that a trainer rank and a vLLM engine
share, in each phase of a run, in the order the GRPO loop hands the GPU over (``runtime.colocated``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megagrpo import plan_experts

if TYPE_CHECKING:
    from megagrpo.config import Config
    from megagrpo.models.shape import GPTShape
    from megagrpo.plan import RankMemory

GIB = 2**30
PROCESS_CONTEXT_BYTES = GIB // 2
"""What a process keeps on a GPU whatever it does (CUDA context, allocator pools): an estimate, for
each of the two processes on a colocated GPU (a sleeping vLLM engine keeps about this much)."""

COLOCATED_PHASES = ("start", "resume", "step0_sync", "wake", "sync", "generation", "train", "save")
"""A colocated GPU's phases, in the order a run meets them (:func:`colocated_phases`)."""


def largest_engine_tensor(s: GPTShape, etp: int, wb: int) -> int:
    """The largest tensor of one engine worker that a weight reload materializes at once: the
    embedding or output layer, a layer's fused QKV or gate/up projection, or an MoE layer's experts."""
    from megagrpo.models.shape import padded_vocab_size

    h = s.hidden_size
    qkv = h * (s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim
    mlp = 2 * h * s.ffn_hidden_size if not s.is_moe else plan_experts.routed_layer_params(s)
    return int(max(padded_vocab_size(s.vocab_size) * h, qkv, mlp) * wb / etp)


def colocated_phases(cfg: Config, ranks: list[RankMemory], engine: dict) -> dict[str, object]:
    """Bytes on one colocated GPU in each phase of a run, for the rank of the heaviest stage, in the
    order the GRPO loop hands the GPU over (``runtime.colocated``): wake weights -> sync -> park the
    trainer -> wake the KV cache -> generate -> sleep -> train.

    - start: the engine starts beside the built trainer (weights, gradient buffers, optimizer) and
      claims ``gpu_memory_utilization`` of the GPU (its weights, KV cache and workspace);
    - resume: a checkpoint loaded with the engine asleep (vLLM's level 2: it keeps its context
      only); the optimizer's states are counted twice, for the tensors the load reads into;
    - step0_sync, sync: the trainer has parked what ``policy.offload`` moves before a sync (the
      optimizer; with ``all`` the gradient buffers too) and the engine has woken its weights only:
      beside them its two receive buffers (one bucket each) and the layer being reloaded (vLLM
      re-processes a layer once all of it arrived: the largest tensor, twice, for its copy);
    - wake: the same without the receive buffers (the weights woken, nothing received yet);
    - generation: the engine's whole claim beside what the trainer keeps once the weights are synced
      (``all``: nothing but, while the probe is scored, its weights);
    - train: the trainer's states and activations beside the sleeping engine;
    - save: a checkpoint written with the engine asleep, from the weights and the optimizer (and the
      gradient buffers where they were never parked), the optimizer's states counted twice for the
      copies the checkpoint's format makes.
    Each adds the trainer's two shared bucket slots (allocated when the sync is set up and kept) and
    :data:`PROCESS_CONTEXT_BYTES` per process."""
    offload, ctx = cfg.policy.offload, 2 * PROCESS_CONTEXT_BYTES
    bucket = int(cfg.generation.sync_bucket_mb * 2**20)
    slots, claimed, engine_weights = 2 * bucket, engine["claimed"], engine["weights"]
    receiving = 2 * bucket + 2 * engine.get("largest_tensor", 0)

    def worst(bytes_of) -> int:
        return max(bytes_of(r) for r in ranks)

    def keeps_at_sync(r: RankMemory) -> int:
        return r.weights + (0 if offload == "all" else r.grads) + (r.optimizer if offload == "none" else 0)

    def keeps_at_generation(r: RankMemory) -> int:
        # "all": the weights are parked, and borrowed back while the probe is scored.
        return {
            "none": r.weights + r.grads + r.optimizer,
            "optimizer": r.weights + r.grads,
            "all": r.weights,
        }[offload]

    def states(r: RankMemory) -> int:
        return r.weights + r.grads + r.optimizer

    def saved_from(r: RankMemory) -> int:
        return r.weights + 2 * r.optimizer + (0 if offload == "all" else r.grads)

    sync = worst(keeps_at_sync) + engine_weights + receiving + slots + ctx
    phases = {
        "start": worst(states) + claimed + ctx,
        "resume": worst(lambda r: states(r) + r.optimizer) + slots + ctx,
        "step0_sync": sync,
        "wake": worst(keeps_at_sync) + engine_weights + slots + ctx,
        "sync": sync,
        "generation": worst(keeps_at_generation) + claimed + slots + ctx,
        "train": max(r.total for r in ranks) + slots + ctx,
        "save": worst(saved_from) + slots + ctx,
    }
    peak = max(COLOCATED_PHASES, key=phases.get)
    return {**phases, "peak": phases[peak], "peak_phase": peak, "offload": offload}
