"""The CUDA->CPU redirection, checked in a fresh process (activation is process-wide and permanent)."""

import pytest
import torch

from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.unit


def _probe_redirection(rank: int, world_size: int) -> dict:
    from megagrpo.parallel import cpu

    active_before = cpu.is_active()
    activated = cpu.activate()
    out = {"active_before": active_before, "activated": activated, "again": cpu.activate()}
    out["factory_device"] = str(torch.empty(3, device="cuda").device)
    out["index_device"] = str(torch.zeros(2, device=torch.cuda.current_device()).device)
    t = torch.ones(2)
    out["cuda_is_identity"] = t.cuda() is t
    out["to_device"] = str(t.to("cuda:0").device)
    out["to_dtype_kept"] = t.to(torch.float64).dtype == torch.float64
    out["type_name"] = t.type()
    out["half_type_name"] = t.half().type()
    out["type_convert"] = t.type("torch.cuda.DoubleTensor").dtype == torch.float64
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        event = torch.cuda.Event()
        event.record()
    torch.cuda.synchronize()

    # The "CUDA" RNG is the CPU generator, so seeding it makes CPU draws reproducible.
    torch.cuda.manual_seed(11)
    a = torch.rand(4)
    torch.cuda.manual_seed(11)
    out["cuda_seed_reproducible"] = torch.equal(a, torch.rand(4))

    # Megatron's tracker: a forked region draws from its own stream and leaves the outer one intact.
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, initialize_rng_tracker

    initialize_rng_tracker(force_reset=True)
    tracker = get_cuda_rng_tracker()
    tracker.add("tp-stream", 123)
    torch.manual_seed(5)
    outer_expected = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork("tp-stream"):
        inside = torch.rand(3)
    out["outer_preserved"] = torch.equal(torch.rand(3), outer_expected)
    torch.manual_seed(123)
    out["fork_uses_its_seed"] = torch.equal(inside, torch.rand(3))

    # A Python backward (run by the autograd engine, outside the caller's modes) is redirected too.
    class CudaBufferInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            buffer = torch.empty(grad.shape, device=torch.cuda.current_device())
            return buffer.copy_(grad) * 2

    x = torch.ones(3, requires_grad=True)
    CudaBufferInBackward.apply(x).sum().backward()
    out["backward_grad"] = x.grad.tolist()
    return out


def test_cpu_redirection_in_fresh_process():
    (res,) = run_local_ranks(_probe_redirection, 1, timeout_s=120)
    assert res["active_before"] is False
    assert res["activated"] is True and res["again"] is True
    assert res["factory_device"] == "cpu"
    assert res["index_device"] == "cpu"
    assert res["cuda_is_identity"]
    assert res["to_device"] == "cpu"
    assert res["to_dtype_kept"]
    assert res["type_name"] == "torch.cuda.FloatTensor"
    assert res["half_type_name"] == "torch.cuda.HalfTensor"
    assert res["type_convert"]
    assert res["cuda_seed_reproducible"]
    assert res["outer_preserved"]
    assert res["fork_uses_its_seed"]
    assert res["backward_grad"] == [2.0, 2.0, 2.0]


def test_this_process_is_untouched_by_import():
    # Importing the module changes nothing; only activate() does.
    from megagrpo.parallel import cpu  # noqa: F401

    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
