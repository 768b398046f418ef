"""The weight-sync probe's inputs and bounds, importable without Ray (the device benchmarks use them).

The probe itself (scoring on the engines and the trainer, the verdict) is ``sync.WeightSync.probe``.
"""

from __future__ import annotations

import torch

# The probe's bound by the trainer's and the engines' dtype (both ``model.dtype``): float32 kernels
# agree to ~1e-7 (measured on CPU: 1.0000002); bfloat16 ones differ by their rounding.
PROBE_BOUNDS = {"float32": 1.001, "bfloat16": 1.05, "float16": 1.05}


def probe_sequences(
    vocab_size: int, *, count: int = 4, length: int = 32, seed: int = 1234
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=gen).tolist()
