"""The weight-sync transport's deadlines (``megagrpo.weight_sync.transport``), on gloo groups that connect
as NCCL's do, in the first broadcast (``tests/lazy_groups.py``): a group is connected when made, within
the timeout; a member that never joins or never receives ends the wait at the timeout with an error
naming the link and the rank."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from lazy_groups import DeferredBroadcastGroup, DeferredGloo

from megagrpo.compat.torch_store import listening_socket
from megagrpo.parallel.local import free_port
from megagrpo.weight_sync.transport import GroupAddress

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _address() -> GroupAddress:
    return GroupAddress("127.0.0.1", free_port(), 2, None, (0,), None, 0)


def _member(addr: GroupAddress, rank: int, timeout_s: float) -> DeferredBroadcastGroup:
    return DeferredBroadcastGroup(
        addr, rank, backend="gloo", timeout_s=timeout_s, device=CPU, name=f"link (0, 0, 0) member {rank}"
    )


def _pair(timeout_s: float) -> tuple[DeferredBroadcastGroup, DeferredBroadcastGroup]:
    addr, made = _address(), {}
    thread = threading.Thread(target=lambda: made.setdefault(1, _member(addr, 1, timeout_s)))
    thread.start()
    sender = _member(addr, 0, timeout_s)
    thread.join(timeout=30)
    return sender, made[1]


def test_the_fake_connects_in_its_first_broadcast_as_nccl_does():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    group = DeferredGloo(store, 0, 1)
    assert group.connected_by is None  # made, not connected: torch's gloo would be
    group.broadcast([torch.ones(4)], dist.BroadcastOptions()).wait()
    assert group.connected_by == "broadcast"


def test_a_group_is_connected_when_made_and_broadcasts():
    sender, receiver = _pair(timeout_s=20)
    # Connected at set-up (eager_connect_single_device), not by the first broadcast.
    assert (sender.pg.connected_by, receiver.pg.connected_by) == ("eager", "eager")
    data, out = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    posted = receiver.broadcast(out, root=0)
    sender.wait(sender.broadcast(data, root=0), "the broadcast of bucket 0")
    receiver.wait(posted, "receiving bucket 0")
    assert torch.equal(out, data)


def test_a_member_that_never_joins_ends_the_connection_at_the_timeout():
    with pytest.raises(TimeoutError) as err:
        _member(_address(), 0, timeout_s=1)
    assert str(err.value) == (
        "link (0, 0, 0) member 0: connecting did not finish within 1s (generation.sync_timeout_s) at "
        "group rank 0 of 2: a member did not join; the connection was given up"
    )


def test_a_member_that_never_receives_ends_the_broadcast_at_the_timeout_and_aborts_the_group():
    sender, receiver = _pair(timeout_s=1)
    work = sender.broadcast(torch.ones(8, dtype=torch.uint8), root=0)  # the receiver posts nothing
    with pytest.raises(TimeoutError) as err:
        sender.wait(work, "the broadcast of bucket 3")
    assert str(err.value) == (
        "link (0, 0, 0) member 0: the broadcast of bucket 3 did not finish within 1s "
        "(generation.sync_timeout_s) at group rank 0; the group was aborted"
    )
    assert sender.pg is None and receiver.pg is not None


def test_a_sender_takes_over_the_socket_that_held_its_port_since_the_offer():
    """``WeightSender.offer`` hands out ports of sockets already listening; a receiver may connect
    before the sender's store exists, and is served once it does."""
    held = listening_socket("127.0.0.1")
    addr = GroupAddress("127.0.0.1", held.getsockname()[1], 2, None, (0,), None, 0)
    made = {}
    thread = threading.Thread(target=lambda: made.setdefault(1, _member(addr, 1, 20)))
    thread.start()
    sender = DeferredBroadcastGroup(
        addr, 0, backend="gloo", timeout_s=20, device=CPU, name="link (0, 0, 0)", listening=held
    )
    thread.join(timeout=30)
    assert held.fileno() == -1  # the store's server owns the descriptor now
    data, out = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    posted = made[1].broadcast(out, root=0)
    sender.wait(sender.broadcast(data, root=0), "the broadcast of bucket 0")
    made[1].wait(posted, "receiving bucket 0")
    assert torch.equal(out, data)
