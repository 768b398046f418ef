"""Activation memory: the bytes autograd keeps for the backward pass, measured on any device.

``SavedActivations`` is a ``torch.autograd.graph.saved_tensors_hooks`` context: every tensor an op
saves for its backward is counted, once per storage (views of one buffer share it), while the graph
holds it, and the peak of that total is what a training step needs for activations. Parameters
(weights saved by the linears) are not activations and are left out. Recompute shows as what it
is: a checkpointed region saves only its inputs (it runs without grad), then saves its activations
again, one region at a time, during the backward pass.
"""

from __future__ import annotations

import torch


class _Held:
    """What the graph holds in place of a saved tensor; its release is the tensor's release."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedActivations):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class SavedActivations:
    """``with SavedActivations(model) as act: step()`` then ``act.peak_bytes``."""

    def __init__(self, *modules: torch.nn.Module):
        self._params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, references]
        self.current_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self._params or tensor.numel() == 0:
            return tensor
        entry = self._live.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.current_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[1] += 1
        return _Held(tensor, key, self)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current_bytes -= entry[0]
            del self._live[key]

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
