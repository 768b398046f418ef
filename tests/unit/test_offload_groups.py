"""The offloader brings back only what a call needs: a group by name, or a group borrowed for reading and
parked again (the probe and re-sends borrow the weights; a checkpoint leaves the gradient buffers parked)."""

from __future__ import annotations

import pytest
import torch

from megagrpo.policy.offload import Offloader

pytestmark = pytest.mark.unit


def _parked_states():
    cpu = torch.device("cpu")
    weights, moments, grads = torch.randn(64), torch.randn(2, 64), torch.randn(64)
    kept = {"weights": weights.clone(), "optimizer": moments.clone(), "grads": grads.clone()}
    off = Offloader(cpu)
    freed = (
        off.offload("optimizer", [moments])
        + off.offload("grads", [grads])
        + off.offload("weights", [weights])
    )
    assert freed == 4 * (64 + 128 + 64)
    return off, {"weights": weights, "optimizer": moments, "grads": grads}, kept


def test_reload_brings_back_the_groups_named_and_leaves_the_others_parked():
    off, live, kept = _parked_states()
    assert off.reload(["weights", "optimizer"]) == 4 * (64 + 128)
    assert torch.equal(live["weights"], kept["weights"]) and torch.equal(live["optimizer"], kept["optimizer"])
    assert live["grads"].untyped_storage().nbytes() == 0 and list(off.parked) == ["grads"]
    assert off.reload() == 4 * 64 and torch.equal(live["grads"], kept["grads"]) and off.parked == {}


def test_a_borrowed_group_is_back_inside_and_parked_again_after():
    off, live, kept = _parked_states()
    with off.borrowed("weights"):
        assert torch.equal(live["weights"], kept["weights"])  # read, e.g. the probe's forward
        assert live["optimizer"].untyped_storage().nbytes() == 0
    assert live["weights"].untyped_storage().nbytes() == 0
    assert sorted(off.parked) == ["grads", "optimizer", "weights"]
    with off.borrowed("nothing parked by that name"):
        pass
    assert off.reload() == 4 * (64 + 128 + 64)  # every byte as it was, the borrowed ones included
    for name, tensor in live.items():
        assert torch.equal(tensor, kept[name]), name
