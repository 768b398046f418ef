"""Continuous generation on one in-process vLLM engine: a queue of requests that keeps decoding while the
trainer's weights are swapped in between engine steps, every sampled token stamped with the policy
version that sampled it.

Design (verified against vLLM 0.32, engine core in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

- **Driving the engine.** Requests go straight to ``LLM.llm_engine``: ``add_request`` (our id; vLLM
  appends a random suffix and returns that internal id, which ``abort_request(..., internal=True)``
  takes), ``step`` (one schedule + forward + sample; with the engine core in-process it returns only
  when that step is done), ``abort_request``. Not ``LLM.generate``: it steps the engine until *every*
  request is done, this stream's included, and sorts the results by ``int(request_id)``. So while a
  stream holds requests, the engine must not be used through ``LLM.generate`` (the probe included).
- **Token boundary.** Between two :meth:`RequestStream.advance` calls no engine step runs, so weights
  loaded then (``collective_rpc``: the weight sync's path) land between two tokens of every request
  in flight. This needs a step to finish inside ``step()``: vLLM's async scheduling keeps a batch
  queued past it (``max_concurrent_batches`` > 1), so the stream refuses such an engine. vLLM's CPU
  build turns async scheduling off itself; on GPUs the engine is started with ``async_scheduling=False``.
  No pause call is needed: vLLM's own ``pause_scheduler(mode="keep")`` exists for engines whose core
  loops in another process; in-process, not calling ``step`` is the pause.
- **Outputs.** Requests ask for ``RequestOutputKind.DELTA``: each step returns only the tokens (and their
  logprobs) that step sampled, so the stream stamps them with the version of the weights that ran the
  step, and holds each request's tokens, logprobs and versions so far itself. (``CUMULATIVE``, vLLM's
  default, re-sends every token every step; ``FINAL_ONLY`` shows nothing before the end.) vLLM labels
  the same spans itself (``set_weight_version``; ``CompletionOutput.weight_versions`` at the end): the
  stream checks that both agree.
- **KV cache at a swap** (:data:`KV_MODES`). ``"keep"``: in-flight requests keep the KV their prefix
  had under the old weights and decode on (what PipelineRL-style in-flight updates do; free). A token
  sampled after the swap then comes from new weights over a prefix whose keys and values older weights
  computed; its version says which weights sampled it. ``"recompute"``: ``reset_prefix_cache(
  reset_running_requests=True)`` makes vLLM preempt every running request and prefill prompt + tokens
  so far again, with the new weights, before its next token (one prefill of everything in flight). The
  plain ``reset_prefix_cache()`` after a sync refuses (returns False) while requests hold blocks.
  Either way no *new* request reuses a prefix block computed by other weights: each request's prefix
  blocks are salted with the version at its submission (vLLM's ``cache_salt``), so requests share
  cached prefixes only within a version.
- **Failures.** A request the engine ends otherwise than "stop" or "length" ("abort", "error") is never
  a sample: it goes to :meth:`RequestStream.take_failed`, not to the finished list. The stream learns of
  an end only from the engine's outputs: vLLM's pause and sleep in "abort" mode (``sleep``'s default)
  drop requests without one (``Scheduler.finish_requests``), so neither may run while a stream holds
  requests.
- **Snapshot** (:meth:`RequestStream.in_flight`): per request, the request itself (prompt, sampling
  settings, seed, group) and its tokens, sampling logprobs and versions so far: what a checkpoint
  stores. :meth:`RequestStream.resume_from` submits each as a continuation, prompt + tokens so far with
  ``max_tokens`` less the tokens it has, and returns it finished with the parts joined; one that already
  ended (its last token a stop token, or its ``max_tokens`` reached: a request that finished beside the
  probe and was not yet returned) is returned as it is, nothing sampled after it.
- **Routed experts** (``grpo.routing_replay``, a stream given a ``routing`` capture:
  ``generation.routing``). Each request's rows are kept per position, each position with the row of its
  *first* forward: the one that sampled the next token, under the weights that sampled it
  (``routing.merge_rows``). So a response whose tokens several versions sampled keeps the rows of every
  version, a ``"recompute"`` swap's second forward of the positions so far included: those rows are the
  new weights', but the tokens already sampled were the old weights'. Rows are taken from the capture
  when a request finishes, is aborted or fails (dropped), or a snapshot is taken (kept in it, and carried
  by its continuation, whose own prefill's rows for those positions are dropped).
- **Reproducibility.** vLLM seeds a generator per request (``torch.Generator.manual_seed``) when the
  request first reaches the model runner and keeps it while the request lives, preemption included:
  a ``"recompute"`` swap continues each request's random stream. A CPU generator cannot be rewound or
  skipped ahead, so a continuation from a snapshot is a new engine request with its own seed,
  derived from the request's seed and its token count (:func:`continuation_seed`): the same snapshot
  continues the same way every time, but not as the uninterrupted request would have. Greedy requests
  (temperature 0) continue exactly as the uninterrupted request (tested).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from megagrpo.generation.routing import merge_rows
from megagrpo.types import Completion, SamplingSettings

KvMode = Literal["keep", "recompute"]
KV_MODES: tuple[KvMode, ...] = ("keep", "recompute")
"""What a weight swap does to the KV cache of requests in flight (module docstring)."""

SAMPLE_FINISH_REASONS = ("stop", "length")
"""vLLM finish reasons that end a sample; any other ("abort", "error") makes the request a failure."""


@dataclasses.dataclass(frozen=True)
class StreamRequest:
    """One response to sample (controller -> engine); a group's responses are requests of one group id."""

    request_id: str
    """Unique among the stream's requests in flight."""
    prompt_ids: tuple[int, ...]
    """[P] prompt token ids."""
    settings: SamplingSettings
    """How to sample; ``settings.n`` must be 1 (each sample of a group is a request of its own)."""
    seed: int | None = None
    """This request's sampling seed; None: ``settings.seed``."""
    group_id: int | str | None = None
    """The group (prompt) the response belongs to."""
    task: dict | None = None
    """Multi-turn episodes (``env.environment``): the environment's task; the request is then an episode,
    ``prompt_ids`` unused (``megagrpo.generation.stream_episodes``)."""


@dataclasses.dataclass(frozen=True)
class StreamCompletion:
    """A finished request; N = ``len(token_ids)``, and ``logprobs`` and ``versions`` line up with it."""

    request: StreamRequest
    token_ids: list[int]
    """[N] sampled tokens (the stop token included when one ended the response)."""
    logprobs: list[float]
    """[N] sampling logprob of each token, as the engine's ``logprobs_mode`` has it ([] only if it reports
    none; vLLM's CPU build reports them at temperature 0 too)."""
    versions: list[int]
    """[N] the policy version whose weights sampled each token."""
    finish_reason: str
    """"stop" or "length"."""
    routed_experts: torch.Tensor | None = None
    """[P + N - 1, MoE layers, k] a stream with a routing capture: each position's experts, as its first
    forward routed them (``Completion.routed_experts``); None: none asked for."""
    episode: Completion | None = None
    """A multi-turn episode's whole record (opening, loss mask, reward, stats); None: a plain request."""

    def completion(self, prompt_index: int) -> Completion:
        """The record the rest of the pipeline takes (without the versions)."""
        return Completion(
            prompt_index,
            list(self.token_ids),
            list(self.logprobs),
            self.finish_reason,
            routed_experts=self.routed_experts,
        )


@dataclasses.dataclass(frozen=True)
class StreamSlice:
    """What one ``advance`` of an engine's stream returns to the driver."""

    finished: list[StreamCompletion]
    failed: list[StreamFailure]
    """Requests the engine ended without a sample (never trained on: their groups are generated again)."""
    busy_s: float
    """Seconds the engine spent stepping."""
    restarted: int = 0
    """Episodes resumed from a checkpoint that restarted from their openings (``generation.stream_episodes``:
    their environment answered otherwise on replay)."""


@dataclasses.dataclass(frozen=True)
class PartialRequest:
    """A request in flight, as a checkpoint stores it; N = tokens sampled so far."""

    request: StreamRequest
    token_ids: list[int]
    """[N] tokens sampled so far (after the prompt)."""
    logprobs: list[float]
    """[N] their sampling logprobs (as ``StreamCompletion.logprobs``)."""
    versions: list[int]
    """[N] the policy version that sampled each."""
    routed_experts: torch.Tensor | None = None
    """[F, MoE layers, k] with a routing capture: the rows of the F positions forwarded so far (F <= P +
    N - 1), as their first forward routed them; None: none asked for."""
    episode: dict | None = None
    """A multi-turn episode's state (``generation.stream_episodes``): its turns and environment answers
    so far and the step or turn running, as plain data; ``token_ids`` etc. are then the episode's tokens
    after its opening, observations included. None: a plain request, or an episode opened again."""


@dataclasses.dataclass(frozen=True)
class StreamFailure:
    """A request the engine ended without a sample (never trained on)."""

    request: StreamRequest
    reason: str
    """vLLM's finish reason ("abort", "error", ...)."""


def sampling_params(settings: SamplingSettings, seed: int | None, **overrides):
    """vLLM's ``SamplingParams`` for ``settings`` (n, tokens, temperature, top-p/k, stops) seeded ``seed``:
    token ids only (no detokenizing), with each sampled token's logprob; ``overrides`` replace fields."""
    from vllm import SamplingParams

    fields = {
        "n": settings.n,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        # vLLM's ignore_eos passes EOS only; the stop tokens (EOS among them) go too.
        "stop_token_ids": [] if settings.ignore_eos else list(settings.stop_token_ids),
        "ignore_eos": settings.ignore_eos,
        "seed": seed,
        "logprobs": 0,
        "detokenize": False,
    }
    return SamplingParams(**(fields | overrides))


def continuation_seed(seed: int | None, tokens_so_far: int) -> int | None:
    """The seed of a continuation of a seeded request that has ``tokens_so_far`` tokens: a fixed function of
    both, so the same snapshot continues the same way (vLLM's generator cannot skip ahead: module doc)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + tokens_so_far) % (2**63 - 1)


@dataclasses.dataclass
class _Live:
    """A request in the engine. For a continuation the lists start with the snapshot's tokens, and the
    engine's prompt is ``request.prompt_ids`` + those ``carried`` tokens."""

    request: StreamRequest
    engine_id: str
    carried: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    rows: torch.Tensor | None = None
    """With a routing capture: the rows taken so far (``merge_rows``)."""


class RequestStream:
    """A queue of sampling requests on one ``vllm.LLM`` whose engine core runs in this process.

    ``submit`` queues requests; ``advance`` runs engine steps for a budget and returns the requests that
    finished in it; between two ``advance`` calls the caller may load new weights and call
    ``set_version``. While it holds requests, nothing else may step the engine (``LLM.generate``).
    """

    def __init__(self, llm, *, version: int = 0, routing=None):
        """``routing``: an installed routed-experts capture (``generation.routing``): each finished
        request then carries its rows; None: none."""
        config = llm.llm_engine.vllm_config
        if config.max_concurrent_batches != 1:
            raise ValueError(
                f"RequestStream needs an engine that finishes each step inside step(): this one queues "
                f"{config.max_concurrent_batches} batches (async_scheduling="
                f"{config.scheduler_config.async_scheduling}, pipeline parallel "
                f"{config.parallel_config.pipeline_parallel_size}); start vLLM with async_scheduling=False "
                "and no pipeline parallelism"
            )
        self._llm, self._engine, self._routing = llm, llm.llm_engine, routing
        self._live: dict[str, _Live] = {}  # by request id
        self._ready: list[StreamCompletion] = []  # finished, for the next advance (run_now's, continuations')
        self._failed: list[StreamFailure] = []
        self.version = version
        self._engine.set_weight_version(str(version))
        self.lora_request = None
        """The adapter every request added from now on names (``generation.vllm_lora``); None: the base."""

    # ------------------------------------------------------------------------------------------ queue

    def submit(self, requests: Iterable[StreamRequest]) -> None:
        """Queue ``requests``; they start at the next ``advance``."""
        for request in requests:
            self._add(request, (), (), ())

    def _add(self, request: StreamRequest, tokens: Sequence[int], logprobs, versions, rows=None) -> None:
        from vllm.sampling_params import RequestOutputKind

        s = request.settings
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already in flight on this stream")
        if s.n != 1:
            raise ValueError(
                f"request {request.request_id!r}: settings.n is {s.n}; a stream request is one sample "
                "(submit a group's samples as requests of one group_id)"
            )
        left = s.max_tokens - len(tokens)
        if left < 0:
            raise ValueError(
                f"request {request.request_id!r}: {len(tokens)} tokens so far, more than max_tokens "
                f"{s.max_tokens}"
            )
        # A snapshot taken after its last token (a request finished beside the probe, not yet returned):
        # finished, with nothing to sample; vLLM would sample on past a stop token at the prompt's end.
        stopped = bool(tokens) and not s.ignore_eos and tokens[-1] in s.stop_token_ids
        if left == 0 or stopped:
            reason = "stop" if stopped else "length"
            self._ready.append(
                StreamCompletion(request, list(tokens), list(logprobs), list(versions), reason, rows)
            )
            return
        if self._routing is not None and not self._live:
            self._routing.start(self._llm)  # recording on (a batch-mode generate may have stopped it)
        seed = request.seed if request.seed is not None else s.seed
        params = sampling_params(
            s,
            continuation_seed(seed, len(tokens)) if tokens else seed,
            max_tokens=left,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = {
            "prompt_token_ids": list(request.prompt_ids) + list(tokens),
            "cache_salt": f"v{self.version}",
        }
        engine_id = self._engine.add_request(
            request.request_id, prompt, params, lora_request=self.lora_request
        )
        self._live[request.request_id] = _Live(
            request, engine_id, len(tokens), list(tokens), list(logprobs), list(versions), rows
        )

    def abort(self, request_ids: Iterable[str]) -> list[StreamRequest]:
        """Drop these requests (unknown ids are ignored); none of them is ever returned as finished.
        Returns the requests dropped."""
        dropped = [self._live.pop(rid) for rid in request_ids if rid in self._live]
        if dropped:
            self._engine.abort_request([live.engine_id for live in dropped], internal=True)
            if self._routing is not None:  # their rows so far, never to be used
                self._routing.take_chunks(self._llm, {live.request.request_id: None for live in dropped})
        return [live.request for live in dropped]

    def __len__(self) -> int:
        """Requests in flight (queued or decoding)."""
        return len(self._live)

    def busy(self) -> bool:
        """Requests in flight, or finished ones the next ``advance`` returns."""
        return bool(self._live or self._ready)

    # ------------------------------------------------------------------------------------- stepping

    def advance(
        self, *, max_steps: int | None = None, max_seconds: float | None = None
    ) -> list[StreamCompletion]:
        """Run engine steps until ``max_steps`` steps ran, ``max_seconds`` passed (checked after each step)
        or no request is left; return the requests that finished meanwhile, in the order they finished.
        Without a budget: until no request is left."""
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"advance: max_steps must be at least 1, got {max_steps}")
        finished, self._ready = self._ready, []
        start, steps = time.monotonic(), 0
        while self._live and self._engine.has_unfinished_requests():
            finished.extend(self._finish(self._engine.step()))
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
            if max_seconds is not None and time.monotonic() - start >= max_seconds:
                break
        return finished

    def _finish(self, outputs) -> list[StreamCompletion]:
        """One engine step's outputs of the stream's requests recorded; the requests that ended with a
        sample, with their routed experts when the stream captures them."""
        ended = [(output, live) for output in outputs if (live := self._take(output)) is not None]
        if self._routing is not None and ended:
            chunks = self._routing.take_chunks(self._llm, {live.request.request_id: o for o, live in ended})
        done = []
        for output, live in ended:
            out = output.outputs[0]
            if out.finish_reason not in SAMPLE_FINISH_REASONS:
                self._failed.append(StreamFailure(live.request, str(out.finish_reason)))
                continue
            self._check_versions(live, out.weight_versions)
            rows = None
            if self._routing is not None:
                rows = self._final_rows(live, chunks[live.request.request_id])
            done.append(
                StreamCompletion(
                    live.request, live.token_ids, live.logprobs, live.versions, out.finish_reason, rows
                )
            )
        return done

    @staticmethod
    def _final_rows(live: _Live, chunks) -> torch.Tensor:
        """A finished request's rows: every position of prompt + response but the last token's."""
        what = f"stream request {live.request.request_id!r}"
        rows = merge_rows(live.rows, chunks, what)
        length = len(live.request.prompt_ids) + len(live.token_ids) - 1
        if rows.shape[0] < length:
            raise RuntimeError(
                f"routed experts of {what}: {rows.shape[0]} positions routed, expected {length}"
            )
        return rows[:length]

    def _take(self, output) -> _Live | None:
        """Record one request's delta; the request, out of the stream, when it ended."""
        # vLLM reports our id (its internal id less the suffix it added); it drops an aborted request's.
        live = self._live.get(output.request_id)
        if live is None:
            return None
        (out,) = output.outputs
        new = list(out.token_ids)
        live.token_ids.extend(new)
        if out.logprobs:
            live.logprobs.extend(step[tok].logprob for step, tok in zip(out.logprobs, new, strict=True))
        live.versions.extend([self.version] * len(new))
        if not output.finished:
            return None
        del self._live[output.request_id]
        return live

    @staticmethod
    def _check_versions(live: _Live, spans) -> None:
        """Our per-token versions against vLLM's own labels of the engine request's tokens."""
        ours = live.versions[live.carried :]
        theirs = [int(s.version) for s in spans or () for _ in range(s.start, s.end)]
        if ours != theirs or (live.logprobs and len(live.logprobs) != len(live.token_ids)):
            raise RuntimeError(
                f"request {live.request.request_id!r}: per-token records out of line (tokens "
                f"{len(live.token_ids)}, logprobs {len(live.logprobs)}, versions {ours} vs vLLM's {theirs})"
            )

    def take_failed(self) -> list[StreamFailure]:
        """The requests the engine ended without a sample since the last call."""
        failed, self._failed = self._failed, []
        return failed

    # ---------------------------------------------------------------------------------- weight swap

    def set_version(self, version: int, *, kv: KvMode = "keep") -> None:
        """Call after new weights are loaded (between two ``advance`` calls): tokens sampled from now on
        carry ``version``; ``kv`` says what becomes of the KV cache of requests in flight (module doc)."""
        if kv not in KV_MODES:
            raise ValueError(f"set_version: kv must be one of {KV_MODES}, got {kv!r}")
        if kv == "recompute" and not self._engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to drop the KV cache of the requests in flight")
        self.version = version
        self._engine.set_weight_version(str(version))
        self.lora_request = None
        """The adapter every request added from now on names (``generation.vllm_lora``); None: the base."""

    # ------------------------------------------------------------------------------ checkpointing

    def in_flight(self) -> list[PartialRequest]:
        """Every request in flight with its tokens, logprobs and versions so far (queued ones: none yet),
        and with a routing capture the rows of the positions forwarded so far."""
        if self._routing is not None and self._live:
            chunks = self._routing.take_chunks(self._llm, dict.fromkeys(self._live))
            for rid, live in self._live.items():
                if live.rows is not None or chunks[rid]:
                    live.rows = merge_rows(live.rows, chunks[rid], f"stream request {rid!r}")
        return [
            PartialRequest(
                live.request, list(live.token_ids), list(live.logprobs), list(live.versions), live.rows
            )
            for live in self._live.values()
        ] + [
            PartialRequest(c.request, c.token_ids, c.logprobs, c.versions, c.routed_experts)
            for c in self._ready
        ]

    def resume_from(self, partials: Iterable[PartialRequest]) -> None:
        """Queue each partial request's continuation (prompt + tokens so far, the tokens left of its
        ``max_tokens``); it finishes as one record, the parts joined."""
        for p in partials:
            lined_up = len(p.versions) == len(p.token_ids) and len(p.logprobs) in (0, len(p.token_ids))
            if not lined_up:
                raise ValueError(
                    f"partial request {p.request.request_id!r}: {len(p.token_ids)} tokens, {len(p.logprobs)} "
                    f"logprobs and {len(p.versions)} versions do not line up"
                )
            self._add(p.request, p.token_ids, p.logprobs, p.versions, p.routed_experts)

    # ------------------------------------------------------------------------- other requests

    def run_now(self, prompts: Sequence[Sequence[int]], params) -> list:
        """vLLM's ``RequestOutput`` of each prompt (one ``SamplingParams``, or one per prompt), in prompt
        order, run on the engine beside the stream's requests: what ``LLM.generate`` would return, for the
        probe and validation while the stream holds requests (``LLM.generate`` would step them and keep
        their outputs). The stream's requests move on meanwhile, their tokens stamped as in ``advance``;
        those that finish are returned by the next ``advance``."""
        from vllm.sampling_params import RequestOutputKind

        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = {}
        for index, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            own = f"run-now-{index}"  # never a stream id: those are the driver's
            ids[own] = index
            self._engine.add_request(
                own, {"prompt_token_ids": list(prompt)}, p, lora_request=self.lora_request
            )
        outputs: list = [None] * len(prompts)
        left = len(ids)
        while left:
            for output in self.step_beside():
                index = ids.get(output.request_id)
                if index is not None and output.finished:
                    outputs[index], left = output, left - 1
        return outputs

    def step_beside(self) -> list:
        """One engine step with requests of the caller's beside the stream's (added to the engine with
        ids of their own): vLLM's outputs of the caller's requests. The stream's requests move on as in
        ``advance``; those that finish are returned by the next ``advance``."""
        ours, theirs = [], []
        for output in self._engine.step():
            (ours if output.request_id in self._live else theirs).append(output)
        self._ready.extend(self._finish(ours))
        return theirs
