"""Run a function on N local ranks (one process each) and collect what each returns.

For single-node CPU jobs, the multi-rank tests and the benchmarks; multinode runs go through Ray
or torchrun (see ``launch/``). Each rank gets the torchrun environment variables, so code inside
calls ``init_parallel`` exactly as it would under torchrun.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable, rank: int, world_size: int, port: int, args: tuple, results, timeout_s: float
) -> None:
    # A hung collective shows up as every rank's stack on stderr just before the parent gives up.
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 2.0), exit=False)
    # These ranks are a world of their own, also when spawned by a torchrun rank (the HF export at the
    # end of `megagrpo sft`): with torchrun's agent-store flag inherited, the env:// rendezvous would
    # wait as a client for a store server that nobody starts at this port.
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(key, None)
    os.environ.update(_rank_env(rank, world_size, port))
    try:
        # Plain pickle (bytes), not torch's shared-memory tensor passing: the rank exits right
        # after, and shared tensors would die with it.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def run_in_this_process(fn: Callable, *args: Any) -> Any:
    """``fn(0, 1, *args)`` as the only rank, here: no process start-up and no second import of torch
    and Megatron (seconds). For command-line tools, which exit afterwards: whatever global state
    ``fn`` leaves behind stays in this process.
    """
    saved = {key: os.environ.get(key) for key in _rank_env(0, 1, 0)}
    os.environ.update(_rank_env(0, 1, free_port()))
    try:
        return fn(0, 1, *args)
    finally:
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
    port = free_port()
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
    return [collected[r] for r in range(world_size)]
