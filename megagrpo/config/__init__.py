"""Typed run configuration: one keyword-only dataclass per component, loaded from YAML, checked once.

- :mod:`~megagrpo.config.schema`: the dataclasses (``Config`` and one per section), every field documented,
  each checking its own fields;
- :mod:`~megagrpo.config.rules`: checks across fields and components, and the one decision of
  ``parallel``'s ``"auto"`` backend and layer implementation (``cfg.parallel.resolved_*``);
- :mod:`~megagrpo.config.load`: YAML, dotted overrides, strict types (``load_config``), and writing a
  config back (``config_to_dict``, ``save_config``);
- :mod:`~megagrpo.config.errors`: ``ConfigError``, whose message names the dotted key and the file.

Everything is validated while the config is built, so a loaded :class:`Config` is valid: the code that
reads it does not check it again.
"""

from megagrpo.config.errors import ConfigError
from megagrpo.config.load import DEFAULT_CONFIG_PATH, config_to_dict, load_config, save_config
from megagrpo.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    Config,
    DataConfig,
    DPOConfig,
    EvalConfig,
    GenerationConfig,
    GRPOConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    PolicyConfig,
    RewardConfig,
    SFTConfig,
    TinyModelConfig,
    WarmupConfig,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DPOConfig",
    "DataConfig",
    "EvalConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PolicyConfig",
    "RewardConfig",
    "SFTConfig",
    "TinyModelConfig",
    "WarmupConfig",
    "config_to_dict",
    "load_config",
    "save_config",
]
