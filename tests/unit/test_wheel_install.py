"""The package works installed from a wheel, without the checkout: `megagrpo plan` from another directory.

The wheel is built from a copy of the sources (the build writes build/ and *.egg-info beside them) with
the setuptools already installed: no build isolation, no network. It goes into a fresh virtual
environment that sees this environment's site-packages through a .pth file (torch, Megatron, ... for
real commands; none of them is imported by `plan`), but not this environment's editable megagrpo: a
.pth line only adds a directory to sys.path, the .pth files inside it (the editable finder's) are not run.
"""

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _run(argv, cwd=None, env=None, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with megagrpo installed from a freshly built wheel."""
    pytest.importorskip(
        "setuptools", reason="building the wheel without isolation needs setuptools (dev extra)"
    )
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "megagrpo", src / "megagrpo", symlinks=True, ignore=skip)  # keeps the configs link
    shutil.copytree(REPO / "configs", src / "configs", ignore=skip)
    for path in REPO.iterdir():
        if path.is_file():  # pyproject.toml, README.md (the long description), ...
            shutil.copy2(path, src / path.name)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src])
    (wheel,) = dist.glob("megagrpo-*.whl")

    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", env_dir])
    python = env_dir / "bin" / "python"
    # Installed before the .pth exists, so pip sees no other megagrpo.
    _run([*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    purelib = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    )
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_megagrpo_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    return env_dir


@pytest.fixture
def env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH pointing into a checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_the_wheel_is_what_runs(venv, env, tmp_path):
    probe = """
import importlib.util, sysconfig, megagrpo, megagrpo.config_files as c
print(sysconfig.get_path("purelib"), megagrpo.__file__, c.DEFAULT_CONFIG_PATH, sep="\\n")
print(*(importlib.util.find_spec(m) is not None for m in ("torch", "megatron.core", "yaml")))
"""
    out = _run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, env=env).stdout.splitlines()
    purelib = Path(out[0])
    assert Path(out[1]).is_relative_to(purelib), out  # not the checkout, not the editable install
    assert Path(out[2]) == purelib / "megagrpo" / "configs" / "tiny_cpu.yaml"
    assert Path(out[2]).is_file() and not Path(out[2]).is_symlink()  # a real file in the wheel
    assert out[3] == "True True True"  # the dependencies are visible


def test_plan_from_outside_the_checkout(venv, env, tmp_path):
    megagrpo = venv / "bin" / "megagrpo"
    done = _run([megagrpo, "plan"], cwd=tmp_path, env=env)
    assert "run            tiny-cpu" in done.stdout and "plan OK" in done.stdout

    shape = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 131072,
    }
    (tmp_path / "config.json").write_text(json.dumps(shape))
    hf = ["--hf-config", "config.json", "--transformer-engine", "yes"]
    done = _run(
        [megagrpo, "plan", "--config", "deepscaler/8k", *hf, "grpo.num_generations=4"], cwd=tmp_path, env=env
    )
    assert "run            deepscaler-8k" in done.stdout
    assert "128 prompts x 4 = 512 rollouts" in done.stdout

    mine = "run_name: mine\nmodel:\n  tiny: {max_position_embeddings: 4096}\n"
    (tmp_path / "tiny_cpu.yaml").write_text(mine)
    done = _run([megagrpo, "plan", "--config", "tiny_cpu.yaml"], cwd=tmp_path, env=env)
    assert "run            mine" in done.stdout  # a file here wins over the packaged name

    done = _run([megagrpo, "plan", "--config", "does-not-exist"], cwd=tmp_path, env=env, check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("megagrpo plan: config error: config 'does-not-exist' not found")
    assert "deepscaler/8k, deepscaler/cpu_twin_1" in done.stderr and "tiny_cpu" in done.stderr
