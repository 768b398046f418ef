"""The policy worker on CUDA (NCCL, one rank): train, save, load and export, as on CPU.

The CPU tiers run the same code over gloo; this is the path the device actually takes: parameters
and the distributed optimizer on the GPU, Megatron's groups on NCCL (no gloo side groups), the
checkpoint writer copying GPU tensors out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import load_then_continue, policy_batch, policy_config

from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.gpu


def _train_save_continue(rank: int, world_size: int, cfg, path: str) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        ctx = worker.ctx
        assert (ctx.device.type, ctx.backend) == ("cuda", "nccl"), (ctx.device, ctx.backend)
        assert all(p.is_cuda for p in worker.engine.module.parameters())
        batch = policy_batch()
        before = worker.logprobs(batch)
        (first,) = worker.train(batch.replace(old_logprobs=before))
        worker.save(path)
        saved = worker.logprobs(batch)
        next_batch = policy_batch(seed=1)
        following = worker.train(next_batch.replace(old_logprobs=worker.logprobs(next_batch)))
        return {"before": before, "first": first, "saved": saved, "next": following}
    finally:
        destroy_parallel()


def test_train_save_load_export_on_cuda(tmp_path):
    hf_dir = str(make_tiny_hf("qwen2", tmp_path / "qwen2"))
    cfg = policy_config(hf_dir, extra=("parallel.backend=auto",))  # the shared cases pin gloo
    ckpt = str(tmp_path / "step")
    (saved,) = run_local_ranks(_train_save_continue, 1, cfg, ckpt, timeout_s=600)
    mask = policy_batch().response_mask()
    first = saved["first"]
    assert first.ratio_mean == 1.0 and first.clip_low_frac == 0.0  # on-policy first step
    assert (saved["saved"][mask] - saved["before"][mask]).abs().max() > 1e-3  # the step moved it
    (loaded,) = run_local_ranks(load_then_continue, 1, cfg, ckpt, timeout_s=600)
    assert loaded["steps"] == 1
    torch.testing.assert_close(loaded["loaded"][mask], saved["saved"][mask], atol=1e-5, rtol=1e-5)
    (got,), (want,) = loaded["next"], saved["next"]
    assert abs(got.loss - want.loss) <= 1e-5 * max(abs(want.loss), 1e-12)
    assert abs(got.grad_norm - want.grad_norm) <= 1e-4 * max(abs(want.grad_norm), 1e-12)

    from megagrpo.ckpt.convert import megatron_to_hf

    out = megatron_to_hf(ckpt, tmp_path / "hf")
    assert (Path(out) / "model.safetensors").is_file()
