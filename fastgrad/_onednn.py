"""The ``"onednn"`` GEMM engine of the fused linear kernels (``fastgrad.gemm_engine``).

PyTorch's fp32 matmul with ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` runs on
oneDNN's brgemm matmul instead of MKL's sgemm (``ONEDNN_VERBOSE=1`` shows
``brg_matmul:avx512_core``, f32 in and out).  oneDNN computes f32 "as bf16" (bf32: operands
down-converted to bf16) only on AMX CPUs (``bf32_dt = f32 && fpmath bf16 && isa ==
avx512_core_amx``, oneDNN src/cpu/x64/matmul/brgemm_matmul_utils.cpp); elsewhere the mode leaves
the arithmetic exact fp32 and only routes the call to oneDNN's AVX-512 kernel, which is much
faster than OpenBLAS's sgemm where OpenBLAS lacks a kernel for the CPU (Zen 5 EPYC) and as fast
where it has one (Zen 4 EPYC; figures in bench/results/README.md, "Measurements behind the
source's choices").  On an AMX CPU the
down-conversion would cost fp32 accuracy: a probe checks it once per process (an operand needing
24 significant bits, ``1 + 2⁻²²``, must survive) and the engine is never used where it fails.

PyTorch is imported only when the engine is asked for (``resolve_engine``); the kernels call
:func:`mm` per output tile, each call single-threaded (this thread's OpenMP team set to one
thread: PyTorch's ``libgomp``), so results do not depend on the thread count.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import numpy as np

from . import _cpu

_lock = threading.Lock()
_ok: bool | None = None  # the probe's verdict (once per process)
_omp = None  # (omp_set_num_threads, omp_get_max_threads) of PyTorch's OpenMP runtime


def _after_fork_in_child() -> None:
    """A lock held by a parent thread at the fork would never be released in the child."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cpu_has_bf16_dot() -> bool:
    """AVX-512 BF16 or AMX-BF16 in the CPU flags (``fastgrad._cpu``, the one detector)."""
    return _cpu.has("avx512_bf16") or _cpu.has("amx_bf16")


def _torch_omp():
    global _omp
    if _omp is None:
        import torch

        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
        lib = ctypes.CDLL(path if os.path.exists(path) else "libgomp.so.1")
        _omp = (lib.omp_set_num_threads, lib.omp_get_max_threads)
    return _omp


@contextlib.contextmanager
def one_omp_thread():
    """This thread's OpenMP team (PyTorch's runtime) limited to one thread, then restored."""
    set_n, get_n = _torch_omp()
    n0 = get_n()
    set_n(1)
    try:
        yield
    finally:
        set_n(n0)


_mode_lock = threading.Lock()
_mode_users = 0  # fastgrad's GEMM calls inside fp32_precision_bf16 now, in every thread
_mode_before: str | None = None  # the mode the first of them found


@contextlib.contextmanager
def fp32_precision_bf16():
    """PyTorch's fp32 matmuls in oneDNN's bf16 math mode for the duration of one ``torch.mm``
    (:func:`mm`, the probe).  PyTorch's setting is process-wide: concurrent calls are counted —
    the first sets the mode, the last restores the value the first found — so two threads never
    undo each other, and the mode is held only while a oneDNN tile runs."""
    global _mode_users, _mode_before
    import torch

    m = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    with _mode_lock:
        if _mode_users == 0:
            _mode_before = m.fp32_precision
            m.fp32_precision = "bf16"
        _mode_users += 1
    try:
        yield
    finally:
        with _mode_lock:
            _mode_users -= 1
            if _mode_users == 0:
                m.fp32_precision = _mode_before


def _probe() -> bool:
    """Does the bf16-mode fp32 matmul keep fp32 accuracy on this machine?"""
    import torch

    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 896)).astype(np.float32)
    b = rng.standard_normal((896, 192)).astype(np.float32)
    a[0, :] = 0  # row 0 of the product: exactly 1 + 2^-22 (24 significant bits)
    a[0, 0] = 1 + 2.0**-22
    b[0, 0] = 1
    c = np.empty((64, 192), np.float32)
    with one_omp_thread(), fp32_precision_bf16():
        torch.mm(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(c))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    return bool(c[0, 0] == np.float32(1 + 2.0**-22) and np.all(np.abs(c - exact) <= 1e-5 * scale))


def usable() -> bool:
    """PyTorch is importable, has the mode (``torch.backends.mkldnn.matmul.fp32_precision``,
    PyTorch ≥ 2.9) and the accuracy probe passes (cached for the process)."""
    global _ok
    if _ok is None:
        with _lock:
            if _ok is None:
                try:
                    import torch  # noqa: F401
                except ImportError:
                    _ok = False
                else:
                    try:
                        _ok = _probe()
                    except Exception:  # noqa: BLE001 - e.g. a PyTorch without the mode: unusable
                        _ok = False
    return _ok


def resolve_engine(setting: str, prefer: bool = False) -> str:
    """``"blas"`` or ``"onednn"`` for a setting of ``fastgrad.gemm_engine`` (its docstring);
    ``prefer``: ``"auto"`` inside ``fastgrad.torch``'s training loss."""
    if setting == "blas":
        return "blas"
    if setting == "onednn":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ValueError("gemm engine 'onednn' needs PyTorch (pip install torch)") from None
        return "onednn" if usable() else "blas"
    if prefer and cpu_has_bf16_dot() and usable():
        return "onednn"
    return "blas"


def mm(A: np.ndarray, B: np.ndarray, out: np.ndarray) -> None:
    """``out = A · B`` for fp32 2-D arrays (views; ``out`` written in place), one thread, in
    oneDNN's bf16 math mode (:func:`fp32_precision_bf16`, around this call only): the calling
    thread's OpenMP team is set to one thread (fastgrad's pool threads keep it; the kernels'
    inline calls run inside :func:`one_omp_thread`, which restores it)."""
    import torch

    set_n, get_n = _torch_omp()
    if get_n() != 1:
        set_n(1)
    f = torch.from_numpy
    with fp32_precision_bf16():
        torch.mm(f(A), f(B), out=f(out))
