"""vLLM's own LoRA support as the receiving end of ``generation.lora_sync: adapter``.

The engine starts with LoRA enabled (one adapter slot, :func:`engine_args`) and holds the base weights,
which a first sync sends as in any run. Every sync after that sends the adapters alone, in PEFT's names,
as tensors (``weight_sync.sync``); each of the engine's workers builds vLLM's adapter from them
(``LoRAModel.from_lora_tensors``, vLLM cutting its TP slices itself) and puts it in the slot of
:data:`ADAPTER_ID`, replacing the previous version's in place (:func:`install`). Every request the
engine runs names that adapter (:func:`adapter_request`): generation, the probe, episodes' turns and
the request stream.

Why one adapter id replaced in place, not a new id per version: vLLM binds a request to its adapter's
id when the request is added, so under ``grpo.async_mode: partial`` the requests in flight at a swap
would go on sampling with the old adapter under a new id. Replaced in place, the next engine step of
every request runs the new adapter, as a weight swap does. Cached KV blocks computed with the old
adapter are dropped after a sync as after a weight sync (``VLLMEngine.load_adapter``), and requests
of a stream are salted by version (``generation.stream``).

Verified on vLLM 0.32's CPU build: an installed adapter's logprobs match ``peft``'s on the HF model,
a replaced one's the new adapter's, and the requests that do not name it the base's
(``tests/e2e/test_lora_sync.py``). On GPUs this path has never run.
"""

from __future__ import annotations

from typing import Any

from megagrpo.weight_sync.adapters import tensors_digest

ADAPTER_ID = 1
ADAPTER_NAME = "megagrpo-policy"
ADAPTER_SOURCE = "megagrpo:weight-sync"
"""What the adapter's request gives as its path: vLLM asks for one, but this adapter is never read from
a file (an engine asked to load it from there fails naming this string)."""

MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's allowed ``max_lora_rank`` values (``config.lora.MaxLoRARanks``)."""


def slot_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for allowed in MAX_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {MAX_RANKS[-1]}")


def engine_args(cfg) -> dict[str, Any]:
    """``vllm.LLM`` arguments for ``generation.lora_sync: adapter`` (none otherwise)."""
    if not (cfg.policy.lora.enabled and cfg.generation.lora_sync == "adapter"):
        return {}
    return {
        "enable_lora": True,
        "max_lora_rank": slot_rank(cfg.policy.lora.rank),
        "max_loras": 1,
        "max_cpu_loras": 1,
    }


def adapter_request():
    """The request every generation names once an adapter is installed."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, lora_path=ADAPTER_SOURCE)


def install(worker, tensors: dict, config: dict) -> str:
    """Inside a vLLM worker: build the adapter from PEFT-named ``tensors`` and put it in place of the one
    held under :data:`ADAPTER_ID`. Returns the digest of the tensors as received."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    digest = tensors_digest(tensors)
    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    # Copies: vLLM scales B in place, and an in-process caller's tensors would be changed with it.
    owned = {name: t.clone() for name, t in tensors.items()}
    lora = LoRAModel.from_lora_tensors(
        ADAPTER_ID,
        owned,
        PEFTHelper.from_dict(dict(config)),
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        # only renames: vLLM packs q/k/v and gate/up itself when the adapter is added
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
    )
    adapters.remove_adapter(ADAPTER_ID)
    adapters.add_adapter(lora)
    adapters.activate_adapter(ADAPTER_ID)
    return digest
