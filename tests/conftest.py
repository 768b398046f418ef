"""Test tiers: unit (one process), dist (spawned gloo ranks), e2e (Ray + vLLM + Megatron), gpu (CUDA only)."""

import pytest
import torch

TIERS = ("unit", "dist", "e2e", "gpu")


def pytest_collection_modifyitems(config, items):
    # `make test` selects by tier (-m): a test without one would never run there.
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        marker = f"pytestmark = pytest.mark.<{'|'.join(TIERS)}>"
        raise pytest.UsageError(f"tests without a tier marker ({marker}): {', '.join(untiered)}")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
