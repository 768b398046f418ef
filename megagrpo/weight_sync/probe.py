"""The weight-sync probe's inputs and bounds, importable without Ray (the device benchmarks use them).

The probe itself (scoring on the engines and the trainer, the verdict) is ``sync.WeightSync.probe``.
"""

from __future__ import annotations

import torch

# The probe's bound by the trainer's and the engines' dtype (both ``model.dtype``): float32 kernels
# agree to ~1e-7 (measured on CPU: 1.0000002); bfloat16 ones differ by their rounding. The bf16 bound,
# measured (benchmarks/probe_bf16.py, results/suite_*/probe_bf16.md): vLLM CPU bf16 against Megatron bf16
# 1.003-1.007 over 20 syncs of the tiny demo model; Megatron bf16 against transformers bf16 at
# Qwen2-1.5B's shape on an H200 1.002-1.021 over 20 syncs. 1.05 leaves 2.3x the largest excess (0.021)
# seen; vLLM's CUDA kernels at 1.5B have not been measured against it.
PROBE_BOUNDS = {"float32": 1.001, "bfloat16": 1.05, "float16": 1.05}


def probe_sequences(
    vocab_size: int, *, count: int = 4, length: int = 32, seed: int = 1234
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=gen).tolist()
