"""The shared-slot handoff to an engine on the sender's device (CPU: /dev/shm), and how each link
reaches the engines under each placement."""

from __future__ import annotations

import argparse
import dataclasses
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megagrpo.compat import cuda_ipc
from megagrpo.config import ConfigError, load_config
from megagrpo.parallel.local import free_port
from megagrpo.weight_sync.buckets import Bucket
from megagrpo.weight_sync.ipc import (
    IpcAddress,
    IpcReceiver,
    IpcSender,
    ProcessId,
    check_colocated_allocator,
    expandable_segments_setting,
    hold_until_receiver_ends,
    release_ended_receivers,
)
from megagrpo.weight_sync.sync import link_addresses
from megagrpo.weight_sync.transport import Link

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _pair(timeout_s: float = 10.0, slot_bytes: int = 64):
    addr = IpcAddress("127.0.0.1", free_port(), engine=0)
    made = {}
    thread = threading.Thread(
        target=lambda: made.setdefault(
            "sender", IpcSender(addr, slot_bytes, device=CPU, timeout_s=timeout_s, name="link (0, 0, 0)")
        )
    )
    thread.start()
    receiver = IpcReceiver(addr, device=CPU, timeout_s=timeout_s, name="link 0 -> engine 0")
    thread.join()
    return made["sender"], receiver


def test_buckets_arrive_bit_exact_through_two_reused_slots():
    sender, receiver = _pair()
    gen = torch.Generator().manual_seed(0)
    buckets = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (64, 10, 64, 33, 1)]
    indices = [3, 5, 8, 9, 12]  # the link's buckets' places in the plan

    def send():
        for n, (index, data) in enumerate(zip(indices, buckets, strict=True)):
            sender.slot(n)[: data.numel()].copy_(data)  # waits for the slot's last receipt
            sender.post(n, index)
        sender.finish()

    thread = threading.Thread(target=send)
    thread.start()
    got = [
        receiver.receive(index, torch.empty_like(data)).clone()
        for index, data in zip(indices, buckets, strict=True)
    ]
    thread.join(timeout=30)
    assert not thread.is_alive()
    for want, have in zip(buckets, got, strict=True):
        assert torch.equal(want, have)


def test_a_receiver_that_never_acknowledges_is_a_timeout_naming_the_link_and_bucket():
    sender, _receiver = _pair(timeout_s=1.0)
    sender.slot(0)
    sender.post(0, 4)
    with pytest.raises(
        TimeoutError, match=r"link \(0, 0, 0\): the engine's receipt of bucket 4 did not happen"
    ):
        sender.finish()


def test_no_shared_memory_file_is_left_behind():
    sender, receiver = _pair()
    # Both have the memory mapped; the file itself is gone.
    assert sender.memory.numel() == 128 and receiver.slots[0].numel() == 64
    assert sender.export["kind"] == "shm" and not Path(sender.export["path"]).exists()


def _links(ranks: list[int], key_engine_rank: int = 0) -> list[Link]:
    buckets = (Bucket(0, 16),)
    return [
        Link((0, r, key_engine_rank), "10.0.0.1", 1000 + r, buckets, rank=r, ipc_port=2000 + r) for r in ranks
    ]


def test_colocated_links_hand_their_own_engine_the_buckets_and_broadcast_to_the_others():
    groups = link_addresses(_links([0, 1]), engines=2, engine_tp=1, shard_wise=True, colocated=True)
    assert [g.ipc.engine for g in groups] == [0, 1]
    assert [g.ipc.port for g in groups] == [2000, 2001]
    assert [g.engines for g in groups] == [(1,), (0,)]
    assert [g.world_size for g in groups] == [2, 2]
    # Engine 0 takes link 0 by handoff and is rank 1 of link 1's group.
    assert groups[0].ipc_for(0, 0) is not None and groups[0].broadcast_rank(0, 0, 1) is None
    assert groups[1].ipc_for(0, 0) is None and groups[1].broadcast_rank(0, 0, 1) == 1


def test_a_single_colocated_engine_forms_no_group():
    (group,) = link_addresses(_links([0]), engines=1, engine_tp=1, shard_wise=True, colocated=True)
    assert group.world_size == 1 and group.engines == () and group.ipc.engine == 0


def test_disaggregated_gathered_groups_hold_every_worker_of_every_engine():
    (group,) = link_addresses(_links([0], -1), engines=2, engine_tp=2, shard_wise=False, colocated=False)
    assert group.ipc is None and group.world_size == 5
    assert [group.broadcast_rank(e, w, 2) for e in (0, 1) for w in (0, 1)] == [1, 2, 3, 4]


# --- the allocator setting CUDA IPC cannot hand over --------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "found"),
    [
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_CUDA_ALLOC_CONF"),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"},
            "PYTORCH_CUDA_ALLOC_CONF",
        ),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_ALLOC_CONF"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, None),
        ({}, None),
    ],
)
def test_expandable_segments_are_found_in_either_allocator_variable(environ, found):
    setting = expandable_segments_setting(environ)
    assert (setting and setting.partition("=")[0]) == found


def _placed(placement: str, gpus: int):
    cfg = load_config(None)
    return dataclasses.replace(
        cfg,
        generation=dataclasses.replace(cfg.generation, placement=placement),
        cluster=dataclasses.replace(cfg.cluster, gpus_per_node=gpus),
    )


def test_colocated_gpu_runs_refuse_expandable_segments_before_any_worker_starts():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(
        ConfigError,
        match=r"generation.placement, PYTORCH_CUDA_ALLOC_CONF: "
        r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with generation.placement colocated: "
        r".*pidfd_getfd.*EPERM.*remove expandable_segments:True",
    ):
        check_colocated_allocator(_placed("colocated", 8), environ)
    check_colocated_allocator(_placed("disaggregated", 8), environ)  # NCCL broadcasts: no IPC export
    check_colocated_allocator(_placed("colocated", 0), environ)  # CPU: /dev/shm slots
    check_colocated_allocator(
        _placed("colocated", 8), {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    )


def test_a_sender_on_a_cuda_device_refuses_expandable_segments_before_allocating(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    addr = IpcAddress("127.0.0.1", free_port(), engine=3)
    with pytest.raises(RuntimeError, match=r"^link 7: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        IpcSender(addr, 64, device=torch.device("cuda", 0), timeout_s=5.0, name="link 7")


def test_the_benchmark_suite_runs_the_ipc_handoff_without_expandable_segments(monkeypatch, tmp_path):
    from benchmarks import suite

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    seen = {}

    def run(command, cwd, env):
        seen[command[2]] = env
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(suite.subprocess, "run", run)
    args = argparse.Namespace(suite="gpu", quick=True, repeat=None, out=tmp_path)
    suite.run_one(suite.BY_NAME["ipc_handoff"], args)
    suite.run_one(suite.BY_NAME["moe"], args)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in seen["benchmarks.ipc_handoff"]
    assert seen["benchmarks.moe"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# --- an engine replaced after the export: its slots are released ----------------------------------------

_RECEIVER = """
import sys, time, torch
from megagrpo.weight_sync.ipc import IpcAddress, IpcReceiver
r = IpcReceiver(IpcAddress("127.0.0.1", int(sys.argv[1]), engine=0), device=torch.device("cpu"),
                timeout_s=60, name="engine")
time.sleep(600)  # holds the slots mapped until killed, as an engine that failed
"""


def _sync_slots_mapped() -> int:
    return sum("megagrpo-sync-" in line for line in Path("/proc/self/maps").read_text().splitlines())


def _engine(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port)])


def test_an_engine_restart_releases_the_replaced_engines_slots():
    before = _sync_slots_mapped()
    senders = []
    for restart in range(3):
        addr = IpcAddress("127.0.0.1", free_port(), engine=0)
        engine = _engine(addr.port)
        sender = IpcSender(addr, 1 << 20, device=CPU, timeout_s=60, name=f"link, engine generation {restart}")
        assert sender.receiver == ProcessId.of(engine.pid)  # the engine said who holds the slots
        engine.kill()  # the engine fails holding them; a new one replaces it
        engine.wait()
        sender.close()  # as WeightSender.open does before the new engine's link
        senders.append(sender)
        assert _sync_slots_mapped() == before  # the replaced engine's slots are gone, each time
    assert all(s.memory is None for s in senders)


@pytest.fixture
def counter_file():
    """A shared-memory counter file laid out as torch's CUDA IPC reference counters (int64 each), and an
    export naming its counter 2, as ``cuda_ipc.export_handle`` would."""
    name = f"megagrpo-test-counters-{os.getpid()}-{free_port()}"
    path = Path("/dev/shm") / name
    path.write_bytes(struct.pack("<4q", 0, 0, 1, 0))  # the export set its counter to 1: one receiver
    yield path, {"kind": "cuda", "ref_handle": f"/{name}".encode().hex(), "ref_offset": 2}
    path.unlink(missing_ok=True)


def _counter(path: Path) -> int:
    return struct.unpack("<4q", path.read_bytes())[2]


def test_a_receiver_that_ended_holding_cuda_slots_has_its_reference_released_once(counter_file):
    path, export = counter_file
    engine = subprocess.Popen(["sleep", "600"])
    hold_until_receiver_ends(ProcessId.of(engine.pid), export)
    assert release_ended_receivers() == 0 and _counter(path) == 1  # still running: it may still read them
    engine.kill()
    engine.wait()
    assert cuda_ipc.receiver_references(export) == 1
    assert release_ended_receivers() == 1 and _counter(path) == 0  # the allocator may now free them
    assert release_ended_receivers() == 0 and _counter(path) == 0  # never twice


def test_a_receiver_that_released_its_own_reference_is_left_alone(counter_file):
    path, export = counter_file
    engine = subprocess.Popen(["sleep", "600"])
    hold_until_receiver_ends(ProcessId.of(engine.pid), export)
    path.write_bytes(struct.pack("<4q", 0, 0, 0, 0))  # it closed its receiver first
    engine.kill()
    engine.wait()
    assert release_ended_receivers() == 0 and _counter(path) == 0
    other_namespace = ProcessId(os.getpid(), "0", "pid:[1]")  # pids there cannot be looked up here
    assert other_namespace.ended() is None
