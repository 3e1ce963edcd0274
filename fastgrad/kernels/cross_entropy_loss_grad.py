"""op_kernel layer of ``cross_entropy_loss_grad`` (aclnnCrossEntropyLossGrad).

One fused, parallel, single pass over ``log_prob``: each block of a row reads its
``log_prob`` elements once, takes ``p = exp(log_prob)`` in fp32, and writes
``x_grad = p * coef_p[i] - coef_s[i] * weight[j] - [j == t_i] * coef_t[i]`` rounded once to the
output format.  The O(N) per-row coefficients (the scale ``s_i``, the target weight, the
mean's denominator ``W = sum_i w_i``) are computed first by a small serial
kernel, in a fixed order, so the result does not depend on the thread count.

Rounding order (ls = 0, the device's path), bit for bit as the 910B kernel
(``cross_entropy_loss_grad_weight_none.h:164-170,90-101``, ``..._weight_not_none.h:183-194,
110-150``): ``c_i = fl(fl(fl(g·(1-ls)) / W)·ignore_i)·w_i`` (mean; ``fl(g·(1-ls))`` for sum,
``fl(g_i·(1-ls))`` for none), ``x = fl(p·c_i)``, at the target ``fl(x - c_i)``, then one RINT
cast to the dtype.  Ignored rows go through the same pass with ``c_i = ±0`` (the device
multiplies them by ``ignoreSelect = 0``): 0, but NaN where ``exp(log_prob)`` is NaN or inf,
and NaN everywhere when ``c_i`` is (all-ignored ``mean``: W = 0).

The element loads/stores (:func:`fastgrad.dtypes.load_f32`, :func:`~fastgrad.dtypes.store_as`)
and :func:`fastgrad.kernels._vmath.exp_f32` are branch-free, so LLVM vectorizes the loops.
"""

from __future__ import annotations

import numpy as np

from .._jit import njit, pjit, prange
from ..dtypes import code_of, storage_view
from ..dtypes import load_f32_arith as load_f32
from ..dtypes import store_arith as store_as
from ._vmath import exp_f32

OP = "cross_entropy_loss_grad"

# ----------------------------------------------------------------------------------------
# Per-row coefficients (O(N), serial, fixed order: the tiling/scalar part)
# ----------------------------------------------------------------------------------------


@njit(error_model="numpy")
def _row_coefficients(tgt, grad, weight, has_weight, red, ignore_index, any_sign, ls, coef_p, coef_t, coef_s, coef_r):
    """Fill the per-row fp32 coefficients; returns True when some row is ignored.

    ``red``: 0 none, 1 mean, 2 sum.  ``grad``: fp32 [N] (the 0-d value repeated for
    mean/sum).  A row is ignored when ``t == ignore_index`` and (``any_sign`` or
    ``ignore_index >= 0``): the SoC's rule (910B: any sign; arch35: only a non-negative
    ignore_index).  For row i with target t and mask m (0 when ignored):

    * nll_i   = s_i·(1-ls)·w_t·m        (s_i = g/W, g or g_i; device order of operations)
    * smooth_i = s_i·(ls/C)·m,  coef_s = smooth_i,  coef_p = nll_i + smooth_i·Σweight
    * coef_t = nll_i (subtracted at j == t; a t outside [0, C) matches no column).
    * coef_r = fl(smooth_i·Σweight) (the arch35 ``smoothGradReduceSum``; C without weight);
      for a non-finite smooth_i the term-by-term ``Σ_j fl(weight_j·smooth_i)`` of the kernel
      (NaN with a zero weight or weights of both signs), also in coef_p.

    Ignored rows get ``coef_t = coef_p = s_i·0·w`` (±0; NaN when s_i is not finite, as on the
    device: e.g. W = 0 for an all-ignored mean).
    """
    n = tgt.shape[0]
    c = weight.shape[0]
    one = np.float32(1.0)
    # W = sum of target weights over non-ignored rows; count of non-ignored rows (fp64, serial)
    wsum = 0.0
    ign_on = any_sign or ignore_index >= 0
    for i in range(n):
        t = tgt[i]
        if not (ign_on and t == ignore_index):
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
    any_ignored = False
    for i in range(n):
        t = tgt[i]
        g = grad[i]
        m = one
        wt = one
        if ign_on and t == ignore_index:
            m = np.float32(0.0)
            any_ignored = True
            if has_weight:  # device: weight[t] (t >= 0), 0 for a negative ignore_index
                wt = weight[t] if 0 <= t < c else np.float32(0.0)
        elif has_weight:
            wt = weight[t]
        if red == 1:
            lo = g * keep / W * m
            sm = g / W * ls_c * m
        else:
            lo = g * keep * m
            sm = g * ls_c * m
        nll = lo * wt
        red_sum = sm * Wc
        if not np.isfinite(sm):
            # arch35 (weight_not_none.h:218-330) and PyTorch's composite add the terms
            # fl(w_j·sm) one by one: with sm = ±inf a zero weight (0·inf) or weights of both
            # signs (inf − inf) make the row's sum NaN where sm·Σw would be ±inf.  For an
            # infinite sm every term is ±inf or NaN, so the sum does not depend on the order;
            # a NaN sm gives NaN either way.  Finite sm keeps fl(sm·fl(Σw)) (row 4l).
            red_sum = np.float32(0.0)
            for j in range(c):
                red_sum += sm * weight[j]
        # ls = 0 (the device's only path): c_i itself, no 0·Σweight term (keeps -0, inf)
        cp = nll + red_sum if lsf != np.float32(0.0) else nll
        coef_t[i] = nll  # ignored rows: ±0 (or NaN), subtracted at t as on the device
        coef_p[i] = cp
        coef_s[i] = sm
        coef_r[i] = red_sum
    return any_ignored


# ----------------------------------------------------------------------------------------
# The main kernel: one pass over log_prob, parallel over (row, column-block)
# ----------------------------------------------------------------------------------------

_BLOCK = 16384  # columns per work item: rows of the 32k vocabulary split in two


@njit(inline="always")
def _ce_block(src, dst, a, b, wv, smooth, code, r, arch35):
    """``dst = exp(src)·a - b·wv`` (or ``exp(src)·a``), for one format ``code``; with
    ``arch35`` (label smoothing on the 950 kernel) ``dst = (exp(src)·r - b·wv) + exp(src)·a``.

    Called with a literal ``code`` from each branch of the kernel, so that after inlining
    every copy of the loop converts with one format only (LLVM does not unswitch it).
    """
    if smooth and arch35:  # arch35 SmoothLabel: ((e·fl(sm·Σw)) − w_j·sm) + fl(e·c)
        for j in range(src.shape[0]):
            e = exp_f32(load_f32(src[j], code))
            v = (e * r - b * wv[j]) + e * a
            dst[j] = store_as(v, code, dst)
    elif smooth:
        for j in range(src.shape[0]):
            v = exp_f32(load_f32(src[j], code)) * a - b * wv[j]
            dst[j] = store_as(v, code, dst)
    else:
        for j in range(src.shape[0]):
            v = exp_f32(load_f32(src[j], code)) * a
            dst[j] = store_as(v, code, dst)


@pjit
def _ce_grad_kernel(lp, code, tgt, ignore_index, coef_p, coef_t, coef_s, coef_r, weight, smooth, arch35, out):
    n, c = lp.shape
    nb = (c + _BLOCK - 1) // _BLOCK
    for blk in prange(n * nb):
        i = blk // nb
        j0 = (blk - i * nb) * _BLOCK
        j1 = min(j0 + _BLOCK, c)
        t = tgt[i]
        a = coef_t[i] if (smooth and arch35) else coef_p[i]
        r = coef_r[i]
        # 1-D row views indexed from 0: LLVM sees unit-stride, non-negative indices.
        # Ignored rows too (a = ±0): exp(log_prob)·0 as on the device, NaN propagates.
        dst = out[i, j0:j1]
        src = lp[i, j0:j1]
        b = coef_s[i]
        wv = weight[j0:j1]
        if code == 1:
            _ce_block(src, dst, a, b, wv, smooth, 1, r, arch35)
        elif code == 2:
            _ce_block(src, dst, a, b, wv, smooth, 2, r, arch35)
        else:
            _ce_block(src, dst, a, b, wv, smooth, 0, r, arch35)
        if j0 <= t and t < j1:
            # the target column: recomputed from the input, one rounding
            e = exp_f32(load_f32(lp[i, t], code))
            if smooth and arch35:  # x[t] = fl(e·c) − c first (ComputeLogPre), then SmoothLabel
                v = (e * r - b * weight[t]) + (e * a - coef_t[i])
            else:
                v = e * a
                if smooth:
                    v = v - b * weight[t]
                v = v - coef_t[i]
            out[i, t] = store_as(v, code, out)


def cross_entropy_loss_grad_cpu(
    *,
    grad_loss: np.ndarray,
    log_prob: np.ndarray,
    target: np.ndarray,
    weight: np.ndarray | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    grad_zloss: np.ndarray | None,
    lse_for_zloss: np.ndarray | None,
    lse_square_scale_for_zloss: float,
    out: np.ndarray,
    ignore_any_sign: bool = True,
    smooth_arch35: bool = False,
) -> np.ndarray:
    """Numba implementation (the op module has validated every argument).

    ``grad_zloss``, ``lse_for_zloss`` and ``lse_square_scale_for_zloss`` are not read, as on the
    device; ``ignore_any_sign`` is the SoC profile's ignore rule (see :func:`_row_coefficients`);
    ``smooth_arch35``: label smoothing in the arch35 kernel's order (``x = fl(e·c)``, ``x[t] −= c``
    — ``arch35/cross_entropy_loss_grad_base.h:487-526`` — then ``((e·fl(sm·Σw)) − w_j·sm) + x``,
    ``arch35/cross_entropy_loss_grad_weight_none.h:57-93``, ``..._weight_not_none.h:146-182``),
    else the composite ``fl(fl(e·(c + sm·Σw)) − sm·w_j) − c``."""
    n, c = log_prob.shape
    if n == 0 or c == 0:
        return out
    red = {"none": 0, "mean": 1, "sum": 2}[reduction]
    # O(N) / O(C) operands, made fp32 / int64 contiguous (tiny next to the N·C tensors)
    tgt = np.ascontiguousarray(target, dtype=np.int64)
    grad = _f32_vector(grad_loss, n)
    has_weight = weight is not None
    w = _f32_vector(weight, c) if has_weight else np.ones(c, np.float32)
    coef_p = np.empty(n, np.float32)
    coef_t = np.empty(n, np.float32)
    coef_s = np.empty(n, np.float32)
    coef_r = np.empty(n, np.float32)
    _row_coefficients(
        tgt,
        grad,
        w,
        has_weight,
        red,
        int(ignore_index),
        bool(ignore_any_sign),
        float(label_smoothing),
        coef_p,
        coef_t,
        coef_s,
        coef_r,
    )
    lp = storage_view(np.ascontiguousarray(log_prob))  # the device's Contiguous step
    _ce_grad_kernel(
        lp,
        code_of(log_prob.dtype),
        tgt,
        int(ignore_index),
        coef_p,
        coef_t,
        coef_s,
        coef_r,
        w,
        float(label_smoothing) != 0.0,
        bool(smooth_arch35),
        storage_view(out),
    )
    return out


def _f32_vector(a, n):
    """A 0-d or 1-d float array -> contiguous fp32 [n] (0-d repeated; exact widening)."""
    from ..dtypes import to_float32

    v = to_float32(np.asarray(a)).reshape(-1)
    if v.size == 1 and n != 1:
        return np.full(n, v[0], np.float32)
    return np.ascontiguousarray(v, dtype=np.float32)
