"""The CUDA->CPU redirection (megagrpo.compat.cuda_on_cpu), checked in fresh processes: activation is
process-wide until ``uninstall``."""

import pytest
import torch

from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.unit


def _probe_redirection(rank: int, world_size: int) -> dict:
    from megagrpo.compat import cuda_on_cpu

    active_before = cuda_on_cpu.is_active()
    activated = cuda_on_cpu.activate()
    out = {"active_before": active_before, "activated": activated, "again": cuda_on_cpu.activate()}
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


def _attributes(owners: list) -> dict:
    return {(id(owner), name): value for owner in owners for name, value in vars(owner).items()}


def _probe_uninstall(rank: int, world_size: int) -> dict:
    import logging

    from megatron.core.tensor_parallel import random as mcore_random
    from torch.autograd.function import BackwardCFunction

    from megagrpo.compat import cuda_on_cpu

    owners = [torch.cuda, torch.cuda.nvtx, torch.cuda.random, mcore_random, BackwardCFunction]
    before = _attributes(owners)
    filters_before = list(logging.getLogger(mcore_random.__name__).filters)
    out = {"activated": cuda_on_cpu.activate()}
    during = _attributes(owners)
    out["replaced"] = sorted(
        f"{type(owner).__name__}:{name}"
        for owner in owners
        for name in vars(owner)
        if during[(id(owner), name)] is not before.get((id(owner), name))
    )
    out["under_mode"] = str(torch.empty(1, device="cuda").device)

    # A mode entered after the redirection and still open: the redirection cannot be left under it.
    class Inner(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Inner():
        try:
            cuda_on_cpu.uninstall()
            out["uninstall_under_inner"] = "no error"
        except RuntimeError as err:
            out["uninstall_under_inner"] = str(err)
    out["still_active"] = cuda_on_cpu.is_active()

    cuda_on_cpu.uninstall()
    after = _attributes(owners)
    out["same_names"] = after.keys() == before.keys()
    out["not_original"] = [key[1] for key, value in after.items() if value is not before[key]]
    out["filters_restored"] = logging.getLogger(mcore_random.__name__).filters == filters_before
    out["active_after"] = cuda_on_cpu.is_active()
    out["modes_left"] = len(torch.overrides._get_current_function_mode_stack())
    try:
        torch.empty(1, device="cuda")
        out["cuda_after"] = "allocated"
    except (RuntimeError, AssertionError):
        out["cuda_after"] = "raises"
    cuda_on_cpu.uninstall()  # again: a no-op
    out["reactivated"] = cuda_on_cpu.activate() and str(torch.zeros(1, device="cuda").device) == "cpu"
    return out


def test_uninstall_puts_every_original_back():
    from megagrpo.compat import cuda_on_cpu

    (res,) = run_local_ranks(_probe_uninstall, 1, timeout_s=120)
    assert res["activated"] is True and res["under_mode"] == "cpu"
    # What changed is exactly the documented list of hooks (torch.cuda.get_rng_state and
    # torch.cuda.random.get_rng_state are one function, counted once per owner).
    assert len(res["replaced"]) == len(cuda_on_cpu.hooks()) == 21
    assert "a torch function mode entered after it is open" in res["uninstall_under_inner"]
    assert res["still_active"] is True
    assert res["same_names"] and res["not_original"] == []
    assert res["filters_restored"] and res["active_after"] is False and res["modes_left"] == 0
    assert res["cuda_after"] == "raises"
    assert res["reactivated"] is True


def _probe_missing_hook(rank: int, world_size: int) -> dict:
    from megatron.core.tensor_parallel import random as mcore_random

    from megagrpo.compat import cuda_on_cpu

    # As if Megatron had renamed one of the private helpers the redirection replaces.
    del mcore_random._set_cuda_rng_state
    current_device = torch.cuda.current_device
    try:
        cuda_on_cpu.activate()
        message = "activated"
    except RuntimeError as err:
        message = str(err)
    return {
        "message": message,
        "active": cuda_on_cpu.is_active(),
        "torch_untouched": torch.cuda.current_device is current_device,
        "modes": len(torch.overrides._get_current_function_mode_stack()),
    }


def test_a_missing_hook_is_named_and_nothing_is_patched():
    (res,) = run_local_ranks(_probe_missing_hook, 1, timeout_s=120)
    assert "megatron.core.tensor_parallel.random._set_cuda_rng_state does not exist" in res["message"]
    assert "verified with torch 2.13.0 and megatron-core 0.16.1" in res["message"]
    assert res["active"] is False and res["torch_untouched"] and res["modes"] == 0


def test_this_process_is_untouched_by_import():
    # Importing the module changes nothing; only activate() does.
    from megagrpo.compat import cuda_on_cpu  # noqa: F401

    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
