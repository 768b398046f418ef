"""The start-up coverage checks: the HF map against a stage's parameters (load, export), Transformer
Engine's grouped-GEMM expert names, and the weight-sync plan against the trainer's and the engine's
parameters. Pure functions over hand-built names and state dicts of the right shapes."""

import itertools
import math
from dataclasses import replace

import pytest
import torch

from megagrpo.ckpt.hf_weights import check_export, hf_tensors_from_full
from megagrpo.generation.vllm_layout import VLLM_LAYOUT, vllm_padded_vocab
from megagrpo.models.layout import (
    CoverageError,
    check_stage,
    is_expert,
    is_gated_fc1,
    layer_offset,
    shift_layer_index,
    stage_global_names,
    stage_rules,
    tp_merge,
    tp_partition_dim,
    tp_shard,
)
from megagrpo.models.mapping import (
    canonical_name,
    decoder_rules,
    hf_tensor_shapes,
    te_grouped_name,
    te_name,
    to_megatron,
)
from megagrpo.models.shape import GPTShape, padded_vocab_size
from megagrpo.parallel import ParallelContext, ParallelSizes
from megagrpo.weight_sync.buckets import Slot, plan_buckets
from megagrpo.weight_sync.coverage import (
    Sent,
    check_engine_plan,
    check_sender_plan,
    sender_shares,
    sent_ranges,
    worker_blocks,
)
from megagrpo.weight_sync.shards import choose_path, rank_pieces

pytestmark = pytest.mark.unit

DENSE = GPTShape(
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=12,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=100,
    max_position_embeddings=32,
    tie_word_embeddings=True,
)
MOE = GPTShape(
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=12,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=100,
    max_position_embeddings=32,
    qkv_bias=False,
    qk_layernorm=True,
    num_experts=4,
    moe_ffn_hidden_size=6,
    moe_router_topk=2,
)


def _ctx(*, tp=1, pp=1, ep=1, etp=None, tp_rank=0, pp_rank=0, ep_rank=0, etp_rank=0) -> ParallelContext:
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp)
    return ParallelContext(
        sizes, 0, tp * pp * ep, ep, tp_rank, pp_rank, 0, 0, torch.device("cpu"), "gloo", None,
        ep_rank=ep_rank, etp_rank=etp_rank,
    )  # fmt: skip


def _te_local_name(global_name: str, ctx: ParallelContext, shape: GPTShape) -> str:
    """A stage's parameter name as Megatron 0.16.1's Transformer Engine spec names it: the layer index
    local to the stage, the input norm fused into ``linear_qkv`` (``TELayerNormColumnParallelLinear``),
    a routed expert's weights as ``TEGroupedMLP``'s grouped linears name them, ``weight{local index}``."""
    name = shift_layer_index(global_name, -layer_offset(shape.num_layers, ctx.sizes.pp, ctx.pp_rank))
    per_rank = shape.num_experts // ctx.sizes.ep if shape.is_moe else 0
    if is_expert(name):
        prefix, _, rest = name.partition(".local_experts.")
        expert, _, tail = rest.partition(".")
        name = f"{prefix}.local_experts.{int(expert) - ctx.ep_rank * per_rank}.{tail}"
        return te_grouped_name(name)
    return te_name(name) if name.endswith("input_layernorm.weight") else name


def test_te_grouped_expert_names_are_those_of_megatron_0_16_1():
    """Names from Megatron-Core 0.16.1: ``transformer/moe/experts.py`` (``TEGroupedMLP`` builds its
    ``linear_fc1`` / ``linear_fc2`` as grouped linears of ``num_local_experts`` GEMMs) and
    ``extensions/transformer_engine.py`` (``TEGroupedLinear._sharded_state_dict_grouped`` reads GEMM i's
    tensors as ``weight{i}`` / ``bias{i}`` of the module, local index i; its checkpoint places them at
    global expert ``ep_rank * num_gemms + i``)."""
    for kind, fc in itertools.product(("weight", "bias"), ("linear_fc1", "linear_fc2")):
        te = f"decoder.layers.1.mlp.experts.{fc}.{kind}3"
        local = f"decoder.layers.1.mlp.experts.local_experts.3.{fc}.{kind}"
        assert canonical_name(te) == local and te_grouped_name(local) == te
    assert is_gated_fc1(canonical_name("decoder.layers.0.mlp.experts.linear_fc1.weight2"))
    assert tp_partition_dim(canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight0")) == 1
    # EP rank 1 of 2 with two local experts: local 1 is global expert 3, the layer offset of PP stage 1.
    ctx = _ctx(pp=2, ep=2, pp_rank=1, ep_rank=1)
    names = stage_global_names(
        [
            "decoder.layers.0.mlp.experts.linear_fc1.weight0",
            "decoder.layers.0.mlp.experts.linear_fc2.weight1",
        ],
        ctx,
        num_layers=2,
    )
    assert list(names.values()) == [
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
    ]


@pytest.mark.parametrize(("tp", "pp", "ep", "etp"), [(1, 2, 2, None), (2, 1, 2, 1), (2, 1, 1, 2)])
def test_hf_to_megatron_te_grouped_names_to_hf_round_trips(tp, pp, ep, etp):
    """HF -> each rank's Megatron stage under TE grouped-GEMM names (checked by ``check_stage``, as the
    load does) -> HF: identical tensors."""
    gen = torch.Generator().manual_seed(0)
    shapes = hf_tensor_shapes(MOE)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    rules = decoder_rules(MOE)
    padded = padded_vocab_size(MOE.vocab_size, tp)
    shards: dict[str, list] = {}  # global name -> the TP shards, in TP rank order
    for pp_rank, ep_rank, tp_rank in itertools.product(range(pp), range(ep), range(tp)):
        etp_rank = tp_rank % (etp or tp)
        ctx = _ctx(
            tp=tp, pp=pp, ep=ep, etp=etp, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank, etp_rank=etp_rank
        )
        stage = {}
        for global_name, rule in stage_rules(rules, MOE, ctx).items():
            rank, size = (etp_rank, etp or tp) if is_expert(global_name) else (tp_rank, tp)
            full = to_megatron(rule, [hf[n] for n in rule.hf], MOE, padded)
            shard = tp_shard(
                full, partition_dim=tp_partition_dim(global_name), tp_rank=rank, tp_size=size,
                gated=is_gated_fc1(global_name),
            )  # fmt: skip
            stage[_te_local_name(global_name, ctx, MOE)] = shard
        assert any(".experts.linear_fc1.weight1" in n for n in stage)
        names = stage_global_names(list(stage), ctx, MOE.num_layers)
        check_stage({n: t.numel() for n, t in stage.items()}, names, rules, MOE, ctx)
        for local, global_name in names.items():
            split = etp_rank if is_expert(global_name) else tp_rank
            shards.setdefault(global_name, {})[split] = stage[local]
    full = {
        name: tp_merge(
            [by_rank[r] for r in sorted(by_rank)],
            partition_dim=tp_partition_dim(name),
            gated=is_gated_fc1(name),
        )
        for name, by_rank in shards.items()
    }
    back = dict(hf_tensors_from_full(full, MOE, rules))
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def _stage(shape: GPTShape, ctx: ParallelContext) -> dict[str, int]:
    """{TE local name: numel} of a rank's stage, as the map says it should be."""
    padded = padded_vocab_size(shape.vocab_size, ctx.sizes.tp)
    shapes = hf_tensor_shapes(shape)
    out = {}
    for global_name, rule in stage_rules(decoder_rules(shape), shape, ctx).items():
        full = to_megatron(rule, [torch.empty(shapes[n]) for n in rule.hf], shape, padded)
        split = ctx.sizes.expert_tp if is_expert(global_name) else ctx.sizes.tp
        numel = full.numel() // (split if tp_partition_dim(global_name) >= 0 else 1)
        out[_te_local_name(global_name, ctx, shape)] = numel
    return out


def test_a_stage_that_misses_or_adds_a_tensor_is_refused_naming_it():
    ctx = _ctx(ep=2, ep_rank=1)
    rules = decoder_rules(MOE)
    params = _stage(MOE, ctx)
    check_stage(params, stage_global_names(list(params), ctx, 2), rules, MOE, ctx)

    def refused(params) -> str:
        with pytest.raises(CoverageError) as err:
            check_stage(params, stage_global_names(list(params), ctx, 2), rules, MOE, ctx)
        return str(err.value)

    dropped = dict(params)
    dropped.pop("decoder.layers.1.mlp.experts.linear_fc2.weight0")
    message = refused(dropped)
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight" in message
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in message  # the HF tensor nothing reads
    renamed = dict(params)
    renamed["decoder.layers.0.mlp.experts.linear_fc3.weight0"] = renamed.pop(
        "decoder.layers.0.mlp.experts.linear_fc1.weight0"
    )
    assert "decoder.layers.0.mlp.experts.linear_fc3.weight0" in refused(renamed)
    resized = {**params, "decoder.final_layernorm.weight": 7}
    assert "decoder.final_layernorm.weight has 7 elements, the map's shard 8" in refused(resized)
    legacy = {k: v for k, v in params.items() if ".experts." not in k}
    legacy["decoder.layers.0.mlp.experts.weight1"] = 2 * 8 * 12
    assert "legacy GroupedMLP" in refused(legacy)


def test_tied_output_layer_is_held_by_a_later_last_stage_only():
    rules = decoder_rules(DENSE)
    assert "output_layer.weight" not in stage_rules(rules, DENSE, _ctx())
    assert "output_layer.weight" in stage_rules(rules, DENSE, _ctx(pp=2, pp_rank=1))
    assert "embedding.word_embeddings.weight" not in stage_rules(rules, DENSE, _ctx(pp=2, pp_rank=1))


def test_export_of_a_model_missing_a_tensor_is_refused():
    rules = decoder_rules(DENSE)
    shapes, padded = hf_tensor_shapes(DENSE), padded_vocab_size(DENSE.vocab_size, 1)
    full = {
        r.megatron: to_megatron(r, [torch.zeros(shapes[n]) for n in r.hf], DENSE, padded)
        for r in rules
        if r.export
    }
    check_export(full, rules)
    with pytest.raises(CoverageError, match=r"decoder\.layers\.1\.self_attention\.linear_proj\.weight"):
        check_export({k: v for k, v in full.items() if "layers.1.self_attention.linear_proj" not in k}, rules)
    with pytest.raises(CoverageError, match=r"decoder\.layers\.1\.mlp\.extra\.weight"):
        list(
            hf_tensors_from_full({**full, "decoder.layers.1.mlp.extra.weight": torch.zeros(1)}, DENSE, rules)
        )


def _sender(shape: GPTShape, t: int, r: int, e: int, engine_ep: bool = False):
    """A trainer rank's (expected shares, offered pieces) as ``WeightSender.offer`` makes them."""
    rules = [rule for rule in decoder_rules(shape) if rule.export]
    splits = [(r, t)] * len(rules)
    pieces = [
        p
        for rule in rules
        for n in rule.hf
        for p in rank_pieces(n, shape, t, r, e, engine_ep, layout=VLLM_LAYOUT)
    ]
    return sender_shares(rules, splits, shape, e, shard_wise=True, layout=VLLM_LAYOUT), pieces


@pytest.mark.parametrize(("shape", "t", "e"), [(DENSE, 2, 1), (DENSE, 1, 2), (MOE, 2, 2)])
def test_a_plan_that_drops_or_renames_a_piece_is_refused_naming_the_tensor(shape, t, e):
    for r in range(t):
        expected, pieces = _sender(shape, t, r, e)
        assert check_sender_plan(r, expected, sent_ranges(pieces, [], shape)) == len(expected)
    expected, pieces = _sender(shape, t, 0, e)
    victim = next(p for p in pieces if p.hf == "model.layers.1.self_attn.o_proj.weight")
    dropped = [p for p in pieces if p != victim]
    with pytest.raises(CoverageError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight \(from element"):
        check_sender_plan(0, expected, sent_ranges(dropped, [], shape))
    renamed = [*dropped, Sent("model.layers.1.self_attn.o_prj.weight", victim.src_start, victim.length)]
    with pytest.raises(CoverageError, match=r"o_prj\.weight \(not this rank's to send\)"):
        check_sender_plan(0, expected, [*sent_ranges(dropped, [], shape), renamed[-1]])


def test_gathered_plan_on_a_rank_other_than_the_sender_expects_nothing():
    rules = [rule for rule in decoder_rules(DENSE) if rule.export]
    assert sender_shares(rules, [(1, 2)] * len(rules), DENSE, 2, shard_wise=False, layout=VLLM_LAYOUT) == {}
    whole = sender_shares(rules, [(0, 2)] * len(rules), DENSE, 2, shard_wise=False, layout=VLLM_LAYOUT)
    assert set(whole) == set(hf_tensor_shapes(DENSE))
    check_sender_plan(0, whole, sent_ranges(None, list(whole), DENSE))


def _vllm_params(shape: GPTShape, e: int, engine_ep: bool = False) -> dict[str, tuple[int, ...]]:
    """A vLLM worker's parameters (engine TP ``e``), written out from vLLM 0.32's Qwen2 / Qwen3-MoE
    layers: fused ``qkv_proj`` / ``gate_up_proj``, stacked experts, the vocabulary padded to 64."""
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    qkv = (shape.num_attention_heads + 2 * shape.num_query_groups) * hd // e
    vocab = (vllm_padded_vocab(shape.vocab_size) // e, h)
    out = {"model.embed_tokens.weight": vocab, "model.norm.weight": (h,), "lm_head.weight": vocab}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.qkv_proj.weight": (qkv, h),
            p + "self_attn.o_proj.weight": (h, shape.num_attention_heads * hd // e),
        }
        if shape.qkv_bias:
            out[p + "self_attn.qkv_proj.bias"] = (qkv,)
        if shape.qk_layernorm:
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if shape.is_moe:
            m, experts = shape.moe_ffn_hidden_size, shape.num_experts
            if engine_ep:  # each worker holds E / e experts whole
                stacked = (experts // e, 2 * m, h), (experts // e, h, m)
            else:  # every expert, its width split
                stacked = (experts, 2 * m // e, h), (experts, h, m // e)
            out |= {
                p + "mlp.gate.weight": (experts, h),
                p + "mlp.experts.routed_experts.w13_weight": stacked[0],
                p + "mlp.experts.routed_experts.w2_weight": stacked[1],
            }
        else:
            out |= {p + "mlp.gate_up_proj.weight": (2 * f // e, h), p + "mlp.down_proj.weight": (h, f // e)}
    return out


def _plan(shape: GPTShape, t: int, e: int, engine_ep: bool = False):
    """The sync's (plan, link keys) for trainer TP ``t`` (one stage) and engine TP ``e``, shard-wise."""
    rules = [rule for rule in decoder_rules(shape) if rule.export]
    keys, plan = [], []
    for r, j in itertools.product(range(t), range(e)):
        slots = [
            Slot(p.param, "float32", p.shape, 0, into=(p.dim, p.dst_start), pad=p.pad)
            for rule in rules
            for n in rule.hf
            for p in rank_pieces(n, shape, t, r, e, engine_ep, layout=VLLM_LAYOUT)
            if p.engine_rank == j
        ]
        if slots:
            plan += [replace(b, source=len(keys)) for b in plan_buckets(slots, 256, -1)]
            keys.append((0, r, j))
    return plan, keys


@pytest.mark.parametrize(
    ("shape", "t", "e", "engine_ep"), [(DENSE, 2, 1, False), (DENSE, 1, 2, False), (MOE, 2, 2, True)]
)
def test_an_engine_parameter_the_plan_misses_is_refused_naming_it(shape, t, e, engine_ep):
    plan, keys = _plan(shape, t, e, engine_ep)
    path = choose_path(shape, t, e, layout=VLLM_LAYOUT, engine_ep=engine_ep)
    assert path.kind == "shard"
    params = _vllm_params(shape, e, engine_ep)
    tied = shape.tie_word_embeddings
    for j in range(e):
        blocks = worker_blocks(plan, keys, path, shape, e, j, layout=VLLM_LAYOUT)
        assert check_engine_plan(blocks, params, tied=tied, where=f"worker {j}") == len(params)
    blocks = worker_blocks(plan, keys, path, shape, e, 0, layout=VLLM_LAYOUT)
    victim = "model.layers.1.self_attn.o_proj.weight"
    with pytest.raises(
        CoverageError, match=r"parameters nothing is sent to: model\.layers\.1\.self_attn\.o_proj"
    ):
        check_engine_plan([b for b in blocks if b.param != victim], params, tied=tied, where="worker 0")
    half = [b for b in blocks if b.param == "model.layers.0.self_attn.qkv_proj.weight"][1:]
    others = [b for b in blocks if b.param != "model.layers.0.self_attn.qkv_proj.weight"]
    with pytest.raises(CoverageError, match=r"qkv_proj\.weight receives \d+ of \d+ elements"):
        check_engine_plan(others + half, params, tied=tied, where="worker 0")
    with pytest.raises(CoverageError, match=r"no parameter for: model\.layers\.1\.self_attn\.o_proj\.weight"):
        check_engine_plan(blocks, {k: v for k, v in params.items() if k != victim}, tied=tied, where="w")


def test_an_untied_lm_head_that_receives_nothing_is_refused():
    shape = replace(DENSE, tie_word_embeddings=False)
    plan, keys = _plan(shape, 1, 1)
    path = choose_path(shape, 1, 1, layout=VLLM_LAYOUT)
    blocks = [
        b
        for b in worker_blocks(plan, keys, path, shape, 1, 0, layout=VLLM_LAYOUT)
        if b.param != "lm_head.weight"
    ]
    with pytest.raises(CoverageError, match=r"nothing is sent to: lm_head\.weight"):
        check_engine_plan(blocks, _vllm_params(shape, 1), tied=False, where="worker 0")


def test_gathered_plan_fills_every_worker_through_vllms_loaders():
    path = choose_path(DENSE, 1, 2, "gathered", layout=VLLM_LAYOUT)
    tensors = [(n, torch.float32, s) for n, s in hf_tensor_shapes(DENSE).items()]
    plan = [replace(b, source=0) for b in plan_buckets(tensors, 256, -1)]
    params = _vllm_params(DENSE, 2)
    for j in range(2):
        blocks = worker_blocks(plan, [(0, 0, -1)], path, DENSE, 2, j, layout=VLLM_LAYOUT)
        assert sum(b.numel for b in blocks) < sum(math.prod(s) for s in params.values())  # padding
        check_engine_plan(blocks, params, tied=True, where=f"worker {j}")


def test_legacy_grouped_mlp_is_refused_by_the_builder():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megagrpo.models.builder import refuse_legacy_grouped_experts

    refuse_legacy_grouped_experts(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False))
    with pytest.raises(ValueError, match="legacy GroupedMLP"):
        refuse_legacy_grouped_experts(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True))
