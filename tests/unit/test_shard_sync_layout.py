"""Shard-wise weight sync, pure layout: which path each TP pair takes, and every trainer rank's pieces
put together on an engine rank equal vLLM's own slicing of the whole HF tensors."""

from __future__ import annotations

import pytest
import torch

from megagrpo.generation import vllm_layout
from megagrpo.generation.vllm_layout import VLLM_LAYOUT
from megagrpo.models.layout import is_gated_fc1, tp_partition_dim, tp_shard
from megagrpo.models.mapping import decoder_rules, hf_tensor_shapes, to_megatron
from megagrpo.models.shape import GPTShape, padded_vocab_size
from megagrpo.weight_sync import shards

pytestmark = pytest.mark.unit


def _shape(heads=8, groups=4, vocab=300, tie=False, qk_norm=False, bias=True, **moe) -> GPTShape:
    return GPTShape(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=vocab,
        max_position_embeddings=64,
        qkv_bias=bias,
        qk_layernorm=qk_norm,
        tie_word_embeddings=tie,
        **moe,
    )


# Qwen3-MoE-like (no shared expert) and Qwen2-MoE-like (a gated shared expert) shapes.
_QWEN3_MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, qk_norm=True, bias=False)
_QWEN2_MOE = dict(
    num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_shared_expert_ffn_hidden_size=48
)


@pytest.mark.parametrize(
    ("heads", "groups", "t", "e", "kind", "words"),
    [
        (8, 4, 2, 2, "shard", "divide one another"),
        (8, 4, 2, 1, "shard", "divide one another"),
        (8, 4, 1, 2, "shard", "divide one another"),
        (8, 4, 4, 2, "shard", "divide one another"),
        (8, 4, 2, 4, "shard", "divide one another"),
        (8, 4, 1, 1, "shard", "divide one another"),
        (12, 6, 2, 3, "gathered", "do not divide one another"),
        (12, 6, 3, 2, "gathered", "do not divide one another"),
        (8, 2, 1, 4, "gathered", "replicates KV heads"),
        (8, 2, 2, 4, "gathered", "replicates KV heads"),
        (8, 1, 1, 2, "gathered", "replicates KV heads"),
    ],
)
def test_path_for_tp_pairs_and_head_counts(heads, groups, t, e, kind, words):
    path = shards.choose_path(_shape(heads, groups), t, e, layout=VLLM_LAYOUT)
    assert path.kind == kind
    assert words in path.reason


def test_experts_that_do_not_split_over_engine_tp_take_the_gathered_path():
    moe = dict(num_experts=4, moe_router_topk=2)
    assert (
        shards.choose_path(_shape(8, 8, moe_ffn_hidden_size=16, **moe), 1, 8, layout=VLLM_LAYOUT).kind
        == "shard"
    )
    path = shards.choose_path(_shape(8, 8, moe_ffn_hidden_size=12, **moe), 1, 8, layout=VLLM_LAYOUT)
    assert path.kind == "gathered" and "expert FFN 12 does not split" in path.reason
    shared = _shape(8, 8, moe_ffn_hidden_size=16, moe_shared_expert_ffn_hidden_size=20, **moe)
    path = shards.choose_path(shared, 1, 8, layout=VLLM_LAYOUT)
    assert path.kind == "gathered" and "shared expert FFN 20 does not split" in path.reason


def test_expert_tensors_go_into_vllms_stacked_expert_parameters():
    layer = "model.layers.1.mlp."
    stacked = layer + "experts.routed_experts."
    assert vllm_layout.vllm_placement(layer + "experts.3.gate_proj.weight") == shards.Placement(
        stacked + "w13_weight", 0, 0, 3
    )
    assert vllm_layout.vllm_placement(layer + "experts.3.up_proj.weight") == shards.Placement(
        stacked + "w13_weight", 0, 1, 3
    )
    assert vllm_layout.vllm_placement(layer + "experts.3.down_proj.weight") == shards.Placement(
        stacked + "w2_weight", 1, 0, 3
    )
    assert vllm_layout.vllm_placement(layer + "shared_expert.up_proj.weight") == shards.Placement(
        layer + "shared_expert.gate_up_proj.weight", 0, 1
    )
    assert vllm_layout.vllm_placement(layer + "shared_expert.down_proj.weight").dim == 1
    for whole in ("gate.weight", "shared_expert_gate.weight"):  # the router, the shared expert's gate
        assert vllm_layout.vllm_placement(layer + whole) == shards.Placement(layer + whole, -1, 0)


def test_gathered_on_request_and_unknown_request_refused():
    assert shards.choose_path(_shape(), 2, 2, "gathered", layout=VLLM_LAYOUT).kind == "gathered"
    with pytest.raises(ValueError, match="weight_sync_path"):
        shards.choose_path(_shape(), 2, 2, "shardwise", layout=VLLM_LAYOUT)


def test_vllm_vocab_padding_is_vllms():
    from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE

    assert vllm_layout.VLLM_VOCAB_PADDING == DEFAULT_VOCAB_PADDING_SIZE


def _vllm_rank_params(
    hf: dict[str, torch.Tensor], shape: GPTShape, e: int, j: int, engine_ep: bool = False
) -> dict[str, torch.Tensor]:
    """Engine rank j's parameters as vLLM 0.32's loaders cut them from whole HF tensors
    (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)."""
    out = {}
    hd = shape.head_dim
    for name, full in hf.items():
        if ".mlp.experts." in name:
            _vllm_experts(out, name, full, shape, e, j, engine_ep)
        elif ".self_attn.q_proj." in name:
            prefix, kind = name.split(".self_attn.q_proj.")
            parts = []
            for proj, heads in (
                ("q", shape.num_attention_heads),
                ("k", shape.num_query_groups),
                ("v", shape.num_query_groups),
            ):
                rows = heads // e * hd
                parts.append(hf[f"{prefix}.self_attn.{proj}_proj.{kind}"].narrow(0, j * rows, rows))
            out[f"{prefix}.self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        elif name.endswith(("mlp.gate_proj.weight", "mlp.shared_expert.gate_proj.weight")):
            prefix = name.removesuffix("gate_proj.weight")
            ffn = (
                shape.moe_shared_expert_ffn_hidden_size
                if ".shared_expert." in name
                else shape.ffn_hidden_size
            )
            rows = ffn // e
            gate, up = hf[name], hf[prefix + "up_proj.weight"]
            out[prefix + "gate_up_proj.weight"] = torch.cat(
                [gate.narrow(0, j * rows, rows), up.narrow(0, j * rows, rows)]
            )
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            cols = full.shape[1] // e
            out[name] = full.narrow(1, j * cols, cols)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            per = vllm_layout.vllm_padded_vocab(shape.vocab_size) // e
            lo, hi = j * per, min((j + 1) * per, shape.vocab_size)
            rows = torch.zeros(per, full.shape[1])
            rows[: hi - lo] = full[lo:hi]
            out[name] = rows
        elif any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            continue  # fused above
        else:
            out[name] = full
    return out


def _vllm_experts(
    out: dict, name: str, full: torch.Tensor, shape: GPTShape, e: int, j: int, engine_ep: bool
) -> None:
    """Expert ``x``'s gate/up/down into engine rank j's stacked ``w13_weight`` [E, 2 f/e, h] (rows
    [gate_j; up_j]) and ``w2_weight`` [E, h, f/e], as vLLM 0.32's ``RoutedExperts`` loaders place them
    (``_load_w13``, ``_load_w2``: the expert's intermediate dim split over TP). With expert parallelism
    (``engine_ep``) rank j holds experts j E/e .. (j+1) E/e - 1 whole, [E/e, 2f, h] and [E/e, h, f]
    (vLLM's linear placement: ``expert_map_manager.determine_expert_map``)."""
    prefix, rest = name.split("experts.", 1)
    x, proj = int(rest.split(".")[0]), rest.split(".")[1]
    stacked = prefix + "experts.routed_experts."
    f, h, E = shape.moe_ffn_hidden_size, shape.hidden_size, shape.num_experts
    if engine_ep:
        local = E // e
        if x // local != j:
            return
        x, E, e, j = x % local, local, 1, 0  # whole experts, local indices
    per = f // e
    if proj == "down_proj":
        w2 = out.setdefault(stacked + "w2_weight", torch.zeros(E, h, per))
        w2[x] = full.narrow(1, j * per, per)
    else:
        w13 = out.setdefault(stacked + "w13_weight", torch.zeros(E, 2 * per, h))
        w13[x].narrow(0, 0 if proj == "gate_proj" else per, per).copy_(full.narrow(0, j * per, per))


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (4, 4), (1, 4)]


@pytest.mark.parametrize(("t", "e"), LAYOUTS, ids=[f"t{t}-e{e}" for t, e in LAYOUTS])
@pytest.mark.parametrize(
    "shape",
    [
        _shape(vocab=300),
        _shape(vocab=512, tie=True, qk_norm=True, bias=False),
        _shape(heads=4, groups=4, vocab=260),
        _shape(**_QWEN3_MOE),
        _shape(**_QWEN2_MOE, tie=True),
    ],
    ids=["qwen2-vocab300", "qwen3-tied-vocab512", "mha-vocab260", "qwen3-moe", "qwen2-moe-shared-expert"],
)
def test_pieces_rebuild_vllms_per_rank_parameters(shape, t, e):
    """Each trainer rank's Megatron shard (made as Megatron splits the whole tensor) -> its HF-layout share
    -> pieces; put together per engine rank, they equal vLLM's slicing of the whole HF tensors, every
    element written once, and an engine rank receives exactly its parameters' real rows."""
    _assert_pieces_rebuild_vllms_parameters(shape, t, e, t)


FOLDED = [(2, 1), (2, 2), (4, 2), (2, 4)]


@pytest.mark.parametrize(("t", "e"), FOLDED, ids=[f"t{t}-etp1-e{e}" for t, e in FOLDED])
@pytest.mark.parametrize(
    "shape", [_shape(**_QWEN3_MOE), _shape(**_QWEN2_MOE)], ids=["qwen3-moe", "qwen2-moe"]
)
def test_pieces_rebuild_vllms_parameters_with_whole_experts_per_trainer_rank(shape, t, e):
    """Expert TP 1 under trainer TP ``t`` (Megatron's parallel folding): each routed expert is whole on
    its trainer rank and split for the engine's ranks from there; the rest as at ETP = TP."""
    _assert_pieces_rebuild_vllms_parameters(shape, t, e, 1)


ENGINE_EP = [(1, 1, 2), (2, 2, 2), (2, 1, 2), (1, 1, 4), (2, 2, 4), (4, 4, 2)]


@pytest.mark.parametrize(("t", "et", "e"), ENGINE_EP, ids=[f"t{t}-etp{et}-e{e}" for t, et, e in ENGINE_EP])
@pytest.mark.parametrize(
    "shape", [_shape(**_QWEN3_MOE), _shape(**_QWEN2_MOE)], ids=["qwen3-moe", "qwen2-moe"]
)
def test_pieces_rebuild_vllms_parameters_under_vllms_expert_parallelism(shape, t, et, e):
    """``generation.engine_expert_parallel``: engine rank j holds its range of experts whole; each trainer
    rank's slice of an expert lands in that rank's stacked parameters at the expert's local index."""
    _assert_pieces_rebuild_vllms_parameters(shape, t, e, et, engine_ep=True)


def _assert_pieces_rebuild_vllms_parameters(
    shape: GPTShape, t: int, e: int, et: int, engine_ep: bool = False
) -> None:
    """Trainer TP ``t``, expert TP ``et``, engine TP ``e`` (``engine_ep``: vLLM's expert parallelism):
    what the tests above state."""
    from megagrpo.models.layout import is_expert
    from megagrpo.weight_sync.vllm_engine import _block_target, _copy_block

    path = shards.choose_path(shape, t, e, layout=VLLM_LAYOUT, expert_tp=et, engine_ep=engine_ep)
    assert path.kind == "shard" and path.engine_ep == engine_ep
    gen = torch.Generator().manual_seed(t * 10 + e)
    hf = {n: torch.randn(s, generator=gen) for n, s in hf_tensor_shapes(shape).items()}
    padded = padded_vocab_size(shape.vocab_size, t)
    rules = [r for r in decoder_rules(shape) if r.export]
    want = [_vllm_rank_params(hf, shape, e, j, engine_ep) for j in range(e)]
    got = [{n: torch.full_like(p, float("nan")) for n, p in w.items()} for w in want]
    written = [{n: torch.zeros_like(p, dtype=torch.int32) for n, p in w.items()} for w in want]
    received = [0] * e
    for rule in rules:
        full = to_megatron(rule, [hf[n] for n in rule.hf], shape, padded)
        dim = tp_partition_dim(rule.megatron)
        tt = et if is_expert(rule.megatron) else t
        for r in range(tt):
            local = tp_shard(
                full, partition_dim=dim, tp_rank=r, tp_size=tt, gated=is_gated_fc1(rule.megatron)
            )
            local_hf = shards.local_hf_tensors(rule, local, shape, tt, r)
            for i, name in enumerate(rule.hf):
                for piece in shards.rank_pieces(name, shape, tt, r, e, engine_ep, layout=VLLM_LAYOUT):
                    block = shards.piece_tensor(local_hf[i], piece)
                    assert tuple(block.shape) == piece.shape
                    j = piece.engine_rank
                    _copy_block(got[j][piece.param], block, piece.dim, piece.dst_start, piece.pad)
                    target, at = _block_target(written[j][piece.param], block, piece.dim, piece.dst_start)
                    target.narrow(piece.dim, at, piece.length).add_(1)
                    received[j] += block.numel()
    for j in range(e):
        assert got[j].keys() == want[j].keys()
        for name in want[j]:
            torch.testing.assert_close(got[j][name], want[j][name], rtol=0, atol=0, msg=f"rank {j} {name}")
        # every element once, except vLLM's vocabulary padding rows (zeroed, not sent)
        pad_rows = sum(
            int((written[j][n] == 0).all(dim=1).sum()) * want[j][n].shape[1]
            for n in ("model.embed_tokens.weight", "lm_head.weight")
            if n in written[j]
        )
        assert all(int(w.max()) == 1 for w in written[j].values())
        assert received[j] == sum(p.numel() for p in want[j].values()) - pad_rows
    sent, recv = shards.shard_bytes(
        shape, rules, t, e, 4, layout=VLLM_LAYOUT, expert_tp=et, engine_ep=engine_ep
    )
    assert recv == [4 * n for n in received]
    assert (
        sum(sent)
        == sum(recv)
        >= 4 * sum(v.numel() for v in hf.values())
        - 4 * sum(hf[n].numel() for n in hf if n.endswith("norm.weight"))
    )


def test_equal_tp_every_trainer_rank_feeds_one_engine_rank_with_half_the_bytes():
    shape = _shape(vocab=512)
    rules = [r for r in decoder_rules(shape) if r.export]
    assert shards.stage_links(rules, shape, 2, 2, layout=VLLM_LAYOUT) == [(0, 0), (1, 1)]
    assert shards.stage_links(rules, shape, 2, 1, layout=VLLM_LAYOUT) == [(0, 0), (1, 0)]
    assert shards.stage_links(rules, shape, 1, 2, layout=VLLM_LAYOUT) == [(0, 0), (0, 1)]
    _, whole = shards.shard_bytes(shape, rules, 1, 1, 4, layout=VLLM_LAYOUT)
    _, halves = shards.shard_bytes(shape, rules, 2, 2, 4, layout=VLLM_LAYOUT)
    norms = 4 * sum(
        n for name, s in hf_tensor_shapes(shape).items() if name.endswith("norm.weight") for n in s
    )
    assert halves[0] == halves[1] == (whole[0] - norms) // 2 + norms


def test_path_is_chosen_in_one_place_and_printed_at_start():
    import inspect

    from megagrpo import plan
    from megagrpo.trainers import grpo as driver
    from megagrpo.weight_sync import sync, trainer

    # the controller asks the trainer's first rank, which calls shards.choose_path; plan calls it too
    assert "WeightSyncEndpoints.weight_sync_path" in inspect.getsource(sync.WeightSync.__init__)
    assert "choose_path(" in inspect.getsource(trainer.WeightSender.choose)
    assert "choose_path(" in inspect.getsource(plan)
    printed = inspect.getsource(driver.print_layout)
    assert "sync.path.kind" in printed and "sync.path.reason" in printed
