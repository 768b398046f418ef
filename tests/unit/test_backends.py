"""The one resolver of "auto" backends and layer implementations, and who uses it."""

import pytest

from megagrpo.parallel import backends

pytestmark = pytest.mark.unit


def test_auto_follows_what_this_process_has(monkeypatch):
    for cuda, want in ((True, "nccl"), (False, "gloo")):
        monkeypatch.setattr(backends, "cuda_available", lambda cuda=cuda: cuda)
        assert backends.resolve_backend("auto") == want
    for te, want in ((True, "transformer_engine"), (False, "local")):
        monkeypatch.setattr(backends, "transformer_engine_available", lambda te=te: te)
        assert backends.resolve_transformer_impl("auto") == want


def test_explicit_names_are_checked_only_where_they_are_used(monkeypatch):
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "transformer_engine_available", lambda: False)
    assert backends.resolve_backend("nccl") == "nccl"
    assert backends.resolve_transformer_impl("transformer_engine") == "transformer_engine"
    with pytest.raises(ValueError, match="needs CUDA"):
        backends.resolve_backend("nccl", check_available=True)
    with pytest.raises(ValueError, match="not installed"):
        backends.resolve_transformer_impl("transformer_engine", check_available=True)
    assert backends.resolve_backend("gloo", check_available=True) == "gloo"
    assert backends.resolve_transformer_impl("local", check_available=True) == "local"


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"parallel\.backend must be one of auto, nccl, gloo; got 'mpi'"):
        backends.resolve_backend("mpi")
    impls = r"parallel\.transformer_impl must be auto, local or transformer_engine; got 'apex'"
    with pytest.raises(ValueError, match=impls):
        backends.resolve_transformer_impl("apex")


def test_init_parallel_and_the_model_builder_use_this_resolver():
    from megagrpo.models import builder
    from megagrpo.parallel import groups

    assert groups.resolve_backend is backends.resolve_backend
    assert builder.resolve_transformer_impl is backends.resolve_transformer_impl


def test_weight_sync_follows_the_trainer_backend(monkeypatch):
    """NCCL with CUDA, gloo without: the sync transport is the trainer's backend, resolved in one place."""
    for cuda, want in ((True, "nccl"), (False, "gloo")):
        monkeypatch.setattr(backends, "cuda_available", lambda cuda=cuda: cuda)
        assert backends.weight_sync_backend("auto") == want
        assert backends.weight_sync_backend(backends.resolve_backend("auto")) == want
    assert backends.weight_sync_backend("gloo") == "gloo"
    assert backends.weight_sync_backend("nccl") == "nccl"


def test_the_weight_sync_and_the_driver_use_this_choice():
    import inspect

    from megagrpo import driver
    from megagrpo.weight_sync import sync

    assert sync.weight_sync_backend is backends.weight_sync_backend
    # No backend argument to override it: WeightSync reads the config's resolved trainer backend.
    assert "backend" not in inspect.signature(sync.WeightSync.__init__).parameters
    assert "weight_sync_backend(cfg.parallel.resolved_backend)" in inspect.getsource(sync.WeightSync.__init__)
    assert "sync.backend" in inspect.getsource(driver.train)
