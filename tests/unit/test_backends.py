"""The one resolver of "auto" backends and layer implementations, and who uses it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megagrpo.parallel import backends

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def test_auto_follows_what_this_process_has(monkeypatch):
    for cuda, want in ((True, "nccl"), (False, "gloo")):
        monkeypatch.setattr(backends, "cuda_available", lambda cuda=cuda: cuda)
        assert backends.resolve_backend("auto") == want
    # Transformer Engine, then PyTorch's fused kernels (the torch layers), then Megatron's local modules.
    for te, torch_layers, want in (
        (True, True, "transformer_engine"),
        (False, True, "torch"),
        (False, False, "local"),
    ):
        monkeypatch.setattr(backends, "transformer_engine_available", lambda te=te: te)
        monkeypatch.setattr(backends, "torch_layers_available", lambda t=torch_layers: t)
        assert backends.resolve_transformer_impl("auto") == want


def test_this_torch_has_the_torch_layers():
    # torch 2.13 here: SDPA with enable_gqa and F.rms_norm, read from the version without importing torch.
    import torch.nn.functional as F

    assert backends.torch_layers_available()
    assert hasattr(F, "rms_norm")


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
    monkeypatch.setattr(backends, "torch_layers_available", lambda: False)
    assert backends.resolve_transformer_impl("torch") == "torch"
    with pytest.raises(ValueError, match=r"'torch' needs PyTorch >= 2\.5"):
        backends.resolve_transformer_impl("torch", check_available=True)


def test_layer_features_name_every_implementation():
    assert set(backends.IMPL_FEATURES) == set(backends.TRANSFORMER_IMPLS)
    assert backends.IMPL_FEATURES["local"] == frozenset()
    assert backends.IMPL_FEATURES["torch"] == {"sequence_parallel", "thd"}  # CP needs TE's ring attention
    assert backends.IMPL_FEATURES["transformer_engine"] == {"sequence_parallel", "context_parallel", "thd"}


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"parallel\.backend must be one of auto, nccl, gloo; got 'mpi'"):
        backends.resolve_backend("mpi")
    impls = r"parallel\.transformer_impl must be auto, local, torch or transformer_engine; got 'apex'"
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

    from megagrpo.trainers import grpo as driver
    from megagrpo.weight_sync import sync

    assert sync.weight_sync_backend is backends.weight_sync_backend
    # No backend argument to override it: WeightSync reads the config's resolved trainer backend.
    assert "backend" not in inspect.signature(sync.WeightSync.__init__).parameters
    assert "weight_sync_backend(cfg.resolved.backend)" in inspect.getsource(sync.WeightSync.__init__)
    assert "sync.backend" in inspect.getsource(driver.print_layout)


def test_the_policy_ranks_act_on_the_decisions_made_where_the_run_started():
    import inspect

    from megagrpo.policy import rank

    # cfg.resolved travels with the config: a rank on another machine does not decide "auto" again.
    source = inspect.getsource(rank.MegatronRank.__init__)
    for read in (
        "backend=cfg.resolved.backend",
        "transformer_impl=cfg.resolved.transformer_impl",
        "cfg.resolved.packs_sequences",
    ):
        assert read in source
    assert "cfg.parallel.backend" not in source and "cfg.parallel.transformer_impl" not in source


def _probe(tmp_path, te_init: str | None) -> dict:
    """transformer_engine_available and auto's choice in a fresh interpreter whose path holds a
    ``transformer_engine`` package with ``te_init`` as its ``__init__`` (None: no such package)."""
    site = tmp_path / "site"
    site.mkdir()
    if te_init is not None:
        (site / "transformer_engine").mkdir()
        (site / "transformer_engine" / "__init__.py").write_text(te_init)
    code = (
        "import importlib.util, json, sys\n"
        "from megagrpo.parallel import backends\n"
        "found = importlib.util.find_spec('transformer_engine') is not None\n"
        "have = backends.transformer_engine_available()\n"
        "try:\n"
        "    backends.resolve_transformer_impl('transformer_engine', check_available=True)\n"
        "    named = ''\n"
        "except ValueError as err:\n"
        "    named = str(err)\n"
        "print(json.dumps({'found': found, 'have': have, 'auto': backends.resolve_transformer_impl('auto'),\n"
        "                  'megatron_imported': 'megatron.core' in sys.modules, 'named': named}))\n"
    )
    path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": path}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_auto_takes_transformer_engine_only_when_megatron_imported_it(tmp_path):
    # Installed without its PyTorch extension (source-only, built in a step of its own): Megatron's own
    # import finds no module and sets HAVE_TE False, so auto must not pick it, and naming it is refused.
    missing = "transformer_engine_torch"
    broken = _probe(tmp_path, f'raise ModuleNotFoundError("No module named {missing!r}", name={missing!r})')
    assert broken.pop("named").endswith(
        "Megatron-Core could not import it (python -c 'import transformer_engine.pytorch' says why)"
    )
    assert broken == {"found": True, "have": False, "auto": "torch", "megatron_imported": True}


def test_a_transformer_engine_that_breaks_megatron_is_named(tmp_path):
    # Any other import error escapes Megatron's own guards: no layer implementation can be built here.
    site = tmp_path / "site" / "transformer_engine"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise ImportError('libcudnn.so.9: cannot open shared object file')")
    code = "from megagrpo.parallel import backends\nbackends.resolve_transformer_impl('auto')\n"
    path = os.pathsep.join([str(site.parent), str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": path}, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert (
        "ValueError: transformer_engine is installed but fails to import (libcudnn.so.9: cannot open shared "
        "object file), and Megatron-Core fails with it" in done.stderr
    )


def test_a_machine_without_transformer_engine_imports_nothing_to_find_out(tmp_path):
    probe = _probe(tmp_path, None)
    assert "not installed" in probe.pop("named")
    assert probe == {"found": False, "have": False, "auto": "torch", "megatron_imported": False}
