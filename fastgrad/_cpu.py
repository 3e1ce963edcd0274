"""The one CPU-feature detector: which instructions this machine has.

Read once per process, in this order:

1. Linux ``/proc/cpuinfo``: the x86 ``flags`` line (``avx2``, ``fma``, ``f16c``, ``avx512f``,
   ``avx512_bf16``, ``amx_bf16``, ...) or ARM's ``Features`` line (``asimd``, ``fphp``,
   ``bf16``, ``sve``, ...), the names the kernel uses;
2. elsewhere (no ``/proc``, or no such line): LLVM's view of the host (llvmlite's
   ``get_host_cpu_features``, the features Numba compiles for), its names mapped to the kernel's
   (``+avx512bf16`` → ``avx512_bf16``, ``+neon`` → ``asimd``, ...).

Used by the native GEMM kernel's builder (``fastgrad/kernels/_native.py``: which variants can
run; ``kernels/_bf16dot.auto_variant``: which the GEMM setting "auto" takes, by vendor), by
the oneDNN engine's choice (``fastgrad/_onednn.py``) and by ``fastgrad/dtypes.py`` (the F16C
conversions).  Nothing else reads ``/proc/cpuinfo``.
"""

from __future__ import annotations

import functools
import platform

__all__ = ["flags", "has", "arch", "vendor"]

#: LLVM feature names (without the ``+``) that differ from the kernel's (``/proc/cpuinfo``) names
_LLVM_TO_LINUX = {
    "avx512bf16": "avx512_bf16",
    "amx-bf16": "amx_bf16",
    "amx-tile": "amx_tile",
    "sse4.1": "sse4_1",
    "sse4.2": "sse4_2",
    "neon": "asimd",
    "fullfp16": "fphp",
    "sve": "sve",
}


def _parse_cpuinfo(text: str) -> frozenset:
    """The first ``flags`` (x86) or ``Features`` (ARM) line of a ``/proc/cpuinfo`` text."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _parse_vendor(text: str) -> str:
    """The first ``vendor_id`` of a ``/proc/cpuinfo`` text (x86: ``GenuineIntel``, ``AuthenticAMD``)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def _from_llvm() -> frozenset:
    """The host's features as LLVM sees them (``+avx2`` → ``avx2``), names mapped as above."""
    try:
        import llvmlite.binding as llvm

        feats = llvm.get_host_cpu_features()
    except Exception:  # noqa: BLE001 - no llvmlite / no host detection: nothing known
        return frozenset()
    return frozenset(_LLVM_TO_LINUX.get(name, name) for name, on in feats.items() if on)


@functools.cache
def _cpuinfo() -> str:
    """``/proc/cpuinfo``'s text, read once ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


@functools.cache
def flags() -> frozenset:
    """The CPU's feature flags, in ``/proc/cpuinfo``'s names (empty when nothing can tell)."""
    return _parse_cpuinfo(_cpuinfo()) or _from_llvm()


def has(*names: str) -> bool:
    """All of ``names`` are in :func:`flags`."""
    f = flags()
    return all(n in f for n in names)


def arch() -> str:
    """``"x86_64"``, ``"aarch64"``, ... (``platform.machine()``, lower case; ``AMD64`` → ``x86_64``)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def vendor() -> str:
    """The x86 vendor (``/proc/cpuinfo``'s ``vendor_id``: ``"GenuineIntel"``, ``"AuthenticAMD"``, ...);
    ``""`` where it cannot tell (another architecture, no ``/proc``)."""
    return _parse_vendor(_cpuinfo())
