"""TrainMetrics: the fields of an optimizer step's metrics, in the key order metrics.jsonl has."""

import dataclasses

import pytest
import torch

from megagrpo.algorithms.grpo import LossConfig, grpo_loss, reduce_metrics
from megagrpo.types import TrainMetrics

pytestmark = pytest.mark.unit


def _reduced(**optional) -> dict[str, float]:
    """What the policy reduces one micro-batch's loss metrics to, as it builds TrainMetrics."""
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 5, generator=gen)
    out = grpo_loss(
        lp,
        lp + 0.05 * torch.randn(2, 5, generator=gen),
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 5),
        LossConfig(
            off_policy_correction=optional.get("correction", "none"),
            behav_weight_cap=2.0 if optional.get("correction") in ("tis", "mis") else None,
            kl_coef=0.1 if optional.get("ref") else 0.0,
        ),
        ref_logprobs=lp - 0.1 if optional.get("ref") else None,
        gen_logprobs=lp + 0.01 if optional.get("gen") else None,
        entropy=torch.rand(2, 5, generator=gen),
    )
    return {"loss": 0.5, **reduce_metrics([out.metrics]), "grad_norm": 1.5, "lr": 1e-3, "update_applied": 1.0}


@pytest.mark.parametrize(
    "optional",
    [
        dict(),
        dict(gen=True),
        dict(gen=True, correction="tis"),
        dict(gen=True, correction="mis", ref=True),
        dict(gen=True, correction="decoupled_ppo"),
        dict(ref=True),
    ],
)
def test_as_dict_is_the_reduced_mapping_in_its_order(optional):
    reduced = _reduced(**optional)
    metrics = TrainMetrics(**reduced)
    assert list(metrics.as_dict().items()) == list(reduced.items())


def test_every_loss_metric_has_a_field():
    reduced = _reduced(gen=True, correction="tis", ref=True) | _reduced(gen=True, correction="mis")
    assert sorted(reduced) == sorted(f.name for f in dataclasses.fields(TrainMetrics))
