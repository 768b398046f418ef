"""The Megatron policy worker on a mixture-of-experts model (tiny Qwen3-MoE, 8 experts, top-2).

With the routing replayed (``grpo.routing_replay: rollout``: each token goes to the experts the batch
carries), the routing no longer depends on the layout, so one optimizer step's loss and grad norm, and the
logprobs before and after it, are those of one rank at EP 2 (tokens dispatched by all-to-all over gloo,
uneven micro-batch counts padded), PP 2, TP 2 (sequence parallel, packed) and TP 2 with the experts whole
on each rank over EP 2 (ETP 1). Replay is what it claims: replaying the routers' own choices changes nothing, other experts change the logprobs, and ``routing_check`` measures exactly that.
Without replay, EP 2 equals one rank as well (the routers choose alike on every rank), and so does a DPO
step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import make_tiny_hf
from policy_cases import SMALL_BUDGET, policy_batch, policy_config
from supervised_cases import dpo_batch

from megagrpo.parallel import destroy_parallel
from megagrpo.parallel.local import run_local_ranks
from megagrpo.algorithms.routing import routing_rows

pytestmark = pytest.mark.dist

EXPERTS, TOPK, LAYERS = 8, 2, 2
REPLAY = "grpo.routing_replay=rollout"
LOCAL = "parallel.transformer_impl=local"
TORCH = "parallel.transformer_impl=torch"


def engine_routing(batch, seed: int = 3) -> list[np.ndarray]:
    """Random distinct top-k experts per forwarded position, as an engine returns them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in batch.lengths.tolist():
        scores = torch.rand(length - 1, LAYERS, EXPERTS, generator=gen)
        out.append(scores.argsort(dim=-1)[..., :TOPK].numpy().astype(np.uint8))
    return out


def moe_batch(routing: list[np.ndarray] | None = None):
    batch = policy_batch()
    gen = torch.zeros(batch.size, batch.input_ids.shape[1] - 1)
    batch = batch.replace(gen_logprobs=gen)
    if routing is None:
        return batch
    return batch.replace(routing=routing_rows(routing, batch.input_ids.shape[1]))


def _one_step(cfg, replay: bool) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        batch = moe_batch(engine_routing(policy_batch()) if replay else None)
        old = worker.logprobs(batch)
        metrics = worker.train(batch.replace(old_logprobs=old))
        return {"old": old, "metrics": metrics, "new": worker.logprobs(batch)}
    finally:
        destroy_parallel(keep_world=True)


def _dpo_step(cfg) -> dict:
    from megagrpo.policy.supervised import DPOWorker

    worker = DPOWorker(cfg)
    try:
        batch = dpo_batch(0)
        return {"metrics": [worker.train_step(batch.replace(ref_logps=worker.reference_logps(batch)))]}
    finally:
        destroy_parallel(keep_world=True)


def _steps(rank: int, world_size: int, cases: list) -> list[dict]:
    """One step per (config, replay) case, one after another in the same processes; replay "dpo": a DPO
    step instead."""
    try:
        return [_dpo_step(cfg) if replay == "dpo" else _one_step(cfg, replay) for cfg, replay in cases]
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("moe_policy") / "qwen3_moe"
    return str(make_tiny_hf("qwen3_moe", out, num_hidden_layers=LAYERS))


def _cfg(hf_dir: str, *extra, **layout):
    return policy_config(hf_dir, extra=(LOCAL, *extra), **layout)


EP2 = "parallel.expert_model_parallel_size=2"
ETP1 = "parallel.expert_tensor_parallel_size=1"
DPO = ("dpo.num_steps=4", "dpo.beta=0.5")
LAYOUTS = {
    # EP 2 with a small token budget: the ranks pack different numbers of micro-batches.
    "ep2-small": (dict(dp=2, budget=SMALL_BUDGET), (EP2,), True),
    "ep2-recompute-full": (dict(dp=2, budget=SMALL_BUDGET), (EP2, "policy.recompute=full"), True),
    "pp2-small": (dict(pp=2, budget=SMALL_BUDGET), (), True),
    # TP 2: the torch layers with sequence parallelism (each TP rank routes its slice of the tokens),
    # packed micro-batches (THD) against the padded reference.
    "tp2-sp-torch": (dict(tp=2, budget=SMALL_BUDGET), (TORCH, "parallel.sequence_parallel=true"), True),
    # TP 2 for attention, the experts whole on each rank and split over the same two ranks by EP 2
    # (ETP 1: Megatron's parallel folding); each TP rank dispatches its sequence-parallel slice.
    "tp2-ep2-etp1": (
        dict(tp=2, budget=SMALL_BUDGET),
        (TORCH, "parallel.sequence_parallel=true", EP2, ETP1),
        True,
    ),
    "ep2-unreplayed": (dict(dp=2), (EP2,), False),
    "ep2-dpo": (dict(dp=2, budget=SMALL_BUDGET), (EP2, *DPO), "dpo"),
}


@pytest.fixture(scope="module")
def one_rank(hf_dir) -> dict:
    """The reference steps on one rank, replayed and not."""
    cases = [(_cfg(hf_dir, REPLAY), True), (_cfg(hf_dir), False), (_cfg(hf_dir, *DPO), "dpo")]
    (res,) = run_local_ranks(_steps, 1, cases, timeout_s=600)
    return {True: res[0], False: res[1], "dpo": res[2]}


@pytest.fixture(scope="module")
def two_ranks(hf_dir) -> dict:
    """Every layout of ``LAYOUTS``, run by the same two ranks one after another."""
    cases = [
        (_cfg(hf_dir, *extra, *((REPLAY,) if replay is True else ()), **layout), replay)
        for layout, extra, replay in LAYOUTS.values()
    ]
    results = run_local_ranks(_steps, 2, cases, timeout_s=900)
    return {name: [res[i] for res in results] for i, name in enumerate(LAYOUTS)}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same_step(results: list[dict], reference: dict) -> None:
    (want,) = reference["metrics"]
    mask = policy_batch().response_mask()
    for res in results:
        (got,) = res["metrics"]
        assert _rel(got.loss, want.loss) <= 1e-5, (got.loss, want.loss)
        assert _rel(got.grad_norm, want.grad_norm) <= 1e-5, (got.grad_norm, want.grad_norm)
        assert got.tokens == want.tokens
        torch.testing.assert_close(res["old"][mask], reference["old"][mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["new"][mask], reference["new"][mask], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", [name for name, case in LAYOUTS.items() if case[2] is True])
def test_replayed_step_does_not_depend_on_layout(layout, one_rank, two_ranks):
    _assert_same_step(two_ranks[layout], one_rank[True])


def test_unreplayed_step_at_ep2_equals_one_rank(one_rank, two_ranks):
    _assert_same_step(two_ranks["ep2-unreplayed"], one_rank[False])
    # Replay changed the routing, so the logprobs and the gradient: the comparisons are not vacuous.
    assert one_rank[True]["metrics"][0].grad_norm != one_rank[False]["metrics"][0].grad_norm
    assert not torch.equal(one_rank[True]["old"], one_rank[False]["old"])


def _replay_semantics(rank: int, world_size: int, cfg) -> dict:
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        plain = moe_batch()
        own = _own_routing(worker, plain)
        chosen = worker.logprobs(plain)
        replayed_own = worker.logprobs(moe_batch(own))
        other = moe_batch(engine_routing(plain))
        replayed_other = worker.logprobs(other)
        return {
            "chosen": chosen,
            "own": replayed_own,
            "other": replayed_other,
            "check_own": worker.routing_check(moe_batch(own).replace(gen_logprobs=chosen)),
            "check_other": worker.routing_check(other.replace(gen_logprobs=replayed_other)),
        }
    finally:
        destroy_parallel()


def _own_routing(worker, batch) -> list[np.ndarray]:
    """The routers' own choices for ``batch`` (one micro-batch per sequence, recorded), per sequence."""
    from megagrpo.policy.engine import forward_backward

    out = []
    for row in range(batch.size):
        sub = batch.select([row])
        ((_, micro),) = worker.micro_batches(sub, [0])
        micro["record"] = []

        def nothing(logits, micro):
            return torch.zeros(()), torch.tensor(1, dtype=torch.int), {}

        worker._forward_only([micro], nothing)
        layers = micro["record"][0]  # per layer [tokens, k], padded layout (b = 1): token order
        n = int(sub.lengths[0]) - 1
        out.append(torch.stack([r[:n] for r in layers], dim=1).numpy().astype(np.uint8))
    return out


def test_replay_routes_through_the_given_experts(hf_dir):
    (res,) = run_local_ranks(_replay_semantics, 1, _cfg(hf_dir, REPLAY), timeout_s=300)
    mask = policy_batch().response_mask()
    # The routers' own choices replayed: the same logprobs, bit for bit.
    assert torch.equal(res["own"][mask], res["chosen"][mask])
    assert res["check_own"]["moe/routing_agreement"] == 1.0
    assert res["check_own"]["moe/token_mult_prob_error_no_replay"] == pytest.approx(1.0, abs=1e-6)
    # Other experts: other logprobs, which only replay reproduces.
    assert (res["other"][mask] - res["chosen"][mask]).abs().max() > 1e-3
    assert res["check_other"]["moe/routing_agreement"] < 0.5
    assert res["check_other"]["moe/token_mult_prob_error_no_replay"] > 1.0 + 1e-4


def test_dpo_step_at_ep2_equals_one_rank(one_rank, two_ranks):
    (want,) = one_rank["dpo"]["metrics"]
    for res in two_ranks["ep2-dpo"]:
        (got,) = res["metrics"]
        assert _rel(got.loss, want.loss) <= 1e-5, (got.loss, want.loss)
        assert _rel(got.grad_norm, want.grad_norm) <= 1e-5, (got.grad_norm, want.grad_norm)
