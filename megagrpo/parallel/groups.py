"""torch.distributed + Megatron model-parallel state, created once and handed out explicitly.

``init_parallel`` is the only place in megagrpo that calls ``torch.distributed.init_process_group``
or ``parallel_state.initialize_model_parallel``. It returns a :class:`ParallelContext` that carries
the Megatron ``ProcessGroupCollection`` and this rank's coordinates; the rest of the code takes the
groups from there instead of reaching into Megatron's globals.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megagrpo.compat import cuda_on_cpu
from megagrpo.compat.torch_store import stores_listen_on_their_host
from megagrpo.parallel.backends import resolve_backend


@dataclass(frozen=True)
class ParallelSizes:
    """Parallel degrees of one trainer job; DP is whatever the world size leaves."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size (needs Transformer Engine attention)."""
    ep: int = 1
    """Expert-parallel size (MoE only)."""
    etp: int | None = None
    """Expert tensor-parallel size (MoE only): how many ranks split each routed expert's width; None:
    the tensor-parallel size. The experts' grid (ETP x EP x expert DP) folds over the same ranks of a
    stage as the dense layers' (TP x DP x CP), as Megatron's ``expert_tensor_parallel_size`` does."""

    @classmethod
    def from_config(cls, parallel) -> ParallelSizes:
        """From a ``megagrpo.config.ParallelConfig``."""
        return cls(
            tp=parallel.tensor_model_parallel_size,
            pp=parallel.pipeline_model_parallel_size,
            cp=parallel.context_parallel_size,
            ep=parallel.expert_model_parallel_size,
            etp=parallel.expert_tensor_parallel_size,
        )

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (``etp``, or TP where unset)."""
        return self.tp if self.etp is None else self.etp

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
                f"= {self.tp} x {self.pp} x {self.cp} = {model_parallel}"
            )
        dp = world_size // model_parallel
        if (self.tp * dp * self.cp) % (self.ep * self.expert_tp):
            raise ValueError(
                f"expert parallel x expert tensor parallel size {self.ep} x {self.expert_tp} must divide "
                f"tensor x data x context parallel size {self.tp} x {dp} x {self.cp}"
            )
        return dp


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the trainer job and the process groups it talks over."""

    sizes: ParallelSizes
    rank: int
    world_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    device: torch.device
    backend: str
    pgs: object  # megatron.core.process_groups_config.ProcessGroupCollection
    ep_rank: int = 0
    """Rank in the expert-parallel group: which share of every MoE layer's experts this rank holds."""
    expert_dp_rank: int = 0
    """Rank among the ranks holding the same experts (Megatron's expert data-parallel group)."""
    etp_rank: int = 0
    """Rank in the expert tensor-parallel group: which slice of each of its experts' width this rank holds."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.sizes.pp - 1


def init_parallel(
    sizes: ParallelSizes,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    backend: str = "auto",
    timeout_s: float = 600.0,
    seed: int = 1234,
) -> ParallelContext:
    """Initialize torch.distributed and Megatron's model-parallel groups for this process.

    Rank, world size and rendezvous default to the torchrun environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Seeds Megatron's RNG tracker so TP ranks draw
    different dropout masks and identical everything else. ``backend``: "gloo" or "nccl" (a loaded
    config's ``cfg.resolved.backend``), or "auto" for callers without a config, resolved by
    :mod:`megagrpo.parallel.backends`. ``timeout_s`` (``parallel.collective_timeout_s``): the default
    group's collective timeout, and Megatron's groups' in whole minutes, rounded up.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    backend = resolve_backend(backend, check_available=True)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    dp_size = sizes.data_parallel_size(world_size)

    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        cuda_on_cpu.activate()
        device = torch.device("cpu")

    if not dist.is_initialized():
        with stores_listen_on_their_host():  # rank 0's store on MASTER_ADDR only
            dist.init_process_group(
                # With NCCL, small CPU-side reductions (metrics, logprob rows) go over gloo.
                backend="cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
                init_method=init_method or "env://",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.expert_tp,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
        # Gloo side-groups only serve Megatron's CPU-side checkpoint exchanges on GPU;
        # with a gloo default backend the main groups already are gloo.
        create_gloo_process_groups=backend == "nccl",
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    return ParallelContext(
        sizes=sizes,
        rank=rank,
        world_size=world_size,
        dp_size=dp_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=device,
        backend=backend,
        pgs=ProcessGroupCollection.use_mpu_process_groups(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
    )


def destroy_parallel(*, keep_world: bool = False) -> None:
    """Tear down Megatron's model-parallel state and, unless ``keep_world``, the default group.

    ``keep_world`` lets one set of processes switch layouts (e.g. TP=1 then TP=2) without a new
    rendezvous, which on gloo races against the previous store's shutdown.
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized() and not keep_world:
        dist.destroy_process_group()
