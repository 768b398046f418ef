"""What ``megagrpo plan`` counts for a mixture-of-experts model (:mod:`megagrpo.plan` adds it in).

Megatron-Core splits an MoE layer (every layer of the models here is one) in two:

- the routed experts (each one's fc1 [2 f, h] and fc2 [h, f]): each rank of an expert-parallel group
  (``parallel.expert_model_parallel_size``, EP) holds num_experts / EP of every layer's experts, their
  intermediate dim split over ``parallel.expert_tensor_parallel_size`` (ETP). Their gradients are
  reduced, and with the distributed optimizer their Adam states sharded, over the *expert* data-parallel
  group: the ranks of a stage that hold the same experts, TP x DP x CP / (EP x ETP) of them;
- the rest (the router [E, h], Qwen2-MoE's shared expert and its [1, h] gate, attention, norms,
  embeddings): split over TP and PP and sharded over DP as in a dense model. With
  ``policy.freeze_router`` the routers have no gradients and no Adam states.

Activations, with dropless routing and the all-to-all dispatcher, routing balanced (a skewed router puts
more on the ranks holding the popular experts): each token's hidden state is copied to its top-k experts
and every rank receives as many copies as its own tokens send. Per token and MoE layer a rank keeps for
backward the router's logits and probabilities (2 E) and, for each of the top-k copies, the permuted
hidden state (h: the dispatcher's output, fc1's input), fc1's output (2 f / ETP), the gated activation
(f / ETP) and the expert's output (h, weighted by its routing probability in the combine). A shared
expert keeps what a dense MLP of its width keeps, and its output (h) for the gate.

All-to-all: per MoE layer and micro-batch, the forward dispatches each rank's tokens x top-k hidden
states and combines them back, each time sending (EP - 1) / EP of them to the other EP ranks:
2 x tokens x top-k x h x dtype bytes x (EP - 1) / EP; backward the same again, and full recompute runs
the forward a second time. In a step a rank trains on at most rollouts_per_step / DP sequences of
model.seq_length / CP tokens, after forward-only passes over them for the old log-probs of every
mini-batch but the first and, with grpo.kl_coef > 0, for the reference log-probs. (ETP > 1 would add
its own all-gathers; the rules keep it at 1 for now.)

vLLM engines: the routers are replicated on every worker (vLLM's ``ReplicatedLinear``); by default every
worker holds all experts with their intermediate dim split over the engine's TP t; with vLLM's expert
parallelism (``enable_expert_parallel``) each holds ceil(E / t) experts whole, the same bytes when t
divides E and f. The weight sync's bytes (each EP share's senders sending their own experts) are
``plan._sync_traffic``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megagrpo.config import Config
    from megagrpo.config.model import ParallelConfig
    from megagrpo.models.shape import GPTShape

__all__ = [
    "ExpertPlan",
    "ExpertRankMemory",
    "engine_weights",
    "expert_dp_size",
    "expert_plan",
    "expert_rank",
    "expert_tp",
    "frozen_params",
    "mlp_activation_elements",
    "mlp_params",
    "routed_layer_params",
]


@dataclass
class ExpertRankMemory:
    """What the routed experts put on a trainer rank of one pipeline stage (included in its RankMemory)."""

    stage: int
    params: int
    """Expert parameters: the stage's layers x num_experts / EP x 3 h f / ETP."""
    weights: int
    grads: int
    """fp32 (``grad_reduce_in_fp32``)."""
    optimizer: int
    """Adam's moments and fp32 master weights, divided over the expert data-parallel group with the
    distributed optimizer."""
    optimizer_without_distributed: int
    activations: int
    """The router's and the top-k copies' activations kept for backward at the peak."""
    all_to_all_layer_forward: int
    """Bytes the rank sends to the other EP ranks in one MoE layer's forward of one micro-batch (dispatch
    and combine)."""
    all_to_all_step: int
    """Bytes the rank sends to the other EP ranks in one step: every MoE layer of its stage, every pass."""


@dataclass
class ExpertPlan:
    """The experts' layout over trainer ranks and engine workers, and what they cost per rank."""

    num_experts: int
    router_topk: int
    expert_ffn_hidden_size: int
    ep: int
    etp: int
    expert_dp: int
    """Ranks of a stage that hold the same experts: TP x DP x CP / (EP x ETP)."""
    local_experts: int
    """Experts of each MoE layer on one trainer rank: num_experts / EP."""
    active_params: int
    """Parameters a token goes through: all but the routed experts, and top-k of them in every layer."""
    ranks: list[ExpertRankMemory]
    engine_expert_ffn: int
    """vLLM's default: every worker holds all experts, this much of each one's intermediate dim."""
    engine_experts_ep: int
    """With vLLM's expert parallelism: whole experts of each layer on a worker (the most any one holds)."""
    engine_weights_ep: int
    """With vLLM's expert parallelism: a worker's weight bytes."""


def expert_tp(par: ParallelConfig) -> int:
    """ETP as the trainer builds it (null: TP)."""
    return par.expert_tensor_parallel_size or par.tensor_model_parallel_size


def expert_dp_size(par: ParallelConfig) -> int:
    """The expert data-parallel group: TP x DP x CP / (EP x ETP) (at least 1 where a rule is broken)."""
    stage = par.tensor_model_parallel_size * par.data_parallel_size * par.context_parallel_size
    return max(1, stage // (par.expert_model_parallel_size * expert_tp(par)))


def routed_layer_params(s: GPTShape) -> int:
    """One layer's routed experts, fc1 [2 f, h] and fc2 [h, f] each (0 for a dense model)."""
    return s.num_experts * 3 * s.hidden_size * (s.moe_ffn_hidden_size or 0)


def router_layer_params(s: GPTShape) -> int:
    return s.num_experts * s.hidden_size


def mlp_params(s: GPTShape) -> int:
    """One layer's MLP parameters but the routed experts: a dense model's gated MLP; an MoE model's
    router, and its shared expert with the shared expert's gate."""
    h = s.hidden_size
    if not s.is_moe:
        return 3 * h * s.ffn_hidden_size
    shared = s.moe_shared_expert_ffn_hidden_size
    return router_layer_params(s) + (3 * h * shared + h if shared else 0)


def mlp_activation_elements(s: GPTShape, etp: int) -> tuple[float, float]:
    """Per token, one layer's MLP elements kept for backward (module docstring): (those split over TP,
    the router's and routed copies', which TP does not split)."""
    h = s.hidden_size
    if not s.is_moe:
        return 3 * s.ffn_hidden_size, 0
    shared = s.moe_shared_expert_ffn_hidden_size
    f = s.moe_ffn_hidden_size
    routed = 2 * s.num_experts + s.moe_router_topk * (2 * h + 3 * f / etp)
    return (3 * shared + h if shared else 0), routed


def frozen_params(cfg: Config, s: GPTShape, stage_layers: int) -> int:
    """Parameters of a stage's ``stage_layers`` layers without gradients: the routers, when frozen."""
    return stage_layers * router_layer_params(s) if s.is_moe and cfg.policy.freeze_router else 0


def _all_to_all(cfg: Config, s: GPTShape, wb: int, layers: int) -> tuple[int, int]:
    """(bytes per MoE layer and micro-batch forward, bytes per step) a rank sends to other EP ranks."""
    par, pol = cfg.parallel, cfg.policy
    ep, cp = par.expert_model_parallel_size, par.context_parallel_size
    copy = s.moe_router_topk * s.hidden_size * wb * (ep - 1) / ep  # one token's copies, one way
    layer_forward = 2 * (pol.micro_batch_max_tokens // cp) * copy
    tokens = cfg.rollouts_per_step // par.data_parallel_size * cfg.model.seq_length // cp
    train_passes = 4 + (2 if pol.recompute == "full" else 0)  # dispatch + combine, forward and backward
    minis = cfg.mini_batches_per_step
    forward_only = tokens * (minis - 1) // minis + (tokens if cfg.grpo.kl_coef > 0 else 0)
    return int(layer_forward), int(layers * copy * (train_passes * tokens + 2 * forward_only))


def expert_rank(
    cfg: Config, s: GPTShape, stage: int, *, wb: int, opt_per_param: int, layers_alive: int
) -> ExpertRankMemory:
    """The routed experts on a trainer rank of ``stage``: parameters, bytes and all-to-all traffic;
    ``layers_alive``: layers whose activations are kept at the peak (as :mod:`megagrpo.plan` counts)."""
    par = cfg.parallel
    ep, etp = par.expert_model_parallel_size, expert_tp(par)
    layers = s.num_layers // par.pipeline_model_parallel_size
    per_expert = 3 * s.hidden_size * -(-s.moe_ffn_hidden_size // etp)
    n = layers * -(-s.num_experts // ep) * per_expert
    trained, lora = n, cfg.policy.lora
    if lora.enabled:  # the experts frozen: only their adapters (policy.lora) have gradients and Adam states
        from megagrpo.models.lora import adapter_params_per_rank

        targets = tuple(t for t in lora.targets if t.startswith("experts."))
        tp = par.tensor_model_parallel_size
        trained = layers * adapter_params_per_rank(s, targets, lora.rank, tp, ep=ep, etp=etp)
        n += trained
    full_opt = trained * opt_per_param
    optimizer = -(-full_opt // expert_dp_size(par)) if par.use_distributed_optimizer else full_opt
    tokens = cfg.policy.micro_batch_max_tokens // par.context_parallel_size
    _, routed = mlp_activation_elements(s, etp)
    layer_forward, step = _all_to_all(cfg, s, wb, layers)
    activations = int(layers_alive * tokens * wb * routed)
    return ExpertRankMemory(
        stage, n, n * wb, trained * 4, optimizer, full_opt, activations, layer_forward, step
    )


def expert_plan(
    cfg: Config, s: GPTShape, ranks: list[ExpertRankMemory], non_expert: int, wb: int
) -> ExpertPlan:
    """The layout of ``s``'s experts under ``cfg``; ``non_expert``: the model's other parameters."""
    par, t = cfg.parallel, cfg.generation.engine_tensor_parallel_size
    f = s.moe_ffn_hidden_size
    active = non_expert + s.num_layers * s.moe_router_topk * routed_layer_params(s) // s.num_experts
    routers = s.num_layers * router_layer_params(s)
    ep_experts = -(-s.num_experts // t)
    ep_weights = (non_expert - routers) / t + routers + s.num_layers * ep_experts * 3 * s.hidden_size * f
    return ExpertPlan(
        num_experts=s.num_experts,
        router_topk=s.moe_router_topk,
        expert_ffn_hidden_size=f,
        ep=par.expert_model_parallel_size,
        etp=expert_tp(par),
        expert_dp=expert_dp_size(par),
        local_experts=-(-s.num_experts // par.expert_model_parallel_size),
        active_params=active,
        ranks=ranks,
        engine_expert_ffn=-(-f // t),
        engine_experts_ep=ep_experts,
        engine_weights_ep=int(ep_weights * wb),
    )


def engine_weights(s: GPTShape, non_expert: int, t: int, wb: int) -> int:
    """A vLLM worker's weight bytes at engine TP ``t``, vLLM's default layout (module docstring)."""
    routers = s.num_layers * router_layer_params(s)
    experts = s.num_layers * s.num_experts * 3 * s.hidden_size * -(-s.moe_ffn_hidden_size // t)
    return int(((non_expert - routers) / t + routers + experts) * wb)


def render(con, x: ExpertPlan, cfg: Config, _size) -> None:
    """The experts' layout and their part of each trainer rank's bytes (in the trainer table too), for
    ``megagrpo plan``; ``_size`` formats a byte count."""
    from rich.table import Table

    con.print(
        f"experts        {x.num_experts} per layer, top-{x.router_topk}, expert MLP "
        f"{x.expert_ffn_hidden_size}; EP {x.ep} x ETP {x.etp}: {x.local_experts} per rank, expert DP "
        f"{x.expert_dp} (TP x DP x CP / EP x ETP)"
    )
    t = Table(
        title=f"Routed experts, in the totals above (bytes per rank; optimizer over expert DP {x.expert_dp})"
    )
    for col in ("stage", "params", "weights", "grads", "optimizer", "optim. w/o dist.", "activations"):
        t.add_column(col, justify="right")
    for col in ("a2a/layer fwd", "a2a/step"):
        t.add_column(col, justify="right")
    for r in x.ranks:
        g = (r.weights, r.grads, r.optimizer, r.optimizer_without_distributed, r.activations)
        a2a = (r.all_to_all_layer_forward, r.all_to_all_step)
        t.add_row(str(r.stage), f"{r.params / 1e6:.1f}M", *map(_size, (*g, *a2a)))
    con.print(t)
    passes = ["forward", "backward"] + ["full recompute"] * (cfg.policy.recompute == "full")
    passes += ["old log-probs"] * (cfg.mini_batches_per_step > 1) + ["reference"] * (cfg.grpo.kl_coef > 0)
    con.print(
        f"               activations: the router's and the top-{x.router_topk} copies' (permuted hidden "
        "states, expert MLPs), routing balanced"
    )
    con.print("               a2a: all-to-all bytes a rank sends to the other EP ranks (dispatch + combine)")
    con.print(f"               a2a/step, at most: {', '.join(passes)}")
