"""Warnings of other libraries that tell a megagrpo user nothing they can act on.

Importing megagrpo installs no warning filter: a program that imports it sees every warning its
libraries raise. The ``megagrpo`` program and the converter tools silence those below
(``silence_in_this_program``), for their own process and for the Python processes they start, which
inherit them through ``PYTHONWARNINGS`` (a local Ray's workers, spawned ranks; a Ray cluster's
workers get it through the job's environment, ``runtime.ray_session``). Each entry names how the
message begins (as ``PYTHONWARNINGS`` matches it) and its category; no entry replaces anything, so
there is nothing to verify or restore.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Noise:
    category: type[Warning]
    starts: str
    """How the message begins (no ``:`` or ``,``: it travels in ``PYTHONWARNINGS``)."""
    why: str
    """Who raises it and why it is not actionable here."""


NOISE = (
    Noise(
        UserWarning,
        "Transformer Engine and Apex are not installed",
        "Megatron-Core at import: its optional fused kernels are missing and it uses torch's, as on CPU",
    ),
    Noise(UserWarning, "Apex is not installed", "Megatron-Core at import: torch's norm layers, as on CPU"),
    Noise(
        UserWarning,
        "full scope is deprecated",
        "Megatron-Core's TransformerConfig: its own default cuda_graph_scope, at every construction",
    ),
    Noise(
        UserWarning,
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "Megatron-Core's tensor-parallel linear layers: CUDA stream tuning advice",
    ),
    Noise(
        UserWarning,
        "When using sequence parallelism it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "the same advice, with sequence parallelism",
    ),
    Noise(
        FutureWarning,
        "Please use DTensor instead",
        "torch's ShardedTensor, of which Megatron-Core's distributed checkpoints are made",
    ),
    Noise(
        FutureWarning,
        "`load_state_dict` is deprecated",
        "torch.distributed.checkpoint's loader, as Megatron-Core's checkpoint loading calls it",
    ),
)


def pythonwarnings_entries() -> list[str]:
    """``NOISE`` as ``PYTHONWARNINGS`` entries (``action:message:category``)."""
    return [f"ignore:{noise.starts}:{noise.category.__name__}" for noise in NOISE]


def silence_in_this_program(environ: MutableMapping[str, str] = os.environ) -> None:
    """Ignore ``NOISE`` in this process and in the Python processes it starts from now on.

    For programs only (the ``megagrpo`` command, the converter tools), never on import. Entries the
    user put in ``PYTHONWARNINGS`` come after ours, so they take precedence."""
    for noise in reversed(NOISE):
        warnings.filterwarnings("ignore", message=re.escape(noise.starts), category=noise.category)
    user = [entry for entry in environ.get("PYTHONWARNINGS", "").split(",") if entry]
    ours = [entry for entry in pythonwarnings_entries() if entry not in user]
    environ["PYTHONWARNINGS"] = ",".join([*ours, *user])
