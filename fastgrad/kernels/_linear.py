"""Shared pieces of the fused linear cross-entropy kernels: fp32 operands for BLAS, mask bits.

The GEMMs run on NumPy's BLAS (sgemm) over fp32 operands holding the exact values of the
bf16/fp16 inputs; the element-wise epilogues run in parallel Numba kernels.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as D
from .._jit import tjit
from ..errors import InternalError
from ._gemm import matmul_nn, matmul_tn, row_tasks, run_rows, run_tasks


@tjit
def _widen_rows(lo, hi, src, code, dst):
    """dst[i, :] = fp32(src[i, :]) for rows lo:hi of a C-contiguous uint16 [n, H] block."""
    h = src.shape[1]
    for i in range(lo, hi):
        for j in range(h):
            dst[i, j] = D.to_f32(src[i, j], code)


def fp32_block_tasks(
    a: np.ndarray, r0: int, r1: int, buf: np.ndarray | None = None, width: int | None = None
) -> tuple[np.ndarray, list]:
    """Rows ``r0:r1`` of a 2-D bf16/fp16/fp32 array as a C-contiguous fp32 array (exact), and the
    tasks that fill it (none for fp32), to run beside other work (``_gemm.run_tasks``);
    :func:`fp32_block` runs them at once.

    fp32 inputs are returned as a view when already contiguous; 16-bit rows are widened into
    ``buf`` (a flat fp32 scratch of at least (r1-r0)*H elements) when given.  ``width`` (16-bit
    inputs, ≥ H): the rows ``[r1-r0, width]`` with the columns past H zero — the fp32 kernel's
    padded ``B`` (``_bf16dot``); the values are its ``[:, :H]``.
    """
    blk = a[r0:r1]
    n, h = blk.shape
    if a.dtype == D.FLOAT32:
        return np.ascontiguousarray(blk), []
    w = h if width is None else width
    out = buf[: n * w].reshape(n, w) if buf is not None else np.empty((n, w), np.float32)
    if w > h:
        out[:, h:] = 0
    if not (n and h):
        return out, []
    return out, row_tasks(_widen_rows, n, np.ascontiguousarray(blk).view(np.uint16), D.code_of(a.dtype), out)


def fp32_block(a: np.ndarray, r0: int, r1: int, buf: np.ndarray | None = None, width: int | None = None) -> np.ndarray:
    """:func:`fp32_block_tasks` with its tasks run on the GEMM pool: the fp32 rows."""
    out, tasks = fp32_block_tasks(a, r0, r1, buf, width)
    run_tasks(tasks)
    return out


@tjit
def _take_cols(lo, hi, src, cols, dst):
    """dst[i, q] = src[i, cols[q]] for the rows ``lo:hi``."""
    n = cols.size
    for i in range(lo, hi):
        r = src[i]
        d = dst[i]
        for q in range(n):
            d[q] = r[cols[q]]


@tjit
def _take_rows(lo, hi, src, rows, dst):
    """dst[q, :] = src[rows[q], :] for ``q`` in ``lo:hi``."""
    for q in range(lo, hi):
        dst[q, :] = src[rows[q], :]


@tjit
def _add_rows_at(lo, hi, dst, rows, src):
    """dst[rows[q], :] += src[q, :] for ``q`` in ``lo:hi`` (``rows`` distinct: no two tasks add
    to one row)."""
    for q in range(lo, hi):
        d = dst[rows[q]]
        s = src[q]
        for j in range(d.size):
            d[j] += s[j]


def take_cols(src: np.ndarray, cols: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = src[:, cols]`` (gradient filtering's kept columns) on the GEMM pool; returns ``out``."""
    run_rows(_take_cols, src.shape[0], src, cols, out)
    return out


def take_rows(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = src[rows]`` (the kept weight rows) on the GEMM pool; returns ``out``."""
    run_rows(_take_rows, rows.size, src, rows, out)
    return out


def add_rows_at(dst: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
    """``dst[rows] += src`` (distinct ``rows``: one addition per element, as NumPy's) on the GEMM pool."""
    run_rows(_add_rows_at, rows.size, dst, rows, src)


def kept_blocks(keep: np.ndarray, fb: int, rb: int, nrows: int, ncols: int):
    """Gradient filtering: for each row block ``k`` of ``keep`` [row blocks, column blocks] with
    a kept column block, yield ``(r0, r1, cols)``: its rows and the kept columns (below ``ncols``)."""
    for k in range(keep.shape[0]):
        kb = np.flatnonzero(keep[k])
        if kb.size == 0:
            continue
        cols = (kb[:, None] * fb + np.arange(fb)[None, :]).reshape(-1)
        yield k * rb, min((k + 1) * rb, nrows), cols[cols < ncols]


def kept_products(
    keep: np.ndarray,
    fb: int,
    rb: int,
    nrows: int,
    ncols: int,
    *,
    group: int,
    gather_g,
    gather_w,
    X: np.ndarray,
    gi_rows: np.ndarray | None,
    add_gw,
    bufs: tuple,
    engine: str = "blas",
) -> None:
    """Gradient filtering's two GEMMs over the kept blocks only — the one rule of both LM-head
    kernels on the fp32 engines (the FLCE grad's tile, the training loss's row block).

    For each row block of ``keep`` with a kept column block (:func:`kept_blocks`; rows
    ``r0:r1``, kept columns ``cols``), ``group`` columns at a time (``cq``):
    ``Gc = gather_g(r0, r1, cq, out)`` — the gradient's kept columns, fp32 ``[r1 - r0, len(cq)]``
    written into ``out`` and returned —, then ``gi_rows[r0:r1] += Gc · gather_w(cq, out)``
    (the kept weight rows, fp32 ``[len(cq), H]``) and ``add_gw(cq, Gcᵀ · X[r0:r1])``.  The products
    on ``_gemm.matmul_nn`` / ``matmul_tn`` (fixed tiles: bitwise at any thread count).
    ``gi_rows`` / ``add_gw`` None: that gradient is not computed.  ``bufs``: fp32 scratch
    ``(g [rb·group], w [group·H], product [rb·H], grad_weight rows [group·H])`` (the plans'
    ``kept_g``, ``kept_w``, ``kept_product``, ``kept_grad_weight``)."""
    g_buf, w_buf, p_buf, q_buf = bufs
    H = X.shape[1]
    for r0, r1, cols in kept_blocks(keep, fb, rb, nrows, ncols):
        nr = r1 - r0
        for q0 in range(0, cols.size, group):
            cq = cols[q0 : q0 + group]
            nq = cq.size
            Gc = gather_g(r0, r1, cq, g_buf[: nr * nq].reshape(nr, nq))
            if gi_rows is not None:
                Wc = gather_w(cq, w_buf[: nq * H].reshape(nq, H))
                matmul_nn(Gc, Wc, gi_rows[r0:r1], tmp=p_buf[: nr * H].reshape(nr, H), engine=engine)
            if add_gw is not None:
                Q = q_buf[: nq * H].reshape(nq, H)
                matmul_tn(Gc, X[r0:r1], Q, engine=engine)
                add_gw(cq, Q)


@tjit
def _narrow_rows(lo, hi, src, scale, code, dst):
    """dst[i, :] = round(fp32(src[i, :] · scale)) to the 16-bit dtype ``code`` for rows lo:hi."""
    n = src.shape[1]
    for i in range(lo, hi):
        for j in range(n):
            dst[i, j] = D.from_f32(np.float32(src[i, j] * scale), code)


def narrow(src: np.ndarray, out: np.ndarray, scale: float | None = None) -> np.ndarray:
    """``out[...] = src`` rounded to ``out``'s dtype (fp32, bf16 or fp16; RNE, bitwise
    :func:`fastgrad.dtypes.from_float32`) for 2-D fp32 ``src`` and ``out`` of its shape (any
    strides: every layout the op layer accepts for ``out=``), on the GEMM pool: no OpenMP region, so a
    process that forks afterwards (a DataLoader worker) can run the op again in the child
    (GNU OpenMP terminates a child of a process that used it).  ``scale`` (16-bit ``out``): each
    value multiplied by ``np.float32(scale)`` in fp32 first (two roundings, as PyTorch's
    ``(g * s).to(dtype)``).  Returns ``out``."""
    if src.shape != out.shape or src.ndim != 2 or src.dtype != np.float32:
        raise InternalError(f"narrow: src must be 2-D float32 of out's shape {out.shape}, got {src.dtype} {src.shape}")
    if out.dtype == np.float32 and scale is None:
        out[...] = src
        return out
    if out.dtype not in (D.BFLOAT16, D.FLOAT16):
        raise InternalError(f"narrow: out must be bfloat16 or float16 (float32 without scale), got {out.dtype}")
    if out.size:  # without a scale, times 1: exact, the same bits (a 16-bit view: any strides)
        s = np.float32(1.0 if scale is None else scale)
        run_rows(_narrow_rows, out.shape[0], src, s, D.code_of(out.dtype), out.view(np.uint16))
    return out
