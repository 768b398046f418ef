"""The patches of third-party libraries: each is undone when its block ends, and unpinned library
versions are named in one warning."""

import importlib
import subprocess
import sys
import textwrap
import warnings
from typing import ClassVar

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
    megatron_part = message.split("megatron-core 0.17.0 (pinned 0.16.1; patches not verified for it: ")[1]
    named = set(megatron_part.split(")")[0].split(", "))
    assert named == {p.name for p in compat.PATCHES if p.library == "megatron-core"}
    assert named >= {"cuda_on_cpu", "megatron_writer", "megatron_optimizer", "startup"}
    vllm_part = message.split("vllm 0.33.1 (pinned 0.32.0; patches not verified for it: ")[1]
    named = set(vllm_part.split(")")[0].split(", "))
    assert named == {p.name for p in compat.PATCHES if p.library == "vllm"}
    assert named >= {"vllm_weight_transfer", "vllm_eager_cpu", "vllm_moe_reload", "vllm_routed_experts"}
    assert "torch" not in message and "python" not in message


def test_another_python_names_the_exit_patch():
    with pytest.warns(
        RuntimeWarning,
        match=r"python 3\.12 \(pinned 3\.11; patches not verified for it: "
        r"process_exit\)",
    ):
        compat.warn_unverified({**compat.PINNED, "python": "3.12"})
    assert compat.installed_version("python") == "{}.{}".format(*sys.version_info[:2])


def test_a_library_that_is_not_installed_is_not_reported():
    assert compat.unverified({**compat.PINNED, "vllm": None}) == {}


def test_every_patch_module_exists_and_names_its_versions():
    for patch in compat.PATCHES:
        module = importlib.import_module(f"megagrpo.compat.{patch.name}")
        assert patch.library in compat.PINNED and patch.verified and patch.reason
        for version in patch.verified:  # the docstring says what the record says
            assert version in module.__doc__, (patch.name, patch.library, version)
        assert patch.name in compat.__doc__


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


def _run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


def test_vllm_weight_transfer_engine_is_registered_once():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megagrpo.compat import vllm_weight_transfer

    name = "megagrpo-test-engine"
    try:
        assert vllm_weight_transfer.is_registered(name) is False
        assert vllm_weight_transfer.register_engine_once(name, "megagrpo.weight_sync.vllm_engine", "X")
        assert vllm_weight_transfer.is_registered(name) is True
        assert not vllm_weight_transfer.register_engine_once(name, "megagrpo.weight_sync.vllm_engine", "X")
    finally:
        WeightTransferEngineFactory._registry.pop(name, None)


def test_vllm_weight_transfer_without_a_registry_relies_on_the_documented_refusal(monkeypatch):
    from megagrpo.compat import vllm_weight_transfer

    class Factory:  # a vLLM whose factory keeps its engines elsewhere
        names: ClassVar[set] = set()

        @classmethod
        def register_engine(cls, name, module, class_name):
            if name in cls.names:
                raise ValueError(f"Weight transfer engine '{name}' is already registered.")
            if not class_name:
                raise ValueError("class_name is required when registering with module path")
            cls.names.add(name)

    monkeypatch.setattr(vllm_weight_transfer, "_factory", lambda: Factory)
    assert vllm_weight_transfer.is_registered("e") is None
    assert vllm_weight_transfer.register_engine_once("e", "m", "C") is True
    assert vllm_weight_transfer.register_engine_once("e", "m", "C") is False
    with pytest.raises(ValueError, match="class_name is required"):
        vllm_weight_transfer.register_engine_once("f", "m", "")


def test_vllm_still_compiles_the_helpers_eager_cpu_engines_switch_off():
    # The reason for TORCH_COMPILE_DISABLE in eager CPU engines holds for the installed vLLM: the
    # helpers exist and are torch.compile'd (dynamo wraps them, keeping the original function).
    from megagrpo.compat.vllm_eager_cpu import COMPILED_HELPERS, eager_cpu_engine_env

    for module, name in COMPILED_HELPERS:
        helper = getattr(importlib.import_module(module), name)
        assert callable(getattr(helper, "_torchdynamo_orig_callable", None)), (module, name)
    assert eager_cpu_engine_env(gpus=0, enforce_eager=True) == {"TORCH_COMPILE_DISABLE": "1"}
    assert eager_cpu_engine_env(gpus=0, enforce_eager=False) == {}
    assert eager_cpu_engine_env(gpus=8, enforce_eager=True) == {}


def test_exit_without_teardown_falls_back_to_a_normal_exit_without_its_hook():
    done = _run_python(
        """
        import atexit
        from megagrpo.compat.process_exit import exit_without_teardown

        class Finalized:
            def __del__(self):
                print("teardown ran")

        keep = Finalized()
        del atexit._run_exitfuncs  # as in a Python without it
        exit_without_teardown(4)
        """
    )
    assert done.returncode == 4 and done.stdout == "teardown ran\n"


def _without_pythonwarnings() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}


def test_importing_megagrpo_installs_no_warning_filter():
    done = _run_python(
        """
        import warnings
        before = list(warnings.filters)
        import megagrpo, megagrpo.cli, megagrpo.compat.upstream_warnings
        assert warnings.filters == before, [f for f in warnings.filters if f not in before]
        warnings.simplefilter("always")
        import megatron.core.models.backends  # warns that Apex is missing
        """,
        env=_without_pythonwarnings(),
    )
    assert done.returncode == 0, done.stderr
    assert "UserWarning: Apex is not installed" in done.stderr


def test_a_program_silences_the_noise_here_and_in_the_processes_it_starts():
    from megagrpo.compat.upstream_warnings import NOISE, pythonwarnings_entries

    assert all(":" not in n.starts and "," not in n.starts for n in NOISE)
    raise_all = "\n".join(
        f"warnings.warn({(n.starts + ' (and more)')!r}, {n.category.__name__})" for n in NOISE
    )
    probe = f"import warnings\n{raise_all}\nwarnings.warn('kept')\n"
    done = _run_python(
        f"""
        import os, subprocess, sys, warnings
        from megagrpo.compat.upstream_warnings import silence_in_this_program

        os.environ["PYTHONWARNINGS"] = "error::DeprecationWarning"
        silence_in_this_program()
        silence_in_this_program()  # once is enough: nothing is added twice
        print(os.environ["PYTHONWARNINGS"])
        with warnings.catch_warnings(record=True) as caught:
            exec({probe!r})
        print([str(w.message) for w in caught])
        child = subprocess.run([sys.executable, "-c", {probe!r}], capture_output=True, text=True)
        print(child.stderr.count("Warning:"), "kept" in child.stderr)
        """,
        env=_without_pythonwarnings(),
    )
    assert done.returncode == 0, done.stderr
    env_line, caught, child = done.stdout.splitlines()
    assert env_line == ",".join([*pythonwarnings_entries(), "error::DeprecationWarning"])
    assert caught == "['kept']"
    assert child == "1 True"  # the child shows only the unrelated warning


def test_vllm_still_skips_the_cpu_experts_processing_on_a_weight_update():
    # The reason for vllm_moe_reload holds for the installed vLLM: a second processing of an MoE layer
    # (the kernel set) is taken for a weight update, which skips the experts' own step, and the CPU
    # experts are the ones whose step pads and prepacks.
    import inspect

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    setup = inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel)
    assert "is_weight_update = self.moe_kernel is not None" in setup
    assert "fused_experts.process_weights_after_loading(layer)" in setup
    processing = inspect.getsource(CPUUnquantizedExperts.process_weights_after_loading)
    assert "_pad_moe_intermediate" in processing and "cpu_prepack_moe_weight" in processing
