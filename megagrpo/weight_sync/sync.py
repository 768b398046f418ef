"""Controller side of weight sync: set up the broadcast groups, run a sync, and probe the result.

The trainer ranks are driven through their :class:`~megagrpo.weight_sync.trainer.WeightSyncEndpoints`
methods (plans and what the senders report are the frozen dataclasses of ``buckets``), the engines
through the weight-sync methods of :class:`~megagrpo.generation.engine.RolloutEngine`
(``init_weight_sync`` / ``param_shapes`` / ``receive_weights`` / ``prompt_logprobs``); where the weights
go inside an engine is the ``EngineLayout`` the engines give (``RolloutEngine.weight_layout``).

Set-up: the path is chosen once (``shards.choose_path``, on the first trainer rank, which holds the
model shape); every sending rank offers its links (``transport.Link``: where its group listens and
its buckets); the links are numbered in key order and their buckets interleaved into one plan that
every sender and receiver follows (``buckets.interleave``).

Every sync is checked twice. Exactly: senders and every receiving vLLM worker digest each bucket
(``buckets.checksum``) and a mismatch names the bucket, its tensors and the engine. Numerically: a
fixed probe (a few token sequences made from a fixed seed) is scored by every vLLM engine (prompt
logprobs) and by the trainer; ``mean exp|logprob_vllm - logprob_trainer|`` must stay under
:func:`probe_bound` (``generation.probe_max_error``, by default set by the dtype) or the run stops,
naming the engine and position (:class:`ProbeResult`), and saying whether the digests matched (then
it is numerics, not a broken sync). With rollout routing replay the trainer scores the probe through
the experts the first engine routed its tokens to, as every other trainer forward of engine tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import ray
import torch

from megagrpo.algorithms.routing import routing_rows
from megagrpo.config import Config
from megagrpo.parallel.backends import weight_sync_backend
from megagrpo.types import TrainBatch
from megagrpo.weight_sync.buckets import Bucket, interleave
from megagrpo.weight_sync.coverage import check_engine_plan, worker_blocks
from megagrpo.weight_sync.delta import FULL, HEADER_WORDS, differing_tensor
from megagrpo.weight_sync.ipc import IpcAddress
from megagrpo.weight_sync.probe import PROBE_BOUNDS, probe_sequences
from megagrpo.weight_sync.shards import SyncPath
from megagrpo.weight_sync.trainer import WeightSyncEndpoints
from megagrpo.weight_sync.transport import GroupAddress, Link, LinkKey

if TYPE_CHECKING:
    from megagrpo.runtime.groups import RankGroup


class WeightSyncError(RuntimeError):
    """A sync did not complete in time, or the probe shows vLLM and the trainer disagree.

    ``engine``: the engine that died or did not answer in time, when that is the cause (one a
    ``runtime.engines.EnginePool`` can replace); None otherwise. ``ranks``: trainer ranks still inside
    the call past their own deadline, which cannot take another (the pool then stops the run).
    """

    def __init__(self, message: str, engine: int | None = None, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.engine, self.ranks = engine, ranks


@dataclass(frozen=True)
class ProbeResult:
    """How far every engine's probe logprobs are from the trainer's, right after a sync."""

    error: float
    """Mean exp|delta logprob| over every probe position of every engine (1.0 = identical)."""
    max_abs_delta: float
    """The largest |delta logprob| at any position of any engine (inf when one is not finite)."""
    worst: str
    """Where the largest difference is (engine, sequence, position)."""
    verified_buckets: int = 0
    """(bucket, vLLM worker) pairs whose digests matched in the sync before it (0: not checked)."""
    replayed: bool = False
    """Whether the trainer replayed the first engine's routing of the probe (rollout routing replay)."""


@dataclass(frozen=True)
class SyncStats:
    """What the last sync put on the links (``WeightSync.stats``)."""

    link_bytes: tuple[int, ...]
    """Bytes each link's sender sent, by plan source (delta mode: headers and encodings)."""
    delta: bool = False
    """Whether the sync ran in delta mode (``generation.sync_mode``)."""
    delta_buckets: int = 0
    """Delta mode: buckets sent as their changed elements (the others went whole)."""
    changed_fraction: float = math.nan
    """Delta mode: changed elements / elements over every bucket; NaN in full mode and when some bucket
    had no earlier bytes (the first sync after the links were opened)."""
    adapter_bytes: int = 0
    """``generation.lora_sync: adapter``: the LoRA adapters' bytes (sent once, each engine fetching them;
    ``link_bytes`` then holds the base's buckets, all zero after the first sync)."""

    @property
    def metrics(self) -> dict[str, float]:
        """For the run's metrics: ``sync/bytes`` (all links, adapters included), ``sync/link_bytes_max``;
        in delta mode also ``sync/delta_buckets`` and ``sync/changed_fraction``; in adapter mode
        ``sync/adapter_bytes``."""
        total = float(sum(self.link_bytes) + self.adapter_bytes)
        out = {"sync/bytes": total, "sync/link_bytes_max": float(max(self.link_bytes))}
        if self.delta:
            out |= {"sync/delta_buckets": self.delta_buckets, "sync/changed_fraction": self.changed_fraction}
        if self.adapter_bytes:
            out["sync/adapter_bytes"] = float(self.adapter_bytes)
        return out


def sync_stats(plan: tuple[Bucket, ...], sent: list) -> SyncStats:
    """The links' bytes of a sync from the plan (full mode) or from the senders' encodings (delta mode:
    ``SentBuckets.encoded``)."""
    links = 1 + max(b.source for b in plan)
    encoded = [e for r in sent if r is not None for e in r.encoded]
    if not encoded:
        per_link = [0] * links
        for b in plan:
            per_link[b.source] += b.nbytes
        return SyncStats(tuple(per_link))
    per_link = [0] * links
    changed = words = deltas = 0
    for index, count, nbytes, n_words, n_changed in encoded:
        per_link[plan[index].source] += HEADER_WORDS * 8 + nbytes
        deltas += count != FULL
        words += n_words
        changed = math.nan if n_changed < 0 else changed + n_changed
    return SyncStats(tuple(per_link), True, deltas, changed / words if words else math.nan)


@dataclass(frozen=True)
class SyncCoverage:
    """What the start-up coverage checks found complete (they raise on any gap)."""

    trainer_params: tuple[int, ...]
    """Per trainer rank: its parameters, each matched to an HF map rule and its shard's size."""
    trainer_shares: tuple[int, ...]
    """Per trainer rank: the HF tensors (its shares of them) its offer sends whole."""
    engine_params: tuple[tuple[int, ...], ...]
    """Per engine, per worker: the model's parameters the plan fills exactly."""


def link_addresses(
    links: list[Link], engines: int, engine_tp: int, *, shard_wise: bool, colocated: bool
) -> list[GroupAddress]:
    """How each link reaches the engines. Colocated placement puts engine ``i`` on trainer rank
    ``i``'s device: a link whose sender has an engine on its device hands it the buckets through
    shared slots (NCCL cannot hold two ranks of one device in a communicator); every other engine
    is in the link's broadcast group. Disaggregated engines all receive by broadcast."""
    out = []
    for link in links:
        ipc = link.rank if colocated and link.rank < engines else None
        receivers = tuple(e for e in range(engines) if e != ipc)
        out.append(
            GroupAddress(
                link.address,
                link.port,
                1 + len(receivers) * (1 if shard_wise else engine_tp),
                link.key[2] if shard_wise else None,
                receivers,
                None if ipc is None else IpcAddress(link.address, link.ipc_port, ipc),
                link.rank,
            )
        )
    return out


def describe_transport(groups: list[GroupAddress], backend: str, device_backend: str) -> str:
    """One line: how the engines receive (logged with the path when the sync is set up)."""
    by_ipc = sorted({g.ipc.engine for g in groups if g.ipc is not None})
    if not by_ipc:
        return f"{backend} broadcast to every engine"
    memory = (
        "CUDA IPC handles" if device_backend == "nccl" else "shared memory (/dev/shm, as CUDA IPC on GPU)"
    )
    rest = (
        f"the other links by {backend} broadcast"
        if any(g.world_size > 1 for g in groups)
        else "nothing is broadcast"
    )
    return (
        f"colocated: engine(s) {','.join(map(str, by_ipc))} take the buckets of the trainer rank on their "
        f"device through {memory}, as one communicator cannot hold two ranks of one device; {rest}"
    )


def probe_bound(cfg: Config) -> float:
    """``generation.probe_max_error``, or the bound for ``model.dtype`` when it is null."""
    configured = cfg.generation.probe_max_error
    return PROBE_BOUNDS[cfg.model.dtype] if configured is None else configured


def peft_config(lora, tensors: dict) -> dict:
    """PEFT's ``adapter_config.json`` fields vLLM reads, for the adapters ``tensors`` (PEFT-named) of
    ``policy.lora``."""
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    return {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": modules, "bias": "none"}


class WeightSync:
    """Broadcast groups from the trainer's senders to the vLLM workers, over the trainer's backend.

    The transport is :func:`~megagrpo.parallel.backends.weight_sync_backend` of
    ``cfg.resolved.backend`` (NCCL with CUDA, gloo without), kept as ``self.backend``; the
    path (shard-wise or gathered) is :func:`~megagrpo.weight_sync.shards.choose_path`'s, kept as
    ``self.path``. ``total_bytes``: the plan's bytes, what the senders broadcast per sync (each to every
    engine); ``worker_bytes``: what each of an engine's workers receives, by engine TP rank.
    """

    def __init__(self, cfg: Config, policy: RankGroup, engines: list, vocab_size: int):
        """``engines``: Ray actors of a :class:`~megagrpo.generation.engine.RolloutEngine` (the first one's
        ``weight_layout`` is the plan's)."""
        self.cfg, self.policy, self.engines = cfg, policy, engines
        self.timeout_s = cfg.generation.sync_timeout_s
        self.layout = self._engine_layout()
        self.backend = backend = weight_sync_backend(cfg.resolved.backend)
        gen = cfg.generation
        etp = gen.engine_tensor_parallel_size
        colocated = gen.placement == "colocated"
        self.path: SyncPath = policy.call_first(
            WeightSyncEndpoints.weight_sync_path,
            etp,
            gen.weight_sync_path,
            gen.engine_expert_parallel,
            self.layout,
        )
        bucket_bytes = int(gen.sync_bucket_mb * 2**20)
        offers = policy.call_all(
            WeightSyncEndpoints.weight_sync_offer, self.path, etp, bucket_bytes, self.layout
        )
        links = sorted((link for links in offers for link in links), key=lambda link: link.key)
        self.keys: list[LinkKey] = [link.key for link in links]
        self.verified_buckets = 0
        self.plan: tuple[Bucket, ...] = interleave(
            [replace(b, source=i) for b in link.buckets] for i, link in enumerate(links)
        )
        self.total_bytes = sum(b.nbytes for b in self.plan)
        self.worker_bytes = [
            sum(b.nbytes for b in self.plan if self.keys[b.source][2] in (-1, j)) for j in range(etp)
        ]
        self.coverage = self._check_coverage(etp)
        groups = link_addresses(
            links, len(engines), etp, shard_wise=self.path.kind == "shard", colocated=colocated
        )
        self.transport = describe_transport(groups, backend, cfg.resolved.backend)
        # Delta mode: new groups, so every sender starts with no bytes known to the engines.
        self.delta = gen.sync_mode == "delta"
        fraction = gen.sync_delta_max_fraction if self.delta else None
        self.stats: SyncStats | None = None  # the last sync's
        self._unsure = False  # delta mode: a sync failed, so the next one goes whole
        # Both sides block in the rendezvous until everyone has joined: start them together.
        engine_refs = [
            e.init_weight_sync.remote(
                groups, engine_index=i, backend=backend, timeout_s=self.timeout_s, delta=self.delta
            )
            for i, e in enumerate(engines)
        ]
        trainer_refs = policy.submit_all(
            WeightSyncEndpoints.open_weight_sync, groups, self.keys, backend, self.timeout_s, fraction
        )
        self._wait(engine_refs, trainer_refs, "opening the weight-sync groups")
        self.probe_batch = TrainBatch.from_sequences(probe_sequences(vocab_size), [1] * 4)
        self.replays = cfg.grpo.routing_replay == "rollout"
        # generation.lora_sync adapter: the base goes with the first sync of these groups, then adapters.
        self.adapters = cfg.policy.lora.enabled and gen.lora_sync == "adapter"
        self._base_sent = False

    def _engine_layout(self):
        """The engines' ``EngineLayout`` (every engine of a run is of one class: the first one's)."""
        try:
            return ray.get(self.engines[0].weight_layout.remote(), timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            raise WeightSyncError(f"vLLM engine 0 did not give its weight layout: {err}", 0) from err

    def _check_coverage(self, engine_tp: int) -> SyncCoverage:
        """Before any group opens: the ranks' offers were each checked to send every parameter they hold
        (``WeightSender.offer``); here every parameter of every engine worker's model is checked to be
        filled exactly by the plan (``coverage.check_engine_plan``). Raises ``CoverageError``."""
        shape = self.policy.call_first(WeightSyncEndpoints.weight_sync_shape)
        per_rank = self.policy.call_all(WeightSyncEndpoints.weight_sync_covered)
        refs = [e.param_shapes.remote() for e in self.engines]
        engines = []
        for e, ref in enumerate(refs):
            try:
                workers = ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                raise WeightSyncError(f"vLLM engine {e} did not list its parameters: {err}", e) from err
            counts = []
            for w, params in enumerate(workers):
                blocks = worker_blocks(
                    self.plan, self.keys, self.path, shape, engine_tp, w, layout=self.layout
                )
                where = f"vLLM engine {e} worker {w}"
                counts.append(check_engine_plan(blocks, params, tied=shape.tie_word_embeddings, where=where))
            engines.append(tuple(counts))
        return SyncCoverage(tuple(n for n, _ in per_rank), tuple(n for _, n in per_rank), tuple(engines))

    def _wait(self, engine_refs: list, trainer_refs: list, what: str) -> list:
        """Wait for both sides; a dead or stuck engine becomes an error.

        Each rank gives up on connecting, a broadcast or a handoff that does not finish within the
        timeout by itself, naming the link (``transport.BroadcastGroup``); this wait allows half as
        much again, so that the rank's own error is the one reported. An engine still receiving when a
        rank failed is named as the one to replace. A rank still inside the call by then could not
        give up: replacing an engine would only queue the new groups behind it (the rank is a
        synchronous actor): the error names those ranks (``WeightSyncError.ranks``) instead."""
        refs = engine_refs + trainer_refs
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=1.5 * self.timeout_s)
        silent = [trainer_refs.index(r) for r in pending if r in trainer_refs]
        if silent:
            raise WeightSyncError(
                f"{what}: trainer rank(s) {', '.join(map(str, silent))} still inside it after "
                f"{1.5 * self.timeout_s:.0f}s, past their own deadline (generation.sync_timeout_s = "
                f"{self.timeout_s:g}); their weight-sync groups could not be aborted",
                ranks=tuple(silent),
            )
        stuck = [engine_refs.index(r) for r in pending if r in engine_refs]
        # Engines first: an engine that died also fails the trainer's side of the broadcast.
        for ref in sorted(done, key=lambda r: r not in engine_refs):
            try:
                ray.get(ref)
            except Exception as err:
                side = "vLLM engine" if ref in engine_refs else "trainer"
                index = (engine_refs if ref in engine_refs else trainer_refs).index(ref)
                dead = ref in engine_refs and isinstance(err, ray.exceptions.RayActorError)
                still = f"; engine(s) {', '.join(map(str, stuck))} still receiving" if stuck else ""
                raise WeightSyncError(
                    f"{what} failed on {side} {index}: {err}{still}",
                    index if dead else (stuck[0] if stuck else None),
                ) from err
        if pending:
            names = ", ".join(f"engine {i}" for i in stuck)
            raise WeightSyncError(
                f"{what} did not finish within {1.5 * self.timeout_s:.0f}s; waiting on {names}", stuck[0]
            )
        return [result for _, result in ray.get(trainer_refs)]  # the ranks answer (seconds, result)

    def sync(self, *, with_checksums: bool = True) -> float:
        """Push the trainer's current weights into every engine; returns seconds taken.

        ``with_checksums`` (on unless a benchmark measures without): senders and every receiving vLLM
        worker digest each bucket (``buckets.checksum``, on the device that holds it) and any
        mismatch is an error naming the bucket, its tensors and the engine. ``verified_buckets``
        counts the (bucket, worker) pairs that matched in the last sync (0: not checked).
        """
        start = time.perf_counter()
        self.verified_buckets = 0
        if self._unsure:  # delta mode: after a failed sync the engines' bytes are not known
            self.policy.call_all(WeightSyncEndpoints.forget_sent_weights)
            self._unsure = False
        try:
            self._sync(with_checksums)
        except BaseException:
            self._unsure = self.delta
            raise
        return time.perf_counter() - start

    def _sync(self, with_checksums: bool) -> None:
        if self.adapters and self._base_sent:
            self.stats = replace(
                SyncStats((0,) * len(self.keys)), adapter_bytes=self._sync_adapters(with_checksums)
            )
            return
        engine_refs = [e.receive_weights.remote(self.plan, checksums=with_checksums) for e in self.engines]
        trainer_refs = self.policy.submit_all(WeightSyncEndpoints.send_weights, self.plan, with_checksums)
        sent = self._wait(engine_refs, trainer_refs, "weight sync")
        self.stats = sync_stats(self.plan, sent)
        if with_checksums:
            want = dict(d for r in sent if r is not None for d in r.digests)
            for e, workers in enumerate(ray.get(engine_refs)):
                for w, got in enumerate(workers):
                    self.verified_buckets += self._check_digests(want, got, f"engine {e} worker {w}", w)
        if self.adapters:  # the base is in (and checked): from now on the adapters alone
            self.stats = replace(self.stats, adapter_bytes=self._sync_adapters(with_checksums))
            self._base_sent = True

    def _sync_adapters(self, with_checksums: bool) -> int:
        """``generation.lora_sync: adapter``: every stage's LoRA adapters (``weight_sync.adapters``) into
        every engine's vLLM LoRA slot (``RolloutEngine.load_adapter``); returns their bytes. The digests the
        stages sent must be what each engine worker received."""
        trainer_refs = self.policy.submit_all(WeightSyncEndpoints.send_adapters)
        stages = [r for r in self._wait([], trainer_refs, "gathering the LoRA adapters") if r is not None]
        tensors = {name: t for part, _ in stages for name, t in part.items()}
        config = peft_config(self.cfg.policy.lora, tensors)
        shared = ray.put(tensors)  # once in the object store, fetched by each engine
        engine_refs = [e.load_adapter.remote(shared, config) for e in self.engines]
        self._wait(engine_refs, [], "loading the LoRA adapters")
        if with_checksums:
            want = {entry for _, digest in stages for entry in digest.split(";")}
            for e, workers in enumerate(ray.get(engine_refs)):
                for w, got in enumerate(workers):
                    differing = sorted(want.symmetric_difference(got.split(";")))
                    if differing:
                        raise WeightSyncError(
                            f"LoRA adapter sync: engine {e} worker {w} received tensors that differ from "
                            f"those sent: {', '.join(d.split(':')[0] for d in differing[:4])}"
                        )
                    self.verified_buckets += 1
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _check_digests(self, want: dict[int, str], got: dict[int, str], where: str, worker: int) -> int:
        """Compare one vLLM worker's digests with the senders'; returns how many matched."""
        expected = {i for i in want if self.keys[self.plan[i].source][2] in (-1, worker)}
        if set(got) != expected:
            raise WeightSyncError(
                f"weight sync: {where} received buckets {sorted(got)}, the senders sent it {sorted(expected)}"
            )
        for i in sorted(expected):
            if got[i] != want[i]:
                tensor = differing_tensor(self.plan[i], got[i], want[i])
                if tensor is not None:  # delta mode: a digest per tensor
                    raise WeightSyncError(
                        f"weight sync bucket {i}: tensor {tensor} differs on {where} after a delta sync: "
                        "the engine's bytes are not the trainer's (a delta applied to bytes other than "
                        "those last sent, or damaged on the way)"
                    )
                names = [slot.name for slot in self.plan[i].slots]
                shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                raise WeightSyncError(
                    f"weight sync bucket {i} ({shown}) differs on {where}: "
                    f"checksum {got[i]} != sent {want[i]}: the bytes were damaged on the way"
                )
        return len(expected)

    def _engine_scores(self, routed: bool) -> list:
        """Every engine's probe logprobs (with ``routed``: (logprobs, routed experts) per engine)."""
        sequences = self.probe_batch.input_ids.tolist()
        refs = [e.prompt_logprobs.remote(sequences, routed=routed) for e in self.engines]
        out = []
        for e, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=self.timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                raise WeightSyncError(f"probe failed on vLLM engine {e}: {err}", e) from err
        return out

    def _scores(self) -> tuple[torch.Tensor, list]:
        """(the trainer's [B, S - 1] probe logprobs, every engine's). With rollout routing replay the
        engines score first and the trainer replays the first engine's routing of the probe tokens, as
        it replays the rollouts' (an engine routing otherwise shows up as its logprobs' difference)."""
        # One side after the other: on CPU cores both share, overlapping them took longer (threads
        # oversubscribed: ~25M probe 0.16 s -> 0.50 s).
        if self.replays:
            scored = self._engine_scores(routed=True)
            width = self.probe_batch.input_ids.shape[1]
            batch = self.probe_batch.replace(routing=routing_rows(scored[0][1], width))
            trainer = self.policy.call_first(WeightSyncEndpoints.logprobs, batch, 1.0)
            return trainer, [logprobs for logprobs, _ in scored]
        trainer = self.policy.call_first(WeightSyncEndpoints.logprobs, self.probe_batch, 1.0)
        return trainer, self._engine_scores(routed=False)

    def probe(self) -> ProbeResult:
        """Score the probe on every engine and on the trainer; raise if they disagree."""
        trainer, per_engine = self._scores()
        total, count, worst = 0.0, 0, (0.0, "")
        for e, seqs in enumerate(per_engine):
            got = torch.tensor(seqs, dtype=torch.float64)
            delta = (got - trainer.double()).abs()
            bad = int((~torch.isfinite(delta)).sum())
            if bad:
                worst = (math.inf, f"engine {e}: {bad} non-finite logprobs")
                total, count = math.inf, 1
                break
            total += float(torch.exp(delta).sum())
            count += delta.numel()
            flat = int(delta.argmax())
            value = float(delta.flatten()[flat])
            if value > worst[0]:
                row, col = divmod(flat, delta.shape[1])
                worst = (value, f"engine {e}, probe sequence {row}, position {col + 1}")
        error = total / count if math.isfinite(total) else math.inf
        result = ProbeResult(error, worst[0], worst[1], self.verified_buckets, self.replays)
        bound = probe_bound(self.cfg)
        if not math.isfinite(error) or error > bound:
            digests = (
                f"{self.verified_buckets} bucket digests matched"
                if self.verified_buckets
                else "digests were not checked"
            )
            if not math.isfinite(error):
                cause = (
                    "an engine computed non-finite logprobs: weights it runs were not sent, not loaded or "
                    "damaged (a colocated engine's sleep discards them, and a sync must fill every one), "
                    f"or they overflow; {digests}"
                )
            elif self.verified_buckets:
                cause = (
                    f"every engine received exactly the bytes sent ({self.verified_buckets} bucket digests "
                    "match), so this is numerics (kernels, dtype, a config difference), not a broken sync"
                )
            else:
                cause = "the engines are not running the trainer's weights (digests were not checked)"
            raise WeightSyncError(
                "weight-sync probe failed: vLLM and trainer logprobs differ, "
                f"mean exp|delta| = {error:.6f} > generation.probe_max_error = {bound} "
                f"(largest |delta| {worst[0]:.4f} at {worst[1]}); {cause}"
            )
        return result
