"""Floating-point formats: the device's 16-bit types carried as ``uint16`` inside kernels.

Numba cannot type ``float16`` or ``ml_dtypes.bfloat16`` arrays on the CPU, so kernels receive
16-bit data as ``uint16`` bit patterns plus a format code, widen to fp32 exactly, compute in
fp32 and round once with round-to-nearest-even.  Every conversion here is bit-exact with
``ml_dtypes`` / NumPy ``astype`` (tested on all 65,536 patterns each way and on fp32 ties,
subnormals, ±Inf and NaN):

* bf16 -> fp32: ``bits << 16``.
* fp32 -> bf16: RNE on the top 16 bits; NaN becomes ``0x7FC0 | sign`` (as ml_dtypes).
* fp16 -> fp32: exact, NaN payload kept (as NumPy).
* fp32 -> fp16: RNE with gradual underflow and overflow to ±Inf; NaN keeps the top payload
  bits (never becoming Inf), as NumPy's ``npy_floatbits_to_halfbits``.

Format codes used by every kernel: ``F32 = 0``, ``BF16 = 1``, ``F16 = 2``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ._jit import njit

F32, BF16, F16 = 0, 1, 2

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)

#: The floating dtypes the ops accept (fp64 only through the reference backend's inputs).
FLOAT_DTYPES = (BFLOAT16, FLOAT16, FLOAT32)

_CODE = {FLOAT32: F32, BFLOAT16: BF16, FLOAT16: F16}
_NAME = {FLOAT32: "float32", BFLOAT16: "bfloat16", FLOAT16: "float16", FLOAT64: "float64"}


def code_of(dtype) -> int:
    """Kernel format code of a NumPy dtype (float32, float16, ml_dtypes.bfloat16)."""
    return _CODE[np.dtype(dtype)]


def dtype_name(dtype) -> str:
    dt = np.dtype(dtype)
    return _NAME.get(dt, str(dt))


def is_16bit(dtype) -> bool:
    return np.dtype(dtype) in (BFLOAT16, FLOAT16)


def storage_view(a: np.ndarray) -> np.ndarray:
    """The array a kernel takes: a ``uint16`` view of bf16/fp16 data, else ``a`` itself.

    Made in Python, never inside a parallel kernel (Numba drops writes through views made
    inside ``parallel=True`` kernels).
    """
    if a.dtype in (BFLOAT16, FLOAT16):
        return a.view(np.uint16)
    return a


def promote(*dtypes) -> np.dtype:
    """Type promotion of floating dtypes as the device does it (fp32 > fp16/bf16; fp16+bf16 -> fp32)."""
    ds = {np.dtype(d) for d in dtypes}
    if len(ds) == 1:
        return ds.pop()
    if FLOAT64 in ds:
        return FLOAT64
    return FLOAT32


# ----------------------------------------------------------------------------------------
# Scalar conversions (njit, inlined into kernels)
# ----------------------------------------------------------------------------------------

@njit(inline="always")
def bf16_to_f32(h):
    """bf16 bit pattern -> fp32 value (exact)."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


@njit(inline="always")
def f32_to_bf16(x):
    """fp32 value -> bf16 bit pattern, round-to-nearest-even, NaN -> 0x7FC0|sign."""
    u = np.float32(x).view(np.uint32)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    r = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(r >> np.uint32(16))


@njit(inline="always")
def f16_to_f32(h):
    """fp16 bit pattern -> fp32 value (exact; subnormals, ±Inf, NaN payload kept)."""
    h32 = np.uint32(h)
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    em = h32 & np.uint32(0x7FFF)
    if em >= np.uint32(0x7C00):  # Inf / NaN
        return np.uint32(sign | np.uint32(0x7F800000) | ((em & np.uint32(0x3FF)) << np.uint32(13))).view(np.float32)
    # normal and subnormal alike: shift into place and rescale by 2**112 (exact)
    f = np.uint32(em << np.uint32(13)).view(np.float32) * np.float32(5.192296858534828e33)
    return np.uint32(np.float32(f).view(np.uint32) | sign).view(np.float32)


@njit(inline="always")
def f32_to_f16(x):
    """fp32 value -> fp16 bit pattern, round-to-nearest-even (NumPy's algorithm)."""
    f = np.float32(x).view(np.uint32)
    h_sgn = np.uint32((f & np.uint32(0x80000000)) >> np.uint32(16))
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):
        if f_exp == np.uint32(0x7F800000):
            f_sig = f & np.uint32(0x007FFFFF)
            if f_sig != np.uint32(0):
                ret = np.uint32(0x7C00) + (f_sig >> np.uint32(13))
                if ret == np.uint32(0x7C00):  # keep it a NaN
                    ret = ret + np.uint32(1)
                return np.uint16(h_sgn + ret)
            return np.uint16(h_sgn + np.uint32(0x7C00))
        return np.uint16(h_sgn + np.uint32(0x7C00))
    if f_exp <= np.uint32(0x38000000):
        if f_exp < np.uint32(0x33000000):
            return np.uint16(h_sgn)
        e = f_exp >> np.uint32(23)
        f_sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        f_sig = f_sig >> (np.uint32(113) - e)
        if ((f_sig & np.uint32(0x00003FFF)) != np.uint32(0x00001000)) or ((f & np.uint32(0x000007FF)) != np.uint32(0)):
            f_sig = f_sig + np.uint32(0x00001000)
        return np.uint16(h_sgn + (f_sig >> np.uint32(13)))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    f_sig = f & np.uint32(0x007FFFFF)
    if (f_sig & np.uint32(0x00003FFF)) != np.uint32(0x00001000):
        f_sig = f_sig + np.uint32(0x00001000)
    return np.uint16(h_sgn + (f_sig >> np.uint32(13)) + h_exp)


@njit(inline="always")
def to_f32(h, code):
    """16-bit pattern of format ``code`` (BF16 or F16) -> fp32 value."""
    if code == 1:
        return bf16_to_f32(h)
    return f16_to_f32(h)


@njit(inline="always")
def from_f32(x, code):
    """fp32 value -> 16-bit pattern of format ``code`` (BF16 or F16), RNE."""
    if code == 1:
        return f32_to_bf16(x)
    return f32_to_f16(x)


@njit(inline="always")
def round_f32(x, code):
    """Round an fp32 value to format ``code`` and return it as fp32 (identity for F32)."""
    if code == 1:
        return bf16_to_f32(f32_to_bf16(x))
    if code == 2:
        return f16_to_f32(f32_to_f16(x))
    return np.float32(x)


# ----------------------------------------------------------------------------------------
# Array conversions (parallel, used by the wrappers and tests)
# ----------------------------------------------------------------------------------------

from ._jit import pjit, prange  # noqa: E402


@pjit
def _widen(src, code, dst):
    n = src.size
    for i in prange(n):
        dst[i] = to_f32(src[i], code)


@pjit
def _narrow(src, code, dst):
    n = src.size
    for i in prange(n):
        dst[i] = from_f32(src[i], code)


def to_float32(a: np.ndarray) -> np.ndarray:
    """Widen a bf16/fp16/fp32 array to a new C-contiguous fp32 array (exact)."""
    dt = a.dtype
    if dt == FLOAT32:
        return np.ascontiguousarray(a)
    if dt not in (BFLOAT16, FLOAT16):
        return np.ascontiguousarray(a, dtype=np.float32)
    src = np.ascontiguousarray(a).view(np.uint16).reshape(-1)
    out = np.empty(a.shape, np.float32)
    if src.size:
        _widen(src, code_of(dt), out.reshape(-1))
    return out


def from_float32(a: np.ndarray, dtype, out: np.ndarray | None = None) -> np.ndarray:
    """Round an fp32 array to ``dtype`` (RNE, bit-exact with ml_dtypes), optionally into ``out``."""
    dt = np.dtype(dtype)
    if dt == FLOAT32:
        if out is None:
            return np.array(a, dtype=np.float32, copy=True)
        out[...] = a
        return out
    src = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    res = out if out is not None and out.flags.c_contiguous else np.empty(a.shape, dt)
    if src.size:
        _narrow(src, code_of(dt), res.view(np.uint16).reshape(-1))
    if out is not None and res is not out:
        out[...] = res
        return out
    return res
