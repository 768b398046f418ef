import os

import pytest

from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.unit


def _echo(rank: int, world_size: int, tag: str) -> tuple:
    return (tag, rank, world_size, os.environ["RANK"], os.environ["WORLD_SIZE"])


def _torchrun_vars(rank: int, world_size: int) -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("TORCHELASTIC_")}


def _fail_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom-on-rank-1")
    return rank


def _die_on_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    import time

    time.sleep(60)
    return rank


def test_results_come_back_in_rank_order_with_each_ranks_env():
    """Each spawned rank sees its own RANK and WORLD_SIZE (what ``init_parallel`` reads). A real torchrun
    launch of the trainer commands: tests/dist/test_torchrun.py."""
    assert run_local_ranks(_echo, 2, "x", timeout_s=60) == [("x", 0, 2, "0", "2"), ("x", 1, 2, "1", "2")]


def test_ranks_spawned_from_a_torchrun_rank_do_not_inherit_its_agent_store(monkeypatch):
    """A torchrun rank that spawns ranks of its own (the HF export at the end of ``megagrpo sft``): with
    torchrun's agent-store flag, their rendezvous would wait for a store server nobody starts."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer-job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert run_local_ranks(_torchrun_vars, 2, timeout_s=60) == [{"TORCHELASTIC_RESTART_COUNT": "0"}] * 2


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*KeyError: 'boom-on-rank-1'"):
        run_local_ranks(_fail_on_one, 2, timeout_s=60)


def test_dead_rank_is_reported_without_waiting_for_the_timeout():
    with pytest.raises(
        RuntimeError, match=r"rank\(s\) \[0\] exited without a result \(exit codes \{0: 3\}\)"
    ):
        run_local_ranks(_die_on_zero, 2, timeout_s=600)
