"""vLLM-side weight transfer engine: receive megagrpo's bucketed broadcasts into the model.

Registered with vLLM's ``WeightTransferEngineFactory`` as ``megagrpo`` by the plugin in
``megagrpo.weight_sync.plugin`` (a ``vllm.general_plugins`` entry point, so it exists in every vLLM
worker process). vLLM creates it at model load when the LLM is built with
``weight_transfer_config=WeightTransferConfig(backend="megagrpo")`` and drives it through the
worker methods ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` (``LLM.collective_rpc``).

Each worker joins the groups of its engine TP rank (all of them on the gathered path) and receives
the plan's buckets of those groups; a link whose sender shares this worker's device hands its buckets
over through shared slots instead (``weight_sync.ipc``), copied out into the same receive buffers.
Receiving overlaps loading: the broadcast of bucket k+1 is posted before bucket k is loaded, into
the other of two receive buffers (the engine never holds more than two buckets of received bytes).
Gathered buckets hold whole HF tensors and go through ``model.load_weights`` (vLLM's loaders cut
out the worker's shard); shard-wise buckets hold blocks of this worker's own parameters, copied in
place at their offset (:func:`load_block`), inside vLLM's layerwise reload like any other load, so
vLLM re-processes each layer (on CPU: repacks its GEMM weights) once all of it has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megagrpo.compat.vllm_moe_reload import forget_cpu_moe_kernels, restore_moe_kernels
from megagrpo.weight_sync.buckets import Bucket, Slot, checksum, unpack
from megagrpo.weight_sync.delta import FULL, HEADER_WORDS, ReceivedCopies, slot_digests
from megagrpo.weight_sync.ipc import IpcReceiver
from megagrpo.weight_sync.transport import BroadcastGroup, GroupAddress


class _Received:
    """A posted broadcast: ``wait()`` blocks until it is done, within the group's timeout, and gives
    (count, payload): ``FULL`` and the bucket, or a delta's count and encoding (``weight_sync.delta``)."""

    def __init__(self, group: BroadcastGroup, work, index: int, out: torch.Tensor, count: int = FULL):
        self.group, self.work, self.index, self.out, self.count = group, work, index, out, count

    def wait(self) -> tuple[int, torch.Tensor]:
        if self.work is not None:
            self.group.wait(self.work, f"receiving bucket {self.index}")
        return self.count, self.out


class _Handoff:
    """A bucket taken from a shared slot, shaped like a broadcast's work handle: ``wait()`` receives."""

    def __init__(self, receiver: IpcReceiver, index: int, out: torch.Tensor, delta: bool = False):
        self.receiver, self.index, self.out, self.delta = receiver, index, out, delta

    def wait(self) -> tuple[int, torch.Tensor]:
        if self.delta:
            return self.receiver.receive_encoded(self.index, self.out)
        return FULL, self.receiver.receive(self.index, self.out)


# vLLM builds these from the dicts ``VLLMEngine`` passes to ``collective_rpc`` (``cls(**info)``);
# they subclass vLLM's (mutable) dataclasses, so they cannot be frozen themselves.
@dataclass
class MegagrpoInitInfo(WeightTransferInitInfo):
    groups: list[GroupAddress]
    """One broadcast group per link, indexed by ``Bucket.source``."""
    engine_index: int
    """This engine's place among the sync's engines: its workers' ranks in the groups follow from it."""
    backend: str = "gloo"
    timeout_s: float = 120.0
    delta: bool = False
    """Delta mode (``generation.sync_mode``): every bucket comes with a header, whole or as a delta."""


@dataclass
class MegagrpoUpdateInfo(WeightTransferUpdateInfo):
    buckets: tuple[Bucket, ...]
    """The bucket plan, in broadcast order."""
    checksums: bool = False
    """Debug mode: digest every received bucket (``last_digests``) for the controller to compare."""


class MegagrpoWeightTransferEngine(WeightTransferEngine[MegagrpoInitInfo, MegagrpoUpdateInfo]):
    init_info_cls = MegagrpoInitInfo
    update_info_cls = MegagrpoUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: dict[int, BroadcastGroup] = {}  # plan source -> group, the groups this worker is in
        self.ipc: dict[int, IpcReceiver] = {}  # plan source -> handoff from a sender on this device
        self.last_digests: dict[int, str] = {}  # plan index -> digest of the buckets it received
        self.received_bytes = 0  # bucket bytes this worker received in the last sync
        self._loaders: dict[int, tuple[torch.Tensor, dict]] = {}  # parameters given _copy_block, by id
        self._kept: list[torch.Tensor] = []  # the two receive buffers, kept between syncs (CPU)
        self.buffer_bytes = 0  # the receive buffers' bytes in the last sync
        self._moe_kernels: list = []  # MoE kernels dropped for the reload (compat.vllm_moe_reload)
        self.copies: ReceivedCopies | None = None  # delta mode: each bucket's bytes as last rebuilt

    def init_transfer_engine(self, init_info: MegagrpoInitInfo) -> None:
        self.shutdown()
        self.copies = ReceivedCopies() if init_info.delta else None  # new senders: nothing is known yet
        par, engine = self.parallel_config, init_info.engine_index
        for index, address in enumerate(init_info.groups):  # in plan-source order, as the senders open them
            rank = address.broadcast_rank(engine, par.rank, par.world_size)
            if rank is not None:
                self.groups[index] = BroadcastGroup(
                    address,
                    rank,
                    backend=init_info.backend,
                    timeout_s=init_info.timeout_s,
                    device=self.device,
                    name=f"weight sync link {index} (trainer rank {address.sender} -> engine {engine} "
                    f"worker {par.rank})",
                )
            handoff = address.ipc_for(engine, par.rank)
            if handoff is not None:
                name = f"weight sync link {index} -> engine {engine} worker {par.rank}"
                self.ipc[index] = IpcReceiver(
                    handoff, device=torch.device(self.device), timeout_s=init_info.timeout_s, name=name
                )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._give_back_loaders()  # after a sync that failed half-way
        restore_moe_kernels(self._moe_kernels)  # likewise
        # vLLM's CPU MoE layers would keep their new expert weights unpacked (compat.vllm_moe_reload).
        self._moe_kernels = forget_cpu_moe_kernels(self.model)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._give_back_loaders()
        restore_moe_kernels(self._moe_kernels)  # layers no weights of arrived for
        self._moe_kernels = []
        self._retie_embeddings()

    def _give_back_loaders(self) -> None:
        """The reload registers the very meta tensors it recorded at model load: give them back the
        loaders they had before :func:`load_block`, or a later gathered sync would find _copy_block."""
        for param, loader in self._loaders.values():
            _set_loader(param, loader)
        self._loaders = {}

    def _retie_embeddings(self) -> None:
        """Tied input/output embeddings: the output layer receives no weights of its own (HF
        checkpoints of tied models carry only the input embedding), so vLLM's layerwise reload
        puts back its old tensors, including what its post-load processing derived from them
        (on CPU, the prepacked GEMM weight of the logits matmul). Re-tie and re-process it."""
        if not getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(self.model, "lm_head", None)
        embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None:
            return
        if lm_head.weight.data_ptr() != embed.weight.data_ptr():
            with torch.no_grad():
                lm_head.weight.copy_(embed.weight)
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(lm_head)

    def receive_weights(self, update_info: MegagrpoUpdateInfo) -> None:
        if not self.groups and not self.ipc:
            raise RuntimeError("megagrpo weight transfer: init_weight_transfer_engine was not called")
        mine = [
            (i, b)
            for i, b in enumerate(update_info.buckets)
            if b.source in self.groups or b.source in self.ipc
        ]
        indices, buckets = [i for i, _ in mine], [b for _, b in mine]
        self.received_bytes = sum(b.nbytes for b in buckets)
        if not buckets:
            return

        # Two receive buffers, each as large as the largest bucket: bucket k + 1 arrives in one while
        # bucket k loads from the other. vLLM's layerwise reload keeps the tensors it is given until
        # their layer is complete, and a layer may span buckets (and links): each tensor goes to it as a
        # copy of its own, so a buffer is free again once its bucket is loaded, and the engine holds two
        # buckets, not the model. On CPU the buffers are kept for the next sync (fresh ones would cost
        # a page fault per 4 KiB each time); on a GPU they are let go, and vLLM's sleep (it empties the
        # caching allocator) gives the memory back to the trainer on the same device.
        size, kept = max(b.nbytes for b in buckets), self._kept
        if not kept or kept[0].numel() < size:
            kept = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._kept = kept if torch.device(self.device).type == "cpu" else []
        self.buffer_bytes = sum(k.numel() for k in kept)

        self.last_digests = {}
        try:
            self._receive(buckets, indices, kept, update_info.checksums)
        except BaseException:
            if self.copies is not None:  # which buckets were patched is not known: start over whole
                self.copies.clear()
            raise

    def _post(self, bucket: Bucket, index: int, buf: torch.Tensor):
        """Start receiving bucket ``index`` into ``buf``; its handle's ``wait()`` gives (count, payload). In
        delta mode a broadcast link first sends the bucket's header (``weight_sync.delta``)."""
        delta = self.copies is not None
        if bucket.source in self.ipc:  # taken from the slot when waited for
            return _Handoff(self.ipc[bucket.source], index, buf if delta else buf[: bucket.nbytes], delta)
        group = self.groups[bucket.source]
        if not delta:
            whole = buf[: bucket.nbytes]
            return _Received(group, group.broadcast(whole, root=0), index, whole)
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        group.wait(group.broadcast(header, root=0), f"receiving the header of bucket {index}")
        count, nbytes = header.tolist()
        self.received_bytes += header.numel() * header.element_size() + nbytes - bucket.nbytes
        work = group.broadcast(buf[:nbytes], root=0) if nbytes else None  # unchanged: the header alone
        return _Received(group, work, index, buf[:nbytes], count)

    def _receive(self, buckets: list[Bucket], indices: list[int], kept: list, checksums: bool) -> None:
        """Receive ``buckets`` (plan ``indices``) into the two buffers ``kept`` and load them: bucket k + 1
        arrives while bucket k loads. In delta mode each bucket's bytes are rebuilt from the last ones."""
        pending = self._post(buckets[0], indices[0], kept[0])
        for i, bucket in enumerate(buckets):
            count, buf = pending.wait()
            if i + 1 < len(buckets):
                pending = self._post(buckets[i + 1], indices[i + 1], kept[(i + 1) % 2])
            if self.copies is not None:
                if bucket.source in self.ipc:
                    self.received_bytes += buf.numel() - bucket.nbytes
                buf = self.copies.restore(indices[i], bucket, count, buf)
            if checksums:
                digest = slot_digests(bucket, buf) if self.copies is not None else checksum(buf)
                self.last_digests[indices[i]] = digest
            if bucket.slots[0].into is None:
                self.model.load_weights([(name, tensor.clone()) for name, tensor in unpack(bucket, buf)])
            else:
                for slot, (_, block) in zip(bucket.slots, unpack(bucket, buf), strict=True):
                    load_block(self.model, slot, block.clone(), self._loaders)

    def shutdown(self) -> None:
        self._kept = []
        for channel in [*self.groups.values(), *self.ipc.values()]:
            channel.close()
        self.groups, self.ipc = {}, {}


LORA_WRAPPED = ".base_layer"
"""vLLM's LoRA wrapper of a layer holds the layer under this name (``generation.lora_sync: adapter``)."""


def model_param_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter of the engine's model as a sync fills it: by name, in model format.

    vLLM's post-load processing may change a parameter after loading (its CPU build prepacks the MoE
    router, leaving shape ``(0,)``); the shapes recorded at model load for its layerwise reload
    (``record_metadata_for_reloading``), which the reload gives back before loading, are the ones a
    sync fills. Tensors no loader ever fills (vLLM's ``SKIP_LOAD_TENSORS``) are left out; those the
    recording skips (``bias``, made after the weights) are taken as they are."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    out = {}
    for module_name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        recorded = dict(info.restore_metadata[0]) if info is not None else {}
        live = dict(module.named_parameters(recurse=False))
        if recorded:  # live parameters are kernel-format here; keep only those never recorded
            live = {k: v for k, v in live.items() if k == "bias" and k not in recorded}
        # An engine serving LoRA adapters wraps each adapted layer; its weights keep their HF names.
        module_name = module_name.replace(LORA_WRAPPED, "")
        prefix = f"{module_name}." if module_name else ""
        for attr, tensor in {**live, **recorded}.items():
            if attr not in SKIP_LOAD_TENSORS:
                out[prefix + attr] = tuple(tensor.shape)
    return out


def _block_target(param: torch.Tensor, block: torch.Tensor, dim: int, start: int) -> tuple[torch.Tensor, int]:
    """(the tensor ``block`` goes into, its start there along ``dim``): the parameter itself, or for a
    stacked expert parameter ``[E, ...]`` (a block of one dim fewer) the expert's ``param[x]``, ``x``
    being folded into ``start`` (``shards.Piece.dst_start``)."""
    if param.dim() == block.dim():
        return param.data, start
    per_expert = param.shape[1 + dim]
    return param.data[start // per_expert], start % per_expert


def _copy_block(param: torch.Tensor, loaded_weight: torch.Tensor, dim: int, start: int, pad: bool) -> None:
    """A weight loader for a block of this rank's own shard: no TP slicing, only the offset."""
    target, start = _block_target(param, loaded_weight, dim, start)
    size = loaded_weight.shape[dim]
    target.narrow(dim, start, size).copy_(loaded_weight)
    if pad:  # vLLM's vocabulary padding rows, zeroed as its own embedding loader does
        end = start + size
        target.narrow(dim, end, target.shape[dim] - end).zero_()


_LOADER_ATTRS = ("weight_loader", "_weight_loader")  # plain parameters; vLLM's BasevLLMParameter


def _get_loader(param: torch.Tensor) -> dict:
    return {k: param.__dict__[k] for k in _LOADER_ATTRS if k in param.__dict__}


def _set_loader(param: torch.Tensor, loader: dict) -> None:
    for k in _LOADER_ATTRS:
        if k in loader:
            param.__dict__[k] = loader[k]
        else:
            param.__dict__.pop(k, None)


def load_block(model: torch.nn.Module, slot: Slot, block: torch.Tensor, touched: dict) -> None:
    """Load ``block`` (a shard-wise slot) into its parameter, during a layerwise reload.

    vLLM's layerwise reload (``initialize_layerwise_reload``) gives every parameter a loader that
    records the call and replays it once the layer's elements have all been loaded; the loader it
    replays is the one the parameter had. Giving the parameter :func:`_copy_block` first and then the
    reload's wrapper (``make_online_process_loader``, as the reload does for vLLM's own loaders) puts
    the block through the same bookkeeping. ``touched`` collects the parameters and the loaders they
    had, for the engine to give back once the reload is finalized.
    """
    from vllm.model_executor.model_loader.reload.layerwise import make_online_process_loader

    module_name, _, attr = slot.name.rpartition(".")
    try:
        layer = model.get_submodule(module_name)
        layer = getattr(layer, "base_layer", layer)  # a layer wrapped for LoRA adapters
        param = getattr(layer, attr)
    except AttributeError as err:
        raise RuntimeError(f"shard-wise weight sync: vLLM's model has no parameter {slot.name}") from err
    dim, start = slot.into
    stacked = param.dim() == block.dim() + 1
    if stacked:
        _check_experts_unpadded(layer, slot.name)
    fits = not stacked or start // param.shape[1 + dim] < param.shape[0]
    if fits:
        target, at = _block_target(param, block, dim, start)
        want = list(target.shape)
        want[dim] = block.shape[dim]
        fits = list(block.shape) == want and at + block.shape[dim] <= target.shape[dim]
    if not fits:
        raise RuntimeError(
            f"shard-wise weight sync: block {list(block.shape)} at {start} along dim {dim} does not fit "
            f"{slot.name} {list(param.shape)} of this vLLM worker"
        )
    touched.setdefault(id(param), (param, _get_loader(param)))
    param.weight_loader = _copy_block
    param.weight_loader = make_online_process_loader(layer, attr)
    param.weight_loader(param, block, dim, start, slot.pad)


def _check_experts_unpadded(layer: torch.nn.Module, name: str) -> None:
    """Shard-wise expert blocks are placed by the experts' real intermediate size. vLLM's CUDA
    FlashInfer TRT-LLM and ROCm AITER backends pad it when they create the parameters (vLLM's CPU
    kernel pads only its processed copy, after loading), which would shift every expert's rows."""
    config = getattr(layer, "moe_config", None)
    padded = getattr(config, "intermediate_size_per_partition", None)
    real = getattr(config, "intermediate_size_per_partition_unpadded", None)
    if padded != real:
        raise RuntimeError(
            f"shard-wise weight sync: this vLLM worker pads the experts' intermediate dim ({real} -> "
            f"{padded}) in {name}, so blocks cannot be placed by the model's shape; set "
            "generation.weight_sync_path=gathered"
        )
