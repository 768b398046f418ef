"""Routing agreement with the trainer's rows on the GPU and the engine's on the host, as the driver's
routing check has them (first seen on an H200: the comparison raised on the two devices)."""

import pytest
import torch

from megagrpo.algorithms.routing import routing_agreement

pytestmark = pytest.mark.gpu


def test_routing_agreement_across_devices():
    mine = [torch.tensor([[0, 3], [1, 2], [5, 4]], device="cuda")]
    engine = [torch.tensor([[3, 0], [1, 2], [4, 6]], dtype=torch.int16)]  # the host's rows, another order
    assert routing_agreement(mine, engine) == (2, 3)
