"""The seccomp filter the sandbox's code runs under (bubblewrap's ``--seccomp FD``): no namespaces, mounts or
memory outside the limits.

Without it, code in the sandbox can make a user namespace of its own (``unshare -Urm``), hold every
capability there, and mount a tmpfs of any size, outside every limit we set. bubblewrap's own
``--disable-userns`` would do it, but it needs the code in a user namespace of bwrap's, which a root caller
does not use: the code gets a uid of its own instead (``megagrpo.envs.sandbox``), and in such a namespace
that uid is not mapped (setpriv's switch fails with EINVAL). A filter works for both callers alike.

The filter is a classic BPF program (``struct sock_filter`` instructions, seccomp(2)), 27
instructions written out in :func:`filter_program`, each with what it does. It answers:

- ``unshare``, ``setns`` and every mount call (``mount``, ``umount2``, ``pivot_root`` and the newer
  ``open_tree``/``move_mount``/``fsopen``/``fsconfig``/``fsmount``/``mount_setattr``): EPERM;
- ``memfd_create``, ``memfd_secret``, ``shmget`` and ``msgget``: EPERM. Their memory is counted by no
  limit of the sandbox: 512 MiB of memfd files and 512 MiB of shared memory segments held at
  ``memory_mb`` 256 before;
- ``clone`` with any namespace flag: EPERM (``fork``, ``vfork`` and threads pass: they set none);
- ``clone3``: ENOSYS. Its flags sit in memory, where a filter cannot read them; libc then falls back to
  ``clone``, which the filter can check;
- a system call of another ABI (x86-64's x32 numbers, 32-bit calls through ``int 0x80``), whose numbers
  the checks above would not match: the process is killed;
- anything else: allowed.

bwrap loads the program last, after its own setup, so it binds the code and everything the code starts
(filters are inherited by children and kept across exec).
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

__all__ = ["SECCOMP_ARCHES", "filter_program"]

# Instruction classes and fields (linux/bpf_common.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS: A = the 32-bit word at offset k of seccomp_data
_JEQ = 0x05 | 0x10  # BPF_JMP | BPF_JEQ | BPF_K: jump jt if A == k, else jf
_JGE = 0x05 | 0x30  # BPF_JMP | BPF_JGE | BPF_K: jump jt if A >= k, else jf
_JSET = 0x05 | 0x40  # BPF_JMP | BPF_JSET | BPF_K: jump jt if A & k, else jf
_RET = 0x06  # BPF_RET | BPF_K: return k

# Return values (linux/seccomp.h).
_KILL_PROCESS = 0x8000_0000
_ERRNO = 0x0005_0000  # | errno: the call fails with that errno
_ALLOW = 0x7FFF_0000

# Offsets in struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6];}. args[0]'s
# low word is at 16 on the little-endian machines below.
_NR, _ARCH, _ARG0_LOW = 0, 4, 16

_NAMESPACE_FLAGS = 0x7E02_0000
"""CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
| CLONE_NEWNET (linux/sched.h)."""

_DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root")
_DENIED += ("open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "mount_setattr")
_DENIED += ("memfd_create", "memfd_secret", "shmget", "msgget")
"""Calls that fail with EPERM: every way into another namespace, every mount call, and the memory that no
limit of ours counts (memfd files and System V shared memory and message queues are neither in the
address space once unmapped nor in a filesystem with a size)."""


@dataclass(frozen=True)
class _Arch:
    audit: int
    """AUDIT_ARCH_* (linux/audit.h): what seccomp_data.arch holds for this ABI."""
    numbers: dict[str, int]
    """System call numbers of this ABI."""


_SINCE_5_1 = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432}
_SINCE_5_1 |= {"clone3": 435, "mount_setattr": 442, "memfd_secret": 447}
"""The numbers every architecture shares since Linux 5.1 (asm-generic/unistd.h)."""

_X86_64 = {"unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "clone": 56}
_X86_64 |= {"memfd_create": 319, "shmget": 29, "msgget": 68}
"""asm/unistd_64.h."""
_AARCH64 = {"unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "clone": 220}
_AARCH64 |= {"memfd_create": 279, "shmget": 194, "msgget": 186}
"""asm-generic/unistd.h."""

SECCOMP_ARCHES = {
    # EM_X86_64 or EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
    "x86_64": _Arch(audit=0xC000_003E, numbers=_X86_64 | _SINCE_5_1),
    "aarch64": _Arch(audit=0xC000_00B7, numbers=_AARCH64 | _SINCE_5_1),
}
"""The machines the filter is written for, by ``platform.machine()``; elsewhere the sandbox refuses to run."""


def filter_program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one) as bwrap's ``--seccomp`` reads it: the
    instructions' bytes, 8 each. KeyError for a machine not in :data:`SECCOMP_ARCHES`."""
    arch = SECCOMP_ARCHES[machine or platform.machine()]
    nr = arch.numbers
    # (code, jump if true, jump if false, k); a jump names the label of its target (0: the next one).
    program: list[tuple[int, int | str, int | str, int]] = [
        (_LD_W_ABS, 0, 0, _ARCH),  # A = the ABI of the call
        (_JEQ, 0, "kill", arch.audit),  # another ABI (i386's int 0x80): its numbers differ, kill
        (_LD_W_ABS, 0, 0, _NR),  # A = the call's number
        (_JGE, "kill", 0, 0x4000_0000),  # x32's numbers (__X32_SYSCALL_BIT): another ABI, kill
        *[(_JEQ, "eperm", 0, nr[name]) for name in _DENIED],  # one check per denied call
        (_JEQ, "enosys", 0, nr["clone3"]),  # clone3: libc falls back to clone
        (_JEQ, 0, "allow", nr["clone"]),  # neither denied nor clone: allowed
        (_LD_W_ABS, 0, 0, _ARG0_LOW),  # A = clone's flags (the CLONE_NEW* bits are all in the low word)
        (_JSET, "eperm", "allow", _NAMESPACE_FLAGS),  # a namespace flag: EPERM, else allowed
    ]
    labels = {"allow": _ALLOW, "eperm": _ERRNO | errno.EPERM, "enosys": _ERRNO | errno.ENOSYS}
    labels["kill"] = _KILL_PROCESS
    where = {name: len(program) + i for i, name in enumerate(labels)}
    program += [(_RET, 0, 0, k) for k in labels.values()]  # the four answers, in the labels' order

    def offset(at: int, target: int | str) -> int:
        # Jumps are relative to the next instruction, forward only, at most 255.
        return target if isinstance(target, int) else where[target] - at - 1

    return b"".join(
        struct.pack("=HBBI", c, offset(i, t), offset(i, f), k) for i, (c, t, f, k) in enumerate(program)
    )
