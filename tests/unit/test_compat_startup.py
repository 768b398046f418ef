"""A conversion rank defers Megatron's torch.compile decorations to first call and pauses the GC."""

import gc

import pytest
import torch

from megagrpo.compat.startup import compile_on_first_call, weights_only_process

pytestmark = pytest.mark.unit


def test_compiling_waits_for_the_first_call():
    compiled = []

    def compile_fn(model, **options):
        compiled.append((model.__name__, options))
        return lambda *args: ("compiled", model(*args))

    deferred = compile_on_first_call(compile_fn)

    @deferred
    def double(x):
        """Twice x."""
        return 2 * x

    @deferred(dynamic=True)
    def square(x):
        return x * x

    assert compiled == [] and double.__name__ == "double" and double.__doc__ == "Twice x."
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert square(3) == ("compiled", 9)
    assert compiled == [("double", {}), ("square", {"dynamic": True})]  # once each, options kept
    module = torch.nn.Identity()
    module.__name__ = "identity"
    wrapped = deferred(module)  # not a function (a module, say): compiled at once, as before
    assert compiled[-1] == ("identity", {}) and wrapped(5) == ("compiled", 5)


def test_the_collector_is_paused_and_restored():
    assert gc.isenabled()
    with weights_only_process():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with weights_only_process():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
    with pytest.raises(KeyError), weights_only_process():
        raise KeyError("conversion failed")
    assert gc.isenabled()
