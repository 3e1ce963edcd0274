"""op layer: the GEMM choice of the LM-head ops, made once per call from the settings.

``gemm_choice(dtype)`` reads the settings (``fastgrad._config.settings()``: the GEMM setting, the
native kernel's ISA, ``fastgrad.torch``'s preference) and returns a
:class:`fastgrad.tiling.GemmChoice` — the fp32 engine, whether 16-bit operands run on the native
exact-product kernel and which variant — that the op records in its plan
(``LinearCETiling.gemm``) or passes to the kernel (``linear_cross_entropy``).  The kernels take
it and read no setting (``tests/test_architecture.py``).  The capability is the kernel module's
(``fastgrad/lm_head/engine.py``: ``resolve``), reached here through the cpu backend.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType

import numpy as np

from .. import _config
from .. import dtypes as D
from ..errors import FallbackWarning
from ..tiling import BLAS, GemmChoice, LinearCETiling, plan_linear_cross_entropy

__all__ = [
    "gemm_choice",
    "lm_head_plan",
    "bf16_kernel_available",
    "bf16_kernel_in_use",
    "fp16_kernel_in_use",
    "warn_fallback",
    "FallbackWarning",
]


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_fallback(fallback: str | None) -> None:
    """Warn :class:`FallbackWarning` ``fallback`` (a plan's record) once per process; None: nothing."""
    if fallback is None:
        return
    with _warned_lock:
        if fallback in _warned:
            return
        _warned.add(fallback)
    warnings.warn(fallback, FallbackWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of the first frame outside the fastgrad package (the user's call)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f: FrameType | None = sys._getframe(1)
    level = 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg + os.sep):
        f, level = f.f_back, level + 1
    return level


def gemm_choice(dtype, s: _config.Settings | None = None) -> GemmChoice:
    """The GEMMs an LM-head call of operands ``dtype`` runs under the settings ``s`` (default:
    those in force now).  float64 operands always run BLAS's dgemm (``tiling.BLAS``)."""
    if np.dtype(dtype) == np.float64:
        return BLAS
    s = _config.settings() if s is None else s
    from ..backends.cpu import resolve_gemm

    choice = resolve_gemm(dtype, s.gemm, s.native_isa, s.prefer_onednn)
    warn_fallback(choice.fallback)
    return choice


def lm_head_plan(
    BT: int,
    V: int,
    H: int,
    mode: str,
    dtype,
    s: _config.Settings | None = None,
    *,
    budget_bytes: int | None = None,
    filter_eps: float | None = None,
) -> LinearCETiling:
    """The tile plan (``tiling.plan_linear_cross_entropy``) of an LM-head op on operands of
    ``dtype`` under the settings ``s`` (default: those in force now): the workspace budget
    (``budget_bytes`` overrides it: the command's estimate) and the GEMM choice
    (:func:`gemm_choice`) — the one place the online max-sum, the FLCE grad and the command make
    it."""
    dt = np.dtype(dtype)
    if budget_bytes is None and s is not None:
        budget_bytes = s.workspace_bytes
    return plan_linear_cross_entropy(
        BT,
        V,
        H,
        mode=mode,
        widen=dt != D.FLOAT32,
        dtype=dt.name,
        budget_bytes=budget_bytes,
        filter_eps=filter_eps,
        gemm=gemm_choice(dt, s),
    )


def bf16_kernel_available() -> bool:
    """The exact-product bf16 GEMM kernel (``fastgrad/kernels/_bf16dot.py``) runs on this CPU
    under the ISA setting (:func:`fastgrad._config.native_isa`): AVX-512 BF16, AVX-512F or
    AVX2 + FMA; compiled once per process (a build failure warns once and leaves the GEMMs on
    BLAS)."""
    from ..backends.cpu import native_variant

    return native_variant("bf16", _config.native_isa()) is not None


def bf16_kernel_in_use() -> bool:
    """GEMMs of bf16 values go to the exact-product bf16 kernel: the GEMM setting ``"auto"`` on a
    CPU where the kernel runs (:func:`bf16_kernel_available`) — except an AVX2-only CPU under
    the ISA setting ``"auto"``: there ``"auto"`` keeps BLAS, which was faster (the AVX2 code
    on a Zen 4 EPYC against OpenBLAS's Haswell sgemm path, and on a Zen 3 EPYC;
    ``_bf16dot.AUTO_AVX2``), and a non-AMD CPU with AVX-512 (an Emerald Rapids Xeon: the BLAS
    path faster; ``_bf16dot.AUTO_AVX512_VENDORS``; figures in bench/results/README.md,
    "Measurements behind the source's choices").  An explicit ``set_native_isa("avx2")`` /
    ``FASTGRAD_NATIVE_ISA=avx2`` (or ``"avx512"``) runs the kernel anyway."""
    return gemm_choice(D.BFLOAT16).exact == "bf16"


def fp16_kernel_in_use() -> bool:
    """GEMMs of fp16 values in the NumPy-level fused linear ops go to the fp32 kernel
    (``fastgrad/kernels/_bf16dot.py``, kind ``"f32"``: the products of fp16 values are exact in
    fp32, summed in fp32 in a fixed order): the GEMM setting ``"auto"`` on an AMD CPU with AVX-512F,
    or with AVX2 + FMA only under an explicit ISA setting ``"avx2"`` (on ``"auto"`` an AVX2-only
    CPU keeps BLAS: ``_bf16dot.AUTO_AVX2``; so does a non-AMD AVX-512 CPU:
    ``_bf16dot.AUTO_AVX512_VENDORS``)."""
    return gemm_choice(D.FLOAT16).exact == "f32"
