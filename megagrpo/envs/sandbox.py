"""Run model-written Python where it can do no harm: :func:`run_python`.

The sandbox is bubblewrap (``bwrap``, Debian's ``bubblewrap`` package), the tool Flatpak builds its
sandboxes with; the resource limits are set by util-linux's ``prlimit`` and, when we are root, the switch
to an unprivileged uid by util-linux's ``setpriv`` (util-linux is Essential on Debian). Every piece was
checked by experiment on Debian 12 (bwrap 0.8, kernel 6.x), and tests/unit/test_sandbox.py tries each escape:

- no network: a network namespace of its own (``--unshare-net``), where nothing listens and there is no
  resolver (``/etc`` is not there), so a connection to the host's 127.0.0.1 is refused and DNS fails;
- its own filesystem view: a read-only root holding read-only binds of ``/usr`` (and ``/bin``, ``/lib*``),
  the interpreter's install prefix when it lives elsewhere (pyenv's under ``/root``, say) and nothing
  else (not ``/etc``, ``/home``, ``/root``, ``/work``, the host's ``/tmp``); two tmpfs of ``max_file_mb``
  each, ``/sandbox`` (its working directory and ``HOME``, holding its ``main.py``) and ``/tmp``, so what it
  writes is in memory with a size, never on the host's disk; a ``/proc`` of its own pid namespace and a
  minimal, read-only ``/dev``. Every mount is nosuid and the code runs with no capabilities and
  no_new_privs;
- no namespaces and no mounts of its own: a seccomp filter (``megagrpo.envs.seccomp``) fails ``unshare``,
  ``setns``, namespace flags of ``clone`` and every mount call with EPERM. Without it, ``unshare -Urm``
  gives the code every capability in a user namespace of its own, where it can mount a tmpfs of any size
  past every limit here. It also fails ``memfd_create``, ``shmget`` and ``msgget``, whose memory no limit
  here counts;
- a scrubbed environment: PATH, HOME, LANG and PYTHONDONTWRITEBYTECODE, nothing of ours;
- the base interpreter (not our venv's) in isolated mode (``-I``): the standard library and whatever the
  interpreter's own site-packages holds;
- CPU time, address space, file size, open files and core-dump limits (RLIMIT_CPU/AS/FSIZE/NOFILE/CORE,
  per process; :data:`OPEN_FILES` descriptors);
- a process-count limit: RLIMIT_NPROC counts the processes of a *uid*, and the kernel does not apply it
  to root at all. As root, bwrap builds the sandbox with root's rights (it can then bind an interpreter
  under the 0700 ``/root``: run as another uid, bwrap 0.8 cannot, even from an open fd, since it resolves
  the fd's path) and ``setpriv`` switches the code to a uid of its own, drawn from :data:`SANDBOX_UIDS`,
  so the count is of this run's processes only. Not root, bwrap puts the code in a user namespace of its
  own, where the kernel counts the processes per namespace; the limit is set inside it (set on bwrap
  itself, it would also count every other process of ours);
- memory: the limits are per process, so the run as a whole holds at most ``max_processes`` x
  ``memory_mb`` of address space, plus its two tmpfs. A cgroup would bound the total itself, but needs a
  writable cgroup tree with the memory controller delegated, which the sandbox cannot count on (on the
  machine this was written on, the memory controller is on cgroup v1); :class:`SandboxLimits`' defaults
  keep the product at 2 GiB;
- the deadline: the run starts a process group of its own; at ``wall_s`` the whole group is killed,
  which kills the sandbox's pid namespace and so everything in it (bwrap's ``--die-with-parent`` covers
  the case of our own death). After a run ends, the group is killed as well, so nothing it started
  survives: the kernel empties the namespace within moments of our return (asynchronously: bwrap exits
  as soon as the code's main process does, its reaper a little later);
- output goes to files, not pipes (no deadlock, no reader threads); each is cut to ``max_output_bytes``.

No ``preexec_fn`` anywhere: the trainer's processes have threads, and Python code run between fork and
exec can deadlock there. All the work is done by the programs above, exec'd one after the other.

Without a working bubblewrap, :func:`run_python` raises :class:`SandboxUnavailable`; with
``allow_unsandboxed=True`` it runs the code as the caller, with the rlimits (no process count: for a uid
shared with the caller's other processes that limit would count them too), the scrubbed environment,
a private host directory (removed afterwards) and the deadline only. Processes that leave the process
group (``setsid``) then escape the deadline's kill.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from megagrpo.envs.base import ArgumentError
from megagrpo.envs.seccomp import SECCOMP_ARCHES, filter_program

__all__ = [
    "OPEN_FILES",
    "SANDBOX_UIDS",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "run_python",
    "sandbox_problem",
]

SANDBOX_UIDS = range(0x7000_0000, 0x7000_0000 + 2**27)
"""The uids a root caller's runs get one of, at random (a collision only makes two concurrent runs share
their process count). Above systemd's container ranges and below the 2**31 that some tools read as
negative."""

HOME = "/sandbox"
"""The code's working directory and HOME inside the sandbox."""

OPEN_FILES = 64
"""Descriptors each process may have open (RLIMIT_NOFILE). Each can hold kernel memory no other limit
counts (a socket's unread buffer: a socketpair queues ~220 KiB), so their number is kept small: with the
20000 that processes inherited here, the code queued 889 MiB in 4000 socketpairs at memory_mb 256."""

_FD_FILES = ("main.py", "seccomp.bpf")
"""The run directory's files bwrap reads from descriptors, in :func:`_bwrap_argv`'s order."""

_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
"""Top-level directories that merged-/usr systems make symlinks into /usr; bound as they are on the host."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. All must be positive; all but ``wall_s`` are integers.

    Together they bound the run: at most ``max_processes`` x ``memory_mb`` MiB of address space (2 GiB at
    the defaults) and 2 x ``max_file_mb`` MiB of files (its /sandbox and /tmp), whatever it starts."""

    cpu_s: int = 5
    """CPU seconds of each process (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL a second later."""
    wall_s: float = 10.0
    """Seconds from start until everything the run started is killed (``timed_out``)."""
    memory_mb: int = 512
    """Address space of each process in MiB (RLIMIT_AS): allocations past it raise MemoryError."""
    max_processes: int = 4
    """Processes (and threads) the code may have at once, itself included (RLIMIT_NPROC); sandboxed only.
    With ``memory_mb`` it bounds the run's memory: each process has its own address space."""
    max_output_bytes: int = 64 * 1024
    """stdout and stderr are each cut to this many bytes (a note of how much was cut follows)."""
    max_file_mb: int = 64
    """Size of each of its two tmpfs, /sandbox (its working directory) and /tmp: a write past it fails
    with ENOSPC. Also its largest file, stdout and stderr included (RLIMIT_FSIZE; past it: EFBIG)."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            number = (int, float) if field.name == "wall_s" else int
            if isinstance(value, bool) or not isinstance(value, number) or not 0 < value < math.inf:
                kind = "a number" if field.name == "wall_s" else "an integer"
                raise ArgumentError(field.name, f"must be {kind} > 0, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one run of model-written code did."""

    stdout: str
    """Its standard output, cut to ``max_output_bytes``."""
    stderr: str
    """Its standard error (tracebacks), cut to ``max_output_bytes``."""
    exit_code: int | None
    """Its exit status; minus the signal's number when a signal ended it (SIGXCPU: the CPU limit);
    None when it was killed at the deadline."""
    timed_out: bool
    """It ran past ``wall_s`` and was killed."""
    sandboxed: bool
    """It ran inside bubblewrap (False: rlimits, private directory and deadline only)."""

    def summary(self, tail_lines: int = 20) -> str:
        """What a code tool shows the model: the output, and how the run ended when it did not end well
        (the last ``tail_lines`` lines of stderr, or what killed it)."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.timed_out:
            parts.append("killed: time limit")
        elif self.exit_code == -signal.SIGXCPU:
            parts.append("killed: CPU time limit")
        elif self.exit_code is not None and self.exit_code < 0:
            parts.append(f"killed: {_signal_name(-self.exit_code)}")
        elif self.exit_code:
            error = "\n".join(self.stderr.rstrip("\n").splitlines()[-tail_lines:])
            parts.append(error or f"exit code {self.exit_code}")
        return "\n".join(parts)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no names of their own
        return f"signal {number}"


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or does not work here, and running unsandboxed was not allowed."""

    def __init__(self, problem: str):
        super().__init__(
            f"cannot sandbox model-written code: {problem}. Install bubblewrap (apt-get install bubblewrap), "
            "or set allow_unsandboxed: true to run it with resource limits, a private directory and a "
            "deadline only"
        )


def sandbox_problem() -> str | None:
    """None when bubblewrap runs a sandbox here (a tiny program, checked once per process and bwrap),
    else why not."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap (bubblewrap) is not on PATH"
    return _self_check(bwrap)


def run_python(
    code: str,
    limits: SandboxLimits = SandboxLimits(),
    *,
    allow_unsandboxed: bool = False,
    stdin: str = "",
) -> SandboxResult:
    """Run ``code`` as a Python script in the sandbox (module docstring) and report what it did.

    Raises SandboxUnavailable when bubblewrap does not work here, unless ``allow_unsandboxed``.
    Safe to call from several threads and processes at once."""
    problem = sandbox_problem()
    if problem is not None and not allow_unsandboxed:
        raise SandboxUnavailable(problem)
    bwrap = None if problem is not None else shutil.which("bwrap")
    return _run(code, limits, stdin, bwrap)


@functools.cache
def _self_check(bwrap: str) -> str | None:
    if platform.machine() not in SECCOMP_ARCHES:
        return f"no seccomp filter is written for this machine ({platform.machine()})"
    for tool in ("prlimit", "setpriv") if os.geteuid() == 0 else ("prlimit",):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not on PATH"
    try:
        result = _run("print('ok')", SandboxLimits(wall_s=30), "", bwrap)
    except OSError as err:  # bwrap not executable, say
        return f"bwrap failed its self-check ({err})"
    if result.stdout == "ok\n":
        return None
    error = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
    return f"bwrap failed its self-check ({error[0]})"


def _run(code: str, limits: SandboxLimits, stdin: str, bwrap: str | None) -> SandboxResult:
    """One run: in bwrap at ``bwrap``, or unsandboxed when None."""
    with tempfile.TemporaryDirectory(prefix="megagrpo-sandbox-") as run_dir:
        run = Path(run_dir)
        (run / "main.py").write_text(code)
        (run / "stdin").write_text(stdin)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": HOME, "LANG": "C.UTF-8"}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        with contextlib.ExitStack() as files:
            if bwrap is None:
                work = run / "work"
                work.mkdir()
                shutil.copy(run / "main.py", work / "main.py")
                argv, cwd, env["HOME"], fds = [*_prlimit(limits, nproc=None), *_python()], work, str(work), ()
            else:
                # bwrap reads both from inherited descriptors: the code it copies into /sandbox, the filter.
                (run / "seccomp.bpf").write_bytes(filter_program())
                fds = tuple(files.enter_context(open(run / name, "rb")).fileno() for name in _FD_FILES)
                argv, cwd = _bwrap_argv(bwrap, limits, *fds), run
            exit_code, timed_out = _launch(argv, cwd, env, run, limits.wall_s, fds)
        if bwrap is not None and exit_code is not None and 128 < exit_code < 128 + signal.NSIG:
            # bwrap reports a signal as 128 + its number, the way a shell does.
            exit_code = -(exit_code - 128)
        return SandboxResult(
            stdout=_read_cut(run / "stdout", limits.max_output_bytes),
            stderr=_read_cut(run / "stderr", limits.max_output_bytes),
            exit_code=exit_code,
            timed_out=timed_out,
            sandboxed=bwrap is not None,
        )


def _launch(
    argv: list[str], cwd: Path, env: dict[str, str], run: Path, wall_s: float, fds: tuple[int, ...]
) -> tuple[int | None, bool]:
    """Run ``argv`` in a process group of its own with ``run``/stdin, stdout and stderr, kill the group at
    ``wall_s`` or when it ends: (exit code, None when killed at the deadline; timed out)."""
    with (
        open(run / "stdin", "rb") as stdin,
        open(run / "stdout", "wb") as out,
        open(run / "stderr", "wb") as err,
    ):
        proc = subprocess.Popen(
            argv, stdin=stdin, stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True, pass_fds=fds
        )
    pidfd = os.pidfd_open(proc.pid)
    try:
        # A pidfd turns readable when the process exits and leaves it unreaped: its pid, and so its
        # process group's id, cannot have gone to another process when we kill the group below.
        timed_out = not select.select([pidfd], [], [], wall_s)[0]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        os.close(pidfd)
    code = proc.wait()
    return (None if timed_out else code), timed_out


def _read_cut(path: Path, max_bytes: int) -> str:
    with open(path, "rb") as f:
        data = f.read(max_bytes)
    cut = path.stat().st_size - len(data)
    text = data.decode("utf-8", errors="replace")
    return f"{text}\n[... {cut} more bytes cut]" if cut > 0 else text


def _bwrap_argv(bwrap: str, limits: SandboxLimits, code_fd: int, seccomp_fd: int) -> list[str]:
    """bwrap, then (as root) setpriv to a uid of the run's own, then prlimit, then the interpreter."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd)]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in _ROOT_LINKS:
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for root in _interpreter_roots():
        # bwrap would create the missing parents with the modes of the host's (0700 for /root).
        for parent in reversed(Path(root).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", root, root]
    for tmpfs, perms in ((HOME, "0777"), ("/tmp", "1777")):
        # Memory of its own, max_file_mb each: what the code writes never reaches the host's disk.
        argv += ["--perms", perms, "--size", str(limits.max_file_mb << 20), "--tmpfs", tmpfs]
    argv += ["--perms", "0644", "--file", str(code_fd), f"{HOME}/main.py", "--chdir", HOME]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    # The root and /dev are tmpfs of no size limit, which a caller that is not root leaves writable to
    # the code (its uid owns them in its user namespace): read-only, its two tmpfs are all it can fill.
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    if os.geteuid() != 0:
        # bwrap's reaper (pid 1) is in the code's user namespace and counts against its limit.
        return [*argv, *_prlimit(limits, nproc=limits.max_processes + 1), *_python()]
    # setpriv needs these three; whatever it runs has none (a non-root uid, an empty bounding set).
    argv += ["--cap-drop", "ALL"]
    for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
        argv += ["--cap-add", cap]
    uid = SANDBOX_UIDS.start + secrets.randbelow(len(SANDBOX_UIDS))
    setpriv = [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    setpriv += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return [*argv, *setpriv, *_prlimit(limits, nproc=limits.max_processes), *_python()]


def _prlimit(limits: SandboxLimits, nproc: int | None) -> list[str]:
    argv = [shutil.which("prlimit") or "prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}"]
    argv += [f"--as={limits.memory_mb << 20}", f"--fsize={limits.max_file_mb << 20}", "--core=0"]
    argv.append(f"--nofile={OPEN_FILES}")
    if nproc is not None:
        argv.append(f"--nproc={nproc}")
    return [*argv, "--"]


def _python() -> list[str]:
    return [_interpreter(), "-I", "main.py"]


@functools.cache
def _interpreter() -> str:
    """The base interpreter: a venv's python is a symlink to it, and the venv's packages stay out."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@functools.cache
def _interpreter_roots() -> tuple[str, ...]:
    """The interpreter's prefix and directory, where /usr does not already hold them."""
    roots: list[str] = []
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(_interpreter())):
        if not any(path == r or path.startswith(r.rstrip("/") + "/") for r in ["/usr", *roots]):
            roots.append(path)
    return tuple(roots)
