"""Megatron ranks of the SFT and DPO trainers: a training step, a validation pass and completions.

Both take a :class:`~megagrpo.types.SequenceBatch`; as in the GRPO policy each rank takes its own
data-parallel shard (balanced by tokens), packs it into micro-batches by ``policy.micro_batch_max_tokens``
and runs Megatron's schedule, which divides the summed gradients by the loss count of the whole batch (all
micro-batches and DP ranks): trained tokens for SFT, pairs for DPO. Results are the same on every rank.

- :class:`SFTWorker`: the loss is Megatron's vocab-parallel cross-entropy summed over the trained
  (assistant) tokens: Megatron's own SFT loss, in the padded [b, s] layout, the packed THD row or a
  context-parallel rank's chunks.
- :class:`DPOWorker`: sequence logprobs (sum, or mean when length-normalised) of the response tokens from
  the chunked vocab-parallel logprobs GRPO uses; the reference policy is the initial weights, kept in host
  memory and swapped in for :meth:`DPOWorker.reference_logps`. A pair (rows 2i, 2i + 1) is never split:
  data-parallel shards and micro-batches are made of whole pairs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megagrpo.algorithms.dpo import (
    PREFERENCE_METRICS,
    PreferenceLossConfig,
    preference_loss,
    preference_metrics,
    sequence_logps,
)
from megagrpo.config import Config
from megagrpo.policy.decode import complete
from megagrpo.policy.engine import forward_backward, optimizer_step
from megagrpo.policy.packing import pack_by_token_budget
from megagrpo.policy.rank import MegatronRank
from megagrpo.types import DPOMetrics, SequenceBatch, SFTMetrics, balanced_shards

__all__ = ["DPOWorker", "SFTWorker"]


class _SupervisedRank(MegatronRank):
    """What both trainers share: completions, and sums reduced over DP (and shared over PP)."""

    def complete(
        self, prompts: list[list[int]], max_new: int, temperature: float = 0.0, seed: int = 0
    ) -> list[list[int]]:
        """``max_new`` tokens after each prompt, greedy (temperature 0) or sampled (all ranks)."""
        return complete(
            self.engine,
            prompts,
            max_new,
            vocab_size=self.model_info.shape.vocab_size,
            temperature=temperature,
            seed=seed,
        )

    def _reduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """Sum ``sums`` (computed on the last pipeline stage) over DP x CP ranks; all ranks get the sums."""
        payload = [None]
        if self.ctx.is_last_stage:
            keys = sorted(sums)
            values = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=self.ctx.device)
            dist.all_reduce(values, group=self.ctx.pgs.dp_cp)
            payload = [dict(zip(keys, values.tolist(), strict=True))]
        if self.ctx.sizes.pp > 1:
            src = dist.get_global_rank(self.ctx.pgs.pp, self.ctx.sizes.pp - 1)
            dist.broadcast_object_list(payload, src=src, group=self.ctx.pgs.pp)
        return payload[0]

    def _step(self) -> dict[str, float]:
        applied, grad_norm = optimizer_step(self.engine)
        lr = self.engine.optimizer.param_groups[0]["lr"]
        self.scheduler.step(1)
        self.steps_done += 1
        return {"grad_norm": grad_norm, "lr": lr, "update_applied": float(applied)}

    def _run(self, micro: list[dict], loss_fn, *, train: bool) -> None:
        if train:
            forward_backward(self.engine, micro, loss_fn)
            return
        if not micro:
            # Fewer validation rows than DP ranks: this replica has none (its TP/PP peers neither), and a
            # forward pass has no collective outside the replica.
            return
        for module in self.engine.model:
            module.eval()
        try:
            with torch.no_grad():
                forward_backward(self.engine, micro, loss_fn, forward_only=True)
        finally:
            for module in self.engine.model:
                module.train()


class SFTWorker(_SupervisedRank):
    """One rank of the SFT trainer."""

    def __init__(self, cfg: Config):
        super().__init__(
            cfg,
            seed=cfg.sft.seed + 1234,
            total_steps=cfg.sft.num_steps,
            keep_reference=False,
            temperature=1.0,
        )

    def train_step(self, batch: SequenceBatch) -> SFTMetrics:
        """One optimizer step on ``batch`` (all its sequences, every DP rank its shard)."""
        sums = self._forward(batch, train=True)
        return SFTMetrics(**self._metrics(sums), **self._step())

    def evaluate(self, batch: SequenceBatch) -> SFTMetrics:
        """The loss on ``batch`` without a step (validation)."""
        return SFTMetrics(**self._metrics(self._forward(batch, train=False)))

    def _metrics(self, sums: dict[str, float]) -> dict[str, float]:
        total = self._reduce_sums(sums)
        loss = total["loss_sum"] / total["tokens"] if total["tokens"] else float("nan")
        return {"loss": loss, "tokens": total["tokens"], "sequences": total["sequences"]}

    def _forward(self, batch: SequenceBatch, *, train: bool) -> dict[str, float]:
        from megatron.core import tensor_parallel

        sums = {"loss_sum": 0.0, "tokens": 0.0, "sequences": 0.0}

        def loss_fn(logits, micro):
            targets = micro["targets"].to(logits.device)
            losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)  # [b, s]
            mask = self._row_mask(micro).to(losses.device, losses.dtype)
            total = (losses * mask).sum()
            count = mask.sum().to(torch.int)
            sums["loss_sum"] += float(total.detach())
            sums["tokens"] += float(count)
            sums["sequences"] += micro["sub"].size
            return total, count, {}

        mine = self._my_shard(batch)
        self._run([m for _, m in self.micro_batches(batch, mine)], loss_fn, train=train)
        if self.ctx.cp_rank != 0:
            sums["sequences"] = 0.0  # CP peers hold the same sequences; count them once
        return sums

    def _row_mask(self, micro: dict) -> torch.Tensor:
        """The trained positions in the micro-batch's own layout: [b, s] padded (this CP rank's chunks
        under CP) or [1, T] packed, matching ``micro["targets"]``."""
        sub: SequenceBatch = micro["sub"]
        packed = micro.get("packed")
        if packed is not None:
            flat = torch.zeros(micro["tokens"].shape[1], dtype=torch.bool)
            flat[packed.source[packed.valid]] = sub.loss_mask[packed.valid]
            return flat[None]
        held = micro.get("cp_positions")
        width = micro["tokens"].shape[1] * (self.ctx.sizes.cp if held is not None else 1)
        mask = torch.zeros(sub.size, width, dtype=torch.bool)
        mask[:, : sub.loss_mask.shape[1]] = sub.loss_mask
        return mask[:, held] if held is not None else mask


class DPOWorker(_SupervisedRank):
    """One rank of the DPO trainer; its reference policy is its initial weights."""

    def __init__(self, cfg: Config):
        super().__init__(
            cfg, seed=cfg.dpo.seed + 1234, total_steps=cfg.dpo.num_steps, keep_reference=True, temperature=1.0
        )
        d = cfg.dpo
        self.loss_cfg = PreferenceLossConfig(
            loss=d.loss,
            beta=d.beta,
            label_smoothing=d.label_smoothing,
            length_normalize=d.length_normalize,
            nll_weight=d.nll_weight,
        )

    # ------------------------------------------------------------------------------ pair layout

    def pair_micro_batches(self, batch: SequenceBatch) -> list[tuple[list[int], dict]]:
        """This rank's pairs, grouped by the token budget into micro-batches of whole pairs: per group,
        its rows (2i, 2i + 1 for each pair i) and the micro-batch."""
        if batch.size % 2:
            raise ValueError(f"a DPO batch holds pairs (rows 2i, 2i + 1), got {batch.size} rows")
        lengths = batch.lengths.view(-1, 2)  # [P, 2]
        mine = balanced_shards(lengths.sum(dim=1).tolist(), self.ctx.dp_size)[self.ctx.dp_rank]
        if self.packed:  # THD: a pair costs its two lengths
            costs, budget = [int(lengths[p].sum()) for p in mine], self.cfg.policy.micro_batch_max_tokens
        else:  # padded: two rows as wide as the pair's longer sequence
            costs, budget = [int(lengths[p].max()) for p in mine], self.cfg.policy.micro_batch_max_tokens // 2
        out = []
        for group in pack_by_token_budget(costs, budget, padded=not self.packed):
            rows = [r for g in group for r in (2 * mine[g], 2 * mine[g] + 1)]
            sub = batch.select(rows)
            out.append(
                (rows, self._packed_micro_batch(sub) if self.packed else self._padded_micro_batch(sub))
            )
        return out

    def _sequence_logps(self, logits, micro: dict, *, with_mean: bool = False):
        """[b] response logprob of each row of the micro-batch (sum or mean over its scored tokens);
        ``with_mean``: also the [b] mean token logprob."""
        token_logps, _ = self._token_logprobs(logits, micro, with_entropy=False, temperature=1.0)
        mask = micro["sub"].loss_mask.to(token_logps.device)
        seq = sequence_logps(token_logps, mask, length_normalize=self.loss_cfg.length_normalize)
        if not with_mean:
            return seq
        return seq, sequence_logps(token_logps, mask, length_normalize=True)

    # ----------------------------------------------------------------------------------- steps

    def reference_logps(self, batch: SequenceBatch) -> torch.Tensor:
        """[B] sequence logprobs under the frozen initial weights (all ranks)."""
        result = torch.zeros(batch.size, dtype=torch.float32)
        mine: list[int] = []

        def record(logits, micro):
            result[micro["rows"]] = self._sequence_logps(logits, micro).detach().float().cpu()
            return torch.zeros((), device=logits.device), torch.tensor(1, dtype=torch.int), {}

        micro = []
        for rows, m in self.pair_micro_batches(batch):
            mine += rows
            micro.append({**m, "rows": rows})
        with self.reference_weights():
            self._run(micro, record, train=False)
        return self._share_rows(result, mine)

    def train_step(self, batch: SequenceBatch) -> DPOMetrics:
        """One optimizer step on the pairs of ``batch`` (needs ``ref_logps``)."""
        sums = self._forward(batch, train=True)
        return DPOMetrics(**self._metrics(sums), **self._step())

    def evaluate(self, batch: SequenceBatch) -> DPOMetrics:
        """Loss, accuracy and margins on ``batch`` without a step (validation; needs ``ref_logps``)."""
        return DPOMetrics(**self._metrics(self._forward(batch, train=False)))

    def _metrics(self, sums: dict[str, float]) -> dict[str, float]:
        total = self._reduce_sums(sums)
        out = preference_metrics(total)
        out["loss"] = total["loss_sum"] / total["pairs"] if total["pairs"] else float("nan")
        return out

    def _forward(self, batch: SequenceBatch, *, train: bool) -> dict[str, float]:
        if batch.ref_logps is None:
            raise ValueError("a DPO step needs ref_logps (call reference_logps() first)")
        sums = dict.fromkeys(("loss_sum", *PREFERENCE_METRICS), 0.0)

        def loss_fn(logits, micro):
            seq_logps, mean_logps = self._sequence_logps(
                logits, micro, with_mean=True
            )  # [2p]: chosen, rejected, ...
            ref = micro["sub"].ref_logps.to(seq_logps.device, seq_logps.dtype)
            out = preference_loss(
                seq_logps[0::2],
                seq_logps[1::2],
                ref[0::2],
                ref[1::2],
                self.loss_cfg,
                chosen_nll=-mean_logps[0::2],
            )
            sums["loss_sum"] += float(out.loss_sum.detach())
            for key, value in out.metrics.items():
                sums[key] += float(value)
            return out.loss_sum, out.count.to(torch.int), {}

        self._run([m for _, m in self.pair_micro_batches(batch)], loss_fn, train=train)
        return sums
