"""Typed run configuration: plain-data dataclasses, loaded from YAML, resolved once, validated once.

- :mod:`~megagrpo.config.schema`: ``Config`` (one section per component: :mod:`~megagrpo.config.model`,
  :mod:`~megagrpo.config.training`, :mod:`~megagrpo.config.rollout`, and checkpoint, logging, cluster),
  every field documented, each section checking only its own fields; and ``Resolved``, the record of the
  ``auto`` decisions;
- :mod:`~megagrpo.config.resolution`: :func:`resolve`, the one decision of ``auto`` values (read back as
  ``cfg.resolved``), taken where the run starts;
- :mod:`~megagrpo.config.rules`: :func:`validate`, the checks across sections for one trainer, including
  the user's reward module;
- :mod:`~megagrpo.config.load`: YAML, dotted overrides, strict types (``load_config``, which resolves and
  validates), and writing a config back (``config_to_dict``, ``save_config``);
- :mod:`~megagrpo.config.errors`: ``ConfigError``, whose message names the dotted key and the file.

Building a Config probes nothing and runs no user code. A config from :func:`load_config` is resolved and
valid for the trainer it was loaded for; one built in Python goes through :func:`resolve` (and
:func:`validate`) before its ranks start, and a rank reading ``cfg.resolved`` of one that did not fails.
"""

from megagrpo.config.errors import ConfigError
from megagrpo.config.load import DEFAULT_CONFIG_PATH, config_to_dict, load_config, save_config
from megagrpo.config.resolution import resolve
from megagrpo.config.rules import TRAINERS, Trainer, validate
from megagrpo.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    Config,
    DataConfig,
    DistillConfig,
    DPOConfig,
    EnvConfig,
    EvalConfig,
    GenerationConfig,
    GRPOConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    PolicyConfig,
    Resolved,
    RewardConfig,
    SFTConfig,
    TinyModelConfig,
    WarmupConfig,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "TRAINERS",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
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
    "Trainer",
    "WarmupConfig",
    "config_to_dict",
    "load_config",
    "resolve",
    "save_config",
    "validate",
]
