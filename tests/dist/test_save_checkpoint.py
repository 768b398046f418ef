"""The one checkpoint writer on the SPMD ranks of a trainer-only job (two gloo processes, each with its
own worker): a write that fails on one rank leaves no half-written checkpoint, and every rank takes the
same decision that ``checkpoint.on_error`` asks for (stop: CheckpointWriteError everywhere; continue:
None everywhere), so no rank is left waiting in a collective."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch.distributed as dist
from rank_cases import case, run_cases

from megagrpo.ckpt import manifest
from megagrpo.ckpt.run import CheckpointWriteError
from megagrpo.config import load_config
from megagrpo.runtime.spmd import LocalGroup
from megagrpo.trainers.checkpoints import save_checkpoint

pytestmark = pytest.mark.dist


class ShardWriter:
    """A worker whose ``save`` writes this rank's shard (and fails with ENOSPC on ``failing_rank``)."""

    def __init__(self, failing_rank: int | None):
        self.failing_rank = failing_rank

    def save(self, path: str) -> dict:
        rank = dist.get_rank()
        if rank == self.failing_rank:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        (Path(path) / "megatron").mkdir(parents=True, exist_ok=True)
        (Path(path) / "megatron" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 100)
        return {}


def _save_twice(root: str, on_error: str) -> list:
    """Step 1 written by both ranks, then step 2 with rank 1's write failing: what each rank saw."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cfg = load_config(None, [f"checkpoint.dir={root}", f"checkpoint.on_error={on_error}"])
    seen = [save_checkpoint(cfg, LocalGroup(ShardWriter(None)), ShardWriter.save, 1, 8)]
    try:
        seen.append(save_checkpoint(cfg, LocalGroup(ShardWriter(1)), ShardWriter.save, 2, 16))
    except CheckpointWriteError as err:
        seen.append(f"stopped: {err}")
    dist.barrier()  # every rank got here: none is stuck in the writer's collectives
    return seen


ON_ERROR = ("stop", "continue")


@pytest.fixture(scope="module")
def decisions(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(checkpoint root by ``on_error``'s value, what each rank saw): both settings on one spawn of two
    ranks (``rank_cases``)."""
    root = tmp_path_factory.mktemp("save_checkpoint")
    return root, run_cases(
        2, {on_error: (_save_twice, str(root / on_error / "ckpt"), on_error) for on_error in ON_ERROR}
    )


@pytest.mark.parametrize("on_error", ON_ERROR)
def test_a_write_failing_on_one_rank_is_one_decision_on_every_rank(on_error, decisions):
    root, results = decisions
    root = root / on_error / "ckpt"
    seen = case(results, on_error)
    assert [s[0] for s in seen] == [root.absolute() / "step_1"] * 2
    manifest.verify(root / "step_1")
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]  # step 2's partial write is gone
    second = [s[1] for s in seen]
    if on_error == "stop":
        assert all(
            isinstance(s, str) and s.startswith("stopped: checkpoint step_2 could not be written")
            for s in second
        )
        assert all(
            "No space left on device" in s and "the latest checkpoint is still step_1" in s for s in second
        )
    else:
        assert second == [None, None]
