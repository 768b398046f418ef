"""Test tiers: unit (one process), dist (spawned gloo ranks), e2e (Ray + vLLM + Megatron), gpu (CUDA only:
skipped without CUDA, except where the gpu tier alone is asked for, ``-m gpu``: then the run fails)."""

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
    if config.option.markexpr.strip() == "gpu":
        # The gpu tier asked for by name (`make test-gpu`): without CUDA that is a failure, not a green
        # run of skips.
        raise pytest.UsageError(
            f"-m gpu selects the CUDA tests, and torch {torch.__version__} sees no CUDA device "
            f"(CUDA build: {torch.version.cuda or 'none'}): run them where `python tools/gpu_setup.py check` "
            "passes"
        )
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
