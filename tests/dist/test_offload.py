"""``policy.offload``: the trainer's optimizer, gradient buffers and weights leave the device while the
engines run and come back bit for bit (real Megatron ranks, distributed optimizer, DP 2)."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import policy_batch, policy_config
from rank_cases import case, run_cases

pytestmark = pytest.mark.dist


def _three_steps(cfg, offload: bool) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    freed, metrics, probes = [], [], []
    for step in range(3):
        batch = policy_batch(seed=step)
        metrics += worker.train(batch.replace(old_logprobs=worker.logprobs(batch)))
        if offload:  # as the GRPO loop does around a colocated sync and generation
            sync = worker.offload("sync")
            after_sync = [p.untyped_storage().nbytes() for p in worker.engine.module.parameters()]
            generation = worker.offload("generation")
            parked = [p.untyped_storage().nbytes() for p in worker.engine.module.parameters()]
            freed.append((sync, generation, min(after_sync), max(parked)))
            # The probe, scored with the engines awake: the weights are borrowed and parked again,
            # the optimizer and the gradient buffers stay in host memory.
            probes.append(worker.logprobs(batch))
            again = [p.untyped_storage().nbytes() for p in worker.engine.module.parameters()]
            assert max(again) == 0 and sorted(worker.offloader.parked) == ["grads", "optimizer", "weights"]
            if step == 1:  # else the next train call brings them back by itself
                assert worker.reload() == sync + generation
        else:
            probes.append(worker.logprobs(batch))
    worker.reload()  # the last step's parked states
    weights = {n: p.detach().clone() for n, p in worker.engine.module.named_parameters()}
    return {
        "metrics": [(m.loss, m.grad_norm) for m in metrics],
        "weights": weights,
        "freed": freed,
        "probes": probes,
    }


def test_training_after_offload_and_reload_equals_training_without(tmp_path):
    hf = str(make_tiny_hf("qwen2", tmp_path / "qwen2"))
    extra = ["generation.placement=colocated", "policy.offload=all"]
    cfg = policy_config(hf, dp=2, extra=extra)
    assert cfg.parallel.use_distributed_optimizer
    results = run_cases(2, {"plain": (_three_steps, cfg, False), "moved": (_three_steps, cfg, True)})
    plain, moved = case(results, "plain"), case(results, "moved")  # one spawn for both
    for a, b in zip(plain, moved, strict=True):
        assert a["metrics"] == b["metrics"]  # loss and grad norm, bit for bit, every step
        for plain_probe, borrowed_probe in zip(a["probes"], b["probes"], strict=True):
            assert torch.equal(plain_probe, borrowed_probe)
        for name, tensor in a["weights"].items():
            assert torch.equal(tensor, b["weights"][name]), name
    params = sum(t.numel() for t in plain[0]["weights"].values())
    for sync, generation, weights_at_sync, weights_parked in moved[0]["freed"]:
        # Before the engines wake: Adam's two fp32 moments (the distributed optimizer's half of
        # them on each of the 2 DP ranks) and the fp32 gradient buffer; the weights stay for the sync.
        assert sync >= (2 * 4 * params) // 2 + 4 * params
        assert weights_at_sync > 0
        # Once synced, the fp32 weights too; every parameter's storage is then empty.
        assert generation >= 4 * params and weights_parked == 0
