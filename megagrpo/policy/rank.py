"""What every Megatron trainer rank does, whatever it trains with: the model, optimizer and LR schedule
built from the config, its initial weights, the frozen reference policy in host memory, token-budget
micro-batches (padded or packed), per-token logprobs from vocab-parallel logits, and save/load.

The GRPO policy (``megagrpo.policy.worker.PolicyWorker``) and the SFT/DPO worker
(``megagrpo.policy.supervised.SupervisedWorker``) are subclasses that add their training steps. A batch
here is anything with ``input_ids`` [B, S], ``lengths`` [B], ``size``, ``select(rows)`` and
``response_mask()`` [B, S - 1] (``megagrpo.types.TrainBatch``, ``megagrpo.types.SequenceBatch``).
Every method is collective: all ranks of the job call it with the same batch, and each rank selects its
own data-parallel shard.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.algorithms.routing import engine_routed_rows, micro_batch_routing, routing_agreement
from megagrpo.ckpt.dist_files import check_entry_kinds, trusted_metadata_only
from megagrpo.ckpt.durable import atomic_write
from megagrpo.ckpt.hf_files import HFCheckpoint
from megagrpo.ckpt.hf_weights import load_hf_into_stage
from megagrpo.ckpt.lora import ADAPTERS_DIR, base_reference, check_lora_meta, load_adapters, write_lora_meta
from megagrpo.ckpt.manifest import DigestCollector, FileDigest
from megagrpo.ckpt.megatron import load_megatron, save_dist_checkpoint, save_megatron, write_checkpoint_meta
from megagrpo.compat.megatron_optimizer import adam_step_kept_on_load, untie_adam_steps
from megagrpo.config import Config
from megagrpo.models.description import describe_model
from megagrpo.models.layout import stage_param_names
from megagrpo.models.lora import LoraSpec, adapter_state_dict, base_state_keys
from megagrpo.models.lora import disabled as lora_disabled
from megagrpo.models.shape import padded_vocab_size
from megagrpo.parallel import ParallelSizes, init_parallel
from megagrpo.policy.engine import (
    MoESettings,
    OptimizerSettings,
    build_engine,
    build_lr_scheduler,
    forward_backward,
)
from megagrpo.policy.logprobs import vocab_parallel_logprobs
from megagrpo.policy.offload import Offloader, grad_buffers, optimizer_tensors, release_cached_memory
from megagrpo.policy.packing import (
    context_parallel_positions,
    pack_by_token_budget,
    pack_sequences,
    place_positions,
    round_up,
)
from megagrpo.types import balanced_shards

# Canonical per-parameter optimizer state: reloads at any TP/PP/DP (Megatron's default for the
# distributed optimizer in 0.16, "fully_sharded_model_space", is deprecated and fails validation).
_OPTIMIZER_CKPT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


class HostWeights:
    """A copy of a model stage's parameters in host memory (the frozen reference policy).

    Swapping it in for a forward pass costs two host<->device copies of this rank's shard and no
    second model on the accelerator.
    """

    def __init__(self, module: torch.nn.Module):
        pin = torch.cuda.is_available()
        self.tensors = {
            name: p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone()
            for name, p in module.named_parameters()
        }

    def swap(self, module: torch.nn.Module) -> None:
        """Exchange the module's parameters with the held ones (calling twice restores both)."""
        with torch.no_grad():
            for name, p in module.named_parameters():
                held = self.tensors[name]
                current = p.detach().to("cpu", copy=True)
                p.copy_(held, non_blocking=True)
                self.tensors[name] = current


class MegatronRank:
    """One trainer rank: engine, LR schedule, initial weights, optional frozen reference, save/load.

    ``seed`` seeds Megatron's initialisation (and anything random on the rank); ``total_steps`` is the
    number of optimizer steps of the run (the LR schedule's length); ``keep_reference`` parks a copy of
    the initial weights in host memory; ``temperature`` is the default of :meth:`logprobs`;
    ``trainable=False`` builds a frozen model (no gradient buffers, optimizer or LR schedule) for
    :meth:`logprobs` only.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        seed: int,
        total_steps: int,
        keep_reference: bool,
        temperature: float,
        trainable: bool = True,
    ):
        self.cfg = cfg
        self.model_info = describe_model(cfg)
        self.temperature = temperature
        sizes = ParallelSizes.from_config(cfg.parallel)
        self.ctx = init_parallel(
            sizes, backend=cfg.resolved.backend, timeout_s=cfg.parallel.collective_timeout_s, seed=seed
        )
        pol = cfg.policy
        # THD micro-batches where the layers keep a row's sequences apart (torch, TE), without CP.
        self.packed = cfg.resolved.packs_sequences
        settings = OptimizerSettings(
            lr=pol.lr,
            min_lr=pol.min_lr,
            weight_decay=pol.weight_decay,
            adam_beta1=pol.adam_beta1,
            adam_beta2=pol.adam_beta2,
            adam_eps=pol.adam_eps,
            clip_grad=pol.clip_grad,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        )
        loads_weights = cfg.model.tiny is None
        lora = pol.lora
        # Adapters on a frozen base (policy.lora): only they train; the base is the reference policy.
        self.lora = (
            LoraSpec(lora.rank, lora.alpha, lora.dropout, lora.targets, seed=seed)
            if lora.enabled and trainable
            else None
        )
        self.engine = build_engine(
            self.ctx,
            self.model_info.shape,
            settings,
            dtype=self.model_info.dtype,
            transformer_impl=cfg.resolved.transformer_impl,
            sequence_parallel=cfg.parallel.sequence_parallel,
            initialize=not loads_weights,
            recompute=pol.recompute,
            recompute_num_layers=pol.recompute_num_layers,
            trainable=trainable,
            moe=MoESettings(
                aux_loss_coeff=pol.moe_aux_loss_coeff,
                freeze_router=pol.freeze_router,
                routing_replay=cfg.grpo.routing_replay == "rollout",
            )
            if self.model_info.shape.is_moe
            else None,
            lora=self.lora,
        )
        self.scheduler = (
            None
            if not trainable
            else build_lr_scheduler(
                self.engine,
                lr=pol.lr,
                min_lr=pol.min_lr,
                warmup_steps=pol.lr_warmup_steps,
                total_steps=max(1, total_steps),
                style=pol.lr_schedule,
                weight_decay=pol.weight_decay,
            )
        )
        if loads_weights:
            self._load_initial_weights()
        # The reference policy is the initial weights, parked in host memory (with adapters: the base).
        self.reference = HostWeights(self.engine.module) if keep_reference and self.lora is None else None
        self.steps_done = 0
        self.offloader = Offloader(self.ctx.device)

    # ------------------------------------------------------------------------ colocated handoff

    def offload(self, phase: str) -> int:
        """Colocated placement, per ``policy.offload``: ``phase`` "sync" (before the engines wake: the
        optimizer; with "all" the gradient buffers too) or "generation" (the weights are synced: with
        "all", the weights). The allocator's free blocks go back to the driver either way. Returns
        the device bytes freed."""
        mode = self.cfg.policy.offload
        model_storages = {p.untyped_storage().data_ptr() for p in self.engine.module.parameters()}
        freed = 0
        if phase == "sync" and mode in ("optimizer", "all") and self.engine.optimizer is not None:
            tensors = optimizer_tensors(self.engine.optimizer)
            freed += self.offloader.offload("optimizer", tensors, keep=model_storages)
        if phase == "sync" and mode == "all" and self.engine.optimizer is not None:
            freed += self.offloader.offload("grads", grad_buffers(self.engine.model[0]))
        if phase == "generation" and mode == "all":
            freed += self.offloader.offload("weights", list(self.engine.module.parameters()))
        release_cached_memory(self.ctx.device)
        return freed

    def reload(self) -> int:
        """Everything ``offload`` parked, back on the device bit for bit; returns the bytes."""
        return self.offloader.reload()

    def _on_device(self, *groups: str) -> None:
        """Whatever reads or steps the states first brings them back: the ``groups`` it needs
        ("weights", "optimizer", "grads"), or all of them (a no-op when nothing is parked)."""
        if self.offloader.parked:
            self.offloader.reload(groups or None)

    # ----------------------------------------------------------------------------------- weights

    def _load_initial_weights(self) -> None:
        info = self.model_info
        if info.megatron_ckpt is not None:
            load_megatron(
                self.engine.module, info.megatron_ckpt / "megatron", keys=base_state_keys(self.engine.module)
            )
        else:
            hf = HFCheckpoint(info.hf_dir)
            load_hf_into_stage(self.engine.module, self.ctx, hf, info.shape, info.arch.rules(info.shape))
        if self.engine.optimizer is not None:  # its fp32 main copy (distributed optimizer) follows
            self.engine.optimizer.reload_model_params()

    # ------------------------------------------------------------------------------- micro-batches

    def _my_shard(self, batch) -> list[int]:
        return balanced_shards(batch.lengths.tolist(), self.ctx.dp_size)[self.ctx.dp_rank]

    def micro_batches(self, batch, indices: list[int]) -> list[tuple[list[int], dict]]:
        """This rank's sequences (``indices`` of ``batch``) grouped by the token budget: per group, its
        rows and the micro-batch ``forward_backward`` takes, padded or packed (THD)."""
        lengths = [int(batch.lengths[i]) for i in indices]
        groups = pack_by_token_budget(lengths, self.cfg.policy.micro_batch_max_tokens, padded=not self.packed)
        out = []
        for group in groups:
            rows = [indices[g] for g in group]
            sub = batch.select(rows)
            make = self._packed_micro_batch if self.packed else self._padded_micro_batch
            micro = make(sub)
            if getattr(sub, "routing", None) is not None:  # a TrainBatch with rollout routing
                micro["routing"] = self._replayed_routing(sub, micro)
            out.append((rows, micro))
        return out

    def _replayed_routing(self, sub, micro: dict) -> list[torch.Tensor]:
        """The engine's experts for this micro-batch's tokens, per MoE layer of this stage, in the rows
        Megatron's routers see (``routing.micro_batch_routing``)."""
        per_stage = self.model_info.shape.num_layers // self.ctx.sizes.pp
        first = self.ctx.pp_rank * per_stage
        held = micro.get("cp_positions")  # context parallelism: this rank's two chunks of the row
        width = micro["tokens"].shape[1]
        rows = micro_batch_routing(
            sub.routing,
            sub.lengths,
            packed_tokens=width if self.packed else None,
            layers=range(first, first + per_stage),
            width=width * (self.ctx.sizes.cp if held is not None else 1),
            positions=held,
        )
        return [self._sequence_shard(r) for r in rows]

    def _sequence_shard(self, rows: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism a TP rank's routers see only its slice of the sequence dim, which
        is a contiguous share of the router's rows (row = s_i x b + b_i)."""
        if not self.cfg.parallel.sequence_parallel:
            return rows
        return rows.chunk(self.ctx.sizes.tp)[self.ctx.tp_rank]

    def _padded_micro_batch(self, sub) -> dict:
        """[b, s] right-padded, s rounded up for sequence parallelism (a multiple of TP) and context
        parallelism (2 x CP chunks; this rank keeps its two, see ``context_parallel_positions``)."""
        cp, tp = self.ctx.sizes.cp, self.ctx.sizes.tp
        multiple = math.lcm(tp if self.cfg.parallel.sequence_parallel else 1, 2 * cp if cp > 1 else 1)
        seq = sub.input_ids.shape[1]
        tokens = torch.nn.functional.pad(sub.input_ids, (0, round_up(seq, multiple) - seq))
        micro = {
            "tokens": tokens,
            "position_ids": torch.arange(tokens.shape[1]).expand(sub.size, -1),
            # The ids rolled by one; targets past the sequence are dummies, dropped after scoring.
            "targets": torch.roll(tokens, -1, dims=1),
            "sub": sub,
        }
        if cp > 1:
            # Targets are rolled before the split: a chunk's last target lives in the next chunk.
            held = context_parallel_positions(tokens.shape[1], cp, self.ctx.cp_rank)
            for key in ("tokens", "position_ids", "targets"):
                micro[key] = micro[key][:, held]
            micro["cp_positions"] = held
        return micro

    def _packed_micro_batch(self, sub) -> dict:
        from megatron.core.packed_seq_params import PackedSeqParams

        # Sequence parallelism splits the packed row over TP ranks.
        total_multiple = self.ctx.sizes.tp if self.cfg.parallel.sequence_parallel else 1
        packed = pack_sequences(sub.input_ids, sub.lengths, total_multiple=total_multiple)
        cu = packed.cu_seqlens.to(self.ctx.device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_kv=packed.max_seqlen,
        )
        return {
            "tokens": packed.tokens,
            "position_ids": packed.position_ids,
            "targets": packed.targets,
            "packed_seq_params": params,
            "packed": packed,
            "sub": sub,
        }

    def _token_logprobs(self, logits: torch.Tensor, micro: dict, *, with_entropy: bool, temperature=None):
        """[b, s - 1] fp32 logprobs (and entropy) of each next token, from vocab-parallel logits.

        Every position of the logits is scored against ``micro["targets"]`` (a flatten of the whole
        logits is free, of ``logits[:, :-1]`` a copy), then laid out as [b, s - 1].
        """
        tp, tp_rank = self.ctx.sizes.tp, self.ctx.tp_rank
        local_vocab = padded_vocab_size(self.model_info.shape.vocab_size, tp) // tp
        logprobs, entropy = vocab_parallel_logprobs(
            logits,
            micro["targets"].to(logits.device),
            group=self.ctx.pgs.tp,
            vocab_start=tp_rank * local_vocab,
            vocab_size=self.model_info.shape.vocab_size,
            temperature=self.temperature if temperature is None else temperature,
            chunk_size=self.cfg.policy.logprob_chunk_size,
            with_entropy=with_entropy,
        )
        packed = micro.get("packed")
        if packed is not None:
            return packed.unpack(logprobs), (packed.unpack(entropy) if entropy is not None else None)
        width = micro["sub"].input_ids.shape[1] - 1
        held = micro.get("cp_positions")

        def layout(values):  # [b, s - 1]; under CP, zero where another CP rank holds the position
            if values is None:
                return None
            if held is not None:
                values = place_positions(values, held, micro["tokens"].shape[1] * self.ctx.sizes.cp)
            return values[:, :width]

        return layout(logprobs), layout(entropy)

    def _loss_mask(self, micro: dict) -> torch.Tensor:
        """Response positions this rank scores (under CP: those of its own chunks)."""
        mask = micro["sub"].response_mask()
        held = micro.get("cp_positions")
        if held is not None:
            row = micro["tokens"].shape[1] * self.ctx.sizes.cp
            mine = place_positions(torch.ones(1, len(held)), held, row)[0].bool()
            mask = mask & mine[: mask.shape[1]]
        return mask

    # ------------------------------------------------------------------------------------ logprobs

    def logprobs(self, batch, temperature: float | None = None) -> torch.Tensor:
        """[B, S - 1] fp32 logprobs of every next token under the current policy (all ranks).

        ``temperature`` defaults to the rank's (GRPO: ``generation.temperature``, the distribution
        rollouts are sampled from; the weight-sync probe uses 1.0).
        """
        # The weights only (the probe, with the engines awake): borrowed, and parked again after.
        with self.offloader.borrowed("weights"):
            return self._logprobs(batch, temperature)

    def _logprobs(self, batch, temperature: float | None) -> torch.Tensor:
        mine = self._my_shard(batch)
        result = torch.zeros(batch.size, batch.input_ids.shape[1] - 1)
        collected: list[tuple[list[int], torch.Tensor]] = []

        def record(logits, micro):
            lp, _ = self._token_logprobs(logits, micro, with_entropy=False, temperature=temperature)
            collected.append((micro["rows"], lp.detach().float().cpu()))
            return torch.zeros((), device=logits.device), torch.tensor(1, dtype=torch.int), {}

        micro = [{**m, "rows": rows} for rows, m in self.micro_batches(batch, mine)]
        self._forward_only(micro, record)
        for rows, lp in collected:
            result[rows, : lp.shape[1]] = lp
        return self._share_rows(result, mine)

    def routing_check(self, batch) -> dict[str, float]:
        """Rollout routing replay's health on ``batch`` (which carries the engine's ``routing`` and
        ``gen_logprobs``), from one forward in which the trainer's routers choose for themselves:
        ``moe/routing_agreement``, the share of (token, MoE layer) pairs the engine forwarded whose
        top-k set the trainer picks too, and ``moe/token_mult_prob_error_no_replay``, the mean
        exp|trainer - engine| logprob over response tokens without replay (all ranks)."""
        self._on_device()
        mine = self._my_shard(batch)
        counts = torch.zeros(4, dtype=torch.float64)  # same, compared, error sum, tokens

        def score(logits, micro):
            lp, _ = self._token_logprobs(logits, micro, with_entropy=False)
            sub, mask = micro["sub"], self._loss_mask(micro)
            error = torch.exp((lp.detach().float().cpu() - sub.gen_logprobs[:, : lp.shape[1]]).abs())
            counts[2] += float(error[mask[:, : lp.shape[1]]].sum())
            counts[3] += float(mask.sum())
            return torch.zeros((), device=logits.device), torch.tensor(1, dtype=torch.int), {}

        micro = []
        for _, m in self.micro_batches(batch, mine):
            engine = m.pop("routing")  # the trainer's routers choose; what they chose is recorded
            micro.append({**m, "engine_routing": engine, "record": []})
        self._forward_only(micro, score)
        for m in micro:
            if m["record"]:
                packed = m["tokens"].shape[1] if self.packed else None
                rows = engine_routed_rows(
                    m["sub"].lengths,
                    packed_tokens=packed,
                    width=m["tokens"].shape[1],
                    positions=m.get("cp_positions"),
                )
                rows = self._sequence_shard(rows)
                mine_r = [r[rows] for r in m["record"][0]]
                same, total = routing_agreement(mine_r, [r[rows] for r in m["engine_routing"]])
                counts[0] += same
                counts[1] += total
        dist.all_reduce(counts)  # TP ranks count alike: the shares are unchanged
        return {
            "moe/routing_agreement": float(counts[0] / counts[1]) if counts[1] else float("nan"),
            "moe/token_mult_prob_error_no_replay": float(counts[2] / counts[3])
            if counts[3]
            else float("nan"),
        }

    def _forward_only(self, micro: list[dict], loss_fn) -> None:
        """Forward passes in eval mode, no autograd (the caller's ``loss_fn`` collects what it needs)."""
        chunk = self.engine.model[0]
        training = chunk.training
        chunk.eval()
        try:
            with torch.no_grad():
                forward_backward(self.engine, micro, loss_fn, forward_only=True)
        finally:
            chunk.train(training)

    def reference_logprobs(self, batch) -> torch.Tensor:
        """Logprobs under the frozen initial weights (swapped in from host memory)."""
        with self.reference_weights():
            return self.logprobs(batch)

    def reference_weights(self):
        """Context manager: the frozen initial weights are the model's inside it."""
        from contextlib import contextmanager

        if self.lora is not None:
            self._on_device()
            return lora_disabled(self.engine.module)
        if self.reference is None:
            raise RuntimeError("no reference policy is kept (GRPO keeps one when grpo.kl_coef > 0)")

        @contextmanager
        def swapped():
            self._on_device()
            self.reference.swap(self.engine.module)
            try:
                yield
            finally:
                self.reference.swap(self.engine.module)

        return swapped()

    def _share_rows(self, result: torch.Tensor, mine: list[int]) -> torch.Tensor:
        """Combine each DP rank's rows (computed on the last pipeline stage) onto every rank."""
        if not self.ctx.is_last_stage:
            result.zero_()
        else:
            keep = torch.zeros(result.shape[0], dtype=torch.bool)
            keep[mine] = True
            result[~keep] = 0
            if self.ctx.tp_rank != 0:  # TP peers hold identical rows; count them once
                result.zero_()
        # One sum over all ranks: exactly one rank contributes each row.
        dist.all_reduce(result)
        return result

    # ---------------------------------------------------------------------------------- checkpoint

    def save(self, path: str | Path) -> dict[str, FileDigest]:
        """Model (a megagrpo checkpoint, exportable to HF) + optimizer + scheduler under ``path``.

        Collective. Layout: ``megatron/`` model, ``optimizer/`` optimizer state (both Megatron
        distributed checkpoints, loadable at another TP/PP), ``trainer_state.json``. Returns the
        digests of the files this rank's checkpoint writers wrote, by path relative to ``path``
        (for the checkpoint's manifest). A failed write raises on every rank, never leaving one
        waiting for another.
        """
        self._on_device("weights", "optimizer")  # parked gradient buffers stay so: not saved
        path = Path(path)
        model_sd = self._model_state()
        with DigestCollector() as digests:
            # Megatron's saves agree on a writer failure across ranks (they all raise).
            if self.lora is None:
                save_megatron(self.engine.module, path / "megatron", digests=digests)
            else:  # the adapters only; the base is referred to (lora.json)
                (path / ADAPTERS_DIR).mkdir(parents=True, exist_ok=True)
                # Megatron's save rewrites the state dict it is given: the optimizer maps a fresh one.
                save_dist_checkpoint(self._model_state(), path / ADAPTERS_DIR, digests=digests)
            (path / "optimizer").mkdir(parents=True, exist_ok=True)
            opt_sd = self.engine.optimizer.sharded_state_dict(model_sd, metadata=_OPTIMIZER_CKPT_FORMAT)
            save_dist_checkpoint(opt_sd, path / "optimizer", digests=digests)
        failure = None
        if self.ctx.rank == 0:
            try:
                state = {"steps_done": self.steps_done, "scheduler": self.scheduler.state_dict()}
                atomic_write(path / "trainer_state.json", json.dumps(state, indent=2) + "\n")
                info = self.model_info
                write_checkpoint_meta(
                    path,
                    info.arch,
                    info.shape,
                    info.dtype,
                    tp=self.ctx.sizes.tp,
                    pp=self.ctx.sizes.pp,
                    hf_files=info.hf_dir,
                )
                if self.lora is not None:
                    write_lora_meta(path, self.lora, self.base_reference())
            except OSError as err:
                failure = err
        # Doubles as the barrier that ends the save: every rank learns whether rank 0's part failed.
        failed = torch.tensor([0 if failure is None else 1], device=self.ctx.device)
        dist.all_reduce(failed)
        if failure is not None:
            raise failure
        if failed.item():
            raise OSError(f"rank 0 could not write its part of the checkpoint {path}")
        return digests.under(path)

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote (at this job's TP/PP/DP, whatever it was saved with)."""
        from megatron.core import dist_checkpointing

        self._on_device()
        path = Path(path)
        if self.lora is None:
            load_megatron(self.engine.module, path / "megatron")
        else:
            check_lora_meta(path, self.lora, self.base_reference())
            load_adapters(self.engine.module, self._model_state(), path / ADAPTERS_DIR)
        self._materialize_optimizer_state()
        model_sd = self._model_state()
        opt_sd = self.engine.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=_OPTIMIZER_CKPT_FORMAT
        )
        check_entry_kinds(opt_sd, path / "optimizer")
        with adam_step_kept_on_load(), trusted_metadata_only():
            self.engine.optimizer.load_state_dict(dist_checkpointing.load(opt_sd, str(path / "optimizer")))
        untie_adam_steps(self.engine.optimizer)
        state = json.loads((path / "trainer_state.json").read_text())
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = state["steps_done"]

    def _model_state(self) -> dict:
        """The model's sharded state dict as checkpoints hold it: the whole stage, or its adapters only."""
        module = self.engine.module
        if self.lora is None:
            return module.sharded_state_dict()
        names = stage_param_names(module, self.ctx, self.model_info.shape.num_layers)
        return adapter_state_dict(module, names, self.ctx)

    def base_reference(self) -> dict:
        """What the adapters were trained on (``ckpt.lora.base_reference``), computed once."""
        if getattr(self, "_base_reference", None) is None:
            self._base_reference = base_reference(self.model_info, self.cfg.model, seed=self.lora.seed)
        return self._base_reference

    def _materialize_optimizer_state(self) -> None:
        """Give a fresh optimizer the Adam state tensors a checkpoint is loaded into, in place.

        Megatron's own initializer leaves out torch Adam's ``step``, which the distributed
        optimizer's state_dict requires; a dummy optimizer step would move the weights instead.
        """
        chained = getattr(self.engine.optimizer, "chained_optimizers", [self.engine.optimizer])
        for opt in chained:
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    state = inner.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p.data)
                        state["exp_avg_sq"] = torch.zeros_like(p.data)
