"""Handing a colocated GPU to the engines: the trainer's state to host memory and back.

``policy.offload`` says what leaves the device while the engines run:

- ``none``: nothing (the cached allocator's free blocks are still given back);
- ``optimizer``: Adam's moments and the fp32 master weights (where they are separate from the
  model's weights);
- ``all``: those, the gradient buffers and, once the weights are synced, the weights.

A tensor's storage is copied to host memory (pinned on GPU) and then resized to nothing in place;
bringing it back resizes it again and copies the bytes in. Every view of the storage (Megatron's
``main_grad`` into the gradient buffer, parameters inside the distributed optimizer's parameter
buffer, optimizer shards) stays valid, so nothing is rebuilt and the round trip is bit-exact. The
same code runs on CPU, where it frees host memory for a copy of itself: what is tested there is the
round trip, and the bytes counted are what a GPU would get back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

OFFLOAD_CHOICES = ("none", "optimizer", "all")


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    host: torch.Tensor
    nbytes: int


def _whole(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class Offloader:
    """Storages parked in host memory, by group name (``optimizer``, ``grads``, ``weights``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.parked: dict[str, list[_Parked]] = {}

    def offload(self, group: str, tensors: Iterable[torch.Tensor], *, keep: set[int] = frozenset()) -> int:
        """Park the storages of ``tensors`` that live on this device (each once; none whose data pointer
        is in ``keep``); returns the bytes freed on the device."""
        if group in self.parked:
            return 0  # already off the device
        seen, parked = set(keep), []
        for tensor in tensors:
            if tensor is None or tensor.device != self.device:
                continue
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in seen:
                continue
            seen.add(ptr)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            host.copy_(_whole(storage, self.device))
            storage.resize_(0)
            parked.append(_Parked(storage, host, nbytes))
        self.parked[group] = parked
        return sum(p.nbytes for p in parked)

    def reload(self, groups: Iterable[str] | None = None) -> int:
        """Bring the parked storages of ``groups`` (every group when None) back, bytes unchanged;
        returns the bytes put back on the device."""
        restored = 0
        for group in [g for g in self.parked if groups is None or g in groups]:
            for p in self.parked.pop(group):
                p.storage.resize_(p.nbytes)
                _whole(p.storage, self.device).copy_(p.host)
                restored += p.nbytes
        if restored and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return restored

    @contextmanager
    def borrowed(self, group: str) -> Iterator[None]:
        """Inside: ``group``'s storages on the device for reading (a no-op when it is not parked);
        on the way out they leave it again. Their host copies still hold the bytes, so nothing is
        copied back: whoever borrows them must not write them."""
        parked = self.parked.get(group, [])
        for p in parked:
            p.storage.resize_(p.nbytes)
            _whole(p.storage, self.device).copy_(p.host)
        try:
            yield
        finally:
            for p in parked:
                p.storage.resize_(0)
            if parked:
                release_cached_memory(self.device)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a Megatron optimizer (chained or not) keeps: the inner torch optimizers' states and
    the parameters they step (fp32 master weights, or the model's own; the caller keeps those)."""
    inner = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is not None:
            inner.append(torch_opt)
    out = []
    for torch_opt in inner:
        for group in torch_opt.param_groups:
            out.extend(group["params"])
        for state in torch_opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def grad_buffers(ddp) -> list[torch.Tensor]:
    """Megatron DDP's contiguous gradient buffers (``main_grad`` of every parameter is a view)."""
    buffers = [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]
    return [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the driver (CUDA; nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
