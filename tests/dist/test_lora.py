"""LoRA adapters (``policy.lora``): the base unchanged at the start, layout-independent training, adapter-only
checkpoints that reshard, PEFT and merged exports that transformers + peft load with the trainer's logits;
the same on a mixture-of-experts model's routed experts (tiny Qwen3-MoE, routing replayed so that the
routing does not depend on the layout), at EP 2 and with the experts split over TP 2.

Two spawned worlds (``one_rank``, ``two_ranks``), as ``test_policy`` runs its cases.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import SMALL_BUDGET, policy_batch, policy_config
from rank_cases import case, run_cases

pytestmark = pytest.mark.dist

LORA = ("policy.lora.rank=4", "policy.lora.alpha=8.0")
LAYOUTS = {
    "tp2": dict(tp=2, budget=SMALL_BUDGET),
    "pp2": dict(pp=2, budget=SMALL_BUDGET),
    "dp2": dict(dp=2, budget=SMALL_BUDGET),
    # the sequence-parallel adapters (the torch layers: the local ones refuse sequence parallelism)
    "tp2-sp-torch": dict(tp=2, extra=("parallel.transformer_impl=torch", "parallel.sequence_parallel=true")),
}


# The routed experts' adapters (and attention's), the routing replayed (``test_moe_policy``).
MOE_LORA = (
    "policy.lora.target_modules=linear_qkv,linear_proj,experts.linear_fc1,experts.linear_fc2",
    "parallel.transformer_impl=local",
    "grpo.routing_replay=rollout",
)
EP2 = "parallel.expert_model_parallel_size=2"
MOE_LAYOUTS = {
    # the experts split over the two ranks, each rank's adapters with its experts
    "moe-ep2": dict(dp=2, budget=SMALL_BUDGET, extra=(EP2,)),
    # every expert split over TP 2 (expert TP 2), sequence parallel
    "moe-tp2-sp-torch": dict(
        tp=2, extra=("parallel.transformer_impl=torch", "parallel.sequence_parallel=true")
    ),
    # TP 2 for attention, the experts whole and split over the same two ranks by EP 2 (expert TP 1)
    "moe-tp2-ep2-etp1": dict(
        tp=2,
        budget=SMALL_BUDGET,
        extra=(
            "parallel.transformer_impl=torch",
            "parallel.sequence_parallel=true",
            EP2,
            "parallel.expert_tensor_parallel_size=1",
        ),
    ),
}
MOE_EXPERTS, MOE_TOPK, MOE_LAYERS = 8, 2, 2


def _lora_config(hf_dir: str, *, moe: bool = False, **layout):
    extra = (*LORA, *(MOE_LORA if moe else ()), *layout.pop("extra", ()))
    return policy_config(hf_dir, mini=4, kl=0.1, extra=extra, **layout)


def _batch(moe: bool, routed: bool = True):
    """``policy_batch()``; for the MoE model with random top-k experts per position to replay (``routed``)
    or none (the routers choose, as transformers' model does)."""
    batch = policy_batch()
    if not moe:
        return batch
    from megagrpo.algorithms.routing import routing_rows

    batch = batch.replace(gen_logprobs=torch.zeros(batch.size, batch.input_ids.shape[1] - 1))
    if not routed:
        return batch
    gen = torch.Generator().manual_seed(3)
    rows = []
    for length in batch.lengths.tolist():
        scores = torch.rand(length - 1, MOE_LAYERS, MOE_EXPERTS, generator=gen)
        rows.append(scores.argsort(dim=-1)[..., :MOE_TOPK].numpy().astype(np.uint8))
    return batch.replace(routing=routing_rows(rows, batch.input_ids.shape[1]))


def _base_logprobs(hf_dir: str, moe: bool = False) -> torch.Tensor:
    from megagrpo.policy.worker import PolicyWorker

    extra = MOE_LORA[1:] if moe else ()
    return PolicyWorker(policy_config(hf_dir, extra=extra)).logprobs(_batch(moe))


def _train(cfg, save_to: str | None = None, moe: bool = False) -> dict:
    """Two optimizer steps (two mini-batches; the first moves B only, B being zero, the second A too)."""
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    batch = _batch(moe)
    module = worker.engine.module
    start = worker.logprobs(batch)
    ref = worker.reference_logprobs(batch)
    metrics = worker.train(batch.replace(old_logprobs=start, ref_logprobs=ref))
    ddp = worker.engine.model[0]
    held = [p for buffer in ddp.buffers for p in buffer.params]
    held_expert = [p for buffer in ddp.expert_parallel_buffers for p in buffer.params]
    names = {id(p): n for n, p in module.named_parameters()}
    out = {
        "start": start,
        "metrics": metrics,
        "after": worker.logprobs(batch, 1.0),
        "ref_after": worker.reference_logprobs(batch),
        "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
        "adapter_numel": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "planned_numel": _planned(cfg, worker),
        "ddp_holds_adapters_only": {id(p) for p in held + held_expert}
        == {id(p) for p in module.parameters() if p.requires_grad},
        "expert_buffers": sorted(names[id(p)] for p in held_expert),
    }
    if not moe:  # what an adapter sync sends (generation.lora_sync adapter): None off a stage's first rank
        out["sync_adapters"] = worker.send_adapters()
    if moe:  # the routers' own choices, as transformers' model routes
        out["after_unrouted"] = worker.logprobs(_batch(moe, routed=False), 1.0)
        from megagrpo.models.lora import merged

        with merged(module):  # what the weight sync sends: each rank's experts' shards, merged
            out["merged"] = worker.logprobs(batch, 1.0)
    if save_to is not None:
        worker.save(save_to)
    return out


def _planned(cfg, worker) -> int:
    """What ``megagrpo plan`` counts as this rank's adapter elements."""
    from megagrpo.models.lora import adapter_params_per_rank

    lora, shape, sizes = cfg.policy.lora, worker.model_info.shape, worker.ctx.sizes
    per_layer = adapter_params_per_rank(
        shape, lora.targets, lora.rank, sizes.tp, ep=sizes.ep, etp=sizes.expert_tp
    )
    return shape.num_layers // sizes.pp * per_layer


def _load(cfg, path: str, moe: bool = False) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    worker.load(path)
    return {"loaded": worker.logprobs(_batch(moe), 1.0), "steps": worker.steps_done}


def _exports(*pairs: tuple[str, str]) -> list[dict]:
    """Both exports of each saved checkpoint, ``(ckpt, out)`` (last case of its world: they tear the
    world down)."""
    from megagrpo.ckpt.lora_export import export_merged, export_peft

    return [
        {
            "peft": str(export_peft(ckpt, Path(out) / "peft")),
            "merged": str(export_merged(ckpt, Path(out) / "hf")),
        }
        for ckpt, out in pairs
    ]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("lora") / "qwen2"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("lora_moe") / "qwen3_moe"
    return str(make_tiny_hf("qwen3_moe", out, num_hidden_layers=MOE_LAYERS))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_out")
    return {
        "ckpt": root / "step",
        "export": root / "export",
        "moe_ckpt": root / "moe_step",
        "moe_export": root / "moe_export",
    }


@pytest.fixture(scope="module")
def one_rank(hf_dir, moe_dir, dirs) -> list[dict]:
    cases = {
        "base": (_base_logprobs, hf_dir),
        "train": (_train, _lora_config(hf_dir), str(dirs["ckpt"])),
        "moe/base": (_base_logprobs, moe_dir, True),
        "moe/train": (_train, _lora_config(moe_dir, moe=True), str(dirs["moe_ckpt"]), True),
        # last: it ends the world
        "exports": (
            _exports,
            (str(dirs["ckpt"]), str(dirs["export"])),
            (str(dirs["moe_ckpt"]), str(dirs["moe_export"])),
        ),
    }
    return run_cases(1, cases)


@pytest.fixture(scope="module")
def two_ranks(hf_dir, moe_dir, dirs, one_rank) -> list[dict]:
    cases = {f"train/{name}": (_train, _lora_config(hf_dir, **layout)) for name, layout in LAYOUTS.items()}
    cases["load/tp2"] = (_load, _lora_config(hf_dir, tp=2), str(dirs["ckpt"]))
    for name, layout in MOE_LAYOUTS.items():
        cases[f"train/{name}"] = (_train, _lora_config(moe_dir, moe=True, **dict(layout)), None, True)
    ep2 = _lora_config(moe_dir, moe=True, **dict(MOE_LAYOUTS["moe-ep2"]))
    cases["load/moe-ep2"] = (_load, ep2, str(dirs["moe_ckpt"]), True)
    return run_cases(2, cases)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_zero_initialised_adapters_give_the_base_logprobs_exactly(one_rank):
    (base,) = case(one_rank, "base")
    (res,) = case(one_rank, "train")
    assert torch.equal(res["start"], base)


def test_only_the_adapters_train_and_the_reference_is_the_base(one_rank):
    (base,) = case(one_rank, "base")
    (res,) = case(one_rank, "train")
    assert res["trainable"] and all(".lora.weight_" in n for n in res["trainable"])
    # 2 layers x (qkv, proj, fc1, fc2) x (A, B)
    assert len(res["trainable"]) == 16
    assert res["ddp_holds_adapters_only"]
    assert res["adapter_numel"] == res["planned_numel"]
    first, second = res["metrics"]
    assert first.update_applied == second.update_applied == 1.0
    assert torch.equal(res["ref_after"], base)  # adapters off: the base, untouched by training
    mask = policy_batch().response_mask()
    assert (res["after"][mask] - base[mask]).abs().max() > 1e-3  # and training moved the policy


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_grad_norm_do_not_depend_on_layout(layout, one_rank, two_ranks):
    (want,) = case(one_rank, "train")
    mask = policy_batch().response_mask()
    for res in case(two_ranks, f"train/{layout}"):
        assert res["ddp_holds_adapters_only"]
        assert res["adapter_numel"] == res["planned_numel"]  # megagrpo plan's count is this rank's
        for got, ref in zip(res["metrics"], want["metrics"], strict=True):
            assert _rel(got.loss, ref.loss) <= 1e-5, (got.loss, ref.loss)
            assert _rel(got.grad_norm, ref.grad_norm) <= 1e-5, (got.grad_norm, ref.grad_norm)
        torch.testing.assert_close(res["after"][mask], want["after"][mask], atol=1e-4, rtol=1e-4)


def test_adapter_checkpoint_reloads_at_another_layout(one_rank, two_ranks, dirs):
    (saved,) = case(one_rank, "train")
    ckpt = dirs["ckpt"]
    assert not (ckpt / "megatron").exists() and (ckpt / "adapters").is_dir()  # adapters only
    mask = policy_batch().response_mask()
    for res in case(two_ranks, "load/tp2"):
        assert res["steps"] == 2
        torch.testing.assert_close(res["loaded"][mask], saved["after"][mask], atol=1e-5, rtol=1e-5)


def _hf_logprobs(model) -> torch.Tensor:
    batch = policy_batch()
    out = torch.zeros(batch.size, batch.input_ids.shape[1] - 1)
    with torch.no_grad():
        for i in range(batch.size):
            ids = batch.input_ids[i : i + 1, : int(batch.lengths[i])]
            logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
            out[i, : ids.shape[1] - 1] = logp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return out


def _check_peft_and_merged(base_dir: str, exports: dict, trainer: torch.Tensor) -> None:
    """``peft`` loads the PEFT export onto the HF base with the trainer's logprobs, and the merged export
    gives the same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    mask = policy_batch().response_mask()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    plain = _hf_logprobs(base)
    with_adapter = _hf_logprobs(PeftModel.from_pretrained(base, exports["peft"]).eval())
    merged = AutoModelForCausalLM.from_pretrained(exports["merged"], dtype=torch.float32).eval()
    from_merged = _hf_logprobs(merged)
    assert (with_adapter[mask] - plain[mask]).abs().max() > 1e-3  # the adapter is loaded, not ignored
    torch.testing.assert_close(with_adapter[mask], trainer[mask], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(from_merged[mask], with_adapter[mask], atol=1e-5, rtol=1e-5)


def test_peft_loads_the_adapter_and_the_merged_export_matches(one_rank, hf_dir):
    ((exports, _),) = case(one_rank, "exports")
    (trained,) = case(one_rank, "train")
    _check_peft_and_merged(hf_dir, exports, trained["after"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_adapter_sync_sends_the_same_adapters_at_every_layout(layout, one_rank, two_ranks):
    """``weight_sync.adapters``: each stage's first rank sends its layers' adapters whole (gathered over TP)
    in PEFT's names; together the stages' are one rank's, which are the PEFT export's exactly, and the
    stages' digests join into the whole's."""
    from safetensors.torch import load_file

    from megagrpo.weight_sync.adapters import tensors_digest

    ((exports, _),) = case(one_rank, "exports")
    (want,) = case(one_rank, "train")
    tensors, digest = want["sync_adapters"]
    exported = load_file(str(Path(exports["peft"]) / "adapter_model.safetensors"))
    assert tensors.keys() == exported.keys() and digest == tensors_digest(tensors)
    assert all(torch.equal(tensors[k], exported[k]) for k in tensors)
    sent = [r["sync_adapters"] for r in case(two_ranks, f"train/{layout}") if r["sync_adapters"] is not None]
    assert len(sent) == (2 if layout == "pp2" else 1)  # one per stage
    joined = {k: t for part, _ in sent for k, t in part.items()}
    assert joined.keys() == tensors.keys()
    assert ";".join(sorted(e for _, d in sent for e in d.split(";"))) == tensors_digest(joined)
    for k, t in tensors.items():
        torch.testing.assert_close(joined[k], t, atol=1e-5, rtol=1e-4)


def _moe_assert_same_steps(got: dict, want: dict) -> None:
    mask = policy_batch().response_mask()
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert _rel(g.loss, w.loss) <= 1e-5, (g.loss, w.loss)
        assert _rel(g.grad_norm, w.grad_norm) <= 1e-5, (g.grad_norm, w.grad_norm)
    torch.testing.assert_close(got["after"][mask], want["after"][mask], atol=1e-4, rtol=1e-4)


def test_zero_initialised_expert_adapters_give_the_base_logprobs_exactly(one_rank):
    (base,) = case(one_rank, "moe/base")
    (res,) = case(one_rank, "moe/train")
    assert torch.equal(res["start"], base)
    assert torch.equal(res["ref_after"], base)  # adapters off: the base, untouched by training
    mask = policy_batch().response_mask()
    assert (res["after"][mask] - base[mask]).abs().max() > 1e-3
    torch.testing.assert_close(res["merged"][mask], res["after"][mask], atol=1e-5, rtol=1e-5)


def test_every_routed_expert_carries_an_adapter_that_trains(one_rank):
    (res,) = case(one_rank, "moe/train")
    experts = [n for n in res["trainable"] if ".mlp.experts.local_experts." in n]
    # 2 layers x 8 experts x (fc1, fc2) x (A, B), besides attention's 2 layers x (qkv, proj) x (A, B)
    assert len(experts) == 64 and len(res["trainable"]) == 64 + 8
    assert all(".lora.weight_" in n for n in res["trainable"])
    assert res["ddp_holds_adapters_only"] and res["adapter_numel"] == res["planned_numel"]
    # expert parameters even without expert parallelism: DDP's expert buffers, the expert optimizer
    assert res["expert_buffers"] == experts


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_expert_adapters_train_alike_at_every_expert_layout(layout, one_rank, two_ranks):
    (want,) = case(one_rank, "moe/train")
    results = case(two_ranks, f"train/{layout}")
    mask = policy_batch().response_mask()
    for res in results:
        assert res["ddp_holds_adapters_only"]
        assert res["adapter_numel"] == res["planned_numel"]
        _moe_assert_same_steps(res, want)
        torch.testing.assert_close(res["merged"][mask], want["after"][mask], atol=1e-4, rtol=1e-4)
    for res in results:
        # the experts' adapters in DDP's expert-parallel buffers (reduced over the expert data-parallel
        # group), every other adapter in the dense ones; at EP 2 each rank holds half the experts'
        experts = [n for n in res["trainable"] if ".experts." in n]
        assert res["expert_buffers"] == experts
        assert len(experts) == (32 if EP2 in MOE_LAYOUTS[layout]["extra"] else 64)


def test_expert_adapter_checkpoint_reloads_at_ep2(one_rank, two_ranks, dirs):
    (saved,) = case(one_rank, "moe/train")
    mask = policy_batch().response_mask()
    for res in case(two_ranks, "load/moe-ep2"):
        assert res["steps"] == 2
        torch.testing.assert_close(res["loaded"][mask], saved["after"][mask], atol=1e-5, rtol=1e-5)


def test_peft_loads_the_expert_adapters_and_the_merged_export_matches(one_rank, moe_dir):
    import json

    from safetensors import safe_open

    ((_, exports),) = case(one_rank, "exports")
    (trained,) = case(one_rank, "moe/train")
    with safe_open(Path(exports["peft"]) / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    prefix = "base_model.model.model.layers.1.mlp.experts.7"
    for proj in ("gate_proj", "up_proj", "down_proj"):  # HF's per-expert names, as the checkpoints'
        assert f"{prefix}.{proj}.lora_A.weight" in keys and f"{prefix}.{proj}.lora_B.weight" in keys
    config = json.loads((Path(exports["peft"]) / "adapter_config.json").read_text())
    assert {"gate_proj", "up_proj", "down_proj"} <= set(config["target_modules"])
    _check_peft_and_merged(moe_dir, exports, trained["after_unrouted"])


def test_merging_the_peft_export_gives_the_merged_export_byte_for_byte(one_rank, tmp_path):
    """What ``megagrpo eval --model <PEFT dir>`` evaluates (the adapter merged into the base it names) is
    what ``megagrpo export`` of the checkpoint writes, dense and with adapted experts."""
    from safetensors.torch import load_file

    from megagrpo.ckpt.peft_merge import merge_peft

    (exports,) = case(one_rank, "exports")
    for i, paths in enumerate(exports):
        merged = merge_peft(paths["peft"], tmp_path / f"merged{i}")  # the base: the adapter config's
        got, want = (load_file(str(Path(d) / "model.safetensors")) for d in (merged, paths["merged"]))
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype, name
            assert got[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name
        assert (merged / "config.json").is_file()
