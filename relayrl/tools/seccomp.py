"""A small seccomp deny-list for the bwrap sandbox, as a classic BPF program; the sandbox's pid 1 loads it
(relayrl/tools/bwrap.py: after it has set the tmpfs inode limits, which needs the `mount` call this refuses).

Why a second layer at all: the namespaces are the boundary, but the code inside still talks to the host kernel,
and most container escapes go through a handful of rarely needed kernel interfaces (io_uring, bpf, perf events,
userfaultfd, keyrings, the mount API, ptrace). Refusing those with EPERM costs nothing at run time and keeps the
stdlib-only Python that tool code needs fully working. It is a deny-list (like Docker's default profile, shorter),
not an allow-list: an allow-list for CPython would be long and brittle across versions.

Hand-written BPF rather than libseccomp: no extra dependency, ~30 instructions. Only x86_64 and aarch64 are
covered; elsewhere `program()` returns None and the sandbox runs without this layer (the namespaces still hold).
"""

from __future__ import annotations

import errno
import platform
import struct

# The syscalls refused, by name; numbers per architecture below (x86_64: asm/unistd_64.h, aarch64: the generic
# table asm-generic/unistd.h). Names absent on an architecture (iopl on aarch64) are simply skipped.
DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",  # reading or steering other processes
    "keyctl", "add_key", "request_key",  # kernel keyrings (not namespaced)
    "bpf", "perf_event_open", "userfaultfd",  # frequent kernel-exploit primitives
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",  # reshaping the sandbox's namespaces
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "open_by_handle_at", "name_to_handle_at",  # file handles bypass path lookup
    "memfd_create", "memfd_secret",  # anonymous memory files escape the size-capped tmpfs mounts
    # System V IPC and POSIX message queues: kernel memory that RLIMIT_AS does not count (2 GB of shmget segments
    # were seen). The sandbox's own IPC namespace hides the host's objects, but bounds nothing; tool code (the
    # stdlib) never needs them: multiprocessing's shared memory and semaphores are files in the capped /dev/shm.
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "swapon", "swapoff",
    "reboot", "syslog", "quotactl", "lookup_dcookie", "vhangup", "fanotify_init", "settimeofday",
    "clock_settime", "adjtimex", "sethostname", "setdomainname", "iopl", "ioperm", "modify_ldt", "uselib",
)

_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "keyctl": 250, "add_key": 248,
    "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "unshare": 272, "setns": 308, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "memfd_create": 319, "memfd_secret": 447, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "acct": 163, "swapon": 167, "swapoff": 168, "reboot": 169,
    "syslog": 103, "quotactl": 179, "lookup_dcookie": 212, "vhangup": 153, "fanotify_init": 300,
    "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "sethostname": 170, "setdomainname": 171,
    "iopl": 172, "ioperm": 173, "modify_ldt": 154, "uselib": 134, "shmget": 29, "shmat": 30, "shmctl": 31,
    "shmdt": 67, "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69,
    "msgrcv": 70, "msgctl": 71, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
    "mq_notify": 244, "mq_getsetattr": 245, "clone": 56, "clone3": 435,
}
_AARCH64 = {
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "keyctl": 219, "add_key": 217,
    "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "unshare": 97, "setns": 268, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429,
    "open_tree": 428, "mount_setattr": 442, "open_by_handle_at": 265, "name_to_handle_at": 264,
    "memfd_create": 279, "memfd_secret": 447, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "acct": 89, "swapon": 224, "swapoff": 225, "reboot": 142,
    "syslog": 116, "quotactl": 60, "lookup_dcookie": 18, "vhangup": 58, "fanotify_init": 262,
    "settimeofday": 170, "clock_settime": 112, "adjtimex": 171, "sethostname": 161, "setdomainname": 162,
    "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
    "mq_getsetattr": 185, "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190, "semctl": 191,
    "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197, "clone": 220,
    "clone3": 435,
}
# machine -> (AUDIT_ARCH_* value, syscall table, whether x32 syscall numbers (bit 30) must be refused)
_ARCHES = {"x86_64": (0xC000003E, _X86_64, True), "aarch64": (0xC00000B7, _AARCH64, False)}

_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_RET_EPERM, _RET_ENOSYS = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
_X32_SYSCALL_BIT = 0x40000000
# clone() flags that make a namespace. CLONE_NEWUSER needs no privilege, so this filter (not capabilities) is what
# keeps the code from nesting a user namespace (bwrap's --disable-userns cannot be used: see bwrap.py); the others
# need CAP_SYS_ADMIN, which the code does not have; refused here all the same. (CLONE_NEWTIME is exit-signal bits in
# clone()'s flags, and clone3's flags are in memory a filter cannot read: clone3 answers ENOSYS, and the C library
# falls back to clone.)
_CLONE_NEW_MASK = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_ARG0_LOW = 16  # offsetof(struct seccomp_data, args[0]); its low 32 bits on these little-endian machines


def program(machine: str | None = None) -> bytes | None:
    """The filter for this machine, or None where no syscall table is known.

    Layout: a foreign architecture (e.g. the i386 ABI through `int 0x80` on x86_64, which would number syscalls
    differently) kills the process; x32 numbers are refused; clone3 answers ENOSYS, clone with a namespace flag
    EPERM; each denied number jumps to one EPERM return; everything else is allowed.
    """
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, table, refuse_x32 = arch
    numbers = sorted({table[name] for name in DENIED if name in table})
    # (code, jump-if-true label, jump-if-false label, k); labels resolve to relative offsets below
    code: list[tuple[int, str | int, str | int, int]] = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, audit_arch),
        (_RET_K, 0, 0, _RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, 0)]  # seccomp_data.nr
    if refuse_x32:
        code.append((_JGE_K, "eperm", 0, _X32_SYSCALL_BIT))
    code += [(_JEQ_K, "enosys", 0, table["clone3"]), (_JEQ_K, "clone", 0, table["clone"])]
    code += [(_JEQ_K, "eperm", 0, nr) for nr in numbers]
    code += [(_RET_K, 0, 0, _RET_ALLOW)]
    labels = {"clone": len(code)}
    code += [(_LD_W_ABS, 0, 0, _ARG0_LOW), (_JSET_K, "eperm", 0, _CLONE_NEW_MASK), (_RET_K, 0, 0, _RET_ALLOW)]
    labels["eperm"] = len(code)
    code.append((_RET_K, 0, 0, _RET_EPERM))
    labels["enosys"] = len(code)
    code.append((_RET_K, 0, 0, _RET_ENOSYS))
    out = []
    for i, (op, jt, jf, k) in enumerate(code):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        assert 0 <= jt < 256 and 0 <= jf < 256, "a jump beyond the 8-bit offset field"
        out.append(struct.pack("=HBBI", op, jt, jf, k))  # struct sock_filter
    return b"".join(out)
