"""Routed experts through ``megagrpo.generation.stream.RequestStream`` across a weight swap, on one in-process
vLLM engine with a tiny MoE model, in a process of its own.

Run by ``test_stream.py`` as ``python _stream_routing.py MODEL_DIR NUM_EXPERTS OUT_JSON`` (the caller sets
the environment as for ``_stream_scenarios.py``). Greedy requests run SWAP_AT steps (one token each),
the weights change (the first layer's input norm scaled by ``SCALE``, as ``_stream_scenarios.py`` changes
them), and they run to the end: swapped in flight ("keep" and "recompute"), or snapshot, aborted and
continued from the snapshot. Beside the requests in flight a probe-like request runs and its rows are
collected as the engine collects the probe's (``HookedRouting.collect(running=True)``). ``OUT_JSON``:
per scenario, per request ``{"prompt", "tokens", "versions", "rows"}`` (rows: nested lists).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _stream_scenarios import _norm  # run as a script: its folder is on the path

from megagrpo.generation.routing import HookedRouting
from megagrpo.generation.stream import RequestStream, StreamRequest
from megagrpo.types import SamplingSettings

PROMPTS = [[5, 17, 42, 7], [99, 3, 250, 18, 6, 71], list(range(30, 50))]
PROBE = [11, 12, 13, 200, 7]
GREEDY = SamplingSettings(max_tokens=10, temperature=0.0, ignore_eos=True)
SWAP_AT = 4
SCALE = 1.5


def _record(c, prompt):
    return {
        "prompt": prompt,
        "tokens": c.token_ids,
        "versions": c.versions,
        "rows": c.routed_experts.tolist(),
    }


def scenario(llm, routing, mode: str) -> dict:
    stream = RequestStream(llm, version=0, routing=routing)
    requests = [StreamRequest(f"{mode}{i}", tuple(p), GREEDY, group_id=i) for i, p in enumerate(PROMPTS)]
    stream.submit(requests)
    early = stream.advance(max_steps=SWAP_AT)
    out: dict = {"early": len(early)}
    if mode == "probe":  # the probe's request beside the stream's, as VLLMEngine runs it
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = stream.run_now([PROBE], params)
        out["probe_rows"] = routing.collect(llm, outputs, running=True)[0][0].tolist()
    if mode == "resumed":
        partials = stream.in_flight()
        out["partial_rows"] = {p.request.request_id: p.routed_experts.tolist() for p in partials}
        stream.abort([p.request.request_id for p in partials])
    (old,) = llm.collective_rpc(_norm)
    llm.collective_rpc(_norm, args=(old * SCALE,))
    stream.set_version(1, kv="keep" if mode in ("keep", "probe") else "recompute")
    if mode == "resumed":
        stream.resume_from(partials)
    done = stream.advance()
    llm.collective_rpc(_norm, args=(old,))
    out["requests"] = {c.request.request_id: _record(c, list(c.request.prompt_ids)) for c in done}
    out["left"] = len(stream)
    return out


def main(model_dir: str, num_experts: str, out_path: str) -> None:
    from vllm import LLM

    routing = HookedRouting(int(num_experts))
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        seed=0,
        block_size=32,  # vLLM's CPU attention wants multiples of 32
        enable_chunked_prefill=False,
        **routing.engine_args(),
    )
    routing.install(llm)
    results = {mode: scenario(llm, routing, mode) for mode in ("keep", "recompute", "resumed", "probe")}
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
