"""A fixed policy workload (tiny Qwen2 from an HF directory) shared by the dist and e2e tests."""

from __future__ import annotations

import torch

from megagrpo.config import load_config
from megagrpo.types import TrainBatch

SMALL_BUDGET, LARGE_BUDGET = 64, 4096


def policy_batch(seed: int = 0, size: int = 8) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    seqs, prompts = [], []
    for _ in range(size):
        length = int(torch.randint(8, 21, (1,), generator=gen))
        prompts.append(int(torch.randint(3, 6, (1,), generator=gen)))
        seqs.append(torch.randint(1, 300, (length,), generator=gen).tolist())
    batch = TrainBatch.from_sequences(seqs, prompts)
    return batch.replace(advantages=torch.randn(size, generator=gen))


def policy_config(hf_dir: str, *, tp=1, pp=1, dp=1, budget=LARGE_BUDGET, mini=8, kl=0.0, extra=()):
    return load_config(
        None,
        [
            "model.tiny=null",
            f"model.hf_dir={hf_dir}",
            "model.seq_length=64",
            "generation.max_new_tokens=16",
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"parallel.data_parallel_size={dp}",
            "parallel.use_distributed_optimizer=true",
            f"policy.micro_batch_max_tokens={budget}",
            f"policy.mini_batch_size={mini}",
            "policy.lr=1e-3",
            "policy.logprob_chunk_size=7",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations=4",
            f"grpo.kl_coef={kl}",
            "grpo.off_policy_correction=none",
            "grpo.behav_weight_cap=null",
            *extra,
        ],
    )


def load_then_continue(rank: int, world_size: int, cfg, path: str, keep_world: bool = False) -> dict:
    """A rank that loads a saved policy, scores ``policy_batch()`` and trains one step on the next
    batch: what a resumed run sees (compared with the run that saved). ``keep_world``: the ranks go on
    to other layouts (``destroy_parallel``)."""
    from megagrpo.parallel import destroy_parallel
    from megagrpo.policy.worker import PolicyWorker

    worker = PolicyWorker(cfg)
    try:
        worker.load(path)
        steps_after_load = worker.steps_done
        batch, next_batch = policy_batch(), policy_batch(seed=1)
        loaded_logprobs = worker.logprobs(batch)
        next_metrics = worker.train(next_batch.replace(old_logprobs=worker.logprobs(next_batch)))
        return {"loaded": loaded_logprobs, "next": next_metrics, "steps": steps_after_load}
    finally:
        destroy_parallel(keep_world=keep_world)
