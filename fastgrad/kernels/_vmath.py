"""Vector-friendly fp32 math for the kernels (Numba has no SVML here: ``np.exp`` on float32 is a
scalar libm call per element; this one is branch-free, so LLVM vectorizes the loops using it)."""

from __future__ import annotations

import numpy as np

from numba import types
from numba.extending import overload

from .._jit import njit
from ..dtypes import (HW_F16, _f16_bits_to_f32_hw, _f32_to_f16_bits_hw, bf16_to_f32,
                      load_f32, store_as)

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)        # Cody-Waite split of ln 2 (Cephes expf)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_XMIN = np.float32(-104.0)               # exp(-104) < 2**-150: rounds to +0
_XMAX = np.float32(89.0)                 # exp(89) > FLT_MAX: overflows to +inf


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


# ----------------------------------------------------------------------------------------
# Element conversions for values that only feed / come out of fp32 arithmetic
# ----------------------------------------------------------------------------------------

def load_f32_arith(x, code):
    """Like :func:`fastgrad.dtypes.load_f32`, for a value that is only used as an operand of
    fp32 arithmetic (never copied to an output as is).

    With F16C, an fp16 element is widened by the bare ``vcvtph2ps``: it differs from the exact
    widening only for signaling NaNs (which it quiets), and every arithmetic operation quiets
    a signaling NaN the same way, so the results are bit-identical while the per-element
    NaN-payload fix-up (a compare and a blend per vector) is skipped.
    """
    raise NotImplementedError("only callable from Numba kernels")


@overload(load_f32_arith)
def _load_f32_arith_ol(x, code):
    if isinstance(x, types.Float) or not HW_F16:
        def impl(x, code):
            return load_f32(x, code)
    else:
        def impl(x, code):
            if code == 1:
                return bf16_to_f32(x)
            return _f16_bits_to_f32_hw(x)
    return impl


def store_arith(v, code, like):
    """Like :func:`fastgrad.dtypes.store_as`, for a value produced by fp32 arithmetic (so never
    a signaling NaN).

    With F16C, fp32 -> fp16 is the bare ``vcvtps2ph`` (RNE): for a quiet NaN it gives the sign,
    ``0x7E00`` and the payload's top bits, exactly what the NaN fix-up of ``store_as``
    computes, so it is skipped.  bf16: :func:`_f32_to_bf16_nan`, the same RNE and NaN rule as
    ``store_as`` in fewer vector operations.
    """
    raise NotImplementedError("only callable from Numba kernels")


@overload(store_arith)
def _store_arith_ol(v, code, like):
    if isinstance(like.dtype, types.Float):
        def impl(v, code, like):
            return store_as(v, code, like)
    elif not HW_F16:
        def impl(v, code, like):
            if code == 1:
                return _f32_to_bf16_nan(v)
            return store_as(v, code, like)
    else:
        def impl(v, code, like):
            if code == 1:
                return _f32_to_bf16_nan(v)
            return _f32_to_f16_bits_hw(np.float32(v))
    return impl


@njit(inline="always")
def _f32_to_bf16_nan(x):
    """fp32 -> bf16 bits, RNE, any NaN -> ``0x7FC0 | sign``: bit-identical to
    :func:`fastgrad.dtypes.f32_to_bf16`, with the NaN test as one unordered compare and the
    quiet-NaN pattern as one bitwise select (fewer operations per vector)."""
    xf = np.float32(x)
    u = xf.view(np.uint32)
    r = np.uint32(u + np.uint32(0x7FFF))
    r = np.uint32(r + np.uint32(np.uint32(u >> np.uint32(16)) & np.uint32(1)))
    r = np.uint32(r >> np.uint32(16))
    if xf != xf:
        r = np.uint32(np.uint32(np.uint32(u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    return np.uint16(r)
