"""vLLM plugin (``vllm.general_plugins`` entry point): registers megagrpo's weight transfer engine.

vLLM runs general plugins in every process it starts, so the engine exists wherever a worker is
built; registration is idempotent because vLLM may load plugins more than once per process
(``megagrpo.compat.vllm_weight_transfer``).
"""

BACKEND = "megagrpo"


def register() -> None:
    from megagrpo.compat.vllm_weight_transfer import register_engine_once

    register_engine_once(BACKEND, "megagrpo.weight_sync.vllm_engine", "MegagrpoWeightTransferEngine")
