"""The torch layers' modules on their own: SDPA core attention against softmax attention written out,
packed (THD) rows against their sequences one by one, the arguments of the CUDA varlen call under
both of its signatures, and the RMSNorm's sequence-parallel mark."""

import itertools
import math

import pytest
import torch

from megagrpo.models.torch_layers import RMSNorm, SDPAttention

pytestmark = pytest.mark.unit

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        **{"attention_dropout": 0.0, **overrides},
    )


def _attention(**overrides) -> SDPAttention:
    from megatron.core.transformer.enums import AttnMaskType

    return SDPAttention(_config(**overrides), 1, AttnMaskType.causal, "self")


def _reference(q_SBHD, k_SBGD, v_SBGD) -> torch.Tensor:
    """Causal softmax attention, K/V heads repeated per query group: [s, b, heads * d]."""
    s = q_SBHD.shape[0]
    k = k_SBGD.repeat_interleave(q_SBHD.shape[2] // k_SBGD.shape[2], dim=2)
    v = v_SBGD.repeat_interleave(q_SBHD.shape[2] // v_SBGD.shape[2], dim=2)
    scores_BHSS = torch.einsum("qbhd,kbhd->bhqk", q_SBHD, k) / math.sqrt(HEAD_DIM)
    blocked = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores_BHSS.masked_fill(blocked, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(s, q_SBHD.shape[1], -1)


def _qkv(s: int, b: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64).float()
    k = torch.randn(s, b, GROUPS, HEAD_DIM, generator=gen, dtype=torch.float64).float()
    v = torch.randn(s, b, GROUPS, HEAD_DIM, generator=gen, dtype=torch.float64).float()
    return q, k, v


def test_sdpa_is_causal_grouped_query_attention():
    q, k, v = _qkv(s=12, b=3)
    got = _attention()(q, k, v, attention_mask=None)
    assert got.shape == (12, 3, HEADS * HEAD_DIM)
    torch.testing.assert_close(got, _reference(q, k, v), rtol=1e-5, atol=1e-6)
    # Causal: changing the last position's key and value leaves every earlier output as it was.
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 1.0
    v2[-1] -= 1.0
    again = _attention()(q, k2, v2, attention_mask=None)
    torch.testing.assert_close(again[:-1], got[:-1], rtol=0, atol=0)
    assert not torch.allclose(again[-1], got[-1])


def test_no_seq_by_seq_tensor_is_saved_for_backward():
    s = 64
    shapes = []

    def keep_shape(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    q, k, v = (x.requires_grad_() for x in _qkv(s=s, b=2))
    with torch.autograd.graph.saved_tensors_hooks(keep_shape, lambda t: t):
        out = _attention()(q, k, v, attention_mask=None)
    out.sum().backward()
    assert shapes  # the hook saw what autograd keeps
    assert all(shape.count(s) < 2 for shape in shapes), shapes
    assert q.grad is not None and k.grad.abs().sum() > 0


def test_packed_rows_equal_their_sequences_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [5, 9, 2, 7]
    seqs = [_qkv(n, 1, seed=i) for i, n in enumerate(lengths)]
    # THD: [t, heads, d], the sequences end to end.
    q, k, v = (torch.cat([s[i][:, 0] for s in seqs]).requires_grad_() for i in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    packed = _attention()(q, k, v, attention_mask=None, packed_seq_params=params)
    assert packed.shape == (sum(lengths), HEADS * HEAD_DIM)
    alone = torch.cat([_reference(*s)[:, 0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    # Gradients stay inside a sequence: a loss on the first sequence's outputs reaches only its q/k/v.
    packed[: lengths[0]].sum().backward()
    assert k.grad[: lengths[0]].abs().sum() > 0
    assert k.grad[lengths[0] :].abs().sum() == 0 and q.grad[lengths[0] :].abs().sum() == 0


def test_unsupported_attention_is_refused():
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="causal attention only"):
        SDPAttention(_config(), 1, AttnMaskType.padding, "self")
    with pytest.raises(ValueError, match="context-parallel"):
        _attention(context_parallel_size=2)
    with pytest.raises(ValueError, match="sliding window"):
        _attention(window_size=(4, 0))


def test_rms_norm_is_torchs_and_marks_sequence_parallel_weights():
    x = torch.randn(6, 2, HEADS * HEAD_DIM)
    for sp in (False, True):
        config = _config(sequence_parallel=sp, tensor_model_parallel_size=2)
        norm = RMSNorm(config, HEADS * HEAD_DIM, eps=1e-6)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
        torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-6)
        # Megatron's finalize_model_grads all-reduces over TP the weights marked so.
        assert norm.weight.sequence_parallel is sp


def _fake_varlen(with_gqa_switch: bool):
    """A CPU stand-in for ``varlen_attn`` (CUDA-only) with one of its two signatures: causal attention
    per segment, refusing what the real one refuses (no causal flag; fewer K/V heads without the switch)."""

    def attend(query, key, value, cu, cu_k, max_q, max_k, causal, gqa):  # [t, heads, d], [t, kv heads, d]
        assert causal, "called without the causal flag"
        assert cu is cu_k and cu.dtype == torch.int32
        assert max_q == max_k == int((cu[1:] - cu[:-1]).max())
        assert gqa or key.shape[1] == query.shape[1], "K/V with fewer heads without enable_gqa"
        bounds = cu.tolist()
        return torch.cat(
            [
                _reference(*(x[a:b].unsqueeze(1) for x in (query, key, value)))[:, 0]
                for a, b in itertools.pairwise(bounds)
            ]
        ).reshape(query.shape)

    if with_gqa_switch:

        def varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
        ):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, window_size == (-1, 0), enable_gqa)

    else:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, False)

    return varlen_attn


@pytest.mark.parametrize("with_gqa_switch", [True, False], ids=["window-size-enable-gqa", "is-causal"])
def test_varlen_call_follows_the_signature_of_this_torch(monkeypatch, with_gqa_switch):
    # The CUDA path's arguments, checked on the CPU: what the kernel computes is PyTorch's to test.
    import inspect

    from torch.nn.attention import varlen

    from megagrpo.models import torch_layers

    fake = _fake_varlen(with_gqa_switch)
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(
        torch_layers, "_varlen_options", lambda: frozenset(inspect.signature(fake).parameters)
    )
    lengths = [3, 6, 4]
    q, k, v = (x[:, 0] for x in _qkv(sum(lengths), 1, seed=5))  # THD
    cu = torch.tensor([0, 3, 9, 13], dtype=torch.int32)
    got = _attention()._varlen(q, k, v, cu, max(lengths))
    alone = torch.cat(
        [_reference(*(x[a:b].unsqueeze(1) for x in (q, k, v)))[:, 0] for a, b in ((0, 3), (3, 9), (9, 13))]
    )
    torch.testing.assert_close(got.reshape(sum(lengths), -1), alone, rtol=1e-5, atol=1e-6)
