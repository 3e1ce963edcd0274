"""op_kernel layer of ``scaled_masked_softmax_backward`` (aclnnScaledMaskedSoftmaxBackward).

The input is seen as rows of the last dimension: ``[R, S2]`` with ``R = B·N·S1``.  One
parallel pass over the rows; per row, the ``grad_output`` and ``y`` rows are read (the
second read hits L1), ``acc = Σ_j go_j·y_j`` is accumulated in fp32 in a fixed order, and
``out_j = (go_j·y_j - acc·y_j)·scale`` is written, or an explicit 0 where the mask is set.

The mask is never broadcast in memory: it stays a flat ``uint8`` array in its own
(unbroadcast) shape; ``mask_row[r]`` gives the offset of row r's mask row and ``mask_step``
is 1 (a mask row) or 0 (one flag broadcast over the row).  ``triu`` adds the causal mask
``j > i`` with ``i = r mod S1``.
"""

from __future__ import annotations

import numpy as np

from .._jit import FASTMATH_SAFE, njit, pjit, prange
from ..dtypes import code_of, storage_view
from ..dtypes import load_f32_arith as load_f32
from ..dtypes import store_arith as store_as

OP = "scaled_masked_softmax_backward"


@njit(inline="always")
def _smb_row(g, yr, o, mr, use_mr, jend, sc, code):
    """One row for one format ``code`` (a literal at each call site, so that each inlined
    copy of the loops converts with one format only)."""
    acc = np.float32(0.0)
    for j in range(g.shape[0]):
        acc += load_f32(g[j], code) * load_f32(yr[j], code)
    zero = store_as(np.float32(0.0), code, o)
    if use_mr:
        for j in range(jend):
            yv = load_f32(yr[j], code)
            v = (load_f32(g[j], code) * yv - acc * yv) * sc
            o[j] = zero if mr[j] != 0 else store_as(v, code, o)
    else:
        for j in range(jend):
            yv = load_f32(yr[j], code)
            v = (load_f32(g[j], code) * yv - acc * yv) * sc
            o[j] = store_as(v, code, o)
    tail = o[jend:]
    for j in range(tail.shape[0]):
        tail[j] = zero


@pjit(fastmath=set(FASTMATH_SAFE))
def _smb_kernel(go, y, code, mask, mask_row, mask_step, has_mask, triu, s1, scale, out):
    rows, s = go.shape
    sc = np.float32(scale)
    use_mr = has_mask and mask_step != 0
    for r in prange(rows):
        # columns [0, jend) follow the mask; [jend, s) are causally masked (triu)
        jend = s
        if triu:
            jend = min(s, r % s1 + 1)
        if has_mask and mask_step == 0 and mask[mask_row[r]] != 0:
            jend = 0
        base = mask_row[r] if use_mr else 0
        mr = mask[base : base + s]
        # 1-D row views indexed from 0: LLVM sees unit-stride, non-negative indices
        if code == 1:
            _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 1)
        elif code == 2:
            _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 2)
        else:
            _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 0)


def mask_plan(mask_shape, shape):
    """The mask's row offsets for each of the ``prod(shape[:-1])`` rows, and its column step.

    ``mask_shape`` (already left-padded to ``len(shape)``) broadcasts to ``shape``.  Row r of
    the output (C order over ``shape[:-1]``) uses the mask elements
    ``mask_flat[mask_row[r] + j·step]``.  O(rows) int64 — the device's broadcast tiling.
    """
    lead_m = tuple(mask_shape[:-1])
    s2m = int(mask_shape[-1]) if mask_shape else 1
    nrows_m = int(np.prod(lead_m, dtype=np.int64)) if lead_m else 1
    ids = np.arange(nrows_m, dtype=np.int64).reshape(lead_m) * s2m
    mask_row = np.ascontiguousarray(np.broadcast_to(ids, tuple(shape[:-1]))).reshape(-1)
    step = 1 if (s2m == shape[-1] and s2m != 1) else 0
    return mask_row, step


def scaled_masked_softmax_backward_cpu(*, grad_output, y, mask, scale, fix_triu_mask, out):
    """Numba implementation (the op module has validated every argument).

    ``mask``: None or a bool/integer array broadcastable to ``grad_output`` (nonzero = masked).
    """
    shape = grad_output.shape
    if out.size == 0:
        return out
    s2 = shape[-1]
    s1 = shape[-2] if len(shape) >= 2 else 1
    go = storage_view(np.ascontiguousarray(grad_output)).reshape(-1, s2)  # the device's Contiguous
    yy = storage_view(np.ascontiguousarray(y)).reshape(-1, s2)
    if mask is not None:
        m = mask.reshape((1,) * (len(shape) - mask.ndim) + mask.shape)
        flat = np.ascontiguousarray(m)
        flat = flat.view(np.uint8) if flat.dtype.itemsize == 1 else (flat != 0).view(np.uint8)
        mask_row, step = mask_plan(m.shape, shape)
        flat = flat.reshape(-1)
    else:
        flat = np.zeros(1, np.uint8)
        mask_row, step = np.zeros(1, np.int64), 0
    _smb_kernel(
        go,
        yy,
        code_of(grad_output.dtype),
        flat,
        mask_row,
        step,
        mask is not None,
        bool(fix_triu_mask),
        s1,
        float(scale),
        storage_view(out).reshape(-1, s2),
    )
    return out
