"""This process's Ray: join ``cluster.ray_address`` or start a local one, and shut it down.

A local Ray listens on 127.0.0.1 only (``compat.ray_loopback``; its workers form their process groups
on the loopback interface) and does not outlive the driver that started it (``runtime.watchdog``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from megagrpo.compat.ray_loopback import local_ray_on_loopback
from megagrpo.config import ClusterConfig, Config, ConfigError
from megagrpo.runtime import watchdog

# Environment of every Ray worker of a local run: process groups on the loopback interface.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}

_local_session: tuple[Path, Any] | None = None  # (session dir, watchdog) of the Ray this process started


def start_ray(cluster: ClusterConfig, *, num_cpus: int | None = None, cfg: Config | None = None) -> None:
    """Join ``cluster.ray_address`` or start a local Ray; idempotent.

    A local Ray gets at least as many logical CPUs as the job's actors reserve (trainer ranks, engines
    and a distillation teacher's ranks, ``cpus_per_worker`` each): on a small machine they share the
    cores, and a placement group that cannot be satisfied would otherwise wait forever.
    """
    if ray.is_initialized():
        return
    if num_cpus is None and cfg is not None:
        actors = cfg.parallel.world_size + cfg.generation.num_engines
        if cfg.generation.placement == "colocated":  # every rank's bundle holds room for an engine
            actors = 2 * cfg.parallel.world_size
        if cfg.distill.teacher_hf_dir is not None:  # megagrpo distill: the teacher's ranks
            actors += cfg.distill.teacher_world_size
        num_cpus = max(os.cpu_count() or 1, int(actors * cluster.cpus_per_worker + 0.999))
    env = {
        # Our Megatron workers print their own progress; Ray's per-actor log prefixing is enough.
        "RAY_DEDUP_LOGS": "0",
    }
    if "PYTHONWARNINGS" in os.environ:  # the program's filters (compat.upstream_warnings), on every node
        env["PYTHONWARNINGS"] = os.environ["PYTHONWARNINGS"]
    if cluster.ray_address:
        # Joining a cluster only: a local Ray (loopback) writes ~/.ray/auth_token itself, mode 644, and
        # sets RAY_AUTH_MODE=token in its driver's environment, which later child drivers inherit.
        check_ray_token_file()
        ray.init(address=cluster.ray_address, runtime_env={"env_vars": env}, log_to_driver=True)
        return
    env |= {k: v for k, v in LOOPBACK_ENV.items() if k not in os.environ}
    with local_ray_on_loopback():
        context = ray.init(
            # A new local cluster even where `ray start` runs one on this machine (ray.init() would
            # join that one, which refuses num_cpus).
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            num_gpus=cluster.gpus_per_node or None,
            include_dashboard=False,
            runtime_env={"env_vars": env},
            log_to_driver=True,
        )
    global _local_session
    session = Path(context.address_info["session_dir"])
    _local_session = (session, watchdog.claim(session))
    for swept in watchdog.sweep_orphans(session.parent):
        print(f"stopped the processes left by {swept}, the local Ray of a driver that was killed")


def check_ray_token_file(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a Ray token file that group or others may read or write, before Ray reads it.

    With token authentication (``RAY_AUTH_MODE=token``) and no ``RAY_AUTH_TOKEN``, Ray takes the token
    from ``RAY_AUTH_TOKEN_PATH`` (default ``~/.ray/auth_token``, which Ray's own ``ray start`` writes
    with mode 644). A token others could read may already be theirs: ConfigError naming the file, its
    mode and what to do (``launch/ray_auth.sh`` refuses it the same way)."""
    if environ.get("RAY_AUTH_MODE") != "token" or environ.get("RAY_AUTH_TOKEN"):
        return
    path = Path(environ.get("RAY_AUTH_TOKEN_PATH") or Path(environ.get("HOME", "~")) / ".ray" / "auth_token")
    try:
        mode = stat.S_IMODE(path.expanduser().stat().st_mode)
    except FileNotFoundError:
        return  # Ray reports a missing token itself
    if mode & 0o066:
        raise ConfigError(
            "RAY_AUTH_TOKEN_PATH",
            f"the Ray token {path} has mode {mode:o}: group or others may read or replace it, so anyone on "
            "this machine may already hold it; refused. Make a new token (remove the file and start the "
            f"head with launch/ray_head.sh, which writes one with mode 600), or, where no one else could "
            f"have read it, chmod 600 {path}",
        )


def shutdown_ray() -> None:
    """``ray.shutdown``; a local Ray's watchdog is dismissed (its session ended cleanly)."""
    global _local_session
    ray.shutdown()
    if _local_session is not None:
        watchdog.release(*_local_session)
        _local_session = None


def local_session_dir() -> Path | None:
    """The session directory of the local Ray this process started and has not shut down, else None
    (no Ray, or one joined at ``cluster.ray_address``)."""
    return _local_session[0] if _local_session is not None else None
