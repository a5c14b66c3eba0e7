"""The sandbox's seccomp filter: a classic-BPF program that refuses syscalls code under test never needs.

Owns the deny list, its syscall numbers (x86_64 and aarch64) and the compiled program; installs nothing
itself. bubblewrap loads the program with `--seccomp FD`; rlimit mode runs `LOADER_CODE` first, which
loads it and execs the rest of the command. Every refused syscall fails with EPERM, except clone3,
which fails with ENOSYS: its flags sit in memory a filter cannot read, and on ENOSYS glibc falls back
to clone(), whose flags the filter does check. A syscall made through another ABI (i386 `int 0x80` on
x86_64, x32) would bypass the numbers below, so it kills the process instead.
"""

from __future__ import annotations

import errno
import functools
import platform
import struct

from inflight.errors import UserError

# name: (x86_64 number, aarch64 number; None where that architecture lacks the syscall). Numbers from
# the kernel's arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.
DENIED_SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    # New namespaces and mounts: the way out of (or around) bubblewrap's namespaces, and the kernel
    # code a user namespace opens to an unprivileged process. clone() is checked by flags below.
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    # Reading or steering other processes.
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
    "process_madvise": (440, 440),
    "kcmp": (312, 272),
    # Large kernel attack surface that ordinary code does not use.
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    # Host administration: already refused without capabilities; refused here whatever the caps.
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "syslog": (103, 116),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "lookup_dcookie": (212, 18),
    "vhangup": (153, 58),
    "nfsservctl": (180, 42),
    "iopl": (172, None),
    "ioperm": (173, None),
    "uselib": (134, None),
    "sysfs": (139, None),
    "ustat": (136, None),
    "_sysctl": (156, None),
}
CLONE_SYSCALLS = {"x86_64": (56, 435), "aarch64": (220, 435)}  # (clone, clone3)
# clone() flags that create a namespace. CLONE_NEWTIME (0x80) overlaps clone()'s exit-signal byte and is
# only honoured by unshare and clone3, both refused outright.
CLONE_NAMESPACE_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

# Classic BPF, as in linux/filter.h and linux/seccomp.h; the program reads struct seccomp_data
# {int nr; u32 arch; u64 ip; u64 args[6]}, little-endian on both architectures.
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_NR_OFFSET, _ARCH_OFFSET, _ARG0_LOW_OFFSET = 0, 4, 16
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
Instruction = tuple[int, str | None, str | None, int]

# Run by rlimit mode as `python -I -S -B -c LOADER_CODE FD ARGV...`: reads the program from FD, loads
# it (no_new_privs first, which an unprivileged filter needs) and execs ARGV under it.
LOADER_CODE = """\
import ctypes, os, sys
fd = int(sys.argv[1])
program = b''
while chunk := os.read(fd, 65536):
    program += chunk
os.close(fd)
class SockFprog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_char_p)]
libc = ctypes.CDLL(None, use_errno=True)
ulong = ctypes.c_ulong
prog = SockFprog(len(program) // 8, program)
if libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) or libc.prctl(22, ulong(2), ctypes.byref(prog)):
    sys.exit('seccomp: cannot load the filter: ' + os.strerror(ctypes.get_errno()))
os.execv(sys.argv[2], sys.argv[2:])
"""


@functools.cache
def filter_program(machine: str | None = None) -> bytes:
    """The compiled filter for `machine` (default: this one), as struct sock_filter[] bytes."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        raise UserError(
            f"the sandbox's seccomp filter knows x86_64 and aarch64 syscall numbers, not {machine}"
        )
    column = 0 if machine == "x86_64" else 1
    numbers = (pair[column] for pair in DENIED_SYSCALLS.values())
    denied = sorted({number for number in numbers if number is not None})
    clone, clone3 = CLONE_SYSCALLS[machine]
    # A str is a label; an instruction is (code, jump-if-true label, jump-if-false label, k), with
    # None for "fall through". Every jump goes forward, as classic BPF requires.
    program: list[str | Instruction] = [
        (_LD_W_ABS, None, None, _ARCH_OFFSET),
        (_JEQ_K, None, "kill", AUDIT_ARCH[machine]),
        (_LD_W_ABS, None, None, _NR_OFFSET),
    ]
    if machine == "x86_64":
        program.append((_JGE_K, "kill", None, X32_SYSCALL_BIT))
    program += [(_JEQ_K, "deny", None, number) for number in denied]
    program += [
        (_JEQ_K, "clone", None, clone),
        (_JEQ_K, "enosys", None, clone3),
        (_RET_K, None, None, RET_ALLOW),
        "clone",
        (_LD_W_ABS, None, None, _ARG0_LOW_OFFSET),
        (_JSET_K, "deny", None, CLONE_NAMESPACE_FLAGS),
        (_RET_K, None, None, RET_ALLOW),
        "kill",
        (_RET_K, None, None, RET_KILL_PROCESS),
        "enosys",
        (_RET_K, None, None, RET_ERRNO | errno.ENOSYS),
        "deny",
        (_RET_K, None, None, RET_ERRNO | errno.EPERM),
    ]
    return _assemble(program)


def _assemble(program: list[str | Instruction]) -> bytes:
    """Resolve labels to forward jump offsets and pack each instruction as struct sock_filter."""
    labels: dict[str, int] = {}
    instructions: list[Instruction] = []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(instructions)
        else:
            instructions.append(item)
    packed = bytearray()
    for index, (code, true_label, false_label, k) in enumerate(instructions):
        jumps = [0 if label is None else labels[label] - index - 1 for label in (true_label, false_label)]
        assert all(0 <= jump <= 255 for jump in jumps), "a BPF jump must go forward by at most 255"
        packed += struct.pack("<HBBI", code, jumps[0], jumps[1], k)
    return bytes(packed)
