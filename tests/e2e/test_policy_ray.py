"""The policy as a Ray actor group: same numbers as the same ranks run without Ray."""

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import policy_batch, policy_config

from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks
from megagrpo.policy.worker import PolicyWorker

pytestmark = pytest.mark.e2e


def _local_step(rank: int, world_size: int, cfg) -> dict:
    worker = PolicyWorker(cfg)
    try:
        batch = policy_batch()
        old = worker.logprobs(batch)
        return {"old": old, "metrics": worker.train(batch.replace(old_logprobs=old))}
    finally:
        destroy_parallel()


def test_ray_rank_group_matches_local_ranks(tmp_path):
    import ray

    from megagrpo.cluster import RankGroup, start_ray

    hf_dir = str(make_tiny_hf("qwen2", tmp_path / "qwen2"))
    cfg = policy_config(hf_dir, tp=2)
    local = run_local_ranks(_local_step, 2, cfg, timeout_s=300)[0]

    start_ray(cfg.cluster, num_cpus=2)
    try:
        group = RankGroup(cfg, PolicyWorker, timeout_s=300)
        batch = policy_batch()
        old = group.call_first(PolicyWorker.logprobs, batch)
        per_rank = group.call_all(PolicyWorker.train, batch.replace(old_logprobs=old))
        group.shutdown()
    finally:
        ray.shutdown()
    mask = batch.response_mask()
    torch.testing.assert_close(old[mask], local["old"][mask], atol=1e-6, rtol=1e-6)
    assert per_rank[0] == per_rank[1]  # every rank reports the same metrics
    (got,), (want,) = per_rank[0], local["metrics"]
    assert abs(got.loss - want.loss) <= 1e-6 * abs(want.loss)
    assert abs(got.grad_norm - want.grad_norm) <= 1e-6 * want.grad_norm
