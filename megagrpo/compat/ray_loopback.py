"""A local Ray on the loopback interface.

Verified with ray 2.60.0. ``ray.init()`` without an address takes the node's address from
``ray._private.services.get_node_ip_address``, which is the machine's outward address unless
``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` is false (Ray's own switch for machines it does
not cluster, read once from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` at import); Ray's servers (GCS,
raylet, object manager, workers) listen on that address. Reason: a local run serves no other
machine, so none of its ports should be reachable from one. ``local_ray_on_loopback`` sets the
switch to false for the ``ray.init`` call only and restores it on exit; where Ray has no such
constant, nothing is patched (and the caller is told).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def local_ray_on_loopback() -> Iterator[bool]:
    """Within the block, a local ``ray.init()`` puts its node on 127.0.0.1; yields whether it will."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        yield False
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield True
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
