"""Megatron-Core's mixture-of-experts router without Transformer Engine.

Verified with megatron-core 0.16.1. ``moe_utils.RouterGatingLinearFunction`` tests
``te_general_gemm is not None``, a module global bound only when Transformer Engine imports: without it
the first router forward raises NameError. Bound to None here, the router takes Megatron's own torch
matmul path. Nothing to restore: where TE imported, the global exists and is left alone; elsewhere None
is what every reader of it takes to mean "no TE".
"""

from __future__ import annotations

__all__ = ["install"]


def install() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
