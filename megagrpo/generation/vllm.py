"""One vLLM engine: token ids in, token ids + sampling logprobs out; receives weights from the trainer.

:class:`VLLMEngine` is the :class:`~megagrpo.generation.engine.RolloutEngine` of ``generation.engine:
vllm``; its weight layout is ``generation.vllm_layout``, and its workers load what the sync sends through
``weight_sync.vllm_engine``. A plain class; ``megagrpo.runtime.engines`` runs it as a Ray actor
(``num_gpus`` = engine TP on GPU). The engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the actor owns it outright. Prompts and responses are token
ids end to end: no detokenize/re-tokenize between generator and trainer, so the trainer scores exactly
the tokens that were sampled. Multi-turn episodes run on the engine's own loop (:func:`vllm_turn_engine`).

What crosses the actor boundary is typed: ``generate`` takes ``SamplingSettings`` and returns
``Completion`` records (``megagrpo.types``); ``receive_weights`` takes the sync's bucket plan
(``weight_sync.buckets.Bucket``) and ``init_weight_sync`` the groups' ``GroupAddress``es; only
the last hop into vLLM's worker (``collective_rpc``) is the dict vLLM's API asks for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from megagrpo.compat import vllm_cpu_moe_ep
from megagrpo.compat.torch_store import stores_listen_on_their_host
from megagrpo.compat.vllm_eager_cpu import eager_cpu_engine_env
from megagrpo.config import Config
from megagrpo.envs.episodes import Turn, TurnEngine
from megagrpo.generation import vllm_lora
from megagrpo.generation.engine import SLEEP_TAGS
from megagrpo.generation.routing import engine_routing
from megagrpo.generation.stream import (
    PartialRequest,
    RequestStream,
    StreamRequest,
    StreamSlice,
    sampling_params,
)
from megagrpo.generation.stream_episodes import EpisodeStream
from megagrpo.generation.vllm_layout import VLLM_LAYOUT, VLLMLayout
from megagrpo.types import Completion, SamplingSettings
from megagrpo.weight_sync.buckets import Bucket
from megagrpo.weight_sync.plugin import BACKEND
from megagrpo.weight_sync.transport import GroupAddress


def scheduler_args(cfg: Config) -> dict:
    """vLLM scheduler settings: ``generation.max_num_seqs`` when set; on vLLM's CPU build, whole-prompt
    prefills and room for one step's rollouts per engine.

    Chunked prefill is off on CPU: a prompt prefilled in several steps has its provisional sampled
    tokens discarded, and vLLM then rewinds that request's seeded generator, which CPU generators
    cannot do ("CPU Generator does not use offset"). Every rollout request is seeded, so once a
    step's prompts exceed the token budget (4096 by default) generation would fail. Without chunking
    the budget must hold one whole prompt.

    The CPU build's default of 256 sequences per engine TP rank would decode a larger step in waves,
    each paying vLLM's per-step scheduling again (measured on the tiny demo, 512 rollouts of at most
    8 tokens: 0.37 s in two waves, 0.30 s in one).
    """
    from vllm.platforms import current_platform

    gen, partial = cfg.generation, cfg.grpo.async_mode == "partial"
    args = {} if gen.max_num_seqs is None else {"max_num_seqs": gen.max_num_seqs}
    if not current_platform.is_cpu():
        # A request stream loads weights between two engine steps: each step must be done when step()
        # returns, which vLLM's async scheduling (a batch queued past it) is not (generation.stream).
        return args | ({"async_scheduling": False} if partial else {})
    if gen.max_num_seqs is None:
        # Partial rollouts: the driver keeps up to max_staleness + 1 steps' groups on the engines.
        steps = cfg.grpo.max_staleness + 1 if partial else 1
        rollouts = steps * cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations
        rollouts = max(rollouts, cfg.data.num_val_prompts)
        per_engine = -(-rollouts // gen.num_engines)
        args["max_num_seqs"] = max(256 * gen.engine_tensor_parallel_size, per_engine)
    # vLLM wants the token budget to hold a decode step of every sequence.
    budget = max(4096, cfg.model.seq_length, args["max_num_seqs"])
    return args | {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def vllm_env(cfg: Config) -> dict[str, str]:
    """Environment variables vLLM reads at start-up, as this config wants them (applied only where the
    process environment does not set them already)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if cfg.generation.cpu_kvcache_space_gib is not None:  # null: vLLM's own default
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.generation.cpu_kvcache_space_gib)
    # vLLM logs every weight reload at INFO/WARNING; the driver reports what matters per step.
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    # Eager without GPUs: TorchDynamo off, vLLM would still compile two sampler helpers (compat).
    env |= eager_cpu_engine_env(gpus=cfg.cluster.gpus_per_node, enforce_eager=cfg.generation.enforce_eager)
    if cfg.generation.engine_tensor_parallel_size > 1:
        # vLLM's CPU build otherwise pins each TP worker's threads to a NUMA node of its own and
        # refuses machines with fewer nodes than workers (ignored by the CUDA build).
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def engine_cpu_threads(cfg: Config, node_cores: int) -> int | None:
    """Intra-op threads of a vLLM engine without GPUs, or None to leave them to vLLM (GPUs; engine
    TP > 1, whose worker processes vLLM binds itself).

    Ray starts a 1-CPU actor with one thread, and vLLM's in-process CPU engine keeps that count (it
    disables ``torch.set_num_threads`` once started). So, set before it starts: ``cluster.cpu_threads``
    when given; else, on one node where the trainer waits while the engines generate
    (``grpo.max_staleness`` 0), the node's cores shared among the engines; else ``cpus_per_worker``.
    """
    if cfg.cluster.gpus_per_node > 0 or cfg.generation.engine_tensor_parallel_size > 1:
        return None
    if cfg.cluster.cpu_threads is not None:
        return cfg.cluster.cpu_threads
    if cfg.grpo.max_staleness > 0 or cfg.cluster.num_nodes > 1:
        return max(1, int(cfg.cluster.cpus_per_worker))
    return max(1, node_cores // cfg.generation.num_engines)


class VLLMEngine:
    """A ``vllm.LLM`` in this process (a Ray actor's), as a :class:`~megagrpo.generation.engine.RolloutEngine`
    (the methods' contracts are there). Its sleep tags are vLLM's own (``LLM.wake_up(tags=...)``)."""

    def __init__(self, cfg: Config, model_dir: str, engine_index: int = 0, *, dummy_weights: bool = True):
        for name, value in vllm_env(cfg).items():
            os.environ.setdefault(name, value)
        threads = engine_cpu_threads(cfg, len(os.sched_getaffinity(0)))
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        gen = cfg.generation
        self.cfg, self.model_dir = cfg, model_dir
        self.engine_index = engine_index
        self._episodes = None  # the episode runner's renderer and environment pool, made on first use
        self.asleep: set[str] = set()  # the SLEEP_TAGS given back (colocated placement)
        # grpo.async_mode partial: made by the first submit
        self.stream: RequestStream | EpisodeStream | None = None
        self.version = 0  # the policy version of the weights held (set_version)
        # Routed experts with every completion (grpo.routing_replay), else None.
        self.routing = engine_routing(cfg, model_dir)
        has_tokenizer = any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
        # vLLM's own process group: its store listens on VLLM_HOST_IP only (loopback on a local run).
        with stores_listen_on_their_host():
            self.llm = LLM(
                model=model_dir,
                dtype=cfg.model.dtype,
                tensor_parallel_size=gen.engine_tensor_parallel_size,
                enable_expert_parallel=gen.engine_expert_parallel,
                max_model_len=cfg.model.seq_length,
                enforce_eager=gen.enforce_eager,
                gpu_memory_utilization=gen.gpu_memory_utilization,
                seed=gen.seed + engine_index,
                skip_tokenizer_init=not has_tokenizer,
                # The trainer compares against the distribution that was sampled from (after temperature).
                logprobs_mode="processed_logprobs",
                # Weights arrive with the first sync; loading them from disk would be wasted work.
                load_format="dummy" if dummy_weights else "auto",
                weight_transfer_config=WeightTransferConfig(backend=BACKEND),
                # Colocated engines give their memory back while the trainer runs (vLLM: CUDA only;
                # on CPU their sleep is imitated, see ``sleep``).
                enable_sleep_mode=gen.placement == "colocated" and cfg.cluster.gpus_per_node > 0,
                **scheduler_args(cfg),
                **(self.routing.engine_args() if self.routing is not None else {}),
                **vllm_lora.engine_args(cfg),
            )
        # generation.lora_sync adapter: the adapter every request names, once the first sync installed it
        self.lora_request = None
        if gen.engine_expert_parallel:
            self._check_expert_placement()
        if self.routing is not None:
            self.routing.install(self.llm)

    def _check_expert_placement(self) -> None:
        """vLLM's expert parallelism: its CPU kernel made to take local expert ids
        (``compat.vllm_cpu_moe_ep``), and every worker holding the contiguous range of experts the weight
        sync sends it (``weight_sync.shards``: worker ``j`` of ``e``, experts ``j E/e .. (j+1) E/e - 1``)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            self.llm.collective_rpc(vllm_cpu_moe_ep.install)
        workers = self.llm.collective_rpc(vllm_cpu_moe_ep.local_experts)
        for j, layers in enumerate(workers):
            for layer, experts in enumerate(layers):
                per = len(experts)
                if experts != list(range(j * per, (j + 1) * per)):
                    raise RuntimeError(
                        f"vLLM placed experts {experts} of MoE layer {layer} on engine worker {j}; weight "
                        f"sync sends worker {j} experts {j * per}..{(j + 1) * per - 1} (linear placement)"
                    )

    # ---------------------------------------------------------------------------------- generation

    def cpu_threads(self) -> int:
        """The engine's intra-op threads (on GPUs: those of its host process)."""
        import torch

        return torch.get_num_threads()

    def node_id(self) -> str:
        """The Ray node this engine runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def generate(
        self, prompts: list[list[int]], settings: SamplingSettings, seeds: list[int] | None = None
    ) -> list[Completion]:
        """``settings.n`` completions per prompt, in prompt order.

        ``seeds`` (one per prompt) make each prompt's samples independent of how prompts are
        split across engines and batched, which keeps resumed runs on the same trajectory.
        """
        self._require_awake("generate")
        if seeds is not None:
            per_prompt = [sampling_params(settings, s) for s in seeds]
        else:
            per_prompt = sampling_params(settings, settings.seed)
        outputs, routed = self._run_routed(prompts, per_prompt, self.routing is not None)
        completions = []
        for index, out in enumerate(outputs):
            for c, comp in enumerate(out.outputs):
                ids = list(comp.token_ids)
                # Greedy requests (temperature 0) report no sampling distribution.
                lps = (
                    [step[tok].logprob for step, tok in zip(comp.logprobs, ids, strict=True)]
                    if comp.logprobs
                    else []
                )
                experts = routed[index][c] if routed is not None else None
                completions.append(
                    Completion(index, ids, lps, comp.finish_reason or "length", routed_experts=experts)
                )
        return completions

    def run_episodes(
        self, tasks: list[dict], settings: SamplingSettings, seeds: list[int]
    ) -> list[Completion]:
        """``settings.n`` multi-turn episodes per task (``env.*``, ``megagrpo.envs.episodes``), in task
        order; ``Completion.prompt_index`` is the task's index. The first call starts the environment
        worker processes and loads the model's tokenizer (its chat template renders the messages)."""
        from megagrpo.envs.episodes import EpisodeRunner

        self._require_awake("run_episodes")
        renderer, pool = self.episode_parts()
        # Beside a stream's requests (validation under grpo.async_mode partial): the engine is stepped
        # through the stream, and the routing capture records on (it holds their rows too).
        inner = self.stream.stream if isinstance(self.stream, EpisodeStream) else self.stream
        beside = inner if inner is not None and len(inner) else None
        stops = renderer.stop_token_ids
        engine = vllm_turn_engine(
            self.llm, settings, stops, self.routing, beside=beside, lora_request=self.lora_request
        )
        runner = EpisodeRunner(engine, renderer, pool, self.cfg.env, max_context=self.cfg.model.seq_length)
        if self.routing is None or beside is not None:
            return runner.run(tasks, settings.n, seeds)
        self.routing.start(self.llm)
        try:
            return runner.run(tasks, settings.n, seeds)
        finally:
            self.routing.stop(self.llm)

    def episode_parts(self):
        """(the ``ChatRenderer`` of the model's tokenizer, the environment worker pool), made on first use."""
        if self._episodes is None:
            from transformers import AutoTokenizer

            from megagrpo.envs.chat import ChatRenderer

            renderer = ChatRenderer(AutoTokenizer.from_pretrained(self.model_dir))
            self._episodes = renderer, self._env_pool()
        return self._episodes

    def _env_pool(self):
        """Environment worker processes (``env.num_workers``)."""
        from megagrpo.rewards.pool import DeadlinePool

        env = self.cfg.env
        return DeadlinePool(
            "megagrpo.envs.runner:env_call",
            env.num_workers,
            env.step_timeout_s,
            numeric=False,
            what="environment",
            preload=["megagrpo.envs.runner"],
        )

    def close_episodes(self) -> None:
        """Stop the environment worker processes (a later run_episodes starts new ones)."""
        if self._episodes is not None:
            self._episodes[1].close()
            self._episodes = None
        if isinstance(self.stream, EpisodeStream):
            self.stream.runner.pool.close()

    def prompt_logprobs(self, sequences: list[list[int]], *, routed: bool = False):
        """Logprob of every token after the first, given its prefix (the probe), at temperature 1.

        One list per sequence, ``len(sequence) - 1`` values each: entry ``t`` scores ``sequence[t + 1]``.
        ``routed`` (an engine returning routed experts): (those lists, each sequence's routed experts
        ``[len(sequence), MoE layers, k]``, every position forwarded).
        """
        from vllm import SamplingParams

        self._require_awake("the probe")
        if routed and self.routing is None:
            raise ValueError("routed experts were asked of an engine started without grpo.routing_replay")
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs, rows = self._run_routed(sequences, params, routed)
        result = []
        for seq, out in zip(sequences, outputs, strict=True):
            # Position 0 has no logprob (nothing precedes it).
            result.append([out.prompt_logprobs[t][seq[t]].logprob for t in range(1, len(seq))])
        if not routed:
            return result
        # One sampled token: its prompt's positions are the rows (P + 1 - 1).
        return result, [per[0] for per in rows]

    def sleep(self) -> None:
        """Colocated placement: give the GPU to the trainer, weights and KV cache both (vLLM's level 2:
        discarded, not copied to host memory as at level 1, since every wake-up is followed by a full
        weight sync; vLLM keeps the model's buffers, such as rotary tables, itself). An engine asleep
        already stays so.

        vLLM's CPU worker ignores sleep (its engine still pauses scheduling): there the discarded
        weights are imitated, every weight the forward reads made NaN (:func:`_forget_weights`), so
        that a sync which misses a tensor fails the probe as on a GPU, where the woken memory holds
        whatever it held."""
        from vllm.platforms import current_platform

        if self.asleep == set(SLEEP_TAGS):
            return
        self.llm.sleep(level=2)
        if current_platform.is_cpu():
            self.llm.collective_rpc(_forget_weights)
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Take back ``tags`` of the GPU memory: "weights" before a sync receives them, "kv_cache" once
        the trainer parked its states; vLLM schedules again once both are back."""
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; vLLM's are {list(SLEEP_TAGS)}")
        waking = [t for t in SLEEP_TAGS if t in tags and t in self.asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def _require_awake(self, what: str) -> None:
        """vLLM queues requests while it sleeps (it would wait for ever): an error instead."""
        if self.asleep:
            raise RuntimeError(
                f"{what} on vLLM engine {self.engine_index} while its {' and '.join(sorted(self.asleep))} "
                "sleep (colocated placement wakes the weights for a sync, then the KV cache)"
            )

    # --------------------------------------------------------------------------------- weight sync

    def init_weight_sync(
        self,
        groups: Sequence[GroupAddress],
        *,
        engine_index: int,
        backend: str,
        timeout_s: float,
        delta: bool = False,
    ) -> None:
        """Join the senders' broadcast groups (blocks until the trainer's senders have joined too).

        ``groups``: one address per link, indexed by ``Bucket.source``; each worker joins those of its
        engine TP rank (``GroupAddress.engine_rank``, or all when it is None). ``engine_index``: this
        engine's place among the sync's engines (which fixes its workers' ranks in every group).
        ``delta``: the senders send deltas (``weight_sync.delta``).
        """
        # vLLM hands this dict to the worker's transfer engine as ``MegagrpoInitInfo(**init_info)``.
        init_info = {
            "groups": list(groups),
            "engine_index": engine_index,
            "backend": backend,
            "timeout_s": timeout_s,
            "delta": delta,
        }
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def receive_weights(self, plan: Sequence[Bucket], *, checksums: bool = False) -> list[dict[int, str]]:
        """Receive one full sync of ``plan`` (blocks until every bucket has arrived and loaded).

        With ``checksums``: per worker of this engine (by rank), {plan index: digest} of every bucket
        it received; else [].
        """
        if "weights" in self.asleep:
            raise RuntimeError(
                f"weights sent to vLLM engine {self.engine_index} while its weights sleep: wake them first"
            )
        # vLLM hands this dict to the worker's transfer engine as ``MegagrpoUpdateInfo(**update_info)``.
        update_info = {"buckets": tuple(plan), "checksums": checksums}
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", args=(update_info,))
        self.llm.collective_rpc("finish_weight_update")
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        return self.llm.collective_rpc(_received_digests) if checksums else []

    def load_adapter(self, tensors: dict, config: dict) -> list[str]:
        """``generation.lora_sync: adapter``: install the policy's LoRA adapters (PEFT-named ``tensors``,
        PEFT's ``config``) in place of the last ones, in every worker (``generation.vllm_lora``); every
        request from now on names them, a stream's requests in flight included. Returns each worker's
        digest of the tensors it received, by rank."""
        if "weights" in self.asleep:
            raise RuntimeError(f"adapters sent to vLLM engine {self.engine_index} while its weights sleep")
        digests = self.llm.collective_rpc(vllm_lora.install, args=(tensors, config))
        self.lora_request = vllm_lora.adapter_request()
        if self.stream is not None:
            self.stream.lora_request = self.lora_request
        # Cached KV blocks were computed with the old adapters (a stream's are salted by version).
        self.llm.reset_prefix_cache()
        return digests

    def weight_layout(self) -> VLLMLayout:
        """vLLM's layout (``generation.vllm_layout``)."""
        return VLLM_LAYOUT

    def param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Per worker of this engine (by rank), every parameter a sync fills, with its shape
        (``vllm_engine.model_param_shapes``): what the controller checks the plan against."""
        return self.llm.collective_rpc(_param_shapes)

    def received_bytes(self) -> list[int]:
        """Bucket bytes each of this engine's workers received in the last sync, by worker rank."""
        return self.llm.collective_rpc(_received_bytes)

    def receive_buffer_bytes(self) -> list[int]:
        """The receive buffers' bytes each of this engine's workers held in the last sync (two buckets)."""
        return self.llm.collective_rpc(_receive_buffer_bytes)

    def shutdown_weight_sync(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    # ------------------------------------------------------------------------ continuous generation

    def _run(self, prompts: list[list[int]], params) -> list:
        """vLLM's outputs of ``prompts``: ``LLM.generate``, or beside the stream's requests while it
        holds some (``LLM.generate`` would step them and keep their outputs)."""
        if self.stream is not None and len(self.stream):
            return self.stream.run_now(prompts, params)
        return self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=self.lora_request
        )

    def _run_routed(self, prompts: list[list[int]], params, routed: bool) -> tuple[list, list | None]:
        """``_run``'s outputs and, if ``routed``, their routed experts (per output, per completion). Beside
        a stream's requests the capture records on: it holds their rows too (``generation.stream``)."""
        if not routed:
            return self._run(prompts, params), None
        beside = self.stream is not None and len(self.stream) > 0
        if not beside:
            self.routing.start(self.llm)
        outputs = self._run(prompts, params)
        return outputs, self.routing.collect(self.llm, outputs, running=beside)

    def _stream(self) -> RequestStream | EpisodeStream:
        """The engine's request stream; with ``env.environment`` its requests are episodes, whose turns
        are requests of the stream underneath (``generation.stream_episodes``)."""
        if self.stream is None:
            stream = RequestStream(self.llm, version=self.version, routing=self.routing)
            stream.lora_request = self.lora_request
            if self.cfg.env.enabled:
                # Workers of their own: run_episodes (validation) may run beside, polling its pool.
                renderer, pool = self.episode_parts()[0], self._env_pool()
                stream = EpisodeStream(
                    stream, renderer, pool, self.cfg.env, max_context=self.cfg.model.seq_length
                )
            self.stream = stream
        return self.stream

    def submit(self, requests: Sequence[StreamRequest]) -> None:
        self._require_awake("submit")
        self._stream().submit(requests)

    def advance(self, seconds: float) -> StreamSlice:
        start = time.perf_counter()
        finished = self._stream().advance(max_seconds=seconds)
        restarted = self.stream.take_restarted() if isinstance(self.stream, EpisodeStream) else 0
        return StreamSlice(finished, self.stream.take_failed(), time.perf_counter() - start, restarted)

    def abort(self, request_ids: Sequence[str]) -> list[str]:
        return [r.request_id for r in self._stream().abort(request_ids)]

    def set_version(self, version: int) -> None:
        self.version = version
        if self.stream is not None:
            self.stream.set_version(version, kv=self.cfg.generation.stream_kv)

    def in_flight(self) -> list[PartialRequest]:
        return self._stream().in_flight()

    def resume_from(self, partials: Sequence[PartialRequest]) -> None:
        self._require_awake("resume_from")
        self._stream().resume_from(partials)


def vllm_turn_engine(
    llm,
    settings: SamplingSettings,
    stop_token_ids: Sequence[int],
    routing=None,
    beside=None,
    lora_request=None,
) -> TurnEngine:
    """``llm``'s engine (vLLM's ``LLM``, in process) as a :class:`TurnEngine` sampling with ``settings``;
    with ``routing`` (``megagrpo.generation.routing``, started), each turn carries its routed experts;
    ``beside``: a ``RequestStream`` holding requests, through which the engine is stepped;
    ``lora_request``: the adapter every turn names (``generation.vllm_lora``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    stops = sorted({*stop_token_ids, *settings.stop_token_ids})
    own: set[str] = set()  # this engine's requests in flight

    class _Engine:
        def add(self, request_id: str, prompt: list[int], max_tokens: int, seed: int) -> None:
            params = SamplingParams(
                n=1,
                max_tokens=max_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                stop_token_ids=stops,
                seed=seed,
                logprobs=0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora_request)
            own.add(request_id)

        def busy(self) -> bool:
            return bool(own) if beside is not None else engine.has_unfinished_requests()

        def step(self) -> list[Turn]:
            outputs = beside.step_beside() if beside is not None else engine.step()
            finished = [out for out in outputs if out.finished]
            own.difference_update(out.request_id for out in finished)
            routed = routing.collect(llm, finished, running=True) if routing and finished else None
            turns = []
            for i, out in enumerate(finished):
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                lps = [s[t].logprob for s, t in zip(comp.logprobs, ids, strict=True)] if comp.logprobs else []
                turns.append(Turn(out.request_id, ids, lps, routed[i][0] if routed else None))
            return turns

    return _Engine()


def _param_shapes(worker) -> dict[str, tuple[int, ...]]:
    from megagrpo.weight_sync.vllm_engine import model_param_shapes

    return model_param_shapes(worker.weight_transfer_engine.model)


def _received_bytes(worker) -> int:
    return worker.weight_transfer_engine.received_bytes


def _forget_weights(worker) -> None:
    """Inside a vLLM CPU worker: what its sleep at level 2 would do to the weights on a GPU, imitated.

    Every floating-point parameter is filled with NaN, and so is the output of every linear layer
    whose weight vLLM's CPU build packed away into a GEMM kernel (``cpu_linear``; the parameter left
    empty). A layer the next sync loads is re-processed by vLLM's layerwise reload, which makes its
    kernel anew; a layer it misses keeps answering NaN."""
    import torch

    model = worker.model_runner.model
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.fill_(float("nan"))
        for module in model.modules():
            linear = module.__dict__.get("cpu_linear")
            if linear is not None:
                module.cpu_linear = _answering_nan(linear)


def _answering_nan(linear):
    def forgotten(x, weight, bias):
        return linear(x, weight, bias).fill_(float("nan"))

    return forgotten


def _receive_buffer_bytes(worker) -> int:
    return worker.weight_transfer_engine.buffer_bytes


def _received_digests(worker) -> dict[int, str]:
    return dict(worker.weight_transfer_engine.last_digests)
