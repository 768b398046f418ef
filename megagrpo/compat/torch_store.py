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

``rendezvous_at_hosted_store``: within the block, every rank's rendezvous at the store named by
``HOSTED_STORE_VAR`` joins it as a client, none hosts it: the process that started the ranks
(``megagrpo.parallel.local``, a Ray rank group's first actor) created that server on port 0 before
they started, so no port number is picked, let go of and bound again later, when another process may
hold it (a second test process's server, or the source port of any outgoing connection). As torchrun's
agent store does, but keyed by address instead of a process-wide flag, so that a rendezvous of vLLM
or of a nested world elsewhere still hosts its own. Each rendezvous there gets a key prefix of its
own: the store outlives a default group that is destroyed and made again, and torch numbers the second
world's groups from 0 again, so their keys would meet the first's.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib
import itertools
import os
import socket
from collections.abc import Iterator

HOSTED_STORE_VAR = "MEGAGRPO_HOSTED_STORE"
"""``host:port`` of the rendezvous store hosted for this process's world by the process that started it."""


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A socket listening on ``host`` at ``port`` (0: one the OS picks as it binds), for
    ``bound_tcp_store``'s ``listening``: a port held from the moment its number is handed out."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def bound_tcp_store(
    host: str,
    port: int,
    world_size: int,
    *,
    is_master: bool,
    timeout: datetime.timedelta,
    multi_tenant: bool = False,
    listening: socket.socket | None = None,
):
    """A ``TCPStore`` at ``host:port``; the server (``is_master``) listens on ``host`` only.
    ``multi_tenant``: as torch's own: later multi-tenant stores of this process at the same port
    share this one's server. ``listening``: the server's socket, already listening at ``port``
    (``listening_socket``); the server takes it over."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    sock = listening if listening is not None else listening_socket(host, port)
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
        if rank != 0 or agent_store() or _is_hosted(hostname, port):
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


def _is_hosted(hostname: str, port: int) -> bool:
    return os.environ.get(HOSTED_STORE_VAR) == f"{hostname}:{port}"


@contextlib.contextmanager
def rendezvous_at_hosted_store() -> Iterator[None]:
    """Within the block, an ``env://`` or ``tcp://`` rendezvous at ``HOSTED_STORE_VAR``'s address joins
    that store as a client on every rank, under a key prefix per rendezvous; any other one is torch's.
    Refuses where torch has no ``_create_c10d_store``: rank 0 would try to host a store that exists."""
    import torch
    import torch.distributed as dist

    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no rendezvous._create_c10d_store: megagrpo.compat.torch_store "
            "cannot make ranks join the store their launcher hosts"
        )
    joins = itertools.count()  # the same sequence on every rank: rendezvous are collective

    def create(hostname, port, rank, world_size, timeout, use_libuv=True):
        if not _is_hosted(hostname, port):
            return original(hostname, port, rank, world_size, timeout, use_libuv)
        client = dist.TCPStore(
            hostname, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
        return dist.PrefixStore(f"megagrpo/rendezvous{next(joins)}", client)

    rendezvous._create_c10d_store = create
    try:
        yield
    finally:
        rendezvous._create_c10d_store = original
