"""Greedy-decode token-id prompts with vLLM, one model after another, in a process of its own.

Run by ``test_vllm_loads_export.py`` as ``python _vllm_greedy.py JOBS_JSON OUT_JSON`` so that vLLM's
global state, OpenMP thread binding and engine threads never enter the pytest process. ``JOBS_JSON``
is a list of ``{"name", "model", "load_tokenizer", "prompts", "max_tokens", "max_model_len"}``;
``OUT_JSON`` gets ``{name: {"tokens": [[id, ...], ...], "logprobs": [[float, ...], ...],
"text": [str, ...] or null}}``, one entry per prompt, written only once every model has run.

The caller sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in this process: one process per
engine fewer to start on a 2-core machine) and a small ``VLLM_CPU_KVCACHE_SPACE``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def greedy(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=not job["load_tokenizer"],
        max_model_len=job["max_model_len"],
        seed=0,
    )
    # ignore_eos only stops the stop; it does not mask the EOS logit, so the argmax is untouched.
    # logprobs=0 returns the sampled token's log-probability from the raw (unprocessed) logits.
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=0)
    results = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    tokens, logprobs, text = [], [], []
    for result in results:
        out = result.outputs[0]
        tokens.append(list(out.token_ids))
        logprobs.append([step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs, strict=True)])
        text.append(out.text)
    del llm
    gc.collect()
    return {"tokens": tokens, "logprobs": logprobs, "text": text if job["load_tokenizer"] else None}


def main(jobs_path: str, out_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    results = {job["name"]: greedy(job) for job in jobs}
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
