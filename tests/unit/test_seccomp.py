"""The sandbox's seccomp filter (megagrpo.envs.seccomp), run by a small classic-BPF interpreter on made-up
system calls of each architecture it is written for: namespaces and mounts fail with EPERM, clone3 with
ENOSYS, another ABI is killed, everything else (clone for a thread or a fork among it) passes.
tests/unit/test_sandbox.py checks the same on this machine's kernel."""

import errno
import struct

import pytest

from megagrpo.envs.seccomp import SECCOMP_ARCHES, filter_program

pytestmark = pytest.mark.unit

ALLOW, KILL = 0x7FFF_0000, 0x8000_0000
EPERM, ENOSYS = 0x0005_0000 | errno.EPERM, 0x0005_0000 | errno.ENOSYS
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x1000_0000, 0x0002_0000, 17
THREAD_FLAGS = 0x003D_0F00  # CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | ...


def run_filter(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What the filter returns for the call: the kernel's classic-BPF semantics, for the five
    instructions it uses."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    code = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, a = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # load a word of seccomp_data
            a, pc = struct.unpack_from("=I", data, k)[0], pc + 1
            continue
        if op == 0x06:
            return k
        taken = {0x15: a == k, 0x35: a >= k, 0x45: bool(a & k)}[op]
        pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine", sorted(SECCOMP_ARCHES))
def test_filter_denies_namespaces_and_mounts_and_nothing_else(machine):
    arch = SECCOMP_ARCHES[machine]
    program, nr = filter_program(machine), arch.numbers
    assert len(program) % 8 == 0
    denied = ("unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "open_tree", "mount_setattr")
    for name in (*denied, "memfd_create", "memfd_secret", "shmget", "msgget"):
        assert run_filter(program, nr[name], arch.audit) == EPERM, name
    assert run_filter(program, nr["clone"], arch.audit, CLONE_NEWUSER | SIGCHLD) == EPERM
    assert run_filter(program, nr["clone"], arch.audit, CLONE_NEWNS) == EPERM
    assert run_filter(program, nr["clone3"], arch.audit) == ENOSYS
    assert run_filter(program, nr["clone"], arch.audit, SIGCHLD) == ALLOW  # fork
    assert run_filter(program, nr["clone"], arch.audit, THREAD_FLAGS) == ALLOW  # a thread
    for other in (0, 1, 2, 59, 63, 221, 334):  # read, write, open..., execve, ...
        if other not in nr.values():
            assert run_filter(program, other, arch.audit) == ALLOW
    assert run_filter(program, 0x4000_0000 | nr["unshare"], arch.audit) == KILL  # x32 numbering
    assert run_filter(program, nr["unshare"], 0x4000_0003) == KILL  # i386 (AUDIT_ARCH_I386)
