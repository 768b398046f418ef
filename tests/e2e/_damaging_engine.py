"""A vLLM engine actor that can damage a bucket of its next weight sync: proves the probe (and the
checksum mode) catch a sync that went wrong, with no such hook in the production receive path.

``DamagingGenerationWorker.damage_next_sync(k)`` wraps the broadcast groups of the engine's weight
transfer engine (inside vLLM's worker): the k-th
bucket the next sync receives gets bytes flipped as soon as it has arrived, before it is digested
and loaded. The wrapping undoes itself after that bucket. In-process engines only (engine TP = 1,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``VLLMEngine`` sets it).
"""

from __future__ import annotations

import itertools
import sys

import lazy_groups
import ray.cloudpickle
from lazy_groups import connected_by, defer_group_creation

from megagrpo.generation.vllm import VLLMEngine

# Ray's workers cannot import the test modules by name: ship their classes and functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(lazy_groups)


class DamagingGenerationWorker(VLLMEngine):
    def damage_next_sync(self, bucket: int) -> None:
        """Flip bytes of bucket ``bucket`` (plan order) when the next sync receives it."""
        self.llm.collective_rpc(_damage_on_arrival, args=(bucket,))

    def stall_next_sync(self, seconds: float) -> None:
        """The next sync's first broadcast is posted ``seconds`` late: a stuck engine, alive."""
        self.llm.collective_rpc(_stall_on_post, args=(seconds,))

    def skip_in_next_sync(self, name: str) -> None:
        """The next sync leaves vLLM parameter ``name`` unloaded (its bytes still arrive and are
        digested): a sync that misses a tensor."""
        self.llm.collective_rpc(_skip_on_load, args=(name,))

    def skipped_in_last_sync(self) -> list[str]:
        return self.llm.collective_rpc(_skipped)[0]

    def defer_group_creation(self) -> None:
        """The weight-sync groups this engine makes from now on connect as NCCL's do, in the first
        broadcast (``tests/lazy_groups.py``)."""
        self.llm.collective_rpc(_defer_group_creation)

    def group_connections(self) -> list[str | None]:
        """What connected each weight-sync group of the engine's first worker (``DeferredGloo``)."""
        return self.llm.collective_rpc(_group_connections)[0]

    def drift_loaded_weights(self) -> None:
        """Change the loaded model after a sync (its bytes arrived intact): what kernel or dtype
        differences do to the logprobs, short of a broken sync."""
        self.llm.collective_rpc(_scale_final_norm)


def _defer_group_creation(worker) -> None:
    defer_group_creation()


def _group_connections(worker) -> list[str | None]:
    return connected_by(worker.weight_transfer_engine.groups.values())


def _scale_final_norm(worker) -> None:
    import torch

    with torch.no_grad():
        worker.model_runner.model.model.norm.weight.mul_(1.5)


class _DamagedOnWait:
    """A broadcast's work handle whose ``wait`` damages the received buffer."""

    def __init__(self, work, buf):
        self.work, self.buf = work, buf

    def is_completed(self):
        return self.work.is_completed()

    def wait(self):
        done = self.work.wait()
        # The top byte (sign and exponent) of one value in sixteen: every tensor is damaged.
        self.buf[3::64] ^= 0x40
        return done


def _damage_on_arrival(worker, bucket: int) -> None:
    """Inside the vLLM worker: the receiver posts one broadcast per bucket, in plan order."""
    groups = worker.weight_transfer_engine.groups
    posted = itertools.count()

    def restore() -> None:
        for group in groups.values():
            group.__dict__.pop("broadcast", None)

    def wrap(plain):
        def broadcast(tensor, root: int = 0):
            work = plain(tensor, root)
            if next(posted) != bucket:
                return work
            restore()
            return _DamagedOnWait(work, tensor)

        return broadcast

    for group in groups.values():
        group.broadcast = wrap(group.broadcast)


def _stall_on_post(worker, seconds: float) -> None:
    """Inside the vLLM worker: sleep before posting the next broadcast (once)."""
    import time

    groups = worker.weight_transfer_engine.groups

    def wrap(plain):
        def broadcast(tensor, root: int = 0):
            for group in groups.values():
                group.__dict__.pop("broadcast", None)
            time.sleep(seconds)
            return plain(tensor, root)

        return broadcast

    for group in groups.values():
        group.broadcast = wrap(group.broadcast)


def _skip_on_load(worker, name: str) -> None:
    """Inside the vLLM worker: the shard-wise loader passes ``name`` over, for one sync."""
    from megagrpo.weight_sync import vllm_engine

    plain = vllm_engine.__dict__.get("_plain_load_block", vllm_engine.load_block)
    vllm_engine._plain_load_block = plain
    worker.megagrpo_skipped = []

    def load_block(model, slot, block, touched):
        if slot.name == name:
            worker.megagrpo_skipped.append(name)
            return None
        return plain(model, slot, block, touched)

    def finish(engine_finish):
        def finish_weight_update():
            vllm_engine.load_block = plain
            engine.finish_weight_update = engine_finish
            return engine_finish()

        return finish_weight_update

    engine = worker.weight_transfer_engine
    vllm_engine.load_block = load_block
    engine.finish_weight_update = finish(engine.finish_weight_update)


def _skipped(worker) -> list[str]:
    return list(getattr(worker, "megagrpo_skipped", []))
