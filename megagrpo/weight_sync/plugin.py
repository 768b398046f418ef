"""vLLM plugin (``vllm.general_plugins`` entry point): registers megagrpo's weight transfer engine.

vLLM runs general plugins in every process it starts, so the engine exists wherever a worker is
built; registration is idempotent because vLLM may load plugins more than once per process.
"""

BACKEND = "megagrpo"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "megagrpo.weight_sync.vllm_engine", "MegagrpoWeightTransferEngine"
        )
