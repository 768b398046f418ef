"""Handing buckets to an engine on the sender's own device: shared slots, not a broadcast.

A colocated engine shares its GPU with a trainer rank, and NCCL refuses two ranks of one
communicator on one device; so the sender gives that engine its buckets through memory both can
map. The sender owns two slots (one allocation, each slot as large as its largest bucket) and packs
bucket n into slot n % 2, exactly as it packs its broadcast buffers; the engine copies the bucket
out into its own receive buffer and acknowledges it, which frees the slot for bucket n + 2. The
memory is exported once, when the sync is set up:

- on GPU by CUDA IPC handle (``compat.cuda_ipc``);
- on CPU as a file in ``/dev/shm`` that both processes map (the same protocol, so the handoff,
  the bucket plan, the engine's load and the probe run here as they would on a GPU).

Messages go through a TCPStore the sender hosts (on its node's address, like a broadcast group's):
``slots`` (the export, JSON), ``opened``, and per bucket ``ready/<plan index>`` (the slot) and
``ack/<plan index>``. Every wait has the sync's timeout, and a timeout names the link and the bucket.
When a link also has engines on other devices, the slot is what the sender broadcasts to them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megagrpo.compat import cuda_ipc
from megagrpo.compat.torch_store import bound_tcp_store
from megagrpo.config import ConfigError

if TYPE_CHECKING:
    from megagrpo.config import Config


@dataclass(frozen=True)
class IpcAddress:
    """Where a link's handoff meets: the sender's store, and the engine that receives by it."""

    address: str
    port: int
    engine: int
    """The engine (its index in the sync) on the sender's device."""


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where PyTorch reads its CUDA allocator's settings (the second is the newer name of the first)."""


def expandable_segments_setting(environ: Mapping[str, str] = os.environ) -> str | None:
    """``NAME=VALUE`` of the allocator variable that turns expandable segments on, else None.

    Memory of expandable segments is exported by CUDA IPC as a POSIX file descriptor that the receiver
    takes from the sender with ``pidfd_getfd``, which an unprivileged container refuses between sibling
    processes (EPERM): the colocated handoff could not open the slots."""
    for name in ALLOC_CONF_VARS:
        for item in environ.get(name, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
                return f"{name}={environ[name]}"
    return None


def expandable_segments_refusal(setting: str) -> str:
    """Why a colocated handoff refuses ``setting`` (from :func:`expandable_segments_setting`), and the fix."""
    name = setting.partition("=")[0]
    return (
        f"{setting} with generation.placement colocated: CUDA IPC exports expandable segments as file "
        "descriptors the engine must take with pidfd_getfd, which unprivileged containers refuse between "
        f"sibling processes (EPERM); remove expandable_segments:True from {name} (or set it False) for "
        "colocated runs, or use generation.placement disaggregated"
    )


def check_colocated_allocator(cfg: Config, environ: Mapping[str, str] = os.environ) -> None:
    """Before any worker starts: colocated engines on GPUs receive the weights by CUDA IPC, which this
    environment's allocator setting (inherited by the trainer ranks of a local Ray) would break.
    ConfigError naming ``generation.placement`` and the variable; each rank checks its own again."""
    if cfg.generation.placement != "colocated" or cfg.cluster.gpus_per_node == 0:
        return
    setting = expandable_segments_setting(environ)
    if setting is not None:
        raise ConfigError(
            ("generation.placement", setting.partition("=")[0]), expandable_segments_refusal(setting)
        )


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class ProcessId:
    """A process as the sender can recognise it later: pid, its start time (a reused pid has another)
    and its pid namespace (pids of another namespace cannot be looked up here)."""

    pid: int
    start: str
    namespace: str

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 on
            namespace = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:
            return None
        if fields[0] == "Z":
            return None  # ended, not yet reaped
        return cls(pid, fields[19], namespace)  # field 22: the start time

    def encode(self) -> str:
        return f"{self.pid} {self.start} {self.namespace}"

    @classmethod
    def decode(cls, text: str) -> ProcessId | None:
        parts = text.split(" ")
        return cls(int(parts[0]), parts[1], parts[2]) if len(parts) == 3 else None

    def ended(self) -> bool | None:
        """Whether the process has ended; None when this process cannot tell (another pid namespace)."""
        if self.namespace != os.readlink("/proc/self/ns/pid"):
            return None
        return ProcessId.of(self.pid) != self


_HELD: list[tuple[ProcessId, dict]] = []
"""CUDA exports of closed senders whose receiver process was still running: its reference is released
here once it ends (``release_ended_receivers``)."""


def hold_until_receiver_ends(receiver: ProcessId, export: dict) -> None:
    _HELD.append((receiver, export))


def release_ended_receivers() -> int:
    """Release the references that receivers which ended (an engine replaced, killed while it mapped
    the slots) still hold on closed senders' memory, so that the allocator frees it (without this, each
    engine restart would keep its two slots, ~1 GiB at 512 MB buckets, for the rest of the run);
    returns how many were released. A receiver that released its own (it closed first) is left alone."""
    released, kept = 0, []
    for receiver, export in _HELD:
        ended = receiver.ended()
        if ended is None:
            continue  # cannot be told: the reference stays, as it would without this
        if not ended:
            kept.append((receiver, export))
            continue
        if (cuda_ipc.receiver_references(export) or 0) > 0:
            cuda_ipc.release_receiver_reference(export)
            released += 1
    _HELD[:] = kept
    if released and torch.cuda.is_available():
        torch.cuda.ipc_collect()  # the freed blocks leave the allocator's limbo now, not at its next miss
    return released


class _Store:
    def __init__(
        self,
        addr: IpcAddress,
        *,
        is_master: bool,
        timeout_s: float,
        name: str,
        listening: socket.socket | None = None,
    ):
        self.timeout_s, self.name = timeout_s, name
        self.store = bound_tcp_store(
            addr.address,
            addr.port,
            2,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=timeout_s),
            listening=listening,
        )

    def put(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def take(self, key: str, what: str) -> bytes:
        """The value of ``key`` once it is set (then deleted); an error naming ``what`` on timeout."""
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:  # torch raises DistStoreError (a RuntimeError) on timeout
            raise TimeoutError(f"{self.name}: {what} did not happen within {self.timeout_s:.0f}s") from err
        value = self.store.get(key)
        self.store.delete_key(key)
        return value


class IpcSender:
    """The sender's side of one link's handoff: the two slots and the messages."""

    def __init__(
        self,
        addr: IpcAddress,
        slot_bytes: int,
        *,
        device: torch.device,
        timeout_s: float,
        name: str,
        listening: socket.socket | None = None,
    ):
        """``listening``: the store's socket, listening at ``addr.port`` since the port was offered;
        None: the port is bound now."""
        self.name, self.slot_bytes, self.device = name, max(slot_bytes, 1), device
        self.store = _Store(addr, is_master=True, timeout_s=timeout_s, name=name, listening=listening)
        total = 2 * self.slot_bytes
        if device.type == "cuda":
            setting = expandable_segments_setting()  # this process's allocator is what exports
            if setting is not None:
                raise RuntimeError(f"{name}: {expandable_segments_refusal(setting)}")
            self.memory = torch.empty(total, dtype=torch.uint8, device=device)
            export = {"kind": "cuda", **cuda_ipc.export_handle(self.memory)}
        else:
            fd, path = tempfile.mkstemp(prefix="megagrpo-sync-", dir=_shm_dir())
            try:
                os.ftruncate(fd, total)
            finally:
                os.close(fd)
            self.memory = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            export = {"kind": "shm", "path": path}
        self.export = export
        self.slots = [self.memory[: self.slot_bytes], self.memory[self.slot_bytes :]]
        self.store.put("slots", json.dumps({**export, "slot_bytes": self.slot_bytes}))
        try:
            opened = self.store.take("opened", f"engine {addr.engine} mapping the slots")
        except TimeoutError:
            if export["kind"] == "cuda":  # the engine never mapped them: its reference is released now
                with contextlib.suppress(OSError):
                    cuda_ipc.release_receiver_reference(export)
            self.memory = self.slots = None
            raise
        finally:
            if export["kind"] == "shm":
                Path(export["path"]).unlink(missing_ok=True)  # both have it mapped: no file left behind
        self.receiver = ProcessId.decode(opened.decode())
        release_ended_receivers()  # an engine this one replaces has ended by now
        self._pending: dict[int, int] = {}  # slot -> plan index whose ack frees it

    def slot(self, n: int) -> torch.Tensor:
        """Slot for this link's ``n``-th bucket of the sync, once the engine is done with its last use."""
        index = self._pending.pop(n % 2, None)
        if index is not None:
            self.store.take(f"ack/{index}", f"the engine's receipt of bucket {index}")
        return self.slots[n % 2]

    def post(self, n: int, index: int, header: tuple[int, int] | None = None) -> None:
        """Bucket ``index`` of the plan is packed in slot ``n % 2``: tell the engine. ``header``: delta
        mode's (count, payload bytes) of what the slot holds (``weight_sync.delta``)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the packing is done before it reads
        self._pending[n % 2] = index
        message = str(n % 2) if header is None else f"{n % 2} {header[0]} {header[1]}"
        self.store.put(f"ready/{index}", message)

    def finish(self) -> None:
        """Wait for the engine's receipt of the sync's last buckets."""
        for slot in sorted(self._pending, key=self._pending.get):
            index = self._pending.pop(slot)
            self.store.take(f"ack/{index}", f"the engine's receipt of bucket {index}")

    def close(self) -> None:
        """Drop the slots. On CUDA their memory is freed once the engine has unmapped it: at once when
        it closed first, else when its process ends (``release_ended_receivers``, also run here)."""
        if self.export["kind"] == "cuda" and self.receiver is not None:
            hold_until_receiver_ends(self.receiver, self.export)
        self._pending = {}
        self.slots = []
        self.memory = None
        self.store = None
        release_ended_receivers()


class IpcReceiver:
    """The engine's side: maps the sender's slots and copies each bucket out of them."""

    def __init__(self, addr: IpcAddress, *, device: torch.device, timeout_s: float, name: str):
        self.name, self.device = name, torch.device(device)
        self.store = _Store(addr, is_master=False, timeout_s=timeout_s, name=name)
        export = json.loads(self.store.take("slots", "the sender exporting its slots"))
        slot_bytes = export["slot_bytes"]
        if export["kind"] == "cuda":
            memory = cuda_ipc.open_handle(export, self.device)
        elif export["kind"] == "shm":
            memory = torch.from_file(export["path"], shared=True, size=2 * slot_bytes, dtype=torch.uint8)
            if self.device.type != "cpu":
                raise RuntimeError(f"{name}: the sender's slots are host memory, this engine is on {device}")
        else:
            raise RuntimeError(f"{name}: unknown slot kind {export['kind']!r}")
        self.slots = [memory[:slot_bytes], memory[slot_bytes:]]
        me = ProcessId.of(os.getpid())
        self.store.put("opened", me.encode() if me is not None else "")

    def receive(self, index: int, out: torch.Tensor) -> torch.Tensor:
        """Bucket ``index`` of the plan, copied into ``out`` (its size); the slot is then released."""
        slot = int(self.store.take(f"ready/{index}", f"bucket {index} from the sender"))
        out.copy_(self.slots[slot][: out.numel()])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.store.put(f"ack/{index}", "1")
        return out

    def receive_encoded(self, index: int, out: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Delta mode: (count, payload) of bucket ``index``, its payload copied into the start of ``out``
        (``IpcSender.post``'s header says how much); the slot is then released."""
        message = self.store.take(f"ready/{index}", f"bucket {index} from the sender")
        slot, count, nbytes = map(int, message.split())
        payload = out[:nbytes]
        payload.copy_(self.slots[slot][:nbytes])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.store.put(f"ack/{index}", "1")
        return count, payload

    def close(self) -> None:
        self.slots = []
        self.store = None
