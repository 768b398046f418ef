"""The policy as a Ray actor group: same numbers as the same ranks run without Ray; a rank that dies
is named with its node."""

import os
import signal

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


@pytest.fixture(scope="module")
def ray_group(tmp_path_factory):
    """(config, a TP=2 policy group on a local Ray, its CPU threads before ``ready()``); Ray is shut
    down after the module. The group is started as the driver starts it: without waiting for the
    ranks' set-up (the engines start meanwhile)."""
    import ray

    from megagrpo.runtime.groups import RankGroup
    from megagrpo.runtime.ray_session import shutdown_ray, start_ray

    cfg = policy_config(str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("ray") / "qwen2")), tp=2)
    start_ray(cfg.cluster, num_cpus=2)
    try:
        group = RankGroup(cfg, PolicyWorker, timeout_s=300, wait=False)
        before = list(group.cpu_threads)
        yield cfg, group.ready(), before
    finally:
        shutdown_ray()
    assert not ray.is_initialized()


def test_ray_rank_group_matches_local_ranks(ray_group):
    cfg, group, threads_before_ready = ray_group
    assert threads_before_ready == [] and group.cpu_threads == [1, 1]  # set up, one core per rank
    local = run_local_ranks(_local_step, 2, cfg, timeout_s=300)[0]
    batch = policy_batch()
    old = group.call_first(PolicyWorker.logprobs, batch)
    per_rank = group.call_all(PolicyWorker.train, batch.replace(old_logprobs=old))
    mask = batch.response_mask()
    torch.testing.assert_close(old[mask], local["old"][mask], atol=1e-6, rtol=1e-6)
    assert per_rank[0] == per_rank[1]  # every rank reports the same metrics
    (got,), (want,) = per_rank[0], local["metrics"]
    assert abs(got.loss - want.loss) <= 1e-6 * abs(want.loss)
    assert abs(got.grad_norm - want.grad_norm) <= 1e-6 * want.grad_norm


def test_a_dead_rank_is_named_with_its_node(ray_group):
    """Runs last in this module: it kills a rank of the group."""
    from ray._private.worker import get_dashboard_url

    from megagrpo.runtime.faults import RankFailure

    _, group, _ = ray_group
    assert get_dashboard_url() == ""  # a local Ray starts no dashboard
    node = group.nodes[1]
    assert node.startswith("127.0.0.1 (pid ")  # a local Ray is on the loopback interface
    os.kill(int(node.rsplit("pid ", 1)[1].rstrip(")")), signal.SIGKILL)
    with pytest.raises(RankFailure) as failure:
        group.call_all(PolicyWorker.logprobs, policy_batch())
    # "died", not "did not answer within <timeout_s>": the death was seen, not waited out.
    assert f"policy rank 1 on {node} died: " in str(failure.value)
