"""Megatron-Core's distributed optimizer loading "fully_reshardable" state into torch's Adam.

Verified with megatron-core 0.16.1. With torch Adam (no Apex/TE FusedAdam, e.g. on CPU), the
distributed optimizer's loader copies every state entry of a parameter from the checkpoint,
including Adam's ``step``, which the checkpoint does not carry per parameter (it restores it from
the param groups just before): a KeyError. ``adam_step_kept_on_load`` replaces
``DistributedOptimizer._set_main_param_and_optimizer_states`` for the block with a version that
supplies the already-restored step, making that copy a no-op, and restores the original on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def adam_step_kept_on_load() -> Iterator[None]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__.get("_set_main_param_and_optimizer_states")
    if original is None or getattr(original, "_keeps_adam_step", False):
        yield
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state.get(self.optimizer.param_groups[group]["params"][order], {})
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    set_states._keeps_adam_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original
