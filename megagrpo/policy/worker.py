"""One Megatron rank of the policy: logprobs, reference logprobs, GRPO training steps, save/load.

A plain class; ``megagrpo.runtime.groups`` runs one per rank as a Ray actor, and the tests run it on
local ranks. Every method is collective: all ranks of the trainer job call it with the same
batch (the controller puts the batch in the object store once), and each rank selects its
data-parallel shard itself. Results are returned identically on every rank, so the controller
reads any one of them: ``[B, S - 1]`` logprob tensors, one ``TrainMetrics`` per optimizer step.
The weight-sync methods the controller calls (plan, open, send) are inherited from
``megagrpo.weight_sync.trainer.WeightSyncEndpoints``; ``weight_source`` tells them what to read.

Data flow of ``train``: the rollout batch is cut into mini-batches of ``policy.mini_batch_size``
sequences (one optimizer step each); each mini-batch is split over DP ranks by token count and
packed into micro-batches by ``policy.micro_batch_max_tokens``; Megatron's schedule runs them and
divides gradients by the number of loss tokens of the whole mini-batch (all micro-batches, all DP
ranks), so neither packing nor DP size changes the result.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megagrpo.algorithms.grpo import METRIC_REDUCTIONS, LossConfig, combine_metrics, grpo_loss, reduce_metrics
from megagrpo.config import Config
from megagrpo.models.description import ModelDescription
from megagrpo.models.lora import merged as lora_merged
from megagrpo.parallel import ParallelContext
from megagrpo.policy.engine import forward_backward, optimizer_step
from megagrpo.policy.rank import HostWeights, MegatronRank
from megagrpo.types import TrainBatch, TrainMetrics
from megagrpo.weight_sync.trainer import WeightSyncEndpoints

__all__ = ["HostWeights", "PolicyWorker"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class PolicyWorker(MegatronRank, WeightSyncEndpoints):
    """One rank of the GRPO policy (model, logprobs, reference, save/load: ``MegatronRank``); its
    weight-sync methods come from ``WeightSyncEndpoints``."""

    def __init__(self, cfg: Config):
        super().__init__(
            cfg,
            seed=cfg.grpo.seed + 1234,
            total_steps=cfg.grpo.num_steps * cfg.mini_batches_per_step,
            # Without KL no reference model is needed.
            keep_reference=cfg.grpo.kl_coef > 0,
            temperature=cfg.generation.temperature,
        )
        self.loss_cfg = LossConfig(
            loss=cfg.grpo.loss,
            clip_eps_low=cfg.grpo.clip_eps_low,
            clip_eps_high=cfg.grpo.clip_eps_high,
            dual_clip=cfg.grpo.dual_clip,
            kl_coef=cfg.grpo.kl_coef,
            kl_estimator=cfg.grpo.kl_estimator,
            kl_clamp=cfg.grpo.kl_clamp,
            off_policy_correction=cfg.grpo.off_policy_correction,
            behav_weight_cap=cfg.grpo.behav_weight_cap,
            behav_weight_floor=cfg.grpo.behav_weight_floor,
            loss_agg=cfg.grpo.loss_agg,
        )

    # --------------------------------------------------------------------------------------- train

    def train(self, batch: TrainBatch) -> list[TrainMetrics]:
        """One optimizer step per mini-batch of ``policy.mini_batch_size`` sequences; metrics per step.

        ``batch.old_logprobs`` may be None: they are then the training forward's own for the first
        mini-batch and a forward before the first update for the others (``logprobs`` of each)."""
        if batch.advantages is None:
            raise ValueError("train() needs advantages")
        self._on_device()
        size = self.cfg.policy.mini_batch_size
        if batch.size % size:
            raise ValueError(
                f"batch of {batch.size} sequences is not a multiple of policy.mini_batch_size={size}"
            )
        if self.loss_cfg.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError("grpo.kl_coef > 0 needs ref_logprobs (call reference_logprobs() first)")
        minis = [batch.select(range(start, start + size)) for start in range(0, batch.size, size)]
        if batch.old_logprobs is None:
            # PPO's old policy is the weights before the first update. The first mini-batch trains on
            # exactly those, so its forward's detached logprobs are its old ones (ratio 1); only the
            # later mini-batches are scored, now, before that update.
            minis[1:] = [mini.replace(old_logprobs=self.logprobs(mini)) for mini in minis[1:]]
        return [self._train_step(mini) for mini in minis]

    def _train_step(self, mini: TrainBatch) -> TrainMetrics:
        outputs: list[dict[str, torch.Tensor]] = []
        loss_parts: list[tuple[torch.Tensor, torch.Tensor]] = []

        def loss_fn(logits, micro):
            sub: TrainBatch = micro["sub"]
            lp, entropy = self._token_logprobs(logits, micro, with_entropy=True)
            device = lp.device
            out = grpo_loss(
                lp,
                (sub.old_logprobs if sub.old_logprobs is not None else lp.detach()).to(device),
                sub.advantages.to(device),
                self._loss_mask(micro).to(device),
                self.loss_cfg,
                ref_logprobs=None if sub.ref_logprobs is None else sub.ref_logprobs.to(device),
                gen_logprobs=None if sub.gen_logprobs is None else sub.gen_logprobs.to(device),
                entropy=entropy,
            )
            outputs.append(out.metrics)
            loss_parts.append((out.loss_sum.detach(), out.count))
            return out.loss_sum, out.count.to(torch.int), {}

        micro = [m for _, m in self.micro_batches(mini, self._my_shard(mini))]
        forward_backward(self.engine, micro, loss_fn)
        applied, grad_norm = optimizer_step(self.engine)
        lr = self.engine.optimizer.param_groups[0]["lr"]
        self.scheduler.step(1)
        self.steps_done += 1
        metrics = self._reduce(outputs, loss_parts)
        return TrainMetrics(**metrics, grad_norm=grad_norm, lr=lr, update_applied=float(applied))

    def _reduce(self, outputs: list[dict[str, torch.Tensor]], loss_parts: list[tuple]) -> dict[str, float]:
        """Reduce loss metrics over micro-batches and DP ranks; share from the last stage to all."""
        payload = [None]
        if self.ctx.is_last_stage:
            merged = combine_metrics(outputs)
            by_op: dict[str, list[str]] = {}
            for key in sorted(merged):
                by_op.setdefault(METRIC_REDUCTIONS[key], []).append(key)
            for op, keys in by_op.items():  # one all-reduce per reduction kind
                values = torch.stack([merged[k].double().reshape(()) for k in keys])
                dist.all_reduce(values, op=_REDUCE_OPS[op], group=self.ctx.pgs.dp_cp)
                merged.update(zip(keys, values, strict=True))
            loss = torch.tensor([sum(float(s) for s, _ in loss_parts), sum(int(c) for _, c in loss_parts)])
            loss = loss.double()
            dist.all_reduce(loss, group=self.ctx.pgs.dp_cp)
            payload = [
                {"loss": float(loss[0] / loss[1]) if loss[1] else float("nan"), **reduce_metrics([merged])}
            ]
        if self.ctx.sizes.pp > 1:
            src = dist.get_global_rank(self.ctx.pgs.pp, self.ctx.sizes.pp - 1)
            dist.broadcast_object_list(payload, src=src, group=self.ctx.pgs.pp)
        return payload[0]

    # --------------------------------------------------------------------------------- weight sync

    def send_weights(self, plan, with_checksums: bool = False):
        """As ``WeightSyncEndpoints.send_weights``, with the weights borrowed back if
        ``policy.offload: all`` parked them (an engine replaced during generation is re-synced):
        the weights only, parked again once sent; the optimizer stays in host memory. With LoRA
        adapters (``policy.lora``) under ``generation.lora_sync: merged`` the engines get the merged
        weights, ``W + alpha / r * B @ A``, computed shard-wise in place for the sync and the base's exact
        bytes restored after it; under ``adapter`` the base as it is (the adapters go by
        ``send_adapters``)."""
        merge = self.lora is not None and self.cfg.generation.lora_sync == "merged"
        merging = lora_merged(self.engine.module) if merge else contextlib.nullcontext()
        with self.offloader.borrowed("weights"), merging:
            return super().send_weights(plan, with_checksums)

    def send_adapters(self):
        """As ``WeightSyncEndpoints.send_adapters``, with the weights borrowed back as ``send_weights``."""
        with self.offloader.borrowed("weights"):
            return super().send_adapters()

    def weight_source(self) -> tuple[ParallelContext, torch.nn.Module, ModelDescription]:
        """(parallel context, model stage, model description): what the weight-sync sender reads."""
        return self.ctx, self.engine.module, self.model_info
