"""LoRA adapters (``policy.lora``): the base unchanged at the start, layout-independent training, adapter-only
checkpoints that reshard, PEFT and merged exports that transformers + peft load with the trainer's logits.

Two spawned worlds (``one_rank``, ``two_ranks``), as ``test_policy`` runs its cases.
"""

from __future__ import annotations

from pathlib import Path

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


def _lora_config(hf_dir: str, **layout):
    extra = (*LORA, *layout.pop("extra", ()))
    return policy_config(hf_dir, mini=4, kl=0.1, extra=extra, **layout)


def _base_logprobs(hf_dir: str) -> torch.Tensor:
    from megagrpo.policy.worker import PolicyWorker

    return PolicyWorker(policy_config(hf_dir)).logprobs(policy_batch())


def _train(cfg, save_to: str | None = None) -> dict:
    """Two optimizer steps (two mini-batches; the first moves B only, B being zero, the second A too)."""
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    batch = policy_batch()
    module = worker.engine.module
    start = worker.logprobs(batch)
    ref = worker.reference_logprobs(batch)
    metrics = worker.train(batch.replace(old_logprobs=start, ref_logprobs=ref))
    held = [p for buffer in worker.engine.model[0].buffers for p in buffer.params]
    out = {
        "start": start,
        "metrics": metrics,
        "after": worker.logprobs(batch, 1.0),
        "ref_after": worker.reference_logprobs(batch),
        "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
        "adapter_numel": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "planned_numel": _planned(cfg, worker),
        "ddp_holds_adapters_only": {id(p) for p in held}
        == {id(p) for p in module.parameters() if p.requires_grad},
    }
    if save_to is not None:
        worker.save(save_to)
    return out


def _planned(cfg, worker) -> int:
    """What ``megagrpo plan`` counts as this rank's adapter elements."""
    from megagrpo.models.lora import adapter_params_per_rank

    lora, shape = cfg.policy.lora, worker.model_info.shape
    per_layer = adapter_params_per_rank(shape, lora.targets, lora.rank, worker.ctx.sizes.tp)
    return shape.num_layers // worker.ctx.sizes.pp * per_layer


def _load(cfg, path: str) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    worker.load(path)
    return {"loaded": worker.logprobs(policy_batch(), 1.0), "steps": worker.steps_done}


def _exports(ckpt: str, out: str) -> dict:
    """Both exports of the saved checkpoint (last case of its world: they tear the world down)."""
    from megagrpo.ckpt.lora_export import export_merged, export_peft

    return {
        "peft": str(export_peft(ckpt, Path(out) / "peft")),
        "merged": str(export_merged(ckpt, Path(out) / "hf")),
    }


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny_hf("qwen2", tmp_path_factory.mktemp("lora") / "qwen2"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_out")
    return {"ckpt": root / "step", "export": root / "export"}


@pytest.fixture(scope="module")
def one_rank(hf_dir, dirs) -> list[dict]:
    cases = {
        "base": (_base_logprobs, hf_dir),
        "train": (_train, _lora_config(hf_dir), str(dirs["ckpt"])),
        "exports": (_exports, str(dirs["ckpt"]), str(dirs["export"])),  # last: it ends the world
    }
    return run_cases(1, cases)


@pytest.fixture(scope="module")
def two_ranks(hf_dir, dirs, one_rank) -> list[dict]:
    cases = {f"train/{name}": (_train, _lora_config(hf_dir, **layout)) for name, layout in LAYOUTS.items()}
    cases["load/tp2"] = (_load, _lora_config(hf_dir, tp=2), str(dirs["ckpt"]))
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


def test_peft_loads_the_adapter_and_the_merged_export_matches(one_rank, hf_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    (exports,) = case(one_rank, "exports")
    (trained,) = case(one_rank, "train")
    mask = policy_batch().response_mask()
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    plain = _hf_logprobs(base)
    adapted = PeftModel.from_pretrained(base, exports["peft"]).eval()
    with_adapter = _hf_logprobs(adapted)
    merged = AutoModelForCausalLM.from_pretrained(exports["merged"], dtype=torch.float32).eval()
    from_merged = _hf_logprobs(merged)
    assert (with_adapter[mask] - plain[mask]).abs().max() > 1e-3  # the adapter is loaded, not ignored
    torch.testing.assert_close(with_adapter[mask], trained["after"][mask], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(from_merged[mask], with_adapter[mask], atol=1e-5, rtol=1e-5)
