"""The one place that turns ``"auto"`` into a torch.distributed backend or a Megatron layer implementation,
and says what each layer implementation supports.

``megagrpo.config.resolve`` calls :func:`resolve_backend` and :func:`resolve_transformer_impl` once, where
the run starts (``load_config`` does), and the config carries the result to every rank
(``cfg.resolved.backend``, ``cfg.resolved.transformer_impl``). ``init_parallel`` and the model builder
accept ``"auto"`` too, for callers that are not config-driven (the converters, tests), and resolve it here
as well; they also ask for ``check_available``: the machine that is about to use a backend or a layer
implementation must have it, while a config may name one that only the trainer's machines have.

No torch import at module level: loading a config stays cheap unless ``"auto"`` needs the CUDA probe, or
finds Transformer Engine installed (then Megatron's import of it decides).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Literal

__all__ = [
    "BACKENDS",
    "IMPL_FEATURES",
    "TRANSFORMER_IMPLS",
    "cuda_available",
    "resolve_backend",
    "resolve_transformer_impl",
    "torch_layers_available",
    "transformer_engine_available",
    "weight_sync_backend",
]

Backend = Literal["gloo", "nccl"]
TransformerImpl = Literal["local", "torch", "transformer_engine"]

BACKENDS: tuple[Backend, ...] = ("gloo", "nccl")
"""Concrete torch.distributed backends ``parallel.backend`` may name besides ``"auto"``."""
TRANSFORMER_IMPLS: tuple[TransformerImpl, ...] = ("local", "torch", "transformer_engine")
"""Concrete Megatron layer implementations ``parallel.transformer_impl`` may name besides ``"auto"``."""

IMPL_FEATURES: dict[str, frozenset[str]] = {
    "local": frozenset(),  # Megatron's wrapper of torch's norms refuses SP; its attention takes no THD
    "torch": frozenset({"sequence_parallel", "thd"}),  # no ring attention of our own: CP needs TE's
    "transformer_engine": frozenset({"sequence_parallel", "context_parallel", "thd"}),
}
"""What each layer implementation supports beyond plain TP/PP/DP: ``sequence_parallel`` (Megatron SP),
``context_parallel`` (CP ring attention), ``thd`` (packed variable-length attention). A new
implementation adds its row here; the config checks and ``megagrpo plan`` read this table."""

# The torch layers need torch.nn.functional.rms_norm (2.4) and SDPA's enable_gqa (2.5).
_TORCH_LAYERS_MIN = (2, 5)


def cuda_available() -> bool:
    """Whether this process sees a CUDA device."""
    import torch

    return torch.cuda.is_available()


def transformer_engine_available() -> bool:
    """Whether Megatron's own import of Transformer Engine succeeded (``HAVE_TE`` of the module that builds
    its TE layer spec), not merely whether the package is found: an installed TE whose extension does not
    load (built for another torch or CUDA, cuDNN missing) leaves Megatron without it, and a TE spec would
    then fail at build. Looked up first, so a machine without TE imports nothing (importing TE is slow)."""
    try:
        if importlib.util.find_spec("transformer_engine") is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        from megatron.core.models.gpt import gpt_layer_specs
    except ImportError as err:
        # Megatron takes a missing module for "no TE" but lets other import errors through (a library
        # that does not load): then no layer implementation can be built here.
        raise ValueError(
            f"transformer_engine is installed but fails to import ({err}), and Megatron-Core fails with it: "
            "repair or uninstall it"
        ) from None
    return bool(gpt_layer_specs.HAVE_TE)


def torch_layers_available() -> bool:
    """Whether the installed PyTorch has what the ``torch`` layers call (read from its version, no import)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= _TORCH_LAYERS_MIN


def resolve_backend(name: str = "auto", *, check_available: bool = False) -> Backend:
    """``auto`` means NCCL when CUDA is available, gloo otherwise; other names are returned as they are.

    With ``check_available``, NCCL without CUDA is an error (the caller is about to use it here).
    """
    if name == "auto":
        return "nccl" if cuda_available() else "gloo"
    if name not in BACKENDS:
        raise ValueError(f"parallel.backend must be one of auto, nccl, gloo; got {name!r}")
    if check_available and name == "nccl" and not cuda_available():
        raise ValueError("parallel.backend='nccl' needs CUDA, and none is available; use 'gloo' or 'auto'")
    return name


def resolve_transformer_impl(name: str = "auto", *, check_available: bool = False) -> TransformerImpl:
    """``auto`` means Transformer Engine when Megatron imported it, else the ``torch`` layers (PyTorch's fused
    kernels) when this PyTorch has them, else Megatron's local modules.

    With ``check_available``, a named implementation this machine lacks is an error.
    """
    if name == "auto":
        if transformer_engine_available():
            return "transformer_engine"
        return "torch" if torch_layers_available() else "local"
    if name not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"parallel.transformer_impl must be auto, local, torch or transformer_engine; got {name!r}"
        )
    if check_available and name == "transformer_engine" and not transformer_engine_available():
        raise ValueError(
            "parallel.transformer_impl='transformer_engine' but transformer_engine is not installed, or "
            "Megatron-Core could not import it (python -c 'import transformer_engine.pytorch' says why)"
        )
    if check_available and name == "torch" and not torch_layers_available():
        raise ValueError(
            "parallel.transformer_impl='torch' needs PyTorch >= "
            f"{'.'.join(map(str, _TORCH_LAYERS_MIN))} (scaled_dot_product_attention with enable_gqa)"
        )
    return name


def weight_sync_backend(trainer_backend: str) -> Backend:
    """The weight-sync transport: the trainer's backend, so NCCL with CUDA and gloo without.

    ``trainer_backend`` is ``parallel.backend`` (``auto`` resolved here as above) or the already
    resolved ``cfg.resolved.backend``. The trainer ranks' and the vLLM workers' GPUs exchange the
    weights over NCCL where the trainer uses NCCL; gloo moves them through host memory and TCP.
    """
    return resolve_backend(trainer_backend)
