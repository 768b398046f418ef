"""The torch layers on CUDA: the kernels the CPU tiers cannot run (flash SDPA with grouped K/V heads,
``varlen_attn`` over packed rows) against per-sequence SDPA, and the policy's logprobs with the torch
layers against the local layers'."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import policy_batch, policy_config

from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks

pytestmark = pytest.mark.gpu

HEADS, GROUPS, HEAD_DIM = 12, 2, 128  # Qwen2-1.5B's attention


def _attention():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megagrpo.models.torch_layers import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        normalization="RMSNorm",
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    return SDPAttention(config, 1, AttnMaskType.causal, "self")


def test_varlen_packed_rows_equal_sequences_alone_in_bf16():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megagrpo.models import torch_layers

    lengths = [700, 1500, 33, 1862]
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(heads):
        return torch.randn(total, heads, HEAD_DIM, device="cuda", generator=gen).bfloat16().requires_grad_()

    q, k, v = rand(HEADS), rand(GROUPS), rand(GROUPS)
    assert torch_layers._varlen_available(q)  # the path under test is the varlen kernel
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    attention = _attention()
    packed = attention(q, k, v, attention_mask=None, packed_seq_params=params)  # [t, heads * d]
    packed.float().square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    alone = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        seq = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, heads, len, d]
        alone.append(attention._sdpa(*seq, 0.0)[0].transpose(0, 1).reshape(end - start, -1))
    alone = torch.cat(alone)
    alone.float().square().sum().backward()
    torch.testing.assert_close(packed, alone, atol=2e-2, rtol=2e-2)
    for got, x in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, x.grad, atol=5e-2, rtol=5e-2)


def _logprobs(rank: int, world_size: int, cfg) -> torch.Tensor:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        assert worker.engine.transformer_impl == cfg.resolved.transformer_impl
        return worker.logprobs(policy_batch())
    finally:
        destroy_parallel()


def test_torch_layers_give_the_local_layers_logprobs_on_cuda(tmp_path):
    hf_dir = str(make_tiny_hf("qwen2", tmp_path / "qwen2"))
    got = {}
    for layers in ("local", "torch"):
        cfg = policy_config(hf_dir, extra=("parallel.backend=auto", f"parallel.transformer_impl={layers}"))
        (got[layers],) = run_local_ranks(_logprobs, 1, cfg, timeout_s=600)
    mask = policy_batch().response_mask()
    torch.testing.assert_close(got["torch"][mask], got["local"][mask], atol=1e-4, rtol=1e-4)
