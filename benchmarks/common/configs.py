"""megagrpo run configs for the benchmarks: the tiny CPU default config with overrides."""

from __future__ import annotations

from pathlib import Path


def override(key: str, value: object) -> str:
    """``section.key=value`` as ``load_config`` reads it (None -> null, booleans in lower case, a string
    that YAML would read as something else quoted: ``off`` is a boolean to YAML)."""
    import json

    import yaml

    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    else:
        text = str(value)
        if isinstance(value, str) and yaml.safe_load(text) != value:
            text = json.dumps(value)
    return f"{key}={text}"


def make_config(overrides: dict[str, object]):
    """``load_config`` of the default config with ``{"section.key": value}`` applied in order."""
    from megagrpo.config import load_config

    return load_config(None, [override(k, v) for k, v in overrides.items()])


def cpu_engine_overrides(hf_dir: Path, *, seq_length: int) -> dict[str, object]:
    """An fp32 HF model for the vLLM CPU engines: eager, 1 GiB KV cache, engines on their own
    workers (one CPU each), TP=1."""
    return {
        "model.tiny": None,
        "model.hf_dir": hf_dir,
        "model.dtype": "float32",
        "model.seq_length": seq_length,
        "generation.cpu_kvcache_space_gib": 1,
        "generation.enforce_eager": True,
        "generation.placement": "disaggregated",
        "parallel.tensor_model_parallel_size": 1,
        "cluster.cpus_per_worker": 1,
    }
