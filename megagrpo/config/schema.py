"""The run configuration: :class:`Config`, one keyword-only, frozen dataclass per component, every field
documented; and :class:`Resolved`, the record of its ``auto`` values once decided.

A run is described by a YAML file with one section per component (``model``, ``parallel``, ``policy``,
``generation``, ``grpo``, ``sft``, ``dpo``, ``data``, ``reward``, ``eval``, ``warmup``, ``checkpoint``,
``logging``, ``cluster``) plus ``run_name``; :class:`Config` holds them. Each trainer reads the sections it
needs (GRPO: ``grpo``, ``generation``, ``reward``; SFT: ``sft``; DPO: ``dpo``; all of them ``policy`` for
the optimizer and micro-batching). The sections live in :mod:`~megagrpo.config.model`,
:mod:`~megagrpo.config.training`, :mod:`~megagrpo.config.rollout` and here (checkpoint, logging, cluster).

The dataclasses are plain data: each ``__post_init__`` checks its own fields (raising
:class:`~megagrpo.config.errors.ConfigError` with the field's name; the loader prefixes the section), and
nothing else: no environment probe, no user code. The checks across sections, per trainer, are
:func:`megagrpo.config.rules.validate`; ``auto`` is decided by :func:`megagrpo.config.resolve`; reading
YAML and overrides is :mod:`megagrpo.config.load`, which takes all three steps.
"""

import math
import re
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

from megagrpo.config.errors import check, positive, require
from megagrpo.config.model import ModelConfig, ParallelConfig, TinyModelConfig
from megagrpo.config.rollout import DataConfig, EnvConfig, EvalConfig, GenerationConfig, RewardConfig
from megagrpo.config.training import (
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    PolicyConfig,
    SFTConfig,
    WarmupConfig,
)

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "DPOConfig",
    "DataConfig",
    "DistillConfig",
    "EnvConfig",
    "EvalConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PolicyConfig",
    "Resolved",
    "RewardConfig",
    "SFTConfig",
    "TinyModelConfig",
    "WarmupConfig",
    "key_fields",
]

NOT_A_KEY = {"key": False}
"""Field metadata of a value a config carries that no YAML file or override sets."""


def key_fields(cls: type) -> list[Field]:
    """The fields of dataclass ``cls`` that are config keys (what YAML and overrides set, and what
    ``config_to_dict`` writes)."""
    return [f for f in fields(cls) if f.init and f.metadata.get("key", True)]


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Saving, resuming and exporting."""

    dir: str | None = None
    """Checkpoint directory; null disables checkpointing."""
    save_every: int = 0
    """Save every this many steps; 0 saves only at the end of the run."""
    keep_last: int = 2
    """Number of most recent checkpoints kept on disk."""
    resume: bool = False
    """Resume from the latest checkpoint in dir if there is one (the one switch: the command line's
    ``--resume`` sets it)."""
    export_hf_at_end: bool = False
    """Write an HF-format copy of the final policy to `<logging.dir>/<run_name>/hf_export`."""
    on_corrupt: Literal["fallback", "error"] = "fallback"
    """Resume when the latest checkpoint fails its manifest: use the newest that passes, or stop."""
    on_error: Literal["stop", "continue"] = "stop"
    """A checkpoint that cannot be written (disk full, unwritable dir) stops the run, or it goes on without
    it; every trainer (GRPO, SFT, DPO) saves through the one writer that honours it."""

    def __post_init__(self) -> None:
        check(self, "save_every", self.save_every >= 0, ">= 0")
        positive(self, "keep_last")
        if self.dir is None:
            for name in ("resume", "export_hf_at_end"):
                require(not getattr(self, name), (name, "dir"), f"{name} needs dir to be set")
            require(self.save_every == 0, ("save_every", "dir"), "save_every > 0 needs dir to be set")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """Metrics and progress output."""

    dir: str = "runs"
    """Root of run outputs; a run writes config.yaml and metrics under `<dir>/<run_name>/`."""
    tensorboard: bool = False
    """Also write TensorBoard event files."""
    log_every: int = 1
    """Print the step's summary line every this many steps (and the last step); metrics.jsonl, TensorBoard
    and the progress bar get every step."""
    val_every: int = 0
    """Validate every this many steps; 0 disables validation."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""
    wandb: bool = False
    """Also log every step to Weights & Biases (needs the optional ``wandb`` package: megagrpo[wandb])."""
    wandb_project: str = "megagrpo"
    """W&B project the run is logged to."""
    wandb_mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server; offline: write the run under <run dir>/wandb for `wandb sync`."""

    def __post_init__(self) -> None:
        require(bool(self.dir), "dir", "must not be empty")
        require(bool(self.wandb_project), "wandb_project", "must not be empty")
        positive(self, "log_every")
        check(self, "val_every", self.val_every >= 0, ">= 0")


@dataclass(kw_only=True, frozen=True)
class ClusterConfig:
    """Ray cluster the actors are placed on."""

    ray_address: str | None = None
    """Address of a running Ray cluster; null starts a local one."""
    num_nodes: int = 1
    """Nodes used."""
    gpus_per_node: int = 0
    """GPUs used per node; 0 runs everything on CPU."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per Ray actor (fractions allowed)."""
    cpu_threads: int | None = None
    """Intra-op threads of each trainer rank and vLLM engine (engine TP 1) without GPUs. null: in the
    sequential loop (grpo.max_staleness 0: engines and trainer take turns), the node's cores shared
    out among the trainer ranks on it, and on one node among the engines; else cpus_per_worker
    (at least 1)."""
    policy_resource: str | None = None
    """Custom Ray resource every policy rank requires: a node label (start the training nodes with
    `ray start --resources '{"NAME": 1}'`); null places ranks on any node."""
    engine_resource: str | None = None
    """Custom Ray resource every vLLM engine requires (disaggregated placement): puts engines on the
    nodes started with it; null places engines on any node."""
    rank_call_timeout_s: float = 600.0
    """Seconds the driver waits for every policy (or teacher) rank to answer one call (a train step, a
    logprob pass, a checkpoint save) before the run stops on a fault naming the ranks that did not."""

    def __post_init__(self) -> None:
        positive(self, "num_nodes")
        for key in ("policy_resource", "engine_resource"):
            name = getattr(self, key)
            check(
                self,
                key,
                name is None or (name != "" and name not in ("CPU", "GPU", "memory")),
                "a custom resource name",
            )
        check(self, "gpus_per_node", self.gpus_per_node >= 0, ">= 0")
        check(self, "cpus_per_worker", self.cpus_per_worker > 0, "> 0")
        check(self, "cpu_threads", self.cpu_threads is None or self.cpu_threads > 0, "> 0 or null")
        check(
            self,
            "rank_call_timeout_s",
            math.isfinite(self.rank_call_timeout_s) and self.rank_call_timeout_s > 0,
            "finite and > 0",
        )


@dataclass(kw_only=True, frozen=True)
class Resolved:
    """A config's ``auto`` values, decided once where the run starts (:func:`megagrpo.config.resolve`, which
    ``load_config`` calls) and carried inside the Config to every rank, so no rank decides them again."""

    backend: Literal["gloo", "nccl"]
    """``parallel.backend``; "auto": nccl where the resolving process sees CUDA, else gloo."""
    transformer_impl: Literal["local", "torch", "transformer_engine"]
    """``parallel.transformer_impl``; "auto": transformer_engine where it is importable, else torch (PyTorch
    >= 2.5), else local. Named values are taken as given (the ranks check that they have them)."""
    packs_sequences: bool
    """Whether the policy's micro-batches are packed end to end (THD): ``policy.sequence_packing`` auto,
    layers that keep packed sequences apart, and context_parallel_size 1."""
    settings: tuple[Any, ...]
    """What was decided from (:meth:`settings_of`); a config whose settings differ refuses the record."""

    @staticmethod
    def settings_of(cfg: "Config") -> tuple[Any, ...]:
        """The settings the decisions read: (parallel.backend, parallel.transformer_impl,
        policy.sequence_packing, parallel.context_parallel_size)."""
        par = cfg.parallel
        return (par.backend, par.transformer_impl, cfg.policy.sequence_packing, par.context_parallel_size)


@dataclass(kw_only=True, frozen=True)
class Config:
    """A whole run: plain data. Building one checks each section's own fields only; the checks across
    sections (``megagrpo.config.rules.validate``) and the decision of ``auto`` values
    (``megagrpo.config.resolve``, read back as :attr:`resolved`) are separate, explicit steps, both taken
    by ``load_config``."""

    run_name: str = "megagrpo"
    """Name of the run; outputs go to `<logging.dir>/<run_name>/`."""
    model: ModelConfig
    """Weights to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallelism."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Optimizer and batching."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Rollout engines and weight sync."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO (``megagrpo train``)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher (``megagrpo distill``)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning (``megagrpo sft``)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Preference optimisation (``megagrpo dpo``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes with an environment (null environment: single-turn)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """pass@k evaluation (``megagrpo eval``, sampled validation)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Optional supervised warm-up before GRPO (tiny models on the synthetic task)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray resources."""
    resolution: Resolved | None = field(default=None, compare=False, metadata=NOT_A_KEY)
    """Not a key: the ``auto`` decisions :func:`megagrpo.config.resolve` made (None until then); read them
    through :attr:`resolved`, which refuses a config that was never resolved."""

    def __post_init__(self) -> None:
        require(
            re.fullmatch(r"[A-Za-z0-9._-]+", self.run_name) is not None,
            "run_name",
            f"must be non-empty and use only letters, digits, '.', '_' and '-', got {self.run_name!r}",
        )

    @property
    def rollouts_per_step(self) -> int:
        """Sequences generated per step: num_prompts_per_step * num_generations."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations

    @property
    def mini_batches_per_step(self) -> int:
        """Optimizer steps per GRPO step."""
        return self.rollouts_per_step // self.policy.mini_batch_size

    @property
    def resolved(self) -> Resolved:
        """The ``auto`` decisions the ranks act on. A RuntimeError for a config that was never resolved
        (built in Python: pass it through :func:`megagrpo.config.resolve` where the run starts) or whose
        settings they were decided from were changed since (``dataclasses.replace`` keeps the record
        and decides nothing again)."""
        res = self.resolution
        if res is None:
            raise RuntimeError(
                "this Config's 'auto' values were never resolved: load it with megagrpo.config.load_config, "
                "or pass a Config built in Python through megagrpo.config.resolve() where the run starts"
            )
        now = Resolved.settings_of(self)
        if res.settings != now:
            raise RuntimeError(
                f"this Config's 'auto' values were decided from {res.settings} (parallel.backend, "
                f"parallel.transformer_impl, policy.sequence_packing, parallel.context_parallel_size), but "
                f"it now has {now}: pass the changed config through megagrpo.config.resolve() again"
            )
        return res
