"""Vector-friendly fp32 math for the kernels (Numba has no SVML here: ``np.exp`` on float32 is a
scalar libm call per element; this one is branch-free, so LLVM vectorizes the loops using it)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

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


def row_max_nan(r, ninf):  # pragma: no cover - replaced by the overload inside jitted code
    """``(max, nan_count)`` of a 1-D row: the largest value that is not NaN (``ninf`` for an empty
    or all-NaN row; a NaN never becomes the max) and the number of NaNs, in one pass (jitted code
    only).  fp32 C-contiguous rows: 8 lanes of ``x > m ? x : m`` (:func:`_max_nan_f32`: LLVM does
    not vectorize a scalar max reduction without ``nnan``, and ``nnan`` would make NaN rows
    undefined); any other row: the scalar loop.  The max is exact, so the lanes give the scalar
    loop's value (of two zeros of either sign, either may be returned)."""
    vals = [x for x in r if x == x]
    return (max(vals) if vals else ninf), len(r) - len(vals)


_LANES = 8


def _f32_row(arr, ninf) -> bool:
    """The types :func:`_max_nan_f32` compiles: an fp32 C-contiguous 1-D row and an fp32 ``ninf``."""
    return (
        isinstance(arr, types.Array)
        and arr.ndim == 1
        and arr.dtype == types.float32
        and arr.layout == "C"
        and ninf == types.float32
    )


@intrinsic
def _max_nan_f32(typingctx, arr, ninf):
    """:func:`row_max_nan` of an fp32 C-contiguous row as LLVM vector code: per lane ``m = x > m ?
    x : m`` (``maxps``) and ``count += x != x``, the lanes folded, then the scalar tail."""
    if not _f32_row(arr, ninf):
        return None
    sig = types.Tuple((types.float32, types.intp))(arr, ninf)

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        n = builder.extract_value(a.shape, 0)
        intp = n.type
        i32 = ir.IntType(32)
        vf = ir.VectorType(ir.FloatType(), _LANES)
        vi = ir.VectorType(i32, _LANES)
        splat = cgutils.get_null_value(vf)
        for k in range(_LANES):
            splat = builder.insert_element(splat, args[1], ir.Constant(i32, k))
        m_acc = cgutils.alloca_once_value(builder, splat)  # promoted to registers by LLVM
        c_acc = cgutils.alloca_once_value(builder, ir.Constant(vi, None))
        nv = builder.udiv(n, ir.Constant(intp, _LANES))
        with cgutils.for_range(builder, nv) as loop:
            p = builder.gep(a.data, [builder.mul(loop.index, ir.Constant(intp, _LANES))])
            v = builder.load(builder.bitcast(p, vf.as_pointer()), align=4)
            m = builder.load(m_acc)
            builder.store(builder.select(builder.fcmp_ordered(">", v, m), v, m), m_acc)
            nan = builder.zext(builder.fcmp_unordered("uno", v, v), vi)
            builder.store(builder.add(builder.load(c_acc), nan), c_acc)
        mv, cv = builder.load(m_acc), builder.load(c_acc)
        ms = cgutils.alloca_once_value(builder, builder.extract_element(mv, ir.Constant(i32, 0)))
        cs = cgutils.alloca_once_value(builder, builder.zext(builder.extract_element(cv, ir.Constant(i32, 0)), intp))

        def fold(x, cnt):
            cur = builder.load(ms)
            builder.store(builder.select(builder.fcmp_ordered(">", x, cur), x, cur), ms)
            builder.store(builder.add(builder.load(cs), cnt), cs)

        for k in range(1, _LANES):
            fold(
                builder.extract_element(mv, ir.Constant(i32, k)),
                builder.zext(builder.extract_element(cv, ir.Constant(i32, k)), intp),
            )
        start = builder.mul(nv, ir.Constant(intp, _LANES))
        with cgutils.for_range_slice(builder, start, n, ir.Constant(intp, 1)) as (j, _):
            x = builder.load(builder.gep(a.data, [j]))
            fold(x, builder.zext(builder.fcmp_unordered("uno", x, x), intp))
        return context.make_tuple(builder, sig.return_type, (builder.load(ms), builder.load(cs)))

    return sig, codegen


@overload(row_max_nan)
def _row_max_nan_ol(r, ninf):
    if _f32_row(r, ninf):
        return lambda r, ninf: _max_nan_f32(r, ninf)  # type: ignore[call-arg]

    def impl(r, ninf):
        m = ninf
        c = 0
        for j in range(r.shape[0]):
            x = r[j]
            if x > m:
                m = x
            c += x != x
        return m, c

    return impl


@njit(fastmath=FASTMATH_SAFE)
def row_sum_exp(r, m, zero):
    """``Σ_j exp(r[j] - m)`` in the dtype of ``zero``."""
    acc = zero
    for j in range(r.shape[0]):
        acc += exp_c(r[j] - m)
    return acc
