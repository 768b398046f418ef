"""Our context-parallel split of a row is Megatron's (``get_batch_on_this_cp_rank``), rank by rank."""

import pytest
import torch

from megagrpo.parallel.local import run_local_ranks
from megagrpo.policy.packing import context_parallel_positions

pytestmark = pytest.mark.dist


class _Group:
    """Size and rank of a CP group, which is all Megatron's split reads from it."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _megatron_split(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    dist.init_process_group("gloo")  # Megatron's split is a no-op unless distributed is initialized
    try:
        out = {}
        for cp in (2, 4):
            for r in range(cp):
                row = torch.arange(48).expand(2, -1)
                batch = get_batch_on_this_cp_rank({"tokens": row.clone()}, cp_group=_Group(cp, r))
                out[(cp, r)] = batch["tokens"][0]
        return out
    finally:
        dist.destroy_process_group()


def test_split_matches_megatron():
    (megatron,) = run_local_ranks(_megatron_split, 1, timeout_s=120)
    for (cp, r), positions in megatron.items():
        assert torch.equal(context_parallel_positions(48, cp, r), positions), (cp, r)
