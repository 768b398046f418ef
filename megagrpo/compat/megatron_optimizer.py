"""Megatron-Core's distributed optimizer loading "fully_reshardable" state into torch's Adam.

Verified with megatron-core 0.16.1. With torch Adam (no Apex/TE FusedAdam, e.g. on CPU), the
distributed optimizer's loader copies every state entry of a parameter from the checkpoint,
including Adam's ``step``, which the checkpoint does not carry per parameter (it restores it from
the param groups just before): a KeyError. ``adam_step_kept_on_load`` replaces
``DistributedOptimizer._set_main_param_and_optimizer_states`` for the block with a version that
supplies the already-restored step, making that copy a no-op, and restores the original on exit.

The same loader (``DistributedOptimizer.load_state_dict``, without Apex/TE) gives every parameter's state
one and the same ``step`` tensor; torch's Adam increments each parameter's step in place, so after a load
the shared tensor advanced once per parameter at every step and the bias correction went wrong from the
first step after a resume (seen with DP=2: a resumed run's second step differed). ``untie_adam_steps``
gives each parameter a step tensor of its own after a load; nothing to restore.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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


def untie_adam_steps(optimizer) -> None:
    """Give each parameter of a (chained) Megatron optimizer its own torch Adam ``step`` tensor."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        seen: set[int] = set()
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                seen.add(id(state["step"]))
