import pytest
import torch

pytestmark = pytest.mark.gpu


def test_activate_is_a_no_op_when_cuda_exists():
    from megagrpo.compat import cuda_on_cpu

    current_device = torch.cuda.current_device
    assert cuda_on_cpu.activate() is False
    assert not cuda_on_cpu.is_active()
    assert torch.cuda.current_device is current_device
    assert torch.empty(1, device="cuda").device.type == "cuda"
