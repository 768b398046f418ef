"""The sandbox for model-written code (megagrpo.envs.sandbox): each way out is tried (a socket, reading and
writing outside its directory, too much memory, a fork bomb, endless loops, our environment, a user
namespace and mounts of its own, filling its tmpfs, children that each hold memory) and is refused or
cut, and the run right after works normally; without bubblewrap the sandbox refuses to run unless
running unsandboxed is allowed."""

import json
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megagrpo.envs import sandbox
from megagrpo.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_problem

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _bubblewrap_works():
    problem = sandbox_problem()
    assert problem is None, f"the sandbox cannot run here ({problem}); `make setup` installs bubblewrap"


def assert_runs_normally(**limits):
    result = run_python("import sys\nprint(sum(range(10)), sys.flags.isolated)", SandboxLimits(**limits))
    assert (result.stdout, result.stderr, result.exit_code) == ("45 1\n", "", 0)
    assert result.sandboxed and not result.timed_out
    assert result.summary() == "45 1"


def test_network_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"""
import socket
for address in [("127.0.0.1", {port}), ("example.com", 80)]:
    try:
        socket.create_connection(address, timeout=5)
        print("connected", address)
    except OSError as err:
        print("refused", type(err).__name__)
"""
        result = run_python(code)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert result.stdout == "refused ConnectionRefusedError\nrefused gaierror\n"
    assert_runs_normally()


def test_files_outside_its_directory_cannot_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-42")
    paths = [str(secret), str(REPO / "pyproject.toml"), str(Path(__file__).resolve()), "/etc/passwd"]
    code = f"""
import os
for path in {paths!r}:
    try:
        print("read", open(path).read(100))
    except OSError as err:
        print("refused", type(err).__name__)
print(*sorted(os.listdir("/")))
"""
    result = run_python(code)
    lines = result.stdout.splitlines()
    assert lines[: len(paths)] == ["refused FileNotFoundError"] * len(paths), result.stdout
    assert "the-secret-42" not in result.stdout
    # Beside /usr and its links, only the interpreter's own install (under /root, say) shows.
    interpreter_top = Path(sys.base_prefix).resolve().parts[1]
    host_only = {"etc", "home", "work", "var", "opt", "mnt", "srv"} - {interpreter_top}
    assert "sandbox" in lines[-1].split()
    assert not host_only & set(lines[-1].split()), lines[-1]
    assert_runs_normally()


def test_files_outside_its_directory_cannot_be_written(tmp_path):
    name = f"megagrpo-escape-{uuid.uuid4().hex}"
    targets = [tmp_path / name, Path("/usr/lib") / name, Path("/tmp") / name, REPO / name]
    code = f"""
for path in {[str(t) for t in targets]!r}:
    try:
        open(path, "w").write("escaped")
        print("wrote")
    except OSError as err:
        print("refused", type(err).__name__)
open("own.txt", "w").write("mine")
print(open("own.txt").read())
"""
    try:
        result = run_python(code)
        leaked = [t for t in targets if t.exists()]
    finally:
        for target in targets:
            target.unlink(missing_ok=True)
    # The sandbox's /tmp is a tmpfs of its own: the write lands there, not on the host.
    assert result.stdout.splitlines() == [
        "refused FileNotFoundError",
        "refused OSError",  # read-only filesystem
        "wrote",
        "refused FileNotFoundError",
        "mine",
    ], result.stdout
    assert leaked == []
    assert_runs_normally()


NAMESPACE_ESCAPES = """
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)

def call(name, *args):
    ok = getattr(libc, name)(*args) == 0
    print(name, "succeeded" if ok else os.strerror(ctypes.get_errno()))

shell = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs none /tmp; df /tmp"],
                       capture_output=True, text=True)
print("unshare -Urm:", shell.returncode, shell.stderr.strip())
call("unshare", 0x10000000)  # CLONE_NEWUSER
call("unshare", 0x00020000)  # CLONE_NEWNS
call("mount", b"none", b"/tmp", b"tmpfs", 0, None)
call("setns", os.open("/proc/self/ns/user", os.O_RDONLY), 0)
if hasattr(os, "unshare"):  # Python 3.12
    try:
        os.unshare(os.CLONE_NEWUSER)
        print("os.unshare succeeded")
    except OSError as err:
        print("os.unshare", err.strerror)
else:
    print("os.unshare absent")
# What the filter lets through: threads (clone3 falls back to clone) and processes.
thread = threading.Thread(target=print, args=("thread ran",))
thread.start(), thread.join()
print(subprocess.run(["echo", "process ran"], capture_output=True, text=True).stdout.strip())
"""


def test_no_user_namespaces_or_mounts_inside():
    result = run_python(NAMESPACE_ESCAPES)
    assert result.stdout.splitlines() == [
        "unshare -Urm: 1 unshare: unshare failed: Operation not permitted",
        "unshare Operation not permitted",
        "unshare Operation not permitted",
        "mount Operation not permitted",
        "setns Operation not permitted",
        # The sandbox runs our interpreter's base: os.unshare is there from Python 3.12.
        "os.unshare Operation not permitted" if hasattr(os, "unshare") else "os.unshare absent",
        "thread ran",
        "process ran",
    ], result.stdout + result.stderr
    assert_runs_normally()


@pytest.mark.parametrize("place", ["/sandbox", "/tmp"])
def test_files_fill_a_tmpfs_of_max_file_mb_and_no_more(place):
    # Files of 3 MiB each (under the 8 MiB file size limit): the third one fills the tmpfs.
    code = f"""
import errno, os
os.chdir({place!r})
stat = os.statvfs(".")
print("size", stat.f_blocks * stat.f_frsize >> 20)
written = 0
try:
    for i in range(10):
        with open(f"fill-{{i}}", "wb") as f:
            for _ in range(3):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1 << 20
except OSError as err:
    print(errno.errorcode[err.errno])
print("written", written >> 20)
"""
    result = run_python(code, SandboxLimits(max_file_mb=8))
    lines = result.stdout.splitlines()
    assert lines[:2] == ["size 8", "ENOSPC"], result.stdout + result.stderr
    assert 6 <= int(lines[2].split()[1]) <= 8  # at most the tmpfs's size, in 1 MiB writes
    assert_runs_normally()


def test_root_and_dev_are_read_only():
    code = """
import errno
for path in ["/escape", "/dev/shm/escape", "/dev/escape"]:
    try:
        open(path, "w")
        print("wrote", path)
    except OSError as err:
        print(errno.errorcode[err.errno])
"""
    result = run_python(code)
    assert result.stdout.splitlines() == ["EROFS"] * 3, result.stdout + result.stderr


def test_no_memory_outside_the_limits():
    # memfd files, System V shared memory and message queues hold memory that neither the address space
    # nor a tmpfs counts; socket buffers do too, bounded by the open-files limit.
    code = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
for name, args in [("memfd_create", (b"m", 0)), ("shmget", (0, 1 << 20, 0o1600)), ("msgget", (0, 0o1600))]:
    print(name, getattr(libc, name)(*args), os.strerror(ctypes.get_errno()))
pairs = []
try:
    while True:
        pairs.append(socket.socketpair())
except OSError as err:
    print("socketpairs", len(pairs), err.strerror)
"""
    result = run_python(code)
    assert result.stdout.splitlines() == [
        "memfd_create -1 Operation not permitted",
        "shmget -1 Operation not permitted",
        "msgget -1 Operation not permitted",
        f"socketpairs {(sandbox.OPEN_FILES - 3) // 2} Too many open files",  # stdin, stdout, stderr: 3
    ], result.stdout + result.stderr
    assert_runs_normally()


CHILDREN_HOLD_MEMORY = """
import os, sys
MIB = 1 << 20
reports, release = os.pipe(), os.pipe()
children = refused = 0
for _ in range(8):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        held = []
        try:
            while True:
                held.append(b"x" * (4 * MIB))  # touched, not just reserved
        except MemoryError:
            pass
        os.write(reports[1], b"%d\\n" % (4 * len(held)))
        os.read(release[0], 1)  # hold it until every child has filled up
        os._exit(0)
    children += 1
got = b""
while got.count(b"\\n") < children:
    got += os.read(reports[0], 4096)
os.close(release[1])
print(children, refused, sum(int(x) for x in got.split()))
"""


def test_memory_of_all_processes_is_bounded_by_processes_times_memory_mb():
    limits = SandboxLimits(memory_mb=96, max_processes=4)
    result = run_python(CHILDREN_HOLD_MEMORY, limits)
    children, refused, held_mb = map(int, result.stdout.split())
    # The code is one of the 4 processes: 3 children start, 5 forks are refused, and what they hold
    # together stays under max_processes x memory_mb.
    assert (children, refused) == (3, 5), result.stdout + result.stderr
    assert 3 * 48 <= held_mb < limits.max_processes * limits.memory_mb
    assert_runs_normally()


def test_memory_past_the_limit_raises_memory_error():
    result = run_python("x = bytearray(2 << 30)\nprint('allocated')", SandboxLimits(memory_mb=256))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.rstrip().endswith("MemoryError")
    assert result.summary().endswith("MemoryError")
    assert_runs_normally(memory_mb=256)


FORK_BOMB = """
import os, time
forks = 0
for _ in range(1000):
    try:
        pid = os.fork()
    except OSError as err:
        print("refused", type(err).__name__, flush=True)
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forks += 1
print("forks", forks, "uid", os.getuid(), flush=True)
"""


@pytest.mark.parametrize("ending", ["exits", "hangs"])
def test_fork_bomb_is_capped_and_nothing_survives(ending):
    code = FORK_BOMB + ("time.sleep(60)\n" if ending == "hangs" else "")
    # What it printed before the deadline's kill is kept (a loaded machine gets 5 s for 7 forks).
    result = run_python(code, SandboxLimits(max_processes=8, wall_s=5 if ending == "hangs" else 60))
    lines = result.stdout.splitlines()
    assert lines[:1] == ["refused BlockingIOError"], result  # EAGAIN: RLIMIT_NPROC
    assert lines[1].startswith("forks 7 ")  # the limit counts the code's own process
    assert result.timed_out == (ending == "hangs")
    if os.geteuid() == 0:
        # As root each run has a uid of its own: no process of that uid may outlive the run. Killing a pid
        # namespace is asynchronous, so give its processes a moment to go.
        uid = int(lines[1].split()[-1])
        assert uid in sandbox.SANDBOX_UIDS
        deadline = time.monotonic() + 10
        while _processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_of(uid) == []
    assert_runs_normally()


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:  # gone meanwhile
            continue
        if any(line.split()[1:2] == [str(uid)] for line in status.splitlines() if line.startswith("Uid:")):
            pids.append(int(entry.name))
    return pids


def test_endless_loop_is_killed_at_the_deadline():
    result = run_python("while True:\n    pass", SandboxLimits(cpu_s=60, wall_s=3))
    assert result.timed_out and result.exit_code is None, result
    assert result.summary() == "killed: time limit"
    assert_runs_normally()


def test_endless_loop_is_cut_by_the_cpu_limit():
    result = run_python("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=60))
    assert not result.timed_out
    assert result.exit_code == -signal.SIGXCPU, result
    assert result.summary() == "killed: CPU time limit"
    assert_runs_normally()


def test_environment_is_scrubbed_and_our_venv_is_not_visible(monkeypatch):
    monkeypatch.setenv("MEGAGRPO_SANDBOX_CANARY", "leaked")
    code = """
import json, os, sys
try:
    import megagrpo
    imported = True
except ImportError:
    imported = False
print(json.dumps({"env": dict(os.environ), "path": sys.path, "imported": imported}))
"""
    report = json.loads(run_python(code).stdout)
    assert set(report["env"]) <= {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PWD"}
    assert report["env"]["HOME"] == sandbox.HOME
    assert not report["imported"]
    assert not any(".venv" in entry or str(REPO) in entry for entry in report["path"])
    assert_runs_normally()


def test_output_is_cut_and_stdin_is_given():
    result = run_python("print(input() * 100_000)", SandboxLimits(max_output_bytes=1000), stdin="ab\n")
    assert result.stdout.startswith("ab" * 500 + "\n[... ")
    assert result.stdout.endswith(" more bytes cut]")
    assert result.exit_code == 0
    assert_runs_normally()


def test_concurrent_runs_keep_to_themselves():
    code = (
        "import os, sys\nopen('mine', 'w').write(input())\nprint(sorted(os.listdir()), open('mine').read())"
    )
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(code, stdin=f"run-{i}"), range(8)))
    assert [r.stdout for r in results] == [f"['main.py', 'mine'] run-{i}\n" for i in range(8)]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"wall_s": 0}, "wall_s: must be a number > 0, got 0"),
        ({"memory_mb": -1}, "memory_mb: must be an integer > 0, got -1"),
        ({"max_processes": 2.5}, "max_processes: must be an integer > 0, got 2.5"),
        ({"max_file_mb": "64"}, "max_file_mb: must be an integer > 0, got '64'"),
        ({"cpu_s": True}, "cpu_s: must be an integer > 0, got True"),
        ({"wall_s": float("inf")}, "wall_s: must be a number > 0, got inf"),
    ],
)
def test_limits_are_checked_by_name(limits, message):
    with pytest.raises(ValueError) as err:
        SandboxLimits(**limits)
    assert str(err.value) == message


def test_without_bubblewrap_it_refuses_unless_allowed(monkeypatch):
    which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **kw: None if name == "bwrap" else which(name, *a, **kw)
    )
    monkeypatch.setenv("MEGAGRPO_SANDBOX_CANARY", "leaked")
    assert "bwrap" in sandbox_problem()
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed: true"):
        run_python("print('ran')")

    code = "import os\nprint(sorted(os.environ), os.getcwd() == os.environ['HOME'])"
    result = run_python(code, allow_unsandboxed=True)
    assert not result.sandboxed and result.exit_code == 0
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE'] True\n"
    # The rlimits and the deadline still hold.
    result = run_python("x = bytearray(2 << 30)", SandboxLimits(memory_mb=256), allow_unsandboxed=True)
    assert result.stderr.rstrip().endswith("MemoryError")
    result = run_python("while True:\n    pass", SandboxLimits(cpu_s=60, wall_s=1), allow_unsandboxed=True)
    assert result.timed_out and not result.sandboxed
