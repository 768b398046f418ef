"""Megatron model + DDP + optimizer for one trainer rank, and one step through Megatron's schedule.

This is the thin layer between megagrpo and Megatron-Core's training machinery: it builds this
rank's pipeline stage, wraps it in Megatron DDP (optionally with the distributed optimizer),
creates Megatron's optimizer, and runs ``get_forward_backward_func`` with a caller-supplied loss.
The policy actor (GRPO losses, logprobs, reference model) is built on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megagrpo.models.builder import build_gpt_model, transformer_config
from megagrpo.models.layout import stage_param_names
from megagrpo.models.lora import LoraSpec
from megagrpo.models.lora import attach as attach_lora
from megagrpo.models.shape import GPTShape
from megagrpo.parallel import ParallelContext
from megagrpo.parallel.backends import resolve_transformer_impl

# (output_tensor of the last stage, micro-batch) -> (summed loss, token count, metrics to report)
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


@dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer knobs passed to Megatron's ``OptimizerConfig``."""

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False


@dataclass(frozen=True)
class MoESettings:
    """A mixture-of-experts model's training options (``policy.moe_aux_loss_coeff``,
    ``policy.freeze_router``, ``grpo.routing_replay``)."""

    aux_loss_coeff: float = 0.0
    freeze_router: bool = False
    routing_replay: bool = False
    """Build the routers able to replay given experts (micro-batches then carry ``routing``)."""


@dataclass
class TrainEngine:
    """This rank's model chunk(s), DDP wrapper and optimizer (frozen: the bare chunk, no optimizer)."""

    ctx: ParallelContext
    shape: GPTShape
    config: object  # megatron.core.transformer.TransformerConfig shared by model and schedule
    model: (
        list  # [DistributedDataParallel] or, frozen, [GPTModel]: one chunk (no virtual pipeline stages yet)
    )
    optimizer: object | None  # megatron.core.optimizer.MegatronOptimizer; None for a frozen model
    transformer_impl: str  # the layers built ("auto" resolved): local, torch or transformer_engine

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel of this stage (inside DDP when it trains)."""
        return self.model[0] if self.optimizer is None else self.model[0].module


def build_engine(
    ctx: ParallelContext,
    shape: GPTShape,
    opt: OptimizerSettings,
    *,
    dtype: torch.dtype = torch.float32,
    transformer_impl: str = "auto",
    sequence_parallel: bool = False,
    initialize: bool = True,
    recompute: str = "none",
    recompute_num_layers: int = 1,
    trainable: bool = True,
    moe: MoESettings | None = None,
    lora: LoraSpec | None = None,
) -> TrainEngine:
    """``initialize=False`` skips random initialisation when weights are loaded right after;
    ``recompute`` is ``policy.recompute``. ``trainable=False`` builds a frozen model for forward passes
    only (a distillation teacher): no DDP gradient buffers, no optimizer, no parameter needing grad.
    ``moe``: a mixture-of-experts model's training options. ``lora``: freeze the model and train adapters
    on it (``models.lora``): DDP's buffers and the optimizer then hold the adapters only."""
    transformer_impl = resolve_transformer_impl(transformer_impl, check_available=True)
    sizes = ctx.sizes
    config = transformer_config(
        shape,
        tp=sizes.tp,
        pp=sizes.pp,
        cp=sizes.cp,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        on_cpu=ctx.device.type == "cpu",
        initialize=initialize,
        recompute=recompute,
        recompute_num_layers=recompute_num_layers,
        ep=sizes.ep,
        etp=sizes.expert_tp,
        moe_aux_loss_coeff=moe.aux_loss_coeff if moe else 0.0,
        routing_replay=bool(moe and moe.routing_replay),
    )
    if config.moe_enable_routing_replay:
        _forget_earlier_routers()
    # Micro-batches are packed by a token budget, so their [batch, seq] shapes differ; pipeline
    # stages then exchange shapes before activations.
    config.variable_seq_lengths = True
    # Token-level losses: the loss function returns (sum, token count) and Megatron divides by
    # the global token count after the DP all-reduce, so micro-batching and DP never change it.
    config.calculate_per_token_loss = True
    module = build_gpt_model(
        shape,
        config,
        ctx.pgs,
        transformer_impl=transformer_impl,
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
    )
    if not trainable:
        for p in module.parameters():
            p.requires_grad_(False)
        module.eval()
        return TrainEngine(ctx, shape, config, [module], None, transformer_impl)
    if moe and moe.freeze_router:
        _freeze_routers(module)
    if lora is not None:
        attach_lora(module, lora, stage_param_names(module, ctx, shape.num_layers))
    return _trained(ctx, shape, config, module, opt, dtype, transformer_impl)


def _trained(ctx, shape: GPTShape, config, module, opt: OptimizerSettings, dtype, impl: str) -> TrainEngine:
    """``module`` under Megatron's DDP (gradient buffers for the parameters that need grad) with its
    optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        average_in_collective=False,
    )
    ddp = DistributedDataParallel(config, ddp_config, module, pg_collection=ctx.pgs)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return TrainEngine(ctx, shape, config, [ddp], megatron_optimizer(opt, dtype, ddp, ctx), impl)


def _forget_earlier_routers() -> None:
    """Every router able to replay registers itself in one class-wide list: a model built earlier in
    this process (a conversion, a test) must not stay in it."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def _freeze_routers(module: torch.nn.Module) -> None:
    """``policy.freeze_router``: the routers' weights need no grad, so they stay out of DDP's buffers
    and the optimizer."""
    for name, p in module.named_parameters():
        if name.endswith("mlp.router.weight"):
            p.requires_grad_(False)


def megatron_optimizer(opt: OptimizerSettings, dtype: torch.dtype, ddp, ctx: ParallelContext):
    """Megatron's Adam over the DDP-wrapped model (distributed over DP ranks when configured)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=opt.use_distributed_optimizer,
    )
    # Megatron refuses gloo side groups when it is handed a pg_collection (found on the H200, where
    # the backend is NCCL); the distributed optimizer then gathers its state over the NCCL groups.
    return get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False, pg_collection=ctx.pgs)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Boolean [1, 1, seq, seq] mask, True where attention is *blocked*.

    Passed explicitly because Megatron's default mask helper allocates on ``cuda``.
    """
    return torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device).triu(1)


def forward_backward(
    engine: TrainEngine,
    micro_batches: Iterable[dict],
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
) -> list[dict]:
    """Run Megatron's schedule over ``micro_batches`` (each: tokens/position_ids [b, s] + extras).

    A micro-batch holding ``packed_seq_params`` (THD: b = 1, the sequences end to end) is run
    without a mask; fused attention keeps its sequences apart by their boundaries. The torch layers
    take no mask at all (causal by construction, no [s, s] tensor); the others get ``causal_mask``.

    Returns the metrics dicts of the last pipeline stage (empty list elsewhere). Gradients are
    accumulated into the DDP buffers and finalized (DP all-reduce, embedding tie, per-token
    division) by Megatron; call ``optimizer_step`` afterwards.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    batches = list(micro_batches)
    if not batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    real = len(batches)
    batches += _expert_parallel_padding(engine, batches)
    seq_len = max(b["tokens"].shape[1] for b in batches)
    micro_batch_size = max(b["tokens"].shape[0] for b in batches)
    device = engine.ctx.device
    takes_mask = engine.transformer_impl != "torch"
    replay = _RouterReplay() if any("routing" in b or "record" in b for b in batches) else None

    def forward_step(data_iterator: Iterator[dict], model):
        batch = next(data_iterator)
        tokens = batch["tokens"].to(device)
        packed = batch.get("packed_seq_params")
        mask = causal_mask(tokens.shape[1], device) if takes_mask and packed is None else None
        if replay is not None:
            replay.forward(batch.get("routing"), record=batch.get("record") is not None)
        output = model(tokens, batch["position_ids"].to(device), mask, packed_seq_params=packed)
        if replay is not None:
            if batch.get("record") is not None:
                batch["record"].append(replay.recorded())
            replay.backward()
        if batch.get("padding"):
            return output, _padding_loss
        return output, lambda out: loss_fn(out, batch)

    if not forward_only:
        for chunk in engine.model:
            chunk.zero_grad_buffer()
        engine.optimizer.zero_grad()
    pp = engine.ctx.sizes.pp
    # With explicit process groups, the pipelined schedule also wants the p2p communicator.
    p2p = P2PCommunicator(engine.ctx.pgs.pp, engine.config) if pp > 1 else None
    try:
        metrics = get_forward_backward_func(pp_size=pp)(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=engine.model,
            num_microbatches=len(batches),
            seq_length=seq_len,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            pg_collection=engine.ctx.pgs,
            p2p_communicator=p2p,
        )
    finally:
        if replay is not None:
            replay.done()
    return metrics[:real] if metrics else metrics


def _expert_parallel_padding(engine: TrainEngine, batches: list[dict]) -> list[dict]:
    """Under expert parallelism every forward is an all-to-all over the EP group, so its ranks must run
    as many micro-batches as one another; token-budget packing gives each rank its own count. The
    ranks with fewer run copies of their last micro-batch that count for nothing (zero loss, zero
    tokens, no metrics)."""
    import torch.distributed as dist

    if engine.config.expert_model_parallel_size == 1 or not engine.config.num_moe_experts:
        return []
    most = torch.tensor([len(batches)], dtype=torch.long)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=engine.ctx.pgs.ep)
    return [dict(batches[-1], padding=True)] * (int(most) - len(batches))


def _padding_loss(output: torch.Tensor):
    zero = output.sum() * 0.0
    return zero, torch.zeros((), dtype=torch.int, device=output.device), {}


class _RouterReplay:
    """Megatron's router replay over one schedule: a micro-batch carrying ``routing`` (per MoE layer of
    the stage, ``[tokens, k]``) routes its tokens to those experts, and a recomputed forward in the
    backward pops its own (first in, first out); one carrying a ``record`` list gets the experts its
    routers chose appended to it (the same layout); others route as the routers choose."""

    def __init__(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self.replay, self.action = RouterReplay, RouterReplayAction
        self.replaying = False

    def forward(self, routing: list[torch.Tensor] | None, *, record: bool) -> None:
        self.replaying = routing is not None
        if routing is not None:
            self.replay.set_replay_data(routing)
            self.replay.set_global_router_replay_action(self.action.REPLAY_FORWARD)
        elif record:
            self.replay.set_global_router_replay_action(self.action.RECORD)
        else:
            self.replay.clear_global_router_replay_action()

    def recorded(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.replay.get_recorded_data()]

    def backward(self) -> None:
        if self.replaying:
            self.replay.set_global_router_replay_action(self.action.REPLAY_BACKWARD)
        else:
            self.replay.clear_global_router_replay_action()

    def done(self) -> None:
        self.replay.clear_global_indices()
        self.replay.clear_global_router_replay_action()


def optimizer_step(engine: TrainEngine) -> tuple[bool, float]:
    """One optimizer step on the accumulated gradients; returns (applied, grad norm before clipping)."""
    applied, grad_norm, _ = engine.optimizer.step()
    return bool(applied), float(grad_norm) if grad_norm is not None else float("nan")


def build_lr_scheduler(
    engine: TrainEngine,
    *,
    lr: float,
    min_lr: float = 0.0,
    warmup_steps: int = 0,
    total_steps: int = 1,
    style: str = "constant",
    weight_decay: float = 0.0,
):
    """Megatron's ``OptimizerParamScheduler``: linear warm-up, then constant or cosine to ``min_lr``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if style not in ("constant", "cosine"):
        raise ValueError(f"lr schedule must be 'constant' or 'cosine', got {style!r}")
    return OptimizerParamScheduler(
        engine.optimizer,
        init_lr=0.0 if warmup_steps else lr,
        max_lr=lr,
        min_lr=min_lr if style == "cosine" else lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(total_steps, warmup_steps + 1),
        lr_decay_style=style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
