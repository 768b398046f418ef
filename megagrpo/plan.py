"""``megagrpo plan``: a run's layout checked against its model shape; per-rank memory and sync traffic.

Reads the shape from ``model.hf_dir``'s config.json (or a given config.json; no weights), applies the
shape and layer-feature rules of :mod:`megagrpo.config.rules` with ``auto`` resolved as the runtime
resolves it (:mod:`megagrpo.parallel.backends`; ``--transformer-engine yes|no`` states what the trainer's
machines have instead of this one), and estimates, per trainer rank of each pipeline stage: weights,
fp32 gradients (``grad_reduce_in_fp32``), Adam states with fp32 master weights (divided over DP with the
distributed optimizer), activations for ``policy.recompute`` at ``policy.micro_batch_max_tokens``
(Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models": 34 s b h
bytes per layer with selective recompute; the local implementation's unfused attention adds its fp32
[heads, s, s] probabilities), the logits and the chunked log-prob buffers on the last stage; per engine
worker: weights + KV cache for ``model.seq_length`` at the engine's concurrency; and the bytes each
sender puts on each link and each vLLM worker receives per sync, on the path the runtime takes
(shard-wise where trainer and engine TP nest: every TP rank sends its own shard; else gathered:
TP rank 0 of each stage broadcasts its stage). With colocated engines, the bytes on one GPU in
each phase of a run (start, resume, step-0 sync, wake, sync, generation, train, save:
:mod:`megagrpo.plan_colocated`) under ``policy.offload``, and which phase is the peak.
Under ``grpo.async_mode: partial``, the group buffer's host memory and each engine's KV cache for the
requests it holds in flight (:mod:`megagrpo.plan_partial`).
A mixture-of-experts model's routed experts are counted by :mod:`megagrpo.plan_experts` (split over EP
and ETP, their Adam states over the expert data-parallel group; the dispatcher's activations and
all-to-all bytes; the engines' layouts of them) and added to each rank's numbers.
These are estimates; ``python -m benchmarks.train`` compares them with measured peaks.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from megagrpo import plan_experts, plan_partial
from megagrpo.config import rules
from megagrpo.config.errors import ConfigError
from megagrpo.config.resolution import packs_sequences
from megagrpo.models.lora import adapter_params_per_rank
from megagrpo.parallel import backends
from megagrpo.plan_colocated import COLOCATED_PHASES, colocated_phases, largest_engine_tensor
from megagrpo.weight_sync.adapters import adapter_sync_bytes

if TYPE_CHECKING:
    from megagrpo.config import Config
    from megagrpo.models.shape import GPTShape

__all__ = ["COLOCATED_PHASES", "Plan", "colocated_phases", "make_plan", "read_shape"]

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_MAX_NUM_SEQS = 256
"""vLLM's default cap on sequences an engine decodes at once (the plan's engine concurrency bound)."""


@dataclass
class RankMemory:
    stage: int
    params: int
    weights: int
    grads: int
    optimizer: int
    optimizer_without_distributed: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits


@dataclass
class Plan:
    world_size: int
    gpus: int
    gpu_memory_bytes: int
    transformer_impl: str
    backend: str
    params: int
    ranks: list[RankMemory]
    engine_worker_bytes: dict[str, int]
    sync: dict[str, float]
    colocated: dict[str, object] | None = None
    """Colocated placement: bytes per GPU in each phase (:data:`COLOCATED_PHASES`) and the peak."""
    errors: list[str] = field(default_factory=list)
    experts: plan_experts.ExpertPlan | None = None
    """A mixture-of-experts model: the experts' layout and their part of each rank's numbers."""
    partial: dict[str, int] | None = None
    """grpo.async_mode partial: the group buffer's host bytes and the engines' KV cache for the requests
    in flight (:func:`megagrpo.plan_partial.partial_plan`)."""
    trainer: str = "grpo"
    """The command the plan is for (``--trainer``): sft and dpo start no engines (no engine or sync part)."""
    shape_from: str = ""
    """Where the model's shape was read (a config.json, or ``model.tiny``)."""

    def to_json(self) -> str:
        d = asdict(self)
        for r, rm in zip(d["ranks"], self.ranks, strict=True):
            r["total"] = rm.total
        return json.dumps(d, indent=2)


def read_shape(cfg: Config, hf_config: str | None) -> tuple[GPTShape, str]:
    """The model's shape from ``hf_config`` or ``model.hf_dir``'s config.json (or ``model.tiny``)."""
    from megagrpo.models.description import describe_model
    from megagrpo.models.registry import shape_from_hf_config

    if hf_config is not None:
        path = Path(hf_config)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError((), f"--hf-config {path}: {err}") from None
        return shape_from_hf_config(data, str(path))[1], str(path)
    if cfg.model.tiny is not None:
        return describe_model(cfg).shape, "model.tiny"
    config_json = Path(cfg.model.hf_dir) / "config.json"
    if not config_json.is_file():
        raise ConfigError(
            "model.hf_dir",
            f"{config_json} not found: the plan reads the model's shape from it (or pass --hf-config FILE)",
        )
    return describe_model(cfg).shape, str(config_json)


def _layer_params(s: GPTShape) -> int:
    """One layer's parameters but the routed experts (:func:`plan_experts.mlp_params`)."""
    d, a, g, h = s.head_dim, s.num_attention_heads, s.num_query_groups, s.hidden_size
    qkv = h * (a + 2 * g) * d + ((a + 2 * g) * d if s.qkv_bias else 0)
    qk_norms = 2 * d if s.qk_layernorm else 0  # Qwen3's per-head q and k RMSNorms
    return qkv + a * d * h + plan_experts.mlp_params(s) + 2 * h + qk_norms


def _stage_params(s: GPTShape, pp: int, stage: int) -> int:
    """A pipeline stage's parameters but the routed experts."""
    from megagrpo.models.shape import padded_vocab_size

    embed = padded_vocab_size(s.vocab_size) * s.hidden_size
    n = _layer_params(s) * s.num_layers // pp
    if stage == 0:
        n += embed
    if stage == pp - 1:
        n += s.hidden_size + (embed if (not s.tie_word_embeddings or pp > 1) else 0)
    return n


def _activations(cfg: Config, s: GPTShape, impl: str, stage: int) -> int:
    """Activation bytes a rank of ``stage`` keeps for backward at its peak.

    Per token and layer, counted as Korthikanti et al. (2022) count them but for a gated MLP and
    grouped-query attention, in the model's dtype and without dropout: the two norms' inputs and the
    residual (not split over TP without SP), the QKV, projection and fc1 inputs (h each), q/k/v
    ((heads + 2 groups) x head_dim), fc1's output (2 ffn) and the gated activation's (ffn); an MoE
    layer's MLP as :mod:`megagrpo.plan_experts` counts it instead of the last two. An unfused
    attention (an implementation without ``thd`` in IMPL_FEATURES) also materialises fp32 scores and
    probabilities and their gradients, 16 bytes per [head, query, key] element; with core-attention
    recompute only one layer's are alive at a time. 1F1B keeps ``pp - stage`` micro-batches in flight.
    """
    par, pol = cfg.parallel, cfg.policy
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    wb = DTYPE_BYTES[cfg.model.dtype]
    tokens = pol.micro_batch_max_tokens // cp
    seq = min(cfg.model.seq_length, pol.micro_batch_max_tokens) // cp
    h, layers = s.hidden_size, s.num_layers // pp
    qkv = (s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim
    mlp, routed = plan_experts.mlp_activation_elements(s, plan_experts.expert_tp(par))
    split = 3 * h + qkv + mlp  # split over TP
    unsplit = 2 * h  # the norms' inputs: split over TP only with sequence parallelism
    per_token = wb * (split + unsplit) / tp if par.sequence_parallel else wb * (split / tp + unsplit)
    per_token += wb * routed  # the router's and the top-k copies', whole on every TP rank
    unfused = "thd" not in backends.IMPL_FEATURES.get(impl, frozenset())
    attn_core = 16 * (s.num_attention_heads / tp) * seq * tokens if unfused else 0
    in_flight, alive = pp - stage, _layers_alive(cfg, layers, stage)
    if pol.recompute == "none":
        return int(alive * (per_token * tokens + attn_core))
    if pol.recompute == "core_attention":
        return int(alive * per_token * tokens + attn_core)
    # full: each group's input kept, one group's activations alive in its backward
    groups = math.ceil(layers / pol.recompute_num_layers)
    kept = wb * h * tokens / (tp if par.sequence_parallel else 1)
    return int(in_flight * groups * kept + alive * (per_token * tokens + attn_core))


def _layers_alive(cfg: Config, layers: int, stage: int) -> int:
    """Layers whose activations a rank of ``stage`` keeps at its peak: every layer of the ``pp - stage``
    micro-batches 1F1B keeps in flight, or with full recompute one group's."""
    pol, pp = cfg.policy, cfg.parallel.pipeline_model_parallel_size
    return pol.recompute_num_layers if pol.recompute == "full" else (pp - stage) * layers


def _logits(cfg: Config, s: GPTShape, stage: int) -> int:
    par = cfg.parallel
    if stage != par.pipeline_model_parallel_size - 1:
        return 0
    from megagrpo.models.shape import padded_vocab_size

    vocab = padded_vocab_size(s.vocab_size) // par.tensor_model_parallel_size
    tokens = cfg.policy.micro_batch_max_tokens // par.context_parallel_size
    out = DTYPE_BYTES[cfg.model.dtype] * tokens * vocab * 2  # logits and their gradient
    return int(out + 3 * 4 * cfg.policy.logprob_chunk_size * vocab)  # fp32 chunk, softmax, grad


def _stage_of(rule_name: str, shape: GPTShape, pp: int) -> int:
    if rule_name.startswith("embedding."):
        return 0
    if not rule_name.startswith("decoder.layers."):
        return pp - 1  # final norm, output layer
    return int(rule_name.split(".")[2]) * pp // shape.num_layers


def _expert_of(rule_name: str) -> int:
    """A routed expert's global index (-1 for every other tensor)."""
    match = re.search(r"\.local_experts\.(\d+)\.", rule_name)
    return int(match.group(1)) if match else -1


def _sync_traffic(cfg: Config, shape: GPTShape, itemsize: int, link_gbps: float) -> dict:
    """Bytes per sender and per receiving vLLM worker of one sync on the path the runtime takes
    (``weight_sync.shards.choose_path``): shard-wise, every trainer TP rank of each stage sends its
    pieces and each worker receives its shard; gathered, TP rank 0 of each stage sends the stage's
    whole HF tensors and every worker receives the whole model. Under expert parallelism each of a
    stage's EP shares of the experts has senders of its own, which send only its experts (the first
    share's also send the rest of the stage: the most any sender sends). A broadcast carries each byte
    once per link, so the time is the larger of the two over ``link_gbps``."""
    from megagrpo.generation.engine import engine_spec
    from megagrpo.models.mapping import decoder_rules
    from megagrpo.weight_sync.shards import SyncPath, choose_path, shard_bytes

    par, gen = cfg.parallel, cfg.generation
    tp, pp, etp = (
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        gen.engine_tensor_parallel_size,
    )
    fits = (
        shape.num_layers % pp == 0
        and shape.num_query_groups % tp == 0
        and shape.num_attention_heads % tp == 0
    )
    et = plan_experts.expert_tp(par) if shape.is_moe else tp
    layout = engine_spec(gen.engine).layout()
    path = (
        choose_path(
            shape,
            tp,
            etp,
            gen.weight_sync_path,
            layout=layout,
            expert_tp=et,
            engine_ep=gen.engine_expert_parallel,
        )
        if fits
        else SyncPath("gathered", "the trainer layout does not fit the model (see the errors)")
    )
    rules = [r for r in decoder_rules(shape) if r.export]
    shard_wise = path.kind == "shard"
    t, e, et = (tp, etp, et) if shard_wise else (1, 1, 1)
    ep = par.expert_model_parallel_size if shape.is_moe else 1
    per_sender, per_worker = 0, [0] * e
    for stage in range(pp):
        stage_rules = [r for r in rules if _stage_of(r.megatron, shape, pp) == stage]
        _, received = shard_bytes(
            shape, stage_rules, t, e, itemsize, layout=layout, expert_tp=et, engine_ep=path.engine_ep
        )
        # What the first EP share's senders send: the stage's dense tensors and their own experts.
        first = [r for r in stage_rules if _expert_of(r.megatron) < shape.num_experts // ep]
        sent, _ = shard_bytes(
            shape, first, t, e, itemsize, layout=layout, expert_tp=et, engine_ep=path.engine_ep
        )
        per_sender = max(per_sender, *sent)
        per_worker = [a + b for a, b in zip(per_worker, received, strict=True)]
    worst = max(per_sender, *per_worker)
    return {
        "path": path.kind,
        "path_reason": path.reason,
        # A stage's dense senders are its first TP ranks, its expert senders its first EP x ETP ranks.
        "senders": pp * max(t, ep * et),
        "receivers": gen.num_engines * etp,
        "bytes_per_sender": per_sender,
        "bytes_per_worker": max(per_worker),
        "bytes_per_link": per_sender,  # a ring/tree broadcast carries each byte once per link
        "total_bytes": sum(per_worker),  # what one engine receives, all its workers together
        "link_gbps": link_gbps,
        "est_seconds": worst * 8 / (link_gbps * 1e9),
        "sync_mode": gen.sync_mode,
        # Delta mode: each sender keeps the bytes it last sent, each worker those it last received, in host
        # memory (weight_sync.delta); the first sync and any after an engine restart go whole.
        "host_bytes_per_sender": per_sender if gen.sync_mode == "delta" else 0,
        "host_bytes_per_worker": max(per_worker) if gen.sync_mode == "delta" else 0,
        # lora_sync adapter: the base as above once per engine start, then the adapters alone to every worker
        "adapter_bytes": adapter_sync_bytes(cfg, shape, itemsize),
    }


def make_plan(
    cfg: Config,
    shape: GPTShape,
    where: str,
    *,
    gpu_memory_gib: float = 80.0,
    link_gbps: float = 100.0,
    transformer_engine: bool | None = None,
    trainer: str = "grpo",
) -> Plan:
    """Check ``cfg`` against ``shape`` and estimate memory and sync traffic (see the module docstring),
    for the run ``trainer`` makes of it: ``sft`` and ``dpo`` start no engines, so no engine, sync or
    colocated numbers (and no engine rule)."""
    rollouts = trainer in ("grpo", "distill")
    par, gen = cfg.parallel, cfg.generation
    impl, decided = cfg.resolved.transformer_impl, "here"
    if par.transformer_impl == "auto" and transformer_engine is not None:
        # as backends.resolve_transformer_impl resolves "auto" on the trainer's machines
        if transformer_engine:
            impl = "transformer_engine"
        else:
            impl = "torch" if backends.torch_layers_available() else "local"
        decided = "on the trainer's machines (--transformer-engine)"
    errors = []
    for rule in (
        lambda: rules.check_shape(cfg, shape, where, engines=rollouts),
        lambda: rules.check_features(cfg, impl, decided=decided),
        *([lambda: rules.check_engine_share(cfg)] if rollouts else []),
    ):
        try:
            rule()
        except ConfigError as err:
            errors.append(str(err))
    pairs = [_rank_memory(cfg, shape, impl, stage) for stage in range(par.pipeline_model_parallel_size)]
    ranks = [rank for rank, _ in pairs]
    wb = DTYPE_BYTES[cfg.model.dtype]
    non_expert = _stage_params(shape, 1, 0)  # the whole model as one stage, but the routed experts
    params = non_expert + shape.num_layers * plan_experts.routed_layer_params(shape)
    engine = _engine_worker(cfg, shape, non_expert, gpu_memory_gib) if rollouts else {}
    experts = None
    if shape.is_moe:
        experts = plan_experts.expert_plan(cfg, shape, [e for _, e in pairs], non_expert, wb)
    sync = _sync_traffic(cfg, shape, wb, link_gbps) if rollouts else {}
    gpus = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    mem = int(gpu_memory_gib * GIB)
    colocated = colocated_phases(cfg, ranks, engine) if rollouts and gen.placement == "colocated" else None
    plan = Plan(
        par.world_size,
        gpus,
        mem,
        impl,
        cfg.resolved.backend,
        params,
        ranks,
        engine,
        sync,
        colocated,
        experts=experts,
        trainer=trainer,
        shape_from=where,
    )
    if rollouts and cfg.grpo.async_mode == "partial":
        plan.partial = plan_partial.partial_plan(cfg, shape, engine)
    plan.errors = errors
    errors += memory_errors(cfg, ranks, engine, gpu_memory_gib, colocated)
    return plan


def _rank_memory(
    cfg: Config, shape: GPTShape, impl: str, stage: int
) -> tuple[RankMemory, plan_experts.ExpertRankMemory | None]:
    """A trainer rank of ``stage``: the non-expert parameters split over TP, their Adam states divided
    over DP with the distributed optimizer; an MoE model's routed experts added (and returned apart)."""
    par = cfg.parallel
    tp, pp, dp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.data_parallel_size
    wb = DTYPE_BYTES[cfg.model.dtype]
    opt_per_param = 8 + (4 if wb < 4 else 0)  # Adam m, v (+ fp32 master weights)
    n = math.ceil(_stage_params(shape, pp, stage) / tp)
    trained = n - plan_experts.frozen_params(cfg, shape, shape.num_layers // pp)
    lora = cfg.policy.lora
    if lora.enabled:  # the base is frozen: only the adapters have gradients and Adam states
        # (the routed experts' with the experts, plan_experts: their Adam states over the expert DP group)
        dense = tuple(t for t in lora.targets if not t.startswith("experts."))
        trained = shape.num_layers // pp * adapter_params_per_rank(shape, dense, lora.rank, tp)
        n += trained
    full_opt = trained * opt_per_param
    rank = RankMemory(
        stage=stage,
        params=n,
        weights=n * wb,
        grads=trained * 4,
        optimizer=math.ceil(full_opt / dp) if par.use_distributed_optimizer else full_opt,
        optimizer_without_distributed=full_opt,
        activations=_activations(cfg, shape, impl, stage),
        logits=_logits(cfg, shape, stage),
    )
    if not shape.is_moe:
        return rank, None
    alive = _layers_alive(cfg, shape.num_layers // pp, stage)
    e = plan_experts.expert_rank(cfg, shape, stage, wb=wb, opt_per_param=opt_per_param, layers_alive=alive)
    with_experts = replace(
        rank,
        params=rank.params + e.params,
        weights=rank.weights + e.weights,
        grads=rank.grads + e.grads,
        optimizer=rank.optimizer + e.optimizer,
        optimizer_without_distributed=rank.optimizer_without_distributed + e.optimizer_without_distributed,
    )
    return with_experts, e


def _engine_worker(cfg: Config, shape: GPTShape, non_expert: int, gpu_memory_gib: float) -> dict[str, int]:
    """One vLLM worker: its weights (an MoE model's as :func:`plan_experts.engine_weights` lays them out),
    the KV cache for ``model.seq_length`` at the engine's concurrency, and its claim on the GPU."""
    gen, wb = cfg.generation, DTYPE_BYTES[cfg.model.dtype]
    etp = gen.engine_tensor_parallel_size
    kv_per_token = 2 * shape.num_layers * shape.num_query_groups * shape.head_dim * wb / etp
    per_engine = math.ceil(cfg.rollouts_per_step / gen.num_engines)
    concurrency = min(per_engine, VLLM_MAX_NUM_SEQS)
    max_num_seqs = gen.max_num_seqs or VLLM_MAX_NUM_SEQS
    if cfg.grpo.async_mode == "partial":  # the requests it holds in flight, as many as vLLM decodes at once
        concurrency = min(plan_partial.requests_per_engine(cfg), max_num_seqs)
    weights = (
        plan_experts.engine_weights(shape, non_expert, etp, wb)
        if shape.is_moe
        else int(non_expert * wb / etp)
    )
    return {
        "weights": weights,
        "largest_tensor": largest_engine_tensor(shape, etp, wb),
        "kv_cache": int(kv_per_token * cfg.model.seq_length * concurrency),
        "concurrency": concurrency,
        "claimed": int(gen.gpu_memory_utilization * gpu_memory_gib * GIB),
        "kv_per_token": kv_per_token,
        "max_num_seqs": max_num_seqs,
    }


def memory_errors(
    cfg: Config, ranks: list[RankMemory], engine: dict, gpu_memory_gib: float, colocated: dict | None = None
) -> list[str]:
    """What does not fit: a pipeline stage's trainer rank, an engine worker's weights and KV cache in its
    share of the GPU, and (colocated) the peak phase of a step (:func:`colocated_phases`)."""
    gen, mem, errors = cfg.generation, int(gpu_memory_gib * GIB), []
    concurrency = engine.get("concurrency")
    for r in ranks:
        if r.total > mem:
            errors.append(
                f"trainer ranks of pipeline stage {r.stage} need {r.total / GIB:.1f} GiB, "
                f"{(r.total - mem) / GIB:.1f} GiB more than the {gpu_memory_gib:g} GiB per GPU "
                "(parallel.*, policy.micro_batch_max_tokens, policy.recompute)"
            )
    need = engine["weights"] + engine["kv_cache"] if engine else 0
    if engine and need > engine["claimed"]:
        errors.append(
            f"each engine worker needs {need / GIB:.1f} GiB (weights + KV cache for {concurrency} "
            f"sequences of {cfg.model.seq_length}) but generation.gpu_memory_utilization "
            f"{gen.gpu_memory_utilization} "
            f"gives it {engine['claimed'] / GIB:.1f} GiB: {(need - engine['claimed']) / GIB:.1f} GiB short "
            "(vLLM would run fewer sequences at once)"
        )
    if colocated is not None and colocated["peak"] > mem:
        phase = colocated["peak_phase"]
        errors.append(
            f"colocated: the {phase} phase needs {colocated['peak'] / GIB:.1f} GiB per GPU, "
            f"{(colocated['peak'] - mem) / GIB:.1f} GiB more than the {gpu_memory_gib:g} GiB GPU "
            f"(policy.offload {colocated['offload']}, generation.gpu_memory_utilization "
            f"{gen.gpu_memory_utilization})"
        )
    return errors


def _size(n: float) -> str:
    return f"{n / GIB:.1f}G" if n >= GIB / 10 else f"{n / 2**20:.1f}M"


def _render_run(con, plan: Plan, cfg: Config) -> None:
    """The run's model, layouts and step, one line each."""
    par, gen, grpo = cfg.parallel, cfg.generation, cfg.grpo
    m = cfg.model
    model = (
        f"tiny {m.arch}"
        if m.tiny
        else f"HF {m.hf_dir}"
        if m.hf_dir
        # the run it names need not exist yet: the trainer resolves it when it starts
        else f"the result of run {m.init_from} (checked at start), shaped as {plan.shape_from}"
    )
    con.print(f"run            {cfg.run_name} ({plan.trainer})")
    active = f" ({plan.experts.active_params / 1e9:.2f}B active)" if plan.experts else ""
    con.print(
        f"model          {model}, {plan.params / 1e9:.2f}B parameters{active}, {cfg.model.dtype}, "
        f"seq_length {cfg.model.seq_length}"
    )
    con.print(
        f"trainer        {par.world_size} ranks = DP {par.data_parallel_size} x TP "
        f"{par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size} x CP "
        f"{par.context_parallel_size}; backend {plan.backend}; layers {plan.transformer_impl}"
    )
    has = backends.IMPL_FEATURES.get(plan.transformer_impl, frozenset())
    con.print(
        f"layers         {plan.transformer_impl}: sequence parallel "
        f"{'yes' if 'sequence_parallel' in has else 'no'}, context parallel "
        f"{'yes' if 'context_parallel' in has else 'no'}; micro-batches "
        f"{'packed end to end (THD)' if packs_sequences(cfg, plan.transformer_impl) else 'padded'}"
    )
    if not plan.engine_worker_bytes:  # sft, dpo: no engines, no rollouts
        con.print(f"GPUs           {plan.gpus} of {plan.gpu_memory_bytes / GIB:g} GiB; no vLLM engines")
        return
    con.print(
        f"rollout        {gen.num_engines} vLLM engine(s) x TP {gen.engine_tensor_parallel_size}, "
        f"{gen.placement}; {plan.gpus} GPUs of {plan.gpu_memory_bytes / GIB:g} GiB"
    )
    con.print(
        f"step           {grpo.num_prompts_per_step} prompts x {grpo.num_generations} = "
        f"{cfg.rollouts_per_step} rollouts, {cfg.mini_batches_per_step} optimizer step(s) of "
        f"{cfg.policy.mini_batch_size}"
    )


def render(plan: Plan, cfg: Config) -> None:
    """Print the run's layout and ``plan`` as tables (rich)."""
    from rich.console import Console
    from rich.table import Table

    con = Console(width=120, highlight=False)
    _render_run(con, plan, cfg)
    t = Table(
        title=f"Trainer: {plan.world_size} ranks, {plan.transformer_impl}, {plan.backend} (bytes per rank)"
    )
    for col in (
        "stage",
        "params",
        "weights",
        "grads",
        "optimizer",
        "optim. w/o dist.",
        "activations",
        "logits",
        "total",
    ):
        t.add_column(col, justify="right")
    for r in plan.ranks:
        g = (r.weights, r.grads, r.optimizer, r.optimizer_without_distributed, r.activations, r.logits)
        t.add_row(str(r.stage), f"{r.params / 1e6:.1f}M", *map(_size, (*g, r.total)))
    con.print(t)
    if plan.experts is not None:
        plan_experts.render(con, plan.experts, cfg, _size)
    if plan.engine_worker_bytes:
        _render_engines(con, plan, cfg)
    for err in plan.errors:
        con.print(f"[red]error:[/red] {err}")
    con.print("plan OK" if not plan.errors else f"{len(plan.errors)} problem(s)")


def _render_engines(con, plan: Plan, cfg: Config) -> None:
    """Each engine worker's memory, the weight sync's bytes and (colocated) the phases of a step."""
    gen = cfg.generation
    e = plan.engine_worker_bytes
    con.print(
        f"engine worker: weights {_size(e['weights'])} + KV cache {_size(e['kv_cache'])} "
        f"({e['concurrency']} sequences) of {_size(e['claimed'])} claimed"
    )
    if plan.experts is not None:
        x, t = plan.experts, gen.engine_tensor_parallel_size
        con.print(
            f"engine experts: vLLM's default (TP {t}) all {x.num_experts} on each worker, "
            f"{x.engine_expert_ffn} of {x.expert_ffn_hidden_size} wide; expert parallel: "
            f"{x.engine_experts_ep} whole, weights {_size(x.engine_weights_ep)}"
        )
    s = plan.sync
    con.print(
        f"weight sync, {s['path']} ({s['path_reason']}): {s['senders']} sender(s) -> {s['receivers']} "
        f"vLLM workers, {_size(s['bytes_per_sender'])} per sender, {_size(s['bytes_per_worker'])} per "
        f"worker, ~{s['est_seconds']:.2f} s at {s['link_gbps']:g} Gb/s"
    )
    if s["sync_mode"] == "delta":
        con.print(
            f"delta sync: host memory {_size(s['host_bytes_per_sender'])} per sender and "
            f"{_size(s['host_bytes_per_worker'])} per vLLM worker (the last bytes sent and received); "
            "later syncs send the changed elements, 6 bytes each in bf16, the times above bound the first"
        )
    if s["adapter_bytes"]:
        con.print(
            f"adapter sync: the bytes above go once per engine start, then {_size(s['adapter_bytes'])} of "
            "LoRA adapters per sync (through the controller, to every vLLM worker)"
        )
    if plan.partial is not None:
        p = plan.partial
        con.print(
            f"partial rollouts: buffer of {p['groups']} groups ({p['responses']} responses) up to "
            f"{_size(p['buffer_bytes'])} of host memory; {p['requests_per_engine']} requests in flight per "
            f"engine, {p['running_per_engine']} decoding: KV {_size(p['kv_in_flight'])}, headroom "
            f"{_size(p['kv_headroom'])}"
        )
    if plan.colocated is not None:
        c = plan.colocated
        phases = ", ".join(f"{phase} {_size(c[phase])}" for phase in COLOCATED_PHASES)
        con.print(
            f"colocated, per GPU (policy.offload {c['offload']}): {phases}; peak {_size(c['peak'])} in "
            f"the {c['peak_phase']} phase"
        )
