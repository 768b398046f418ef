"""Drive ``megagrpo.generation.stream.RequestStream`` on one in-process vLLM engine, in a process of its own.

Run by ``test_stream.py`` as ``python _stream_scenarios.py MODEL_DIR OUT_JSON`` (vLLM's global state and
engine threads stay out of the pytest process; one engine start for every scenario). ``OUT_JSON`` gets
one entry per scenario, each a dict of plain lists the test compares; records are
``{"id", "tokens", "logprobs", "versions", "finish"}``. The caller sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
and a small ``VLLM_CPU_KVCACHE_SPACE``.

Weights change through ``LLM.collective_rpc`` (a function run inside vLLM's worker), as the weight sync
loads them: the first layer's input norm weight is rescaled, a tensor vLLM's CPU build reads as it is (its
linear layers' weights are packed into GEMM kernels at load), and one that every key and value depends on
(unlike the final norm's, which only the logits see).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megagrpo.generation.stream import PartialRequest, RequestStream, StreamRequest
from megagrpo.types import SamplingSettings

PROMPTS = [[5, 17, 42, 7], [99, 3, 250, 18, 6, 71], [11, 12], list(range(30, 50)), [7] * 9, [123, 4, 56]]
SAMPLED = SamplingSettings(max_tokens=12, temperature=1.0, ignore_eos=True)
GREEDY = SamplingSettings(max_tokens=12, temperature=0.0, ignore_eos=True)


NORM = "model.layers.0.input_layernorm.weight"


def _norm(worker, new=None):
    """Inside vLLM's worker: a copy of ``NORM``; with ``new``, ``NORM`` set to it."""
    import torch

    (weight,) = [p for n, p in worker.model_runner.model.named_parameters() if n == NORM]
    old = weight.detach().clone()
    if new is not None:
        with torch.no_grad():
            weight.copy_(new)
    return old


def _requests(tag, settings, max_tokens=None, seeded=True):
    out = []
    for i, prompt in enumerate(PROMPTS):
        s = (
            settings
            if max_tokens is None
            else SamplingSettings(**{**vars(settings), "max_tokens": max_tokens[i]})
        )
        out.append(StreamRequest(f"{tag}{i}", tuple(prompt), s, seed=100 + i if seeded else None, group_id=i))
    return out


def _record(c):
    return {
        "id": c.request.request_id,
        "tokens": c.token_ids,
        "logprobs": c.logprobs,
        "versions": c.versions,
        "finish": c.finish_reason,
    }


def _run(llm, requests, version=0):
    """Every request uninterrupted on one stream: {id: record}."""
    stream = RequestStream(llm, version=version)
    stream.submit(requests)
    return {c.request.request_id: _record(c) for c in stream.advance()}


def slices(llm) -> dict:
    """Seeded sampling of different lengths, two steps per slice, the version bumped after two slices
    (weights unchanged); the reference: the same requests through ``LLM.generate``."""
    from vllm import SamplingParams

    max_tokens = [3, 5, 8, 13, 4, 9]
    requests = _requests("s", SAMPLED, max_tokens)
    params = [
        SamplingParams(
            max_tokens=m, temperature=1.0, ignore_eos=True, seed=r.seed, logprobs=0, detokenize=False
        )
        for m, r in zip(max_tokens, requests, strict=True)
    ]
    reference = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stream = RequestStream(llm)
    stream.submit(requests)
    per_slice, at_bump = [], None
    while len(stream):
        if len(per_slice) == 2:
            at_bump = {p.request.request_id: len(p.token_ids) for p in stream.in_flight()}
            stream.set_version(1, kv="keep")
        per_slice.append([_record(c) for c in stream.advance(max_steps=2)])
    return {
        "max_tokens": max_tokens,
        "per_slice": per_slice,
        "at_bump": at_bump,
        "reference": [
            {
                "tokens": list(r.outputs[0].token_ids),
                "logprobs": [
                    s[t].logprob for s, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids, strict=True)
                ],
            }
            for r in reference
        ],
        "failed": len(stream.take_failed()),
    }


def swap(llm, kv) -> dict:
    """Greedy requests; after 4 steps ``NORM`` changes (version 1) with ``kv``; references: the same
    requests uninterrupted on the old weights, and the snapshot's continuation on the new weights."""
    import torch

    requests = _requests(f"w{kv}", GREEDY, seeded=False)
    old_weights = _run(llm, requests)
    stream = RequestStream(llm)
    stream.submit(requests)
    early = [_record(c) for c in stream.advance(max_steps=4)]
    snapshot = stream.in_flight()
    (original,) = llm.collective_rpc(_norm)
    changed = original * (1 + 0.5 * torch.randn(original.shape, generator=torch.Generator().manual_seed(3)))
    llm.collective_rpc(_norm, args=(changed,))
    stream.set_version(1, kv=kv)
    swapped = {c.request.request_id: _record(c) for c in stream.advance()}
    continued = RequestStream(llm, version=1)
    continued.resume_from(snapshot)
    new_weights = {c.request.request_id: _record(c) for c in continued.advance()}
    llm.collective_rpc(_norm, args=(original,))
    return {
        "early": early,
        "at_swap": {p.request.request_id: len(p.token_ids) for p in snapshot},
        "swapped": swapped,
        "old_weights": old_weights,
        "continued_on_new_weights": new_weights,
    }


def pause(llm) -> dict:
    """Requests stopped after 3 steps and continued from their snapshot (greedy, and seeded twice), and
    swaps that change no weight (keep, recompute); references: the same requests uninterrupted."""
    out = {}
    for name, settings in (("greedy", GREEDY), ("seeded", SAMPLED)):
        requests = _requests(f"p{name}", settings)
        out[f"{name}_uninterrupted"] = _run(llm, requests)
        for attempt in ("", "_again"):
            stream = RequestStream(llm)
            stream.submit(requests)
            stream.advance(max_steps=3)
            snapshot = stream.in_flight()
            stream.abort([p.request.request_id for p in snapshot])
            stream.resume_from(snapshot)
            out[f"{name}_resumed{attempt}"] = {c.request.request_id: _record(c) for c in stream.advance()}
        for kv in ("keep", "recompute"):
            stream = RequestStream(llm)
            stream.submit(requests)
            stream.advance(max_steps=3)
            stream.set_version(1, kv=kv)
            out[f"{name}_same_weights_{kv}"] = {c.request.request_id: _record(c) for c in stream.advance()}
    return out


def abort(llm) -> dict:
    """Two of six requests aborted: one decoding, one still queued."""
    stream = RequestStream(llm)
    stream.submit(_requests("a", SAMPLED)[:5])
    finished = [_record(c) for c in stream.advance(max_steps=2)]
    stream.submit(_requests("a", SAMPLED)[5:])
    dropped = [r.request_id for r in stream.abort(["a1", "a5", "never-submitted"])]
    finished += [_record(c) for c in stream.advance()]
    return {
        "dropped": dropped,
        "finished": [r["id"] for r in finished],
        "failed": [f.request.request_id for f in stream.take_failed()],
        "engine_unfinished": llm.llm_engine.get_num_unfinished_requests(),
    }


def prefix_salt(llm) -> dict:
    """A prompt of more than one KV block, run at version 0, then (weights changed) at version 1, and once
    more at version 1 with vLLM's prefix cache emptied first; also at version 0 on the new weights, which
    may reuse the first run's blocks."""
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompt = tuple(range(1, block + 5))
    settings = SamplingSettings(max_tokens=4, temperature=1.0, ignore_eos=True)
    request = [StreamRequest("salt", prompt, settings, seed=7)]
    out = {"block_size": block, "v0": _run(llm, request)["salt"]}
    (original,) = llm.collective_rpc(_norm)
    llm.collective_rpc(_norm, args=(original * 1.5,))
    out["v0_label_on_new_weights"] = _run(llm, request, version=0)["salt"]
    out["v1"] = _run(llm, request, version=1)["salt"]
    out["reset"] = llm.reset_prefix_cache()
    out["v1_after_reset"] = _run(llm, request, version=1)["salt"]
    llm.collective_rpc(_norm, args=(original,))
    return out


def errors(llm) -> dict:
    """What bad requests and calls raise (messages), before anything reaches the engine."""
    stream = RequestStream(llm)
    two = SamplingSettings(max_tokens=4, n=2)
    calls = {
        "n2": lambda: stream.submit([StreamRequest("e0", (1, 2), two)]),
        "duplicate": lambda: stream.submit([StreamRequest("e1", (1, 2), GREEDY)] * 2),
        "kv": lambda: stream.set_version(1, kv="drop"),
        "misaligned": lambda: stream.resume_from(
            [PartialRequest(StreamRequest("e2", (1,), GREEDY), [3, 4], [], [0])]
        ),
        "steps": lambda: stream.advance(max_steps=0),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    stream.abort(["e1"])
    out["left"] = len(stream)
    return out


def stopped(llm) -> dict:
    """A snapshot's request whose tokens end with a stop token (one that finished beside the probe, not
    yet returned), continued: the record as it was, with nothing sampled after the stop."""
    stream = RequestStream(llm)
    settings = SamplingSettings(max_tokens=8, temperature=1.0, stop_token_ids=(9,))
    stream.resume_from(
        [PartialRequest(StreamRequest("s0", (1, 2), settings, 5), [5, 9], [-1.0, -2.0], [0, 0])]
    )
    return {"finished": [_record(c) for c in stream.advance()], "left": len(stream)}


def main(model_dir: str, out_path: str) -> None:
    from vllm import LLM

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,  # a prompt of more than one KV block (128 tokens on the CPU build)
        seed=0,
        logprobs_mode="processed_logprobs",  # as the generation worker: the distribution sampled from
        enable_chunked_prefill=False,  # as the worker on CPU: seeded requests need whole prefills
        max_num_batched_tokens=4096,
    )
    results = {"slices": slices(llm), "pause": pause(llm), "abort": abort(llm), "errors": errors(llm)}
    results["stopped"] = stopped(llm)
    results["prefix_salt"] = prefix_salt(llm)
    for kv in ("keep", "recompute"):
        results[f"swap_{kv}"] = swap(llm, kv)
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
