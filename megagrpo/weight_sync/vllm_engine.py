"""vLLM-side weight transfer engine: receive megagrpo's bucketed broadcasts into the model.

Registered with vLLM's ``WeightTransferEngineFactory`` as ``megagrpo`` by the plugin in
``megagrpo.weight_sync.plugin`` (a ``vllm.general_plugins`` entry point, so it exists in every vLLM
worker process). vLLM creates it at model load when the LLM is built with
``weight_transfer_config=WeightTransferConfig(backend="megagrpo")`` and drives it through the
worker methods ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` (``LLM.collective_rpc``).

Receiving overlaps loading: the broadcast of bucket k+1 is posted before bucket k is handed to
``model.load_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megagrpo.weight_sync.buckets import Bucket, checksum, unpack
from megagrpo.weight_sync.transport import BroadcastGroup, GroupAddress


# vLLM builds these from the dicts ``GenerationWorker`` passes to ``collective_rpc`` (``cls(**info)``);
# they subclass vLLM's (mutable) dataclasses, so they cannot be frozen themselves.
@dataclass
class MegagrpoInitInfo(WeightTransferInitInfo):
    groups: list[GroupAddress]
    """One broadcast group per sender (pipeline stage), indexed by ``Bucket.source``."""
    rank_offset: int
    """This engine's first rank in every group (1 + engine index x workers per engine)."""
    backend: str = "gloo"
    timeout_s: float = 120.0


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
        self.groups: list[BroadcastGroup] = []
        self.last_digests: list[str] = []
        self._kept: list[torch.Tensor] = []  # receive buffers kept between syncs (CPU)

    def init_transfer_engine(self, init_info: MegagrpoInitInfo) -> None:
        self.shutdown()
        par = self.parallel_config
        rank = init_info.rank_offset + par.data_parallel_index * par.world_size + par.rank
        self.groups = [
            BroadcastGroup(
                address,
                rank,
                backend=init_info.backend,
                timeout_s=init_info.timeout_s,
                device=self.device,
            )
            for address in init_info.groups
        ]

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._retie_embeddings()

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
        if not self.groups:
            raise RuntimeError("megagrpo weight transfer: init_weight_transfer_engine was not called")
        buckets = update_info.buckets
        if not buckets:
            return

        # A buffer per bucket: vLLM's layerwise reload keeps the tensors it is given (views into
        # the buffer) until their layer is complete, so no buffer is reused within a sync. On CPU
        # the buffers are kept for the next sync (every layer is complete by then): fresh ones
        # would cost a page fault per 4 KiB each time. CUDA's caching allocator reuses memory itself.
        sizes = [b.nbytes for b in buckets]
        if [b.numel() for b in self._kept] != sizes:
            self._kept = []
        buffers = self._kept or [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        if torch.device(self.device).type == "cpu":
            self._kept = buffers

        def post(i: int):
            return buffers[i], self.groups[buckets[i].source].broadcast(buffers[i], root=0)

        self.last_digests = []
        pending = post(0)
        for i, bucket in enumerate(buckets):
            buf, work = pending
            work.wait()
            if i + 1 < len(buckets):
                pending = post(i + 1)
            if update_info.checksums:
                self.last_digests.append(checksum(buf))
            self.model.load_weights(list(unpack(bucket, buf)))

    def shutdown(self) -> None:
        self._kept = []
        for group in self.groups:
            group.close()
        self.groups = []
