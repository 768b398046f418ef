"""CUDA IPC handles of a tensor's memory, as plain values (no pickle).

Verified with torch 2.13.0. Torch exports a CUDA allocation to another process through the
storage methods ``UntypedStorage._share_cuda_`` (the sender: device index, the cudaIpcMemHandle as
bytes, sizes and offsets, the handles of its reference counter and of the event that orders the
first use) and ``UntypedStorage._new_shared_cuda`` (the receiver: maps it). They are what
``torch.multiprocessing.reductions`` calls when a CUDA tensor is pickled; that module's pickled form
carries classes and a rebuild function, which a receiver would have to unpickle from the wire.
Calling the two methods directly keeps the handle a tuple of ints, bytes and a bool, sent as JSON
(``weight_sync.ipc``). The receiver maps the memory onto its own device of the same GPU (devices
are numbered per process under ``CUDA_VISIBLE_DEVICES``; the GPU is matched by its UUID).

Nothing is replaced, so nothing is restored. Where a torch version lacks either method,
:func:`require` says so before any sync starts.

The sender's memory outlives its own tensor while a receiver may still map it: torch counts the
receiver's reference in a shared-memory counter (``ref_handle``, a POSIX shared-memory name; the
int64 at index ``ref_offset``), set to 1 by the export and decremented when the receiver's storage is
freed; until then the sender's allocator keeps the block ("limbo"). A receiver killed while holding
it never decrements: :func:`receiver_references` reads the counter and :func:`release_receiver_reference`
decrements it on the dead receiver's behalf, as torch's own ``UntypedStorage._release_ipc_counter_cuda``
does (the file mapped, the int64 decremented).
"""

from __future__ import annotations

import mmap
import os
import struct

import torch


def require() -> None:
    missing = [
        name for name in ("_share_cuda_", "_new_shared_cuda") if not hasattr(torch.UntypedStorage, name)
    ]
    if missing:
        raise RuntimeError(
            f"this torch has no UntypedStorage.{' / '.join(missing)}: colocated weight sync cannot hand "
            "CUDA memory to the engines (megagrpo.compat.cuda_ipc, verified with torch 2.13)"
        )


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_handle(tensor: torch.Tensor) -> dict:
    """A JSON-able handle to ``tensor``'s whole storage (a contiguous uint8 tensor at offset 0)."""
    require()
    if tensor.dtype != torch.uint8 or tensor.storage_offset() != 0 or not tensor.is_contiguous():
        raise ValueError("export_handle takes a whole, contiguous uint8 tensor")
    (
        device,
        handle,
        size,
        offset,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = tensor.untyped_storage()._share_cuda_()
    return {
        "uuid": device_uuid(torch.device("cuda", device)),
        "handle": bytes(handle).hex(),
        "size": int(size),
        "offset": int(offset),
        "ref_handle": bytes(ref_handle).hex(),
        "ref_offset": int(ref_offset),
        "event_handle": bytes(event_handle).hex() if event_handle else "",
        "event_sync": bool(event_sync),
        "numel": tensor.numel(),
    }


def open_handle(info: dict, device: torch.device) -> torch.Tensor:
    """The uint8 tensor ``info`` exports, mapped into this process on ``device`` (which must be the
    same GPU: checked by UUID)."""
    require()
    if device_uuid(device) != info["uuid"]:
        raise RuntimeError(
            f"CUDA IPC: this process's {device} is GPU {device_uuid(device)}, the sender's memory is on "
            f"GPU {info['uuid']}: a colocated engine must share its trainer rank's GPU"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        bytes.fromhex(info["handle"]),
        info["size"],
        info["offset"],
        bytes.fromhex(info["ref_handle"]),
        info["ref_offset"],
        bytes.fromhex(info["event_handle"]) if info["event_handle"] else None,
        info["event_sync"],
    )
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)[: info["numel"]]


def _counter_path(info: dict) -> str:
    # shm_open names ("/torch_<pid>_...") live in /dev/shm on Linux
    return "/dev/shm/" + bytes.fromhex(info["ref_handle"]).decode().lstrip("/")


def receiver_references(info: dict) -> int | None:
    """References receivers still hold on the memory ``info`` exports (torch's shared counter), or None
    when the counter file is gone (every slot of it released: nothing is held)."""
    try:
        with open(_counter_path(info), "rb") as fh:
            fh.seek(8 * info["ref_offset"])
            raw = fh.read(8)
    except FileNotFoundError:
        return None
    return struct.unpack("<q", raw)[0] if len(raw) == 8 else None


def release_receiver_reference(info: dict) -> None:
    """Drop one receiver's reference on the memory ``info`` exports, for a receiver that can no longer
    drop it itself (its process is gone)."""
    fd = os.open(_counter_path(info), os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as counters:
            at = 8 * info["ref_offset"]
            (value,) = struct.unpack_from("<q", counters, at)
            struct.pack_into("<q", counters, at, value - 1)
    finally:
        os.close(fd)
