import pytest
import torch

from megagrpo.models.layout import is_gated_fc1, tp_partition_dim, tp_shard
from megagrpo.models.mapping import (
    Rule,
    canonical_name,
    decoder_rules,
    hf_tensor_shapes,
    shard_rows,
    to_hf,
    to_megatron,
)
from megagrpo.models.registry import UnsupportedModelError, shape_from_hf_config
from megagrpo.models.shape import GPTShape, padded_vocab_size

pytestmark = pytest.mark.unit

SHAPE = GPTShape(
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=12,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=10,
    max_position_embeddings=32,
    kv_channels=3,
)


def test_qkv_rows_are_interleaved_per_query_group():
    hd, h = 3, 8
    q = torch.arange(4 * hd)[:, None].float().expand(-1, h) + 0  # heads 0..3
    k = 100 + torch.arange(2 * hd)[:, None].float().expand(-1, h)
    v = 200 + torch.arange(2 * hd)[:, None].float().expand(-1, h)
    rule = Rule("x", ("q", "k", "v"), "qkv")
    qkv = to_megatron(rule, [q, k, v], SHAPE, padded_vocab=0)
    # Group 0: q heads 0-1, then k head 0, then v head 0; group 1 follows.
    col = qkv[:, 0]
    assert col[: 2 * hd].tolist() == q[: 2 * hd, 0].tolist()
    assert col[2 * hd : 3 * hd].tolist() == k[:hd, 0].tolist()
    assert col[3 * hd : 4 * hd].tolist() == v[:hd, 0].tolist()
    assert col[4 * hd : 6 * hd].tolist() == q[2 * hd :, 0].tolist()
    back = to_hf(rule, qkv, SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v], strict=True))
    bias = [t[:, 0].clone() for t in (q, k, v)]
    assert all(
        torch.equal(a, b)
        for a, b in zip(to_hf(rule, to_megatron(rule, bias, SHAPE, 0), SHAPE), bias, strict=True)
    )


def test_gated_and_vocab_transforms_round_trip():
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    rule = Rule("fc1", ("g", "u"), "gated")
    fc1 = to_megatron(rule, [gate, up], SHAPE, 0)
    assert torch.equal(fc1[:12], gate) and torch.equal(fc1[12:], up)
    emb = torch.randn(10, 8)
    vocab = Rule("emb", ("e",), "vocab")
    padded = to_megatron(vocab, [emb], SHAPE, padded_vocab=128)
    assert padded.shape == (128, 8) and torch.equal(padded[:10], emb) and not padded[10:].any()
    assert torch.equal(to_hf(vocab, padded, SHAPE)[0], emb)


def test_rules_cover_every_hf_tensor_exactly_once():
    for tie in (False, True):
        shape = GPTShape(**{**SHAPE.__dict__, "tie_word_embeddings": tie, "qk_layernorm": True})
        exported = [n for r in decoder_rules(shape) if r.export for n in r.hf]
        assert sorted(exported) == sorted(hf_tensor_shapes(shape))
        assert ("lm_head.weight" in exported) is not tie


def test_te_names_map_to_local_names():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.3.input_layernorm.weight"
    )
    assert (
        canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    assert (
        canonical_name("decoder.layers.0.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"
    )


BASE = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
}


def test_legacy_and_v5_rope_keys_agree():
    _, old = shape_from_hf_config({**BASE, "rope_theta": 1e6})
    _, new = shape_from_hf_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert old == new and old.rope_theta == 1e6 and old.rope_scaling_factor is None


def test_llama3_scaling_is_read():
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    arch, shape = shape_from_hf_config(
        {**BASE, "architectures": ["LlamaForCausalLM"], "rope_scaling": llama3}
    )
    assert arch.name == "llama" and shape.rope_scaling_factor == 32.0 and not shape.qkv_bias


def test_qwen3_has_qk_norm_and_head_dim():
    arch, shape = shape_from_hf_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert arch.name == "qwen3" and shape.qk_layernorm and not shape.qkv_bias and shape.head_dim == 32


@pytest.mark.parametrize(
    "patch,pattern",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"architectures: \['GPT2LMHeadModel'\] is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act: 'gelu' is not supported"),
        ({"use_sliding_window": True}, r"use_sliding_window"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_scaling\.rope_type: 'dynamic'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}},
            r"rope_scaling\.low_freq_factor: 2\.0 is not supported",
        ),
        ({"mlp_bias": True}, r"mlp_bias"),
        ({"num_hidden_layers": None}, r"num_hidden_layers"),
    ],
)
def test_unsupported_options_are_named(patch, pattern):
    cfg = {**BASE, **patch}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(UnsupportedModelError, match=pattern):
        shape_from_hf_config(cfg, "m/config.json")


@pytest.mark.parametrize("tie,qkv_bias", [(False, True), (True, False)])
@pytest.mark.parametrize("tp", [1, 2])
def test_row_reads_give_the_transformed_shard(tie, qkv_bias, tp):
    """Filling a shard row range by row range from the HF tensors (how the loader reads files)
    gives exactly tp_shard(to_megatron(...)) for every rule; only row-parallel weights at TP > 1
    have no such plan."""
    shape = GPTShape(**{**SHAPE.__dict__, "tie_word_embeddings": tie, "qkv_bias": qkv_bias})
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=gen) for n, s in hf_tensor_shapes(shape).items()}
    padded = padded_vocab_size(shape.vocab_size, tp)
    planned = 0
    for rule in decoder_rules(shape):
        dim = tp_partition_dim(rule.megatron)
        full = to_megatron(rule, [hf[n] for n in rule.hf], shape, padded)
        for rank in range(tp):
            want = tp_shard(
                full, partition_dim=dim, tp_rank=rank, tp_size=tp, gated=is_gated_fc1(rule.megatron)
            )
            plan = shard_rows(
                rule,
                {n: hf[n].shape[0] for n in rule.hf},
                shape,
                padded,
                partition_dim=dim,
                tp_rank=rank,
                tp_size=tp,
            )
            if plan is None:
                assert dim == 1 and tp > 1, rule.megatron
                continue
            got = torch.zeros(plan.rows, *hf[rule.hf[0]].shape[1:])  # uncovered rows: padding, zero
            for read in plan.reads:
                got[read.dest : read.dest + read.stop - read.start] = hf[read.hf][read.start : read.stop]
            assert torch.equal(got, want), (rule.megatron, rank)
            planned += 1
    assert planned > 0
