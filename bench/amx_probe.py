"""Whether this Linux host lets a process use AMX tiles (Intel Sapphire/Emerald/Granite Rapids).

Prints the CPU's AMX flags and the answer of ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``
(Linux ≥ 5.16: a process must ask before its first tile instruction, else SIGILL).  Informational:
fastgrad has no AMX kernel (issue 43's closing note says why).
"""

from __future__ import annotations

import ctypes
import platform

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def main() -> None:
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    amx = sorted(f for f in flags if f.startswith("amx"))
    print(f"machine {platform.machine()}, kernel {platform.release()}, AMX flags: {amx or 'none'}")
    if not amx or platform.machine() != "x86_64":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    r = libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    print(f"ARCH_GET_XCOMP_PERM -> {r} (errno {ctypes.get_errno()}), permitted mask {mask.value:#x}")
    r = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    print(f"ARCH_REQ_XCOMP_PERM(XTILEDATA) -> {r} (errno {ctypes.get_errno()})")
    libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    print(f"permitted mask now {mask.value:#x} (bit 18: tile data)")


if __name__ == "__main__":
    main()
