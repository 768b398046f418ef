"""The tiny model's warm-up before GRPO: an SFT run (``megagrpo.trainers.sft``) on the synthetic
arithmetic task.

GRPO needs a policy that is sometimes right: a randomly initialised model never is, so every group has zero
reward variance and no gradient. The warm-up teaches the tiny default model the answer format with a short
supervised run (loss only on the answer tokens) and measures greedy exact-match accuracy on held-out
problems before and after. ``warmup.*`` maps onto an SFT config (:func:`warmup_config`): its steps, batch,
seed and lr (linear warm-up over the first 10% of the steps, then constant; Adam's defaults), the rest of
the optimizer and the micro-batch budget from ``policy``. It runs the real trainer stack (Megatron-Core
GPTModel, DDP, optimizer, LR scheduler and pipeline schedule over the config's TP/PP/DP layout).

``megagrpo train`` warms up once per config and reuses the saved model (:func:`warmed_up_model`); so does
``megagrpo dpo`` on a tiny model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from megagrpo.ckpt.durable import atomic_write
from megagrpo.config import CheckpointConfig, Config, SFTConfig, config_to_dict
from megagrpo.config.training import LoraConfig


@dataclass(frozen=True)
class WarmupResult:
    accuracy_before: float
    """Greedy exact-match accuracy on the held-out problems before training."""
    accuracy_after: float
    """The same after the warm-up."""
    final_loss: float
    """Mean answer-token cross-entropy of the last step."""
    steps: int
    seconds: float
    tokens_per_s: float
    """Training tokens per second of step time."""
    metrics_path: str


def warmup_config(cfg: Config) -> Config:
    """The SFT run the warm-up is: ``warmup.*`` on the synthetic task, no checkpoints of its own."""
    wu = cfg.warmup
    policy = dataclasses.replace(
        cfg.policy,
        lr=wu.lr,
        min_lr=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        lr_warmup_steps=max(1, wu.steps // 10),
        lr_schedule="constant",
        lora=LoraConfig(),  # the warm-up makes the base: every weight trains, LoRA or not afterwards
    )
    sft = SFTConfig(
        num_steps=wu.steps, batch_size=wu.batch_size, num_val_examples=wu.num_eval_prompts, seed=wu.seed
    )
    data = dataclasses.replace(cfg.data, train_path=None, val_path=None, apply_chat_template=True)
    logging = dataclasses.replace(cfg.logging, log_every=10, wandb=False)
    return dataclasses.replace(
        cfg, policy=policy, sft=sft, data=data, logging=logging, checkpoint=CheckpointConfig()
    )


def run_warmup(cfg: Config, *, ckpt: Path | None = None) -> WarmupResult | None:
    """Run the warm-up (outputs under ``<logging.dir>/<run_name>/warmup``); with ``ckpt``, save the model
    there. Returns the controller's result (None on the other ranks under torchrun)."""
    from megagrpo.trainers.sft import run_sft

    if cfg.warmup.steps <= 0:
        raise ValueError("warmup.steps is 0: nothing to run (set warmup.steps=N)")
    if cfg.model.tiny is None:
        raise ValueError(
            "warm-up runs on the tiny model only: set model.tiny (model.hf_dir is not supported here)"
        )
    out_dir = Path(cfg.logging.dir) / cfg.run_name / "warmup"
    res = run_sft(warmup_config(cfg), run_dir=out_dir, final_model=ckpt)
    if res is None:
        return None
    return WarmupResult(
        accuracy_before=res.first["val/greedy_accuracy"],
        accuracy_after=res.last["val/greedy_accuracy"],
        final_loss=res.final_loss,
        steps=res.steps,
        seconds=res.seconds,
        tokens_per_s=res.tokens_per_s,
        metrics_path=str(out_dir / "metrics.jsonl"),
    )


WARMUP_POLICY_KEYS = ("weight_decay", "clip_grad")
"""The optimizer settings the warm-up takes from ``policy`` (:func:`warmup_config` sets the others)."""


def warmup_stamp(cfg: Config) -> str:
    """What a saved warm-up must have been trained with to be reused for ``cfg``: its model, warm-up,
    data and optimizer settings. Not the parallel layout or the micro-batch budget: they change the
    arithmetic's order, not what is computed (the saved Megatron checkpoint is resharded on load)."""
    config = config_to_dict(cfg)
    stamp = {k: config[k] for k in ("model", "warmup", "data")}
    stamp["policy"] = {k: config["policy"][k] for k in WARMUP_POLICY_KEYS}
    return yaml.safe_dump(stamp, sort_keys=True)


def warmed_up_model(cfg: Config, run_dir: Path) -> tuple[Config, str]:
    """(config whose model is loadable by the policy and vLLM, the HF directory vLLM reads).

    A tiny in-process model is first warmed up (or reused from an earlier warm-up of the same config)
    and saved as a megagrpo checkpoint; both sides then load that. Other models are returned as they are.
    """
    if cfg.model.tiny is None:
        return cfg, str(cfg.model.hf_dir)
    ckpt = run_dir / "warmup" / "ckpt"
    stamp = ckpt / "warmup_config.yaml"
    wanted = warmup_stamp(cfg)
    if not (stamp.is_file() and stamp.read_text() == wanted):
        if cfg.warmup.steps > 0:
            res = run_warmup(cfg, ckpt=ckpt)
            if res is not None:  # None on the ranks other than the controller, under torchrun
                print(f"warm-up: greedy accuracy {res.accuracy_before:.1%} -> {res.accuracy_after:.1%}")
        else:
            run_warmup(dataclasses.replace(cfg, warmup=dataclasses.replace(cfg.warmup, steps=1)), ckpt=ckpt)
        atomic_write(stamp, wanted)
    else:
        print(f"warm-up: reusing {ckpt}")
    model = dataclasses.replace(cfg.model, tiny=None, hf_dir=str(ckpt / "hf"), megatron_ckpt=str(ckpt))
    return dataclasses.replace(cfg, model=model), str(ckpt / "hf")
