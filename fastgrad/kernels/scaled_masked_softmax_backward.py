"""op_kernel layer of ``scaled_masked_softmax_backward`` (aclnnScaledMaskedSoftmaxBackward).

The input is seen as rows of the last dimension: ``[R, S2]`` with ``R = B·N·S1``.  One
parallel pass over the rows, each row computed as the device's kernel computes it (ops-nn
``vfusion/scaled_masked_softmax_grad_v2`` at e5c3fa9; the tiling picks the kernel from the
row length padded to 64, ``scaled_masked_softmax_grad_v2_tiling.cpp:267-272,314``), in fp32
(16-bit inputs widened exactly, the output rounded once, RINT), **without** fastmath:

* padded S2 <= 1024 — AscendC ``SoftmaxGrad`` (``..._norm_headdim.h:152``):
  ``out = ((dy - Σ dy·y)·y)·scale``;
* padded S2 > 1024 — ``..._large_headdim.h:169-184``: ``out = (dy·y - y·Σ dy·y)·scale``;

then 0 where the mask is set.  ``Σ dy·y`` (each product rounded to fp32) is summed in the
order of CANN's own golden (``executor_aclnnScaledMaskedSoftmaxBackward.py`` ``reduce_sum``,
the vector unit's reduce over its blocks): see :func:`_sum_norm` and :func:`_sum_large`.
The order is fixed, so results do not depend on the thread count.

The mask is never broadcast in memory: it stays a flat ``uint8`` array in its own
(unbroadcast) shape; ``mask_row[r]`` gives the offset of row r's mask row and ``mask_step``
is 1 (a mask row) or 0 (one flag broadcast over the row).  ``triu`` adds the causal mask
``j > i`` with ``i = r mod S1``.
"""

from __future__ import annotations

import numpy as np

from .._jit import njit, pjit, prange
from ..dtypes import code_of, storage_view
from ..dtypes import load_f32_arith as load_f32
from ..dtypes import store_arith as store_as

OP = "scaled_masked_softmax_backward"


#: the kernel's switch (tiling :267-272, :314): rows whose length padded to 64 is at most 1024
#: run AscendC ``SoftmaxGrad`` (norm_headdim.h:152), longer rows the explicit form (large_headdim.h)
MAX_NORM_HEAD_DIM = 1024


@njit
def _p(g, yr, j, s, code):
    """fp32 ``dy_j·y_j`` (rounded), 0 in the padding past the row (``j >= s``)."""
    if j < s:
        return load_f32(g[j], code) * load_f32(yr[j], code)
    return np.float32(0.0)


@njit
def _block8(g, yr, b, s, code):
    """The vector unit's pairwise sum of one 32-byte block (8 fp32 products)."""
    p0 = _p(g, yr, b, s, code)
    p1 = _p(g, yr, b + 1, s, code)
    p2 = _p(g, yr, b + 2, s, code)
    p3 = _p(g, yr, b + 3, s, code)
    p4 = _p(g, yr, b + 4, s, code)
    p5 = _p(g, yr, b + 5, s, code)
    p6 = _p(g, yr, b + 6, s, code)
    p7 = _p(g, yr, b + 7, s, code)
    return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))


@njit
def _sum_norm(g, yr, s, code):
    """Σ dy·y in the order of CANN's golden for padded rows <= 1024 (``reduce_sum`` of
    ``executor_aclnnScaledMaskedSoftmaxBackward.py``, the SoftmaxGrad API's reduce): the row
    zero-padded to a multiple of 64; 8-element blocks summed pairwise; the blocks of each
    64-element repeat added lane by lane into 8 accumulators, repeat after repeat; the 8 lanes
    summed pairwise."""
    l0 = _block8(g, yr, 0, s, code)
    l1 = _block8(g, yr, 8, s, code)
    l2 = _block8(g, yr, 16, s, code)
    l3 = _block8(g, yr, 24, s, code)
    l4 = _block8(g, yr, 32, s, code)
    l5 = _block8(g, yr, 40, s, code)
    l6 = _block8(g, yr, 48, s, code)
    l7 = _block8(g, yr, 56, s, code)
    for r in range(1, (s + 63) // 64):
        b = r * 64
        l0 += _block8(g, yr, b, s, code)
        l1 += _block8(g, yr, b + 8, s, code)
        l2 += _block8(g, yr, b + 16, s, code)
        l3 += _block8(g, yr, b + 24, s, code)
        l4 += _block8(g, yr, b + 32, s, code)
        l5 += _block8(g, yr, b + 40, s, code)
        l6 += _block8(g, yr, b + 48, s, code)
        l7 += _block8(g, yr, b + 56, s, code)
    return ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))


@njit
def _sum_large(g, yr, s, code, buf, part):
    """Σ dy·y as large_headdim.h:195-205 reduces (``WholeReduceSum`` per 64-element repeat,
    then over the repeats), in the order of CANN's golden: each 64-block summed pairwise
    (zero padding), then the block sums pairwise, a zero appended at each odd level."""
    nb = (s + 63) // 64
    for k in range(nb):
        for i in range(64):
            buf[i] = _p(g, yr, k * 64 + i, s, code)
        w = 32
        while w >= 1:
            for i in range(w):
                buf[i] = buf[2 * i] + buf[2 * i + 1]
            w //= 2
        part[k] = buf[0]
    n = nb
    while n > 1:
        if n % 2:
            part[n] = np.float32(0.0)
            n += 1
        for i in range(n // 2):
            part[i] = part[2 * i] + part[2 * i + 1]
        n //= 2
    return part[0]


@njit(inline="always")
def _smb_row(g, yr, o, mr, use_mr, jend, sc, code, buf, part):
    """One row for one format ``code`` (a literal at each call site, so that each inlined
    copy of the loops converts with one format only).  No fastmath: the rounding order is
    the kernel's."""
    s = g.shape[0]
    zero = store_as(np.float32(0.0), code, o)
    norm = (s + 63) // 64 * 64 <= MAX_NORM_HEAD_DIM
    if norm:  # SoftmaxGrad: (dy - Σ)·y, then ·scale
        acc = _sum_norm(g, yr, s, code)
        for j in range(jend):
            yv = load_f32(yr[j], code)
            v = ((load_f32(g[j], code) - acc) * yv) * sc
            o[j] = zero if (use_mr and mr[j] != 0) else store_as(v, code, o)
    else:  # dy·y - y·Σ, then ·scale
        acc = _sum_large(g, yr, s, code, buf, part)
        for j in range(jend):
            yv = load_f32(yr[j], code)
            v = (load_f32(g[j], code) * yv - yv * acc) * sc
            o[j] = zero if (use_mr and mr[j] != 0) else store_as(v, code, o)
    tail = o[jend:]
    for j in range(tail.shape[0]):
        tail[j] = zero


@pjit
def _smb_kernel(go, y, code, mask, mask_row, mask_step, has_mask, triu, s1, scale, out):
    rows, s = go.shape
    sc = np.float32(scale)
    use_mr = has_mask and mask_step != 0
    nb = (s + 63) // 64
    for r in prange(rows):
        # columns [0, jend) follow the mask; [jend, s) are causally masked (triu)
        jend = s
        if triu:
            jend = min(s, r % s1 + 1)
        if has_mask and mask_step == 0 and mask[mask_row[r]] != 0:
            jend = 0
        base = mask_row[r] if use_mr else 0
        mr = mask[base : base + s]
        buf = np.empty(64, np.float32)
        part = np.empty(nb + 1, np.float32)
        # 1-D row views indexed from 0: LLVM sees unit-stride, non-negative indices
        if code == 1:
            _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 1, buf, part)
        elif code == 2:
            _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 2, buf, part)
        else:
            _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 0, buf, part)


def mask_plan(mask_shape: tuple[int, ...], shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
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


def scaled_masked_softmax_backward_cpu(
    *,
    grad_output: np.ndarray,
    y: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
    fix_triu_mask: bool,
    out: np.ndarray,
) -> np.ndarray:
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
