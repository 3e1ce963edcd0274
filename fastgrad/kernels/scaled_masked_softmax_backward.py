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


#: rows per task of the parallel loop (each task allocates its scratch once): from the shape only,
#: and each row is computed alone, so the bits do not depend on it or on the thread count
ROWS_PER_TASK = 16


@njit
def _products(g, yr, s, code, A, pad):
    """``A[:pad]``: the fp32 products ``dy_j·y_j`` (each rounded), zero past the row (``j >= s``)."""
    for j in range(s):
        A[j] = load_f32(g[j], code) * load_f32(yr[j], code)
    for j in range(s, pad):
        A[j] = np.float32(0.0)


@njit
def _pairs(src, dst, n):
    """``dst[i] = src[2i] + src[2i+1]`` for ``i < n``: one level of the vector unit's pairwise
    sums (a contiguous loop: it vectorizes)."""
    for i in range(n):
        dst[i] = src[2 * i] + src[2 * i + 1]


@njit
def _sum_norm(g, yr, s, code, A, B):
    """Σ dy·y in the order of CANN's golden for padded rows <= 1024 (``reduce_sum`` of
    ``executor_aclnnScaledMaskedSoftmaxBackward.py``, the SoftmaxGrad API's reduce): the row
    zero-padded to a multiple of 64; 8-element blocks summed pairwise; the blocks of each
    64-element repeat added lane by lane into 8 accumulators, repeat after repeat; the 8 lanes
    summed pairwise.  The blocks' pairwise sums are three levels of adjacent pairs over the whole
    padded row (``A``, ``B``: scratch of its length and half); the same additions in the same
    order as block by block."""
    pad = (s + 63) // 64 * 64
    _products(g, yr, s, code, A, pad)
    _pairs(A, B, pad // 2)
    _pairs(B, A, pad // 4)
    _pairs(A, B, pad // 8)  # B[k]: block k's pairwise sum, 8 blocks per 64-element repeat
    l0, l1, l2, l3 = B[0], B[1], B[2], B[3]
    l4, l5, l6, l7 = B[4], B[5], B[6], B[7]
    for r in range(1, pad // 64):
        b = 8 * r
        l0 += B[b]
        l1 += B[b + 1]
        l2 += B[b + 2]
        l3 += B[b + 3]
        l4 += B[b + 4]
        l5 += B[b + 5]
        l6 += B[b + 6]
        l7 += B[b + 7]
    return ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))


@njit
def _sum_large(g, yr, s, code, A, B):
    """Σ dy·y as large_headdim.h:195-205 reduces (``WholeReduceSum`` per 64-element repeat,
    then over the repeats), in the order of CANN's golden: each 64-block summed pairwise
    (zero padding: six levels of adjacent pairs over the whole padded row, which never cross a
    block), then the block sums pairwise, a zero appended at each odd level."""
    pad = (s + 63) // 64 * 64
    _products(g, yr, s, code, A, pad)
    src, dst, n = A, B, pad
    for _ in range(6):
        n //= 2
        _pairs(src, dst, n)
        src, dst = dst, src
    part = src  # the nb = pad // 64 block sums (room for one appended zero: pad >= 2·nb)
    n = pad // 64
    while n > 1:
        if n % 2:
            part[n] = np.float32(0.0)
            n += 1
        for i in range(n // 2):
            part[i] = part[2 * i] + part[2 * i + 1]
        n //= 2
    return part[0]


@njit(inline="always")
def _smb_row(g, yr, o, mr, use_mr, jend, sc, code, A, B):
    """One row for one format ``code`` (a literal at each call site, so that each inlined
    copy of the loops converts with one format only).  No fastmath: the rounding order is
    the kernel's."""
    s = g.shape[0]
    zero = store_as(np.float32(0.0), code, o)
    norm = (s + 63) // 64 * 64 <= MAX_NORM_HEAD_DIM
    if norm:  # SoftmaxGrad: (dy - Σ)·y, then ·scale
        acc = _sum_norm(g, yr, s, code, A, B)
        for j in range(jend):
            yv = load_f32(yr[j], code)
            v = store_as(((load_f32(g[j], code) - acc) * yv) * sc, code, o)
            o[j] = zero if (use_mr and mr[j] != 0) else v
    else:  # dy·y - y·Σ, then ·scale
        acc = _sum_large(g, yr, s, code, A, B)
        for j in range(jend):
            yv = load_f32(yr[j], code)
            v = store_as((load_f32(g[j], code) * yv - yv * acc) * sc, code, o)
            o[j] = zero if (use_mr and mr[j] != 0) else v
    tail = o[jend:]
    for j in range(tail.shape[0]):
        tail[j] = zero


@pjit
def _smb_kernel(go, y, code, mask, mask_row, mask_step, has_mask, triu, s1, scale, out):
    rows, s = go.shape
    sc = np.float32(scale)
    use_mr = has_mask and mask_step != 0
    pad = (s + 63) // 64 * 64
    ntasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for t in prange(ntasks):
        A = np.empty(pad, np.float32)  # the sums' scratch, once per task
        B = np.empty(pad // 2 + 1, np.float32)
        for r in range(t * ROWS_PER_TASK, min(rows, (t + 1) * ROWS_PER_TASK)):
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
                _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 1, A, B)
            elif code == 2:
                _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 2, A, B)
            else:
                _smb_row(go[r], y[r], out[r], mr, use_mr, jend, sc, 0, A, B)


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
    # a copy (writeable): a read-only view would be a second Numba signature of the kernel
    mask_row = np.broadcast_to(ids, tuple(shape[:-1])).copy().reshape(-1)
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
