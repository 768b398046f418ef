"""The patches of third-party libraries: each is undone when its block ends, and unpinned library
versions are named in one warning."""

import warnings

import pytest

from megagrpo import compat

pytestmark = pytest.mark.unit


def test_pinned_versions_give_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.warn_unverified(dict(compat.PINNED)) is None


def test_another_megatron_version_names_its_unverified_patches_in_one_warning():
    versions = {**compat.PINNED, "megatron-core": "0.17.0", "vllm": "0.33.1"}
    with pytest.warns(RuntimeWarning) as record:
        message = compat.warn_unverified(versions)
    assert len(record) == 1 and str(record[0].message) == message
    for patch in compat.PATCHES:
        assert (patch.name in message) == (patch.library == "megatron-core")
    assert "megatron-core 0.17.0 (pinned 0.16.1" in message and "vllm 0.33.1" in message


def test_a_library_that_is_not_installed_is_not_reported():
    assert compat.unverified({**compat.PINNED, "vllm": None}) == {}


def test_every_patch_module_exists_and_names_its_versions():
    import importlib

    for patch in compat.PATCHES:
        module = importlib.import_module(f"megagrpo.compat.{patch.name}")
        assert "Verified with" in module.__doc__ or "verified" in module.__doc__
        assert patch.library in compat.PINNED and patch.verified


def test_megatron_writer_patches_are_undone():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megagrpo.compat import megatron_writer

    opener = object()
    with megatron_writer.writers_open_with(opener) as active:
        assert active and filesystem_async.open is opener
    assert "open" not in vars(filesystem_async)
    with megatron_writer.in_process_results_queue():
        assert filesystem_async._results_queue is not None
    assert filesystem_async._results_queue is None


def test_torch_save_crc_switch_is_restored():
    from torch.utils.serialization import config

    from megagrpo.compat.torch_save import without_crc32

    before = config.save.compute_crc32
    with without_crc32():
        assert config.save.compute_crc32 is False
    assert config.save.compute_crc32 == before


def test_distributed_optimizer_method_is_restored():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megagrpo.compat.megatron_optimizer import adam_step_kept_on_load

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    with adam_step_kept_on_load():
        patched = DistributedOptimizer._set_main_param_and_optimizer_states
        assert patched is not original and patched._keeps_adam_step
    assert DistributedOptimizer._set_main_param_and_optimizer_states is original


def test_untie_adam_steps_gives_each_parameter_its_own_step():
    import torch

    from megagrpo.compat.megatron_optimizer import untie_adam_steps

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    adam = torch.optim.Adam(params, lr=0.1)
    shared = torch.tensor(5.0)
    for p in params:  # what Megatron's loader leaves behind
        adam.state[p] = {"step": shared, "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}

    class Wrapped:  # a Megatron optimizer holds torch's as .optimizer
        optimizer = adam

    untie_adam_steps(Wrapped())
    steps = [adam.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == 3 and all(float(s) == 5.0 for s in steps)
    for p in params:
        p.grad = torch.ones(2)
    adam.step()
    assert [float(adam.state[p]["step"]) for p in params] == [6.0, 6.0, 6.0]
