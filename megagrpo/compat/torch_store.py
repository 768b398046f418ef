"""torch.distributed's rendezvous store listening on its host's address only.

Verified with torch 2.13.0. The server of a ``TCPStore`` (rank 0 of every process group's
rendezvous) listens on every interface of the machine, whatever host name it is given; its
``master_listen_fd`` argument takes a socket bound by the caller instead. ``bound_tcp_store``
makes one listening on the given host only. ``stores_listen_on_their_host`` has the ``env://``
and ``tcp://`` rendezvous (``torch.distributed.rendezvous._create_c10d_store``: ours through
``init_process_group``, and vLLM's) create their servers that way. Reason: on a local run the
host is 127.0.0.1 and no port should be reachable from another machine; on a cluster the host is
the node's address, where the peers connect anyway. Restored on exit; where torch has no such
function, nothing is patched. Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) the
ranks are clients and nothing changes.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib
import socket
from collections.abc import Iterator


def bound_tcp_store(
    host: str,
    port: int,
    world_size: int,
    *,
    is_master: bool,
    timeout: datetime.timedelta,
    multi_tenant: bool = False,
):
    """A ``TCPStore`` at ``host:port``; the server (``is_master``) listens on ``host`` only.
    ``multi_tenant``: as torch's own: later multi-tenant stores of this process at the same port
    share this one's server."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    # The store's server owns the descriptor from here on (and closes it).
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=multi_tenant,
        master_listen_fd=sock.detach(),
    )


@contextlib.contextmanager
def stores_listen_on_their_host() -> Iterator[bool]:
    """Within the block, rank 0 of an ``env://`` or ``tcp://`` rendezvous hosts a store listening on
    the rendezvous host only; yields whether the patch is in effect."""
    # The module: ``torch.distributed.rendezvous`` as an attribute is a function of that name.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = getattr(rendezvous, "_create_c10d_store", None)
    agent_store = getattr(rendezvous, "_torchelastic_use_agent_store", None)
    if original is None or agent_store is None:
        yield False
        return

    def create(hostname, port, rank, world_size, timeout, use_libuv=True):
        if rank != 0 or agent_store():
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        try:
            # Multi-tenant like torch's own, so that a later rendezvous at this port shares it.
            return bound_tcp_store(
                hostname, port, world_size, is_master=True, timeout=timeout, multi_tenant=True
            )
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            # This process may already serve the port (torch then shares that server).
            return original(hostname, port, rank, world_size, timeout, use_libuv)

    rendezvous._create_c10d_store = create
    try:
        yield True
    finally:
        rendezvous._create_c10d_store = original
