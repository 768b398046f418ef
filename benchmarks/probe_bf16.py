"""The weight-sync probe's error in bfloat16: the numbers ``generation.probe_max_error``'s bf16 bound
is set from.

    python -m benchmarks.probe_bf16 [--against vllm|hf] [--models tiny m25] [--syncs 20]
        [--preset qwen2-1.5b] [--quick]

The probe (``weight_sync.sync.WeightSync.probe``) scores fixed random token sequences on the engines
and on the trainer after every sync; its error is the mean of exp|logprob_engine - logprob_trainer|
(1 = identical). In fp32 both sides agree to ~1e-7; in bf16 each side rounds its own kernels' way.

- ``--against vllm`` (cpu suite): real ``megagrpo train`` runs at ``model.dtype`` bfloat16, vLLM's CPU
  bf16 kernels against Megatron's bf16 layers, ``--syncs`` GRPO steps each (a sync and a probe per
  step), with the bound lifted so that the run records instead of stopping. ``tiny``: the demo's
  model from its own bf16 warm-up (the weights move every step); ``m25``: ``step``'s ~25M model
  from random weights, 2 syncs only: its rewards are mostly 0 (the weights move little) and a bf16 step
  of it takes 45-75 s on 2 CPU cores (bf16 matmuls without bf16 instructions; 245 s at 16 prompts x 8).
  Also recorded: ``train/token_mult_prob_error_mean``, the same measure on every step's sampled tokens
  (vLLM's sampling logprobs against the trainer's).
- ``--against hf`` (gpu suite: the device has no vLLM; on CUDA when torch sees it, else on CPU): Megatron
  bf16 on one rank against
  transformers' bf16 model holding the same weights (the sync's own HF conversion,
  ``WeightSender.hf_tensors``), both scoring the probe's sequences; between syncs one GRPO train step
  on random sequences and advantages moves the weights, and each sync uses the probe of another seed.

Measured: the probe error per sync; target: every sync <= the bf16 bound in force
(``weight_sync.probe.PROBE_BOUNDS``).
"""

from __future__ import annotations

import argparse
import math

from .common import TMP, importable_by_workers, record
from .common.megatron import PRESETS
from .common.record import Measurement
from .common.runs import metrics_rows, train_run

QUICK = {"models": ["tiny"], "syncs": 3, "preset": "smoke"}
MODELS: dict[str, list[str]] = {
    # make demo's model at TP 1, from the demo's warm-up made in bf16.
    "tiny": ["parallel.tensor_model_parallel_size=1"],
    # step.py's ~25M model (random weights, no warm-up), 2 prompts x 8, 32 new tokens.
    "m25": [
        *("model.tiny.num_layers=8", "model.tiny.hidden_size=512", "model.tiny.ffn_hidden_size=1536"),
        *("model.tiny.num_attention_heads=8", "model.tiny.num_query_groups=4", "warmup.steps=0"),
        *("grpo.num_prompts_per_step=2", "policy.mini_batch_size=16", "generation.max_new_tokens=32"),
        *("policy.micro_batch_max_tokens=4096", "parallel.tensor_model_parallel_size=1"),
    ],
}
MAX_SYNCS = {"m25": 2}
"""Syncs of a model whose weights stay where they started (see the module's docstring)."""
BF16 = ["model.dtype=bfloat16", "generation.probe_max_error=1000"]
PROBE_ERROR = "probe error (mean of exp abs delta logprob)"


def parse_args(argv=None) -> argparse.Namespace:
    p = record.parser("probe_bf16", __doc__, repeat=1)
    p.add_argument("--against", choices=["vllm", "hf"], default="vllm", help="the engine side")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "m25"], help="vllm runs")
    p.add_argument("--syncs", type=int, default=20, help="syncs (GRPO steps) per model")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2-1.5b", help="hf: the model shape")
    p.add_argument("--timeout", type=float, default=1800.0, help="hf: seconds for the rank")
    return record.parse(p, argv, QUICK)


def bound() -> float:
    from megagrpo.weight_sync.probe import PROBE_BOUNDS

    return PROBE_BOUNDS["bfloat16"]


def spread(name: str, samples: list[float], settings: dict, headline: bool = False) -> list[Measurement]:
    """The per-sync errors against the bound (no pipe characters in names and units: Markdown tables)."""
    return [Measurement(name, samples, "x", settings, target=f"<= {bound()}", headline=headline)]


def vllm_runs(args) -> list[Measurement]:
    out = []
    root = TMP / "probe_bf16"
    for model in args.models:
        syncs = min(args.syncs, MAX_SYNCS.get(model, args.syncs))
        run = train_run(root, f"bf16_{model}", syncs, [*MODELS[model], *BF16])
        rows = [r for r in metrics_rows(run) if "sync/probe_error" in r]
        settings = {"against": "vllm", "model": model, "syncs": len(rows)}
        probes = [r["sync/probe_error"] for r in rows]
        out += spread(
            f"{PROBE_ERROR}, vLLM bf16 vs Megatron bf16", probes, settings, headline=model == "tiny"
        )
        sampled = [r["train/token_mult_prob_error_mean"] for r in rows]
        name = "sampled tokens' error (the same measure), vLLM bf16 vs Megatron bf16"
        out.append(Measurement(name, sampled, "x", settings))
    return out


def hf_rank(rank: int, world_size: int, args) -> dict:
    """One Megatron rank and a transformers model on the same device, ``--syncs`` probes apart."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megagrpo.models.registry import hf_config_for
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.worker import PolicyWorker
    from megagrpo.types import TrainBatch
    from megagrpo.weight_sync.probe import probe_sequences

    from .common.configs import make_config
    from .common.megatron import model_overrides
    from .train import make_batch

    shape = PRESETS[args.preset]
    run = argparse.Namespace(seq=64, dtype="bfloat16", backend="auto", budget=4096, chunk=1024)
    # Untied, as R1-Distill-Qwen-1.5B (the recipe's model): the head is a tensor of its own.
    cfg = make_config({**model_overrides(run, shape, 1), "model.tiny.tie_word_embeddings": False,
                       "policy.mini_batch_size": 8, "grpo.kl_coef": 0.0, "grpo.num_prompts_per_step": 1,
                       "grpo.num_generations": 8})  # fmt: skip
    worker = PolicyWorker(cfg)
    try:
        _, _, info = worker.weight_source()
        hf_cfg = AutoConfig.for_model(**hf_config_for(info.arch, info.shape, torch.bfloat16))
        device = worker.ctx.device
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).to(device).eval()
        data = make_batch(64, 8, 0.5, shape["vocab_size"])
        # What the model holds that the sync must fill (a tied head is the embedding).
        wanted = {k for k in hf.state_dict() if not (hf_cfg.tie_word_embeddings and k == "lm_head.weight")}
        errors, worst = [], []
        for sync in range(args.syncs):
            sent = dict(worker._sender().hf_tensors())  # the gathered sync's own HF conversion
            if wanted - set(sent):
                raise RuntimeError(f"the sync sends no {sorted(wanted - set(sent))[:3]}")
            hf.load_state_dict({k: v.to(device) for k, v in sent.items()}, strict=False)
            probe = TrainBatch.from_sequences(probe_sequences(shape["vocab_size"], seed=1234 + sync), [1] * 4)
            trainer = worker.logprobs(probe, 1.0).double()  # [4, 31]
            with torch.no_grad():
                logits = hf(probe.input_ids.to(device)).logits.float()  # [4, 32, vocab]
            engine = torch.log_softmax(logits[:, :-1], -1).gather(-1, probe.input_ids[:, 1:, None].to(device))
            delta = (engine[..., 0].double().cpu() - trainer).abs()
            errors.append(float(torch.exp(delta).mean()))
            worst.append(float(delta.max()))
            print(f"[probe_bf16] sync {sync}: {errors[-1]:.6f}, largest |delta| {worst[-1]:.4f}", flush=True)
            old = worker.logprobs(data)
            worker.train(data.replace(old_logprobs=old, gen_logprobs=old))  # moves the weights
        return {"errors": errors, "worst": worst, "device": device.type}
    finally:
        destroy_parallel()


def hf_runs(args) -> list[Measurement]:
    from megagrpo.parallel.local import run_local_ranks

    (result,) = run_local_ranks(hf_rank, 1, args, timeout_s=args.timeout)
    settings = {"against": "hf", "preset": args.preset, "device": result["device"], "syncs": args.syncs}
    out = spread(
        f"{PROBE_ERROR}, transformers bf16 vs Megatron bf16", result["errors"], settings, headline=True
    )
    out.append(Measurement("largest abs delta logprob of a probe", result["worst"], "nats", settings))
    if any(not math.isfinite(e) for e in result["errors"]):
        raise SystemExit("probe_bf16: a non-finite probe error")
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    importable_by_workers()
    out = vllm_runs(args) if args.against == "vllm" else hf_runs(args)
    what = "the weight-sync probe's error in bfloat16, per sync, against the bf16 bound in force"
    notes = [f"bound: weight_sync.probe.PROBE_BOUNDS['bfloat16'] = {bound()}; --syncs {args.syncs}"]
    packages = ("torch", "megatron.core", "vllm" if args.against == "vllm" else "transformers")
    return record.write(args, "probe_bf16", what, out, packages=packages, notes=notes)


if __name__ == "__main__":
    main()
