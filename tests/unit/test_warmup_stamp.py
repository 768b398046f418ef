"""Which config changes let ``megagrpo train`` (and the benchmark suite) reuse a saved warm-up."""

import pytest

from megagrpo.config import load_config
from megagrpo.trainers.warmup import warmup_stamp

pytestmark = pytest.mark.unit


def stamp(*overrides: str) -> str:
    return warmup_stamp(load_config(None, list(overrides)))


def test_layout_and_grpo_settings_keep_the_warm_up():
    base = stamp()
    assert stamp("parallel.tensor_model_parallel_size=1") == base
    assert stamp("policy.micro_batch_max_tokens=1024") == base
    assert stamp("grpo.num_prompts_per_step=32", "generation.max_new_tokens=32") == base


def test_what_the_warm_up_computes_changes_the_stamp():
    base = stamp()
    changed = [
        stamp("warmup.steps=10"),
        stamp("warmup.lr=0.01"),
        stamp("model.tiny.hidden_size=64"),
        stamp("policy.weight_decay=0.5"),
        stamp("policy.clip_grad=0.5"),
    ]
    assert all(s != base for s in changed)
    assert len(set(changed)) == len(changed)


def test_a_lora_run_reuses_the_full_fine_tuning_warm_up_as_its_base():
    """``policy.lora`` and the GRPO lr leave the stamp alone, and the warm-up itself trains every weight:
    a LoRA run of the demo starts its adapters on the dense demo's cached warm-up."""
    from megagrpo.trainers.warmup import warmup_config

    lora = ("policy.lora.rank=8", "policy.lr=3e-3")
    assert stamp(*lora) == stamp()
    assert not warmup_config(load_config(None, list(lora))).policy.lora.enabled
