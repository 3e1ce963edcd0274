"""Vector-friendly fp32 math for the kernels (Numba has no SVML here: ``np.exp`` on float32 is a
scalar libm call per element; this one is branch-free, so LLVM vectorizes the loops using it)."""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .._jit import FASTMATH_SAFE, njit

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # Cody-Waite split of ln 2 (Cephes expf)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_XMIN = np.float32(-104.0)  # exp(-104) < 2**-150: rounds to +0
_XMAX = np.float32(89.0)  # exp(89) > FLT_MAX: overflows to +inf


@njit(fastmath={"contract"})
def exp_f32(x):
    """``exp`` of an fp32 value in fp32, branch-free (Cephes ``expf``, max error ~1 ulp).

    Cody-Waite range reduction ``x = n ln2 + r``, a degree-7 polynomial on
    ``|r| <= ln2/2``, and the scaling by ``2**n`` done as two exact power-of-two products so
    that subnormal results round once (gradual underflow).  ``-inf -> 0``, ``+inf -> inf``,
    NaN -> NaN (it flows through the polynomial).  Compiled with ``contract`` only (FMA;
    never ``reassoc``: the Cody-Waite split must not be reassociated); LLVM inlines it into
    the calling loop, keeping these per-instruction flags.
    """
    xc = np.float32(x)
    if xc < _XMIN:
        xc = _XMIN
    if xc > _XMAX:
        xc = _XMAX
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    r2 = r * r
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * r2 + r + np.float32(1.0)
    k = np.int32(n)
    k1 = k >> np.int32(1)
    k2 = k - k1
    s1 = np.int32((k1 + np.int32(127)) << np.int32(23)).view(np.float32)
    s2 = np.int32((k2 + np.int32(127)) << np.int32(23)).view(np.float32)
    return (p * s1) * s2


def exp_c(x):  # pragma: no cover - replaced by the overload inside jitted code
    """``exp`` in the compute dtype: :func:`exp_f32` for fp32, libm for fp64 (jitted code only)."""
    return np.exp(x)


@overload(exp_c, jit_options={"fastmath": {"contract"}})
def _exp_c_ol(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        return lambda x: exp_f32(x)
    return lambda x: np.exp(x)


# Row reductions over a 1-D row (a slice: indexing ``L[base + j]`` instead makes Numba check each
# index for negative wraparound, which stops LLVM from vectorizing).  ``reassoc``: a fixed order
# per build, so results do not depend on the thread count.


@njit
def row_nan_count(r):
    c = 0
    for j in range(r.shape[0]):
        x = r[j]
        c += x != x
    return c


@njit(fastmath={"nnan", "nsz", "reassoc"})
def row_max(r, ninf):
    """Row max, vectorized; only for a NaN-free row (``nnan``: see ``row_nan_count``)."""
    m = ninf
    for j in range(r.shape[0]):
        m = max(m, r[j])
    return m


@njit(fastmath=FASTMATH_SAFE)
def row_sum_exp(r, m, zero):
    """``Σ_j exp(r[j] - m)`` in the dtype of ``zero``."""
    acc = zero
    for j in range(r.shape[0]):
        acc += exp_c(r[j] - m)
    return acc
