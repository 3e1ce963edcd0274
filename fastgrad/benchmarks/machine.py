"""What the machine can do: its description, library versions, and the two bounds.

* **Copy bandwidth** — a parallel Numba copy of a buffer much larger than the caches, on the
  benchmark's thread count; bytes moved = bytes read + bytes written (``2·size``; the
  write-allocate traffic is not counted, the same convention as each op's byte count).
* **GEMM time** — the fp32 matrix products an FLCE op must perform, timed through NumPy's
  BLAS (sgemm) on the same threads: the time no CPU implementation of the op can beat by
  much, since its GEMMs are the same work.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Callable, Iterable

import numpy as np

from .._jit import pjit, prange
from .timing import time_fn


@pjit
def _copy(src, dst):
    # slices, not ``dst[i] = src[i]``: an indexed loop checks each index for negative
    # wraparound and does not vectorize (3x slower here: 9 GB/s against np.copyto's 27)
    n = src.shape[0]
    nb = (n + 65535) // 65536
    for b in prange(nb):
        lo = b * 65536
        hi = min(n, lo + 65536)
        dst[lo:hi] = src[lo:hi]


def copy_bandwidth(nbytes: int = 512 * 2**20, repeat: int = 7, budget_s: float = 5.0) -> dict:
    """Measured copy bandwidth (bytes/s, read + write) on the current thread setting.

    Returns ``{"gbps": ..., "bytes": nbytes, "numba_gbps": ..., "numpy_gbps": ...}``: the best
    of a parallel Numba copy and NumPy's ``copyto`` (single-threaded).
    """
    n = max(1, nbytes // 4)
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    t_nb = time_fn(lambda: _copy(src, dst), repeat, budget_s)
    t_np = time_fn(lambda: np.copyto(dst, src), repeat, budget_s)
    moved = 2.0 * n * 4
    nb, npy = moved / t_nb.median_s / 1e9, moved / t_np.median_s / 1e9
    return {"gbps": max(nb, npy), "bytes": int(n * 4), "numba_gbps": nb, "numpy_gbps": npy}


def gemm_runner(products: Iterable[tuple[int, int, int]], seed: int = 0) -> Callable[[], None]:
    """A zero-argument callable running fp32 GEMMs ``[(M, K, N), ...]`` (C[M,N] = A[M,K]·B[K,N]).

    Operands are allocated once (outputs preallocated, ``np.matmul(out=)``), so the call
    times only BLAS.
    """
    rng = np.random.default_rng(seed)
    ops = []
    for m, k, n in products:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        ops.append((a, b, c))

    def run() -> None:
        for a, b, c in ops:
            np.matmul(a, b, out=c)

    return run


def _cpu_model() -> str:
    """The model name, with the family and model numbers (a VM's name is often only "AMD EPYC",
    and Zen 4 (family 25) and Zen 5 (family 26) differ in their GEMM rates)."""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                k, _, v = line.partition(":")
                fields.setdefault(k.strip().lower(), v.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def _simd() -> list:
    from .. import _cpu

    return sorted(
        f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "f16c") if _cpu.has(f)
    )


def machine_info() -> dict:
    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "arch": platform.machine(),
        "cpu": _cpu_model(),
        "simd": _simd(),
        "cpus_logical": os.cpu_count(),
    }
    try:
        import psutil

        info["cpus_physical"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:  # noqa: BLE001
        pass
    return info


def machine_id(info: dict) -> str:
    """Short label for a machine: ``hostname (cpu, N cpus)``."""
    return f"{info.get('hostname', '?')} ({info.get('cpu', '?')}, {info.get('cpus_logical', '?')} cpus)"


def versions() -> dict:
    import ml_dtypes
    import numba

    from .. import __version__

    v = {
        "python": platform.python_version(),
        "fastgrad": __version__,
        "numpy": np.__version__,
        "numba": numba.__version__,
        "ml_dtypes": ml_dtypes.__version__,
    }
    try:
        import torch

        v["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        v["torch"] = None
    try:
        from threadpoolctl import threadpool_info

        blas = [f"{i.get('internal_api')} {i.get('version')}" for i in threadpool_info() if i.get("user_api") == "blas"]
        v["blas"] = ", ".join(blas) or None
    except Exception:  # noqa: BLE001
        v["blas"] = None
    return v
