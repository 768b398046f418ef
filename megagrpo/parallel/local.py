"""Run a function on N local ranks (one process each) and collect what each returns.

For single-node CPU jobs, the multi-rank tests and the benchmarks; multinode runs go through Ray
or torchrun (see ``launch/``). Each rank gets the torchrun environment variables, so code inside
calls ``init_parallel`` exactly as it would under torchrun. The rendezvous store is this process's:
made before the ranks start, on a port the OS picks as it binds it, kept until they end
(``megagrpo.compat.torch_store.rendezvous_at_hosted_store``), so that worlds started at once by
several processes never reach for the same port.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed
import torch.multiprocessing as mp

from megagrpo.compat.torch_store import HOSTED_STORE_VAR, bound_tcp_store, rendezvous_at_hosted_store

_LEFT_OPEN: list = []
"""Stores of worlds that ``run_in_this_process`` left initialized (kept for this process's life)."""


def node_ip() -> str:
    """This node's address as other nodes reach it (Ray's view inside a Ray cluster)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def free_port() -> int:
    """A port that was free a moment ago. Racy: it is let go of before its user binds it, and any
    process may take it meanwhile (as a server, or as the source port of an outgoing connection); for
    servers whose port must be known before they exist. ``host_store`` binds in place."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_store(host: str, world_size: int, timeout_s: float):
    """The rendezvous store server of a world about to start, listening on ``host`` at a port the OS
    picks as it binds; the world's ranks join it as clients (``hosted_store_env``) while it lives."""
    return bound_tcp_store(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s))


def hosted_store_env(host: str, port: int) -> dict[str, str]:
    """The environment of a rank whose rendezvous is at the store ``host_store`` made at ``host:port``
    (within ``rendezvous_at_hosted_store``)."""
    return {"MASTER_ADDR": host, "MASTER_PORT": str(port), HOSTED_STORE_VAR: f"{host}:{port}"}


def _rank_main(
    fn: Callable, rank: int, world_size: int, port: int, args: tuple, results, timeout_s: float
) -> None:
    # A hung collective shows up as every rank's stack on stderr just before the parent gives up.
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 2.0), exit=False)
    # These ranks are a world of their own, also when spawned by a torchrun rank (the HF export at the
    # end of `megagrpo sft`): with torchrun's agent-store flag inherited, the env:// rendezvous would
    # wait as a client at the outer agent's port for a store that is not this world's.
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(key, None)
    os.environ.update(_rank_env(rank, world_size, port))
    try:
        # Plain pickle (bytes), not torch's shared-memory tensor passing: the rank exits right
        # after, and shared tensors would die with it.
        with rendezvous_at_hosted_store():
            result = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        **hosted_store_env("127.0.0.1", port),
    )


def run_in_this_process(fn: Callable, *args: Any) -> Any:
    """``fn(0, 1, *args)`` as the only rank, here: no process start-up and no second import of torch
    and Megatron (seconds). For command-line tools, which exit afterwards: whatever global state
    ``fn`` leaves behind stays in this process.
    """
    saved = {key: os.environ.get(key) for key in _rank_env(0, 1, 0)}
    store = host_store("127.0.0.1", 1, 600.0)
    os.environ.update(_rank_env(0, 1, store.port))
    try:
        with rendezvous_at_hosted_store():
            return fn(0, 1, *args)
    finally:
        if torch.distributed.is_initialized():
            _LEFT_OPEN.append(store)  # the world ``fn`` left behind still uses it
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_local_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (module level). A rank that raises, dies or exceeds ``timeout_s``
    stops all ranks and raises ``RuntimeError`` carrying the failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = host_store("127.0.0.1", world_size, timeout_s)
    port = store.port
    # Not daemonic: ranks may start processes of their own (Megatron's checkpoint writer does);
    # the finally block below reaps them instead.
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, args, results, timeout_s))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died without reporting (segfault, OOM kill) ends the job now.
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in collected]
                if dead and results.empty():
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RuntimeError(
                        f"rank(s) {dead} exited without a result (exit codes {codes})"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"local ranks timed out after {timeout_s:.0f}s (ranks done: {sorted(collected)})"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            collected[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(collected) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        del store  # its server stops once no rank is left to use it
    return [collected[r] for r in range(world_size)]
