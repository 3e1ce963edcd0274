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

from typing import TYPE_CHECKING, cast

import ml_dtypes
import numpy as np
import numpy.typing as npt
from llvmlite import ir as llvmir
from numba import types
from numba.extending import intrinsic, overload

from ._jit import njit

if TYPE_CHECKING:  # parse_dtype's argument type only
    import torch

F32, BF16, F16 = 0, 1, 2

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)

#: The floating dtypes the ops accept (fp64 only through the reference backend's inputs).
FLOAT_DTYPES = (BFLOAT16, FLOAT16, FLOAT32)

_CODE = {FLOAT32: F32, BFLOAT16: BF16, FLOAT16: F16}
_NAME = {FLOAT32: "float32", BFLOAT16: "bfloat16", FLOAT16: "float16", FLOAT64: "float64"}


def code_of(dtype: npt.DTypeLike) -> int:
    """Kernel format code of a NumPy dtype (float32, float16, ml_dtypes.bfloat16)."""
    return _CODE[np.dtype(dtype)]


def dtype_name(dtype: npt.DTypeLike) -> str:
    dt = np.dtype(dtype)
    return _NAME.get(dt, str(dt))


def is_16bit(dtype: npt.DTypeLike) -> bool:
    return np.dtype(dtype) in (BFLOAT16, FLOAT16)


def storage_view(a: np.ndarray) -> np.ndarray:
    """The array a kernel takes: a ``uint16`` view of bf16/fp16 data, else ``a`` itself.

    Made in Python, never inside a parallel kernel (Numba drops writes through views made
    inside ``parallel=True`` kernels).
    """
    if a.dtype in (BFLOAT16, FLOAT16):
        return a.view(np.uint16)
    return a


#: The one dtype vocabulary: every spelling fastgrad accepts for a float dtype (the CLI, the
#: benchmarks, ``compare`` and ``logits_dtype=`` parse through :func:`parse_dtype`).
DTYPE_ALIASES = {
    "float16": FLOAT16,
    "fp16": FLOAT16,
    "half": FLOAT16,
    "f16": FLOAT16,
    "bfloat16": BFLOAT16,
    "bf16": BFLOAT16,
    "float32": FLOAT32,
    "fp32": FLOAT32,
    "float": FLOAT32,
    "f32": FLOAT32,
    "single": FLOAT32,
    "float64": FLOAT64,
    "fp64": FLOAT64,
    "double": FLOAT64,
    "f64": FLOAT64,
}


def parse_dtype(dtype: npt.DTypeLike | torch.dtype) -> np.dtype:
    """Any dtype spelling (``"bf16"``, ``"float16"``, ``np.float32``, ``torch.bfloat16``,
    ``ml_dtypes.bfloat16``, ``"int64"`` ...) -> a NumPy dtype.  AclnnError 161002 when unknown."""
    from .errors import invalid

    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key.startswith("torch."):
            key = key[6:]
        if key in DTYPE_ALIASES:
            return DTYPE_ALIASES[key]
        try:
            return np.dtype(key)
        except TypeError:
            raise invalid("dtype", "a dtype name (float16|bfloat16|float32|float64|int32|...)", repr(dtype)) from None
    if type(dtype).__module__ == "torch":  # a torch.dtype
        return parse_dtype(str(dtype))
    try:
        return np.dtype(cast("npt.DTypeLike", dtype))
    except TypeError:
        raise invalid("dtype", "a dtype", repr(dtype)) from None


def promote(*dtypes: npt.DTypeLike) -> np.dtype:
    """Type promotion of floating dtypes as the device does it (fp32 > fp16/bf16; fp16+bf16 -> fp32)."""
    ds = {np.dtype(d) for d in dtypes}
    if len(ds) == 1:
        return ds.pop()
    if FLOAT64 in ds:
        return FLOAT64
    return FLOAT32


# ----------------------------------------------------------------------------------------
# Scalar conversions (njit, inlined into kernels). Every integer step is kept on 32-bit lanes
# and written with selects, so the loops using them vectorize. fp16 uses the CPU's F16C
# conversions where Numba targets a host that has them (with NumPy's NaN payloads restored),
# the integer emulation elsewhere; both are bit-exact with NumPy.
# ----------------------------------------------------------------------------------------


@njit
def _f32_to_f16_sw(x):
    """fp32 -> fp16 bit pattern, round-to-nearest-even, branch-free.

    Bit-identical to NumPy's ``astype(float16)``  on every fp32
    pattern (checked exhaustively), including subnormals, overflow to ±Inf and NaN payloads;
    written with selects on 32-bit lanes so that loops using it vectorize.  fp16 subnormals
    are rounded by the FPU: ``|x| + 0.5`` has an ulp of 2**-24, the fp16 subnormal spacing.
    """
    f = np.float32(x).view(np.uint32)
    sign = np.uint32((f >> np.uint32(16)) & np.uint32(0x8000))
    a = np.uint32(f & np.uint32(0x7FFFFFFF))
    # normal fp16 range: rebias the exponent, round half to even through the odd bit
    odd = np.uint32((a >> np.uint32(13)) & np.uint32(1))
    norm = np.uint32(np.uint32(a + np.uint32(0xC8000FFF) + odd) >> np.uint32(13))  # a - 0x38000000 + 0xFFF
    # subnormal fp16 (|x| < 2**-14): the FPU's RNE of |x| + 0.5 at spacing 2**-24
    sub = np.uint32(np.float32(a.view(np.float32) + np.float32(0.5)).view(np.uint32) - np.uint32(0x3F000000))
    # Inf / NaN (NaN keeps its top payload bits and never becomes Inf)
    nanp = np.uint32(np.uint32(0x7C00) | np.uint32((a & np.uint32(0x007FFFFF)) >> np.uint32(13)))
    if nanp == np.uint32(0x7C00):
        nanp = np.uint32(0x7C01)
    big = np.uint32(0x7C00)
    if a > np.uint32(0x7F800000):
        big = nanp
    r = norm
    if a < np.uint32(0x38800000):
        r = sub
    if a >= np.uint32(0x47800000):
        r = big
    return np.uint16(r | sign)


@njit
def bf16_to_f32(h: np.uint16 | int) -> np.float32:
    """bf16 bit pattern -> fp32 (exact), on 32-bit lanes."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


@njit
def f32_to_bf16(x: np.floating | float) -> np.uint16:
    """fp32 -> bf16 bit pattern, RNE, NaN -> 0x7FC0|sign (as ml_dtypes), on 32-bit lanes.

    The NaN test is one unordered compare and the quiet-NaN pattern one select, so loops using
    it vectorize with few operations per vector.  (Every integer step is wrapped in
    ``np.uint32``: Numba types uint32 arithmetic as uint64, and LLVM only narrows the lanes back
    when each step is truncated.)
    """
    xf = np.float32(x)
    u = xf.view(np.uint32)
    r = np.uint32(u + np.uint32(0x7FFF))
    r = np.uint32(r + np.uint32(np.uint32(u >> np.uint32(16)) & np.uint32(1)))
    r = np.uint32(r >> np.uint32(16))
    if xf != xf:
        r = np.uint32(np.uint32(np.uint32(u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    return np.uint16(r)


@njit
def _f16_to_f32_sw(h):
    """fp16 bit pattern -> fp32 (exact; subnormals, ±Inf, NaN payload kept), on 32-bit lanes."""
    h32 = np.uint32(h)
    sign = np.uint32(np.uint32(h32 & np.uint32(0x8000)) << np.uint32(16))
    em = np.uint32(h32 & np.uint32(0x7FFF))
    # normal and subnormal alike: shift into place and rescale by 2**112 (exact)
    f = np.float32(np.uint32(em << np.uint32(13)).view(np.float32) * np.float32(5.192296858534828e33))
    bits = f.view(np.uint32)
    if em >= np.uint32(0x7C00):  # Inf / NaN
        bits = np.uint32(np.uint32(0x7F800000) | np.uint32(np.uint32(em & np.uint32(0x3FF)) << np.uint32(13)))
    return np.uint32(bits | sign).view(np.float32)


def _host_has_f16c() -> bool:
    """True when Numba compiles for a CPU with the F16C conversions (vcvtph2ps/vcvtps2ph): the
    host (``fastgrad._cpu``, the one detector) unless ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``
    name another target."""
    try:
        from numba.core import config

        from . import _cpu

        if config.CPU_NAME not in (None, "host"):  # type: ignore[attr-defined]
            return False
        if config.CPU_FEATURES:  # type: ignore[attr-defined]
            return "+f16c" in config.CPU_FEATURES.split(",")  # type: ignore[attr-defined]
        return _cpu.has("f16c")
    except Exception:  # pragma: no cover - be conservative
        return False


#: Use the hardware fp16 conversions (one instruction per vector) instead of the integer
#: emulation; chosen once, for the CPU Numba targets (its on-disk cache is keyed by CPU).
HW_F16 = _host_has_f16c()


@intrinsic
def _f16_bits_to_f32_hw(typingctx, h):
    """fp16 bits -> fp32 through LLVM ``fpext half`` (F16C ``vcvtph2ps``); quiets sNaN."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], llvmir.HalfType()), llvmir.FloatType())

    return sig, codegen


@intrinsic
def _f32_to_f16_bits_hw(typingctx, x):
    """fp32 -> fp16 bits through LLVM ``fptrunc`` (F16C ``vcvtps2ph``, RNE); quiets sNaN."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], llvmir.HalfType()), llvmir.IntType(16))

    return sig, codegen


@njit
def _f16_to_f32_hw(h):
    """fp16 bits -> fp32, exact: the F16C conversion, with NumPy's NaN payloads (no quieting)."""
    # an @intrinsic's typing context is implicit: mypy sees the Python signature (one argument short)
    v: np.float32 = _f16_bits_to_f32_hw(h)  # type: ignore[call-arg]
    h32 = np.uint32(h)
    if np.uint32(h32 & np.uint32(0x7FFF)) > np.uint32(0x7C00):
        v = np.uint32(
            np.uint32(np.uint32(h32 & np.uint32(0x8000)) << np.uint32(16))
            | np.uint32(0x7F800000)
            | np.uint32(np.uint32(h32 & np.uint32(0x3FF)) << np.uint32(13))
        ).view(np.float32)
    return v


@njit
def _f32_to_f16_hw(x):
    """fp32 -> fp16 bits, RNE: the F16C conversion, with NumPy's NaN payloads (no quieting)."""
    r: np.uint16 = _f32_to_f16_bits_hw(np.float32(x))  # type: ignore[call-arg]  # implicit typing context
    f = np.float32(x).view(np.uint32)
    a = np.uint32(f & np.uint32(0x7FFFFFFF))
    if a > np.uint32(0x7F800000):
        nanp = np.uint32(np.uint32(0x7C00) | np.uint32(np.uint32(a & np.uint32(0x007FFFFF)) >> np.uint32(13)))
        if nanp == np.uint32(0x7C00):
            nanp = np.uint32(0x7C01)
        r = np.uint16(np.uint32(np.uint32(np.uint32(f >> np.uint32(16)) & np.uint32(0x8000)) | nanp))
    return r


def load_f32(x: np.floating | np.uint16, code: int) -> np.float32:
    """Element of a kernel array -> fp32 (fp32 as is; uint16 storage of format ``code``)."""
    raise NotImplementedError("only callable from Numba kernels")


@overload(load_f32)
def _load_f32_ol(x, code):
    if isinstance(x, types.Float):

        def impl(x, code):
            return np.float32(x)
    elif HW_F16:

        def impl(x, code):
            if code == 1:
                return bf16_to_f32(x)
            return _f16_to_f32_hw(x)
    else:

        def impl(x, code):
            if code == 1:
                return bf16_to_f32(x)
            return _f16_to_f32_sw(x)

    return impl


def store_as(v: np.floating | float, code: int, like: np.ndarray) -> np.float32 | np.uint16:
    """fp32 value -> the element type of array ``like`` (RNE to format ``code`` for uint16)."""
    raise NotImplementedError("only callable from Numba kernels")


@overload(store_as)
def _store_as_ol(v, code, like):
    if isinstance(like.dtype, types.Float):

        def impl(v, code, like):
            return np.float32(v)
    elif HW_F16:

        def impl(v, code, like):
            if code == 1:
                return f32_to_bf16(v)
            return _f32_to_f16_hw(v)
    else:

        def impl(v, code, like):
            if code == 1:
                return f32_to_bf16(v)
            return _f32_to_f16_sw(v)

    return impl


if HW_F16:
    f16_to_f32 = _f16_to_f32_hw
    f32_to_f16 = _f32_to_f16_hw
else:
    f16_to_f32 = _f16_to_f32_sw
    f32_to_f16 = _f32_to_f16_sw


@njit(inline="always")
def to_f32(h: np.uint16 | int, code: int) -> np.float32:
    """16-bit pattern of format ``code`` (BF16 or F16) -> fp32 value."""
    if code == 1:
        return bf16_to_f32(h)
    return f16_to_f32(h)


@njit(inline="always")
def from_f32(x: np.floating | float, code: int) -> np.uint16:
    """fp32 value -> 16-bit pattern of format ``code`` (BF16 or F16), RNE."""
    if code == 1:
        return f32_to_bf16(x)
    return f32_to_f16(x)


@njit(inline="always")
def round_f32(x: np.floating | float, code: int) -> np.float32:
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
        return np.asarray(a, order="C")  # keeps 0-d arrays 0-d
    if dt not in (BFLOAT16, FLOAT16):
        return np.asarray(a, dtype=np.float32, order="C")
    src = np.asarray(a, order="C").view(np.uint16).reshape(-1)
    out = np.empty(a.shape, np.float32)
    if src.size:
        _widen(src, code_of(dt), out.reshape(-1))
    return out


def from_float32(a: np.ndarray, dtype: npt.DTypeLike, out: np.ndarray | None = None) -> np.ndarray:
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


# ----------------------------------------------------------------------------------------
# Element conversions for values that only feed / come out of fp32 arithmetic
# ----------------------------------------------------------------------------------------


def load_f32_arith(x: np.floating | np.uint16, code: int) -> np.float32:
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
            return _f16_bits_to_f32_hw(x)  # type: ignore[call-arg]  # implicit typing context

    return impl


def store_arith(v: np.floating | float, code: int, like: np.ndarray) -> np.float32 | np.uint16:
    """Like :func:`fastgrad.dtypes.store_as`, for a value produced by fp32 arithmetic (so never
    a signaling NaN).

    With F16C, fp32 -> fp16 is the bare ``vcvtps2ph`` (RNE): for a quiet NaN it gives the sign,
    ``0x7E00`` and the payload's top bits, exactly what the NaN fix-up of ``store_as``
    computes, so it is skipped.  bf16: the same :func:`f32_to_bf16` as ``store_as``.
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
                return f32_to_bf16(v)
            return store_as(v, code, like)
    else:

        def impl(v, code, like):
            if code == 1:
                return f32_to_bf16(v)
            return _f32_to_f16_bits_hw(np.float32(v))  # type: ignore[call-arg]  # implicit typing context

    return impl
