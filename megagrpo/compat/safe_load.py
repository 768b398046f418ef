"""``torch.save`` archives from a checkpoint someone handed over, loaded so that nothing in them runs.

Verified with torch 2.13.0, Megatron-Core 0.16.1. Every archive goes through two gates:

1. Its pickle's globals (the functions and classes it would call) are read without running anything
   (``pickletools``) and must all be in the allow-list of the kind of entry it is; a pickle that
   computes the names it calls (``STACK_GLOBAL``: ``torch.save`` never writes one) is refused.
2. Then ``torch.load(weights_only=True)``: torch's own restricted unpickler, which also refuses what
   is not in *its* list (which Megatron widens at import: ``megatron.core.safe_globals``).

A refusal is an :class:`UntrustedCheckpointError` naming the file and the entry.

What a Megatron ``_extra_state`` entry holds (a list: one item per object Megatron stored under the
key) is checked against what the layers we build put there:

- Megatron's local and our ``torch`` layers (its tensor-parallel linears): ``None``
  (``get_extra_state`` returns None; a checkpoint written here holds ``[None]`` per entry);
- Transformer Engine without fp8, as read in TE's ``module/base.py``
  (``TransformerEngineBaseModule.get_extra_state``): 2.x returns an empty ``uint8`` tensor
  (``torch.empty(0, dtype=torch.uint8)``), 2.0 a ``uint8`` tensor of ``pickle.dumps(None)``, 1.x an
  ``io.BytesIO`` of ``torch.save(None)``.

TE's fp8 state (scales, amax histories and the fp8 recipe object) is refused: TE's
``set_extra_state`` unpickles the tensor form with plain ``pickle.loads``, which no check here could
make safe short of re-implementing TE's format, and megagrpo never trains in fp8, so a checkpoint it
wrote holds none.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

# The storages torch.save names for tensors of each dtype (torch 2.13 writes the typed names).
_STORAGES = frozenset(
    f"torch.{name}Storage"
    for name in (
        "Double",
        "Float",
        "Half",
        "BFloat16",
        "Long",
        "Int",
        "Short",
        "Char",
        "Byte",
        "Bool",
        "ComplexFloat",
        "ComplexDouble",
    )
)
TENSORS = _STORAGES | {"torch._utils._rebuild_tensor_v2", "collections.OrderedDict"}
"""A tensor (or containers of tensors and plain values): a weight chunk, rollouts, Adam's state."""
EXTRA_STATE = TENSORS | {"_io.BytesIO", "_codecs.encode"}
"""What a Megatron ``_extra_state`` entry may name (TE 1.x stores an ``io.BytesIO``)."""


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds something a checkpoint this project loads never holds."""


def globals_named(data: bytes, where: str) -> set[str]:
    """The ``module.name`` globals a pickle calls, read without unpickling it."""
    found = set()
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                module, name = str(arg).split(" ", 1)
                found.add(f"{module}.{name}")
            elif op.name in ("STACK_GLOBAL", "EXT1", "EXT2", "EXT4"):
                raise UntrustedCheckpointError(
                    f"{where}: the pickle computes what it calls ({op.name}); torch.save never writes that"
                )
    except (ValueError, EOFError) as err:
        raise UntrustedCheckpointError(f"{where}: not a readable pickle ({err})") from None
    return found


def _record(source: BinaryIO, where: str) -> bytes:
    try:
        return bytes(torch._C.PyTorchFileReader(source).get_record("data.pkl"))
    except RuntimeError:
        raise UntrustedCheckpointError(f"{where}: not a torch.save archive") from None


def load_archive(source: BinaryIO | bytes, where: str, allowed: frozenset[str] = TENSORS) -> Any:
    """What a ``torch.save`` archive holds, after its globals were checked against ``allowed``,
    through ``torch.load(weights_only=True)``. ``where`` (the file, and the entry) names it in errors."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    start = source.tell()
    names = globals_named(_record(source, where), where)
    refused = sorted(names - allowed)
    if refused:
        raise UntrustedCheckpointError(
            f"{where}: refusing to load {refused[0]}: this entry of a checkpoint holds only "
            "tensors and plain values (a crafted pickle can run code when loaded)"
        )
    source.seek(start)
    extra = [io.BytesIO] if "_io.BytesIO" in allowed else []
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UntrustedCheckpointError(f"{where}: refused by torch's restricted loader ({first})") from None


def load_file(path: str | Path, allowed: frozenset[str] = TENSORS, entry: str | None = None) -> Any:
    """``load_archive`` of a whole file."""
    where = f"{path}" if entry is None else f"{path}: entry {entry}"
    with open(path, "rb") as file:
        return load_archive(file, where, allowed)


class _NothingUnpickler(pickle.Unpickler):
    """Plain values only: a pickle that names any function or class is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"names {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("names a persistent id")


def _holds_none(data: bytes) -> bool:
    try:
        return _NothingUnpickler(io.BytesIO(data)).load() is None
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError):
        return False


def _extra_state_item_ok(item: Any) -> bool:
    if item is None:
        return True
    if isinstance(item, torch.Tensor):
        if type(item) is not torch.Tensor or item.dtype != torch.uint8 or item.dim() != 1:
            return False
        return item.numel() == 0 or _holds_none(item.numpy().tobytes())
    if isinstance(item, io.BytesIO):
        try:
            return load_archive(item.getvalue(), "extra state", frozenset()) is None
        except UntrustedCheckpointError:
            return False
    return False


def check_extra_state(value: Any, where: str) -> None:
    """Refuse a Megatron ``_extra_state`` value other than the non-fp8 forms in the module doc."""
    if not isinstance(value, list) or not all(_extra_state_item_ok(item) for item in value):
        kinds = [type(item).__name__ for item in value] if isinstance(value, list) else type(value).__name__
        raise UntrustedCheckpointError(
            f"{where}: extra state holds {kinds}; a layer's extra state loads only as None or "
            "Transformer Engine's empty (non-fp8) state (fp8 scaling state is not loaded: Transformer "
            "Engine unpickles it unchecked, and megagrpo does not train in fp8)"
        )


@contextlib.contextmanager
def refusals_as(error: type[Exception]) -> Iterator[None]:
    """An :class:`UntrustedCheckpointError` in the block is re-raised as ``error`` (same message)."""
    try:
        yield
    except UntrustedCheckpointError as err:
        raise error(str(err)) from None
