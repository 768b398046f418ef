"""Many cases on one spawned world: a dist test module's cases share one spawn per world size.

A spawn and Megatron's import cost seconds per rank, more than the tiny model's step; so a module lists its
cases (``{name: (fn, *args)}``), runs them all on one world (``run_cases``), and each test reads its case's
result (``case``). Each case builds its own workers; its layout is torn down before the next one
(``destroy_parallel(keep_world=True)``: the gloo world stays, no second rendezvous). A case that raises
fails its own test only, with its traceback.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest

from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks


@dataclasses.dataclass(frozen=True)
class CaseFailed:
    traceback: str


def _run_cases(rank: int, world_size: int, cases: dict[str, tuple]) -> dict:
    out = {}
    for name, (fn, *args) in cases.items():
        try:
            out[name] = fn(*args)
        except Exception:
            out[name] = CaseFailed(traceback.format_exc())
        finally:
            destroy_parallel(keep_world=True)
    return out


def run_cases(world_size: int, cases: dict[str, tuple], timeout_s: float = 1200.0) -> list[dict]:
    """``[{name: fn(*args)} for each rank]``: every case in order, on ``world_size`` spawned ranks."""
    return run_local_ranks(_run_cases, world_size, cases, timeout_s=timeout_s)


def case(results: list[dict], name: str) -> list:
    """Case ``name``'s result on every rank of its world; the test fails with the case's traceback."""
    got = [res[name] for res in results]
    for res in got:
        if isinstance(res, CaseFailed):
            pytest.fail(f"case {name} failed:\n{res.traceback}")
    return got


def sums_in_fresh_worlds(rank: int, world_size: int, worlds: int = 2) -> list[int]:
    """On each rank: ``worlds`` default groups made and destroyed in turn, each all-reducing
    ``rank + 1 + 10 * i``. Every world after the first meets the same hosted store again
    (``parallel.local``): its keys must not be the first's."""
    import torch
    import torch.distributed as dist

    sums = []
    for i in range(worlds):
        dist.init_process_group("gloo")
        value = torch.tensor([rank + 1 + 10 * i])
        dist.all_reduce(value)
        sums.append(int(value))
        dist.destroy_process_group()
    return sums
