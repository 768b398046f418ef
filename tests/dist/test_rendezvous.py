"""Worlds of spawned ranks whose rendezvous store their launcher hosts (``megagrpo.parallel.local``):
several started at once from one process, and one started by a rank of another, all come up."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from rank_cases import sums_in_fresh_worlds

from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.dist


def test_worlds_started_at_once_each_come_up():
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_local_ranks, sums_in_fresh_worlds, 2, 2, timeout_s=120) for _ in range(2)]
        assert [run.result() for run in runs] == [[[3, 23], [3, 23]]] * 2


def _outer(rank: int, world_size: int) -> tuple[list, int]:
    # As a torchrun rank would see it: the nested world must not take the outer agent's store.
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="outer")
    dist.init_process_group("gloo")
    nested = run_local_ranks(sums_in_fresh_worlds, 2, 1, timeout_s=120) if rank == 0 else []
    value = torch.tensor([rank + 1])
    dist.all_reduce(value)  # the outer world still works after the nested one ended
    dist.destroy_process_group()
    return nested, int(value)


def test_a_world_started_by_a_rank_of_another_comes_up():
    assert run_local_ranks(_outer, 2, timeout_s=180) == [([[3], [3]], 3), ([], 3)]
