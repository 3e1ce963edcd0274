"""op_kernel layer of ``cross_entropy_loss_grad`` (aclnnCrossEntropyLossGrad).

One fused, parallel, single pass over ``log_prob``: each block of a row reads its
``log_prob`` elements once, takes ``p = exp(log_prob)`` in fp32, and writes
``x_grad = p * coef_p[i] - coef_s[i] * weight[j] - [j == t_i] * coef_t[i]`` rounded once to the
output format.  The O(N) per-row coefficients (the scale ``s_i``, the target weight, the
mean's denominator ``W = sum_i w_i``, the z-loss term) are computed first by a small serial
kernel, in a fixed order, so the result does not depend on the thread count.  Ignored rows
(and rows of an all-ignored ``mean``) are filled without reading ``log_prob``.

This module also holds the vector-friendly fp32 helpers the two softmax-style kernels of
this package share (:func:`exp_f32`, :func:`load_f32`, :func:`store_as`): branch-free, so
LLVM vectorizes the loops that use them (Numba has no SVML here, and ``np.exp`` on float32
would be a scalar libm call per element).
"""

from __future__ import annotations

import numpy as np
from numba import types
from llvmlite import ir as llvmir
from numba.extending import intrinsic, overload

from .._jit import njit, pjit, prange
from ..backends import implements
from ..dtypes import code_of, storage_view

OP = "cross_entropy_loss_grad"

# ----------------------------------------------------------------------------------------
# Vector-friendly scalar helpers (shared with kernels/scaled_masked_softmax_backward.py)
# ----------------------------------------------------------------------------------------

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


@njit
def f32_to_f16_bits(x):
    """fp32 -> fp16 bit pattern, round-to-nearest-even, branch-free.

    Bit-identical to NumPy's ``astype(float16)`` (and ``dtypes.f32_to_f16``) on every fp32
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
def bf16_bits_to_f32(h):
    """bf16 bit pattern -> fp32 (exact), on 32-bit lanes."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


@njit
def f32_to_bf16_bits(x):
    """fp32 -> bf16 bit pattern, RNE, NaN -> 0x7FC0|sign (as ml_dtypes), on 32-bit lanes.

    (Every integer step is wrapped in ``np.uint32``: Numba types uint32 arithmetic as
    uint64, and LLVM only narrows the lanes back when each step is truncated.)
    """
    u = np.float32(x).view(np.uint32)
    hi = np.uint32(u >> np.uint32(16))
    lsb = np.uint32(hi & np.uint32(1))
    r = np.uint32(u + np.uint32(0x7FFF))
    r = np.uint32(r + lsb)
    r = np.uint32(r >> np.uint32(16))
    a = np.uint32(u & np.uint32(0x7FFFFFFF))
    qnan = np.uint32(np.uint32(hi & np.uint32(0x8000)) | np.uint32(0x7FC0))
    if a > np.uint32(0x7F800000):
        r = qnan
    return np.uint16(r)


@njit
def f16_bits_to_f32(h):
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
    """True when Numba compiles for a CPU with the F16C conversions (vcvtph2ps/vcvtps2ph)."""
    try:
        import llvmlite.binding as llvm
        from numba.core import config

        if config.CPU_NAME not in (None, "host"):
            return False
        feats = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
        return "+f16c" in feats.split(",")
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
def f16_bits_to_f32_fast(h):
    """fp16 bits -> fp32, exact: the F16C conversion, with NumPy's NaN payloads (no quieting)."""
    v = _f16_bits_to_f32_hw(h)
    h32 = np.uint32(h)
    if np.uint32(h32 & np.uint32(0x7FFF)) > np.uint32(0x7C00):
        v = np.uint32(np.uint32(np.uint32(h32 & np.uint32(0x8000)) << np.uint32(16))
                      | np.uint32(0x7F800000)
                      | np.uint32(np.uint32(h32 & np.uint32(0x3FF)) << np.uint32(13))).view(np.float32)
    return v


@njit
def f32_to_f16_bits_fast(x):
    """fp32 -> fp16 bits, RNE: the F16C conversion, with NumPy's NaN payloads (no quieting)."""
    r = _f32_to_f16_bits_hw(np.float32(x))
    f = np.float32(x).view(np.uint32)
    a = np.uint32(f & np.uint32(0x7FFFFFFF))
    if a > np.uint32(0x7F800000):
        nanp = np.uint32(np.uint32(0x7C00) | np.uint32(np.uint32(a & np.uint32(0x007FFFFF)) >> np.uint32(13)))
        if nanp == np.uint32(0x7C00):
            nanp = np.uint32(0x7C01)
        r = np.uint16(np.uint32(np.uint32(np.uint32(f >> np.uint32(16)) & np.uint32(0x8000)) | nanp))
    return r


def load_f32(x, code):
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
                return bf16_bits_to_f32(x)
            return f16_bits_to_f32_fast(x)
    else:
        def impl(x, code):
            if code == 1:
                return bf16_bits_to_f32(x)
            return f16_bits_to_f32(x)
    return impl


def store_as(v, code, like):
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
                return f32_to_bf16_bits(v)
            return f32_to_f16_bits_fast(v)
    else:
        def impl(v, code, like):
            if code == 1:
                return f32_to_bf16_bits(v)
            return f32_to_f16_bits(v)
    return impl


# ----------------------------------------------------------------------------------------
# Per-row coefficients (O(N), serial, fixed order: the tiling/scalar part)
# ----------------------------------------------------------------------------------------

@njit(error_model="numpy")
def _row_coefficients(tgt, grad, weight, has_weight, red, ignore_index, ls,
                      gz, lse, zscale, coef_p, coef_t, coef_s):
    """Fill the per-row fp32 coefficients; returns True when some row is ignored.

    ``red``: 0 none, 1 mean, 2 sum.  ``grad``/``gz``: fp32 [N] (the 0-d values repeated
    for mean/sum).  For row i with target t and mask m (0 when ignored):

    * nll_i   = s_i·(1-ls)·w_t·m        (s_i = g/W, g or g_i; device order of operations)
    * smooth_i = s_i·(ls/C)·m,  coef_s = smooth_i,  coef_p = nll_i + smooth_i·Σweight
    * zloss_i = 2·zscale·lse_i·m·gz_i  (gz_i divided by the non-ignored count for mean)
    * coef_t = nll_i (subtracted at j == t).

    Ignored rows get ``coef_t = 0`` and ``coef_p = s_i·0`` (NaN when s_i is not finite, as
    on the device: e.g. W = 0 for an all-ignored mean).
    """
    n = tgt.shape[0]
    c = weight.shape[0]
    one = np.float32(1.0)
    # W = sum of target weights over non-ignored rows; count of non-ignored rows (fp64, serial)
    wsum = 0.0
    cnt = 0
    for i in range(n):
        t = tgt[i]
        if t != ignore_index:
            cnt += 1
            if has_weight:
                wsum += np.float64(weight[t])
            else:
                wsum += 1.0
    wtot = 0.0
    for j in range(c):
        wtot += np.float64(weight[j])
    W = np.float32(wsum)
    Wc = np.float32(wtot)
    lsf = np.float32(ls)
    ls_c = lsf / np.float32(c) if c > 0 else np.float32(0.0)
    keep = one - lsf
    zs2 = np.float32(2.0) * np.float32(zscale)
    any_ignored = False
    for i in range(n):
        t = tgt[i]
        g = grad[i]
        m = one
        wt = one
        if t == ignore_index:
            m = np.float32(0.0)
            any_ignored = True
        elif has_weight:
            wt = weight[t]
        if red == 1:
            lo = g * keep / W * m
            sm = g / W * ls_c * m
        else:
            lo = g * keep * m
            sm = g * ls_c * m
        nll = lo * wt
        cp = nll + sm * Wc
        if zscale != 0.0:
            zg = gz[i]
            if red == 1:
                zg = zg / np.float32(cnt)
            cp = cp + zs2 * lse[i] * m * zg
        if m == np.float32(0.0):
            coef_t[i] = np.float32(0.0)
        else:
            coef_t[i] = nll
        coef_p[i] = cp
        coef_s[i] = sm
    return any_ignored


# ----------------------------------------------------------------------------------------
# The main kernel: one pass over log_prob, parallel over (row, column-block)
# ----------------------------------------------------------------------------------------

_BLOCK = 16384  # columns per work item: rows of the 32k vocabulary split in two


@njit(inline="always")
def _ce_block(src, dst, a, b, wv, smooth, code):
    """``dst = exp(src)·a - b·wv`` (or ``exp(src)·a``), for one format ``code``.

    Called with a literal ``code`` from each branch of the kernel, so that after inlining
    every copy of the loop converts with one format only (LLVM does not unswitch it).
    """
    if smooth:
        for j in range(src.shape[0]):
            v = exp_f32(load_f32(src[j], code)) * a - b * wv[j]
            dst[j] = store_as(v, code, dst)
    else:
        for j in range(src.shape[0]):
            v = exp_f32(load_f32(src[j], code)) * a
            dst[j] = store_as(v, code, dst)


@pjit
def _ce_grad_kernel(lp, code, tgt, ignore_index, coef_p, coef_t, coef_s, weight, smooth, out):
    n, c = lp.shape
    nb = (c + _BLOCK - 1) // _BLOCK
    for blk in prange(n * nb):
        i = blk // nb
        j0 = (blk - i * nb) * _BLOCK
        j1 = min(j0 + _BLOCK, c)
        t = tgt[i]
        a = coef_p[i]
        # 1-D row views indexed from 0: LLVM sees unit-stride, non-negative indices
        dst = out[i, j0:j1]
        if t == ignore_index:
            # ignored row: 0 (NaN when the row scale is not finite), log_prob not read
            d = a - a
            z = store_as(d if d != d else np.float32(0.0), code, out)
            for j in range(dst.shape[0]):
                dst[j] = z
            continue
        src = lp[i, j0:j1]
        b = coef_s[i]
        wv = weight[j0:j1]
        if code == 1:
            _ce_block(src, dst, a, b, wv, smooth, 1)
        elif code == 2:
            _ce_block(src, dst, a, b, wv, smooth, 2)
        else:
            _ce_block(src, dst, a, b, wv, smooth, 0)
        if j0 <= t and t < j1:
            # the target column: recomputed from the input, one rounding
            v = exp_f32(load_f32(lp[i, t], code)) * a
            if smooth:
                v = v - b * weight[t]
            v = v - coef_t[i]
            out[i, t] = store_as(v, code, out)


@implements("cpu", OP)
def cross_entropy_loss_grad_cpu(*, grad_loss, log_prob, target, weight, reduction, ignore_index,
                                label_smoothing, grad_zloss, lse_for_zloss,
                                lse_square_scale_for_zloss, out):
    """Numba implementation (the op module has validated every argument)."""
    n, c = log_prob.shape
    if n == 0 or c == 0:
        return out
    red = {"none": 0, "mean": 1, "sum": 2}[reduction]
    # O(N) / O(C) operands, made fp32 / int64 contiguous (tiny next to the N·C tensors)
    tgt = np.ascontiguousarray(target, dtype=np.int64)
    grad = _f32_vector(grad_loss, n)
    has_weight = weight is not None
    w = _f32_vector(weight, c) if has_weight else np.ones(c, np.float32)
    zscale = float(lse_square_scale_for_zloss)
    if zscale != 0.0:
        gz = grad if grad_zloss is None else grad + _f32_vector(grad_zloss, n)
        lse = _f32_vector(lse_for_zloss, n)
    else:
        gz = lse = np.zeros(1, np.float32)
    coef_p = np.empty(n, np.float32)
    coef_t = np.empty(n, np.float32)
    coef_s = np.empty(n, np.float32)
    _row_coefficients(tgt, grad, w, has_weight, red, int(ignore_index), float(label_smoothing),
                      gz, lse, zscale, coef_p, coef_t, coef_s)
    lp = storage_view(np.ascontiguousarray(log_prob))   # the device's Contiguous step
    _ce_grad_kernel(lp, code_of(log_prob.dtype), tgt, int(ignore_index), coef_p, coef_t, coef_s,
                    w, float(label_smoothing) != 0.0, storage_view(out))
    return out


def _f32_vector(a, n):
    """A 0-d or 1-d float array -> contiguous fp32 [n] (0-d repeated; exact widening)."""
    from ..dtypes import to_float32

    v = to_float32(np.asarray(a)).reshape(-1)
    if v.size == 1 and n != 1:
        return np.full(n, v[0], np.float32)
    return np.ascontiguousarray(v, dtype=np.float32)
