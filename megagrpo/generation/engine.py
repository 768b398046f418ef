"""The contract between the driver and a rollout engine, and the engines megagrpo ships.

An engine is a class the runtime starts as a Ray actor (``runtime.engines``), one per
``generation.num_engines``, as ``cls(cfg, model_dir, engine_index, dummy_weights=...)`` ("start": the
constructor returns once the engine can take requests). The driver (``runtime.engines.EnginePool``,
``runtime.colocated``) and the weight sync (``weight_sync.sync``) call it only through the methods of
:class:`RolloutEngine`; multi-turn episodes run inside the engine (``run_episodes``), on the episode
runner (``envs.episodes``), which sees the engine as a ``TurnEngine``. An engine that also generates
continuously from a request stream, pausing between its steps to take weights, implements
:class:`StreamingEngine` on top.

Where the trainer's weights go inside an engine's workers is the engine's :class:`EngineLayout`, which
``weight_sync.shards`` takes as a parameter; the engine's own weight-loading hook (vLLM's:
``weight_sync.vllm_engine``) copies what arrives into those places.

``generation.engine`` names one :class:`EngineSpec` of :data:`ENGINES`: the engine's class, its layout
and its capabilities. The config's preflight (``config.rules``) checks, before any process starts, that
the engine has every capability the config asks of it (the capabilities are the config's plain data,
``config.rollout.ENGINE_CAPABILITIES``). The class and the layout are import paths, loaded when asked
for. The weight sync asks the engines themselves for their layout (:meth:`RolloutEngine.weight_layout`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

# Capabilities are plain data of the config (its preflight reads them; config does not import engines).
from megagrpo.config.rollout import CAPABILITIES, ENGINE_CAPABILITIES

if TYPE_CHECKING:
    from megagrpo.generation.stream import PartialRequest, StreamRequest, StreamSlice
    from megagrpo.types import Completion, SamplingSettings
    from megagrpo.weight_sync.buckets import Bucket
    from megagrpo.weight_sync.shards import Placement
    from megagrpo.weight_sync.transport import GroupAddress

__all__ = [
    "CAPABILITIES",
    "ENGINES",
    "SLEEP_TAGS",
    "EngineLayout",
    "EngineSpec",
    "RolloutEngine",
    "StreamingEngine",
    "engine_spec",
]

SLEEP_TAGS = ("weights", "kv_cache")
"""What a sleeping engine gives back, woken one tag at a time: "weights" before a sync receives them,
"kv_cache" once the trainer has parked its states (``runtime.colocated``)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the driver and the weight sync call on an engine (each a Ray actor method).

    Every method may be called on a Ray actor, so arguments and results are plain data: token-id lists,
    ``megagrpo.types`` records and the weight sync's frozen dataclasses.
    """

    def cpu_threads(self) -> int:
        """The engine's intra-op threads (on GPUs: those of its host process), for the start-up report."""
        ...

    def node_id(self) -> str:
        """The Ray node the engine runs on, for the start-up report."""
        ...

    def generate(
        self, prompts: list[list[int]], settings: SamplingSettings, seeds: list[int] | None = None
    ) -> list[Completion]:
        """``settings.n`` completions per prompt, in prompt order (``Completion.prompt_index``), sampled
        with ``settings``; with ``seeds`` (one per prompt) each prompt's samples do not depend on how
        prompts are split across engines and batched. Each completion carries its tokens' sampling
        logprobs after temperature ([] at temperature 0) and, for an engine started with
        ``grpo.routing_replay``, its routed experts ("report routing": ``Completion.routed_experts``)."""
        ...

    def run_episodes(
        self, tasks: list[dict], settings: SamplingSettings, seeds: list[int]
    ) -> list[Completion]:
        """``settings.n`` multi-turn episodes per task (``env.*``), in task order, each a ``Completion`` with
        its loss mask, opening prompt and reward (``envs.episodes.EpisodeRunner``)."""
        ...

    def close_episodes(self) -> None:
        """Stop the environment worker processes ``run_episodes`` started (a later call starts new ones)."""
        ...

    def prompt_logprobs(self, sequences: list[list[int]], *, routed: bool = False):
        """The probe: logprob of every token after the first given its prefix, at temperature 1, one list of
        ``len(sequence) - 1`` values per sequence. ``routed``: (those lists, each sequence's routed experts
        ``[len(sequence), MoE layers, k]``); an engine started without routing raises ValueError."""
        ...

    def sleep(self) -> None:
        """Give the device memory back (weights and KV cache, every tag of :data:`SLEEP_TAGS`; colocated
        placement). The weights are gone: a sync must refill every one. An engine asleep stays so; asked to
        generate or probe while asleep it raises instead of waiting."""
        ...

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Take back ``tags`` (of :data:`SLEEP_TAGS`; another tag is a ValueError); the engine takes
        requests again once every tag is back."""
        ...

    def init_weight_sync(
        self,
        groups: Sequence[GroupAddress],
        *,
        engine_index: int,
        backend: str,
        timeout_s: float,
        delta: bool = False,
    ) -> None:
        """Join the senders' groups (``groups[i]`` serves plan source ``i``; each worker of the engine joins
        those of its TP rank), as engine ``engine_index`` of the sync; blocks until the senders joined.
        ``delta``: every bucket comes with a header, whole or as the elements that changed since the
        last sync (``weight_sync.delta``): the engine keeps each bucket's bytes to patch."""
        ...

    def receive_weights(self, plan: Sequence[Bucket], *, checksums: bool = False) -> list[dict[int, str]]:
        """Receive and load one full sync of ``plan`` (blocks until every bucket has loaded); cached state
        computed with the old weights (a prefix cache) is dropped. With ``checksums``: per worker, by TP
        rank, {plan index: digest} of every bucket it received; else []. Weights asleep: RuntimeError."""
        ...

    def load_adapter(self, tensors: dict, config: dict) -> list[str]:
        """``generation.lora_sync: adapter`` (capability ``lora_adapters``): apply the policy's LoRA adapters,
        PEFT-named ``tensors`` with PEFT's ``config`` fields, in place of the last ones, to every request
        from now on; each worker's digest of what it received (``weight_sync.adapters.tensors_digest``)."""
        ...

    def weight_layout(self) -> EngineLayout:
        """Where the trainer's weights go among this engine's worker parameters (the sync plans with it)."""
        ...

    def param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per worker, by TP rank: every parameter a sync fills, with its shape, as the engine's
        :class:`EngineLayout` names them (the controller checks the plan covers them exactly)."""
        ...

    def received_bytes(self) -> list[int]:
        """Bucket bytes each worker received in the last sync, by TP rank."""
        ...

    def receive_buffer_bytes(self) -> list[int]:
        """Bytes of receive buffers each worker held in the last sync, by TP rank."""
        ...

    def shutdown_weight_sync(self) -> None:
        """Leave the sync's groups."""
        ...


@runtime_checkable
class StreamingEngine(RolloutEngine, Protocol):
    """An engine generating continuously from a request stream (capability ``"stream"``;
    ``grpo.async_mode: partial``), with the records of ``megagrpo.generation.stream``.

    Requests go in with :meth:`submit`; generation moves forward only inside :meth:`advance`, in whole
    engine steps (a token of every running request). Between two ``advance`` calls no step runs: the
    engine is paused at a token boundary, its running requests keep their state (KV cache included), and
    ``receive_weights`` may load new weights under them; :meth:`set_version` then says which policy
    version later tokens come from. ``generate`` and ``prompt_logprobs`` (validation, the probe) still
    work while the stream holds requests, which move on meanwhile.
    """

    def submit(self, requests: Sequence[StreamRequest]) -> None:
        """Queue requests (``settings.n`` 1 each); they start at the next :meth:`advance`."""
        ...

    def advance(self, seconds: float) -> StreamSlice:
        """Run whole engine steps until ``seconds`` have passed or no request is left: the requests that
        finished meanwhile, those the engine ended without a sample, and the seconds spent stepping."""
        ...

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Drop these requests (running or queued); the ids that were still there. None is ever a sample."""
        ...

    def set_version(self, version: int) -> None:
        """The policy version of the weights the engine holds from now on (tags the tokens it samples)."""
        ...

    def in_flight(self) -> list[PartialRequest]:
        """Every request not yet returned by :meth:`advance`, with its tokens, logprobs and versions so far
        (a checkpoint's record of it)."""
        ...

    def resume_from(self, partials: Sequence[PartialRequest]) -> None:
        """Queue the continuation of each partial request (prompt + its tokens so far); each finishes as one
        record, the parts joined."""
        ...


class EngineLayout(Protocol):
    """Where HF tensors live in an engine's per-worker parameters (``weight_sync.shards`` plans with it)."""

    name: str
    """The engine, in messages ("vLLM")."""

    def placement(self, hf_name: str) -> Placement:
        """The engine parameter HF tensor ``hf_name`` goes into: its name, the dim engine TP splits (-1:
        whole on every worker), its block in a fused parameter, its expert's index in a stacked one."""
        ...

    def padded_vocab(self, vocab_size: int) -> int:
        """Rows of the engine's embedding and LM head for ``vocab_size`` tokens (split over its TP ranks;
        rows past the vocabulary are zero)."""
        ...


@dataclass(frozen=True)
class EngineSpec:
    """One engine ``generation.engine`` can name."""

    name: str
    engine_class: str
    """"package.module:Class": the :class:`RolloutEngine` the runtime starts as Ray actors."""
    layout_object: str
    """"package.module:NAME": its :class:`EngineLayout`."""
    capabilities: frozenset[str]
    """Of :data:`CAPABILITIES` (``config.rollout.ENGINE_CAPABILITIES``): what it can do ("stream" exactly
    when the class is a StreamingEngine)."""

    def load_class(self) -> type[RolloutEngine]:
        return _load(self.engine_class)

    def layout(self) -> EngineLayout:
        return _load(self.layout_object)


def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


ENGINES = {
    "vllm": EngineSpec(
        "vllm",
        "megagrpo.generation.vllm:VLLMEngine",
        "megagrpo.generation.vllm_layout:VLLM_LAYOUT",
        ENGINE_CAPABILITIES["vllm"],
    ),
}
"""``generation.engine`` -> its spec (the config's Literal lists the same names: a unit test checks)."""


def engine_spec(name: str) -> EngineSpec:
    """The spec ``generation.engine`` names; ValueError listing the engines for another name."""
    if name not in ENGINES:
        raise ValueError(f"generation.engine: unknown engine {name!r}; engines: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]
