"""Kernel: the training linear cross-entropy, forward and backward fused by row blocks.

Not a device op (docs/spec.md, "Training loss").  For each block of ``nb`` rows (``nb`` from the
memory budget, never from BT or the thread count):

1. ``L = X[b] · Wᵀ`` in the compute dtype (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64) by
   BLAS, vocabulary chunk by vocabulary chunk (16-bit weights widened exactly per chunk);
2. a parallel Numba pass turns the logits into ``z = softcap(L + bias) / temperature`` in place
   and computes this shard's row statistics: max (and its first index), ``Σ exp(z - max)``, the
   target's ``z``, ``Σ_v w_v z_v`` (label smoothing);
3. ``combine`` (optional, the caller's all-reduce for vocabulary parallelism) makes them global;
4. when gradients are wanted, a second pass overwrites ``z`` with ``dloss/dL``
   (``G = (a·p - b·onehot - e·w)·dz/dL``, ``p = exp(z - lse)`` from the *same* logits as the
   statistics, not rounded) and two GEMMs accumulate ``grad_input[b] = G·W`` and
   ``grad_weight += Gᵀ·X[b]`` in the compute dtype.

Three GEMMs per row block.  With ``lse`` given (the backward of a forward that did not compute
the gradient) step 2-3 are skipped: the gradient is recomputed from the saved ``lse``.

Gradient filtering (``params["filter_eps"]``, CCE's ``filter_eps``): after step 4's pass a
read-only pass flags, per row and per block of ``filter_cols`` vocabulary columns, whether some
``|G[r, v]|`` is not below ``filter_eps·|coef_ce[r]|`` (the row's scale: the upstream gradient
and the mean's ``1/Σw``; a row whose gradient is identically 0 — ignored — has nothing to keep),
or the block holds the row's target column.  A block of ``filter_rows`` rows × ``filter_cols``
columns without a flag is skipped in both GEMMs: the kept blocks' columns of ``G`` and rows of
``W`` are gathered (at most ``v_chunk`` columns at a time) and the products accumulated.  A row
block with every block kept takes the dense path unchanged (bitwise).  ``grad_bias`` is the
column sum of the whole ``G``, never filtered.

Pure: imports only dtypes helpers, the JIT helpers, the vector math and the GEMM helpers.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import types
from numba.extending import overload

from .. import dtypes as D
from .._jit import pjit, prange
from ._gemm import _run as _run_tasks
from ._gemm import matmul_nn, matmul_nt, matmul_tn, single_threaded_blas
from ._linear import fp32_block, kept_blocks
from ._vmath import exp_f32

__all__ = ["linear_cross_entropy_cpu"]


# ----------------------------------------------------------------------------------------------
# dtype-generic scalar helpers (fp32: the vectorizable exp; fp64: libm)
# ----------------------------------------------------------------------------------------------


def _exp(x):  # pragma: no cover - replaced by the overload inside jitted code
    return np.exp(x)


@overload(_exp, jit_options={"fastmath": {"contract"}})
def _exp_ol(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        return lambda x: exp_f32(x)
    return lambda x: np.exp(x)


# par (compute dtype): 0 softcap, 1 1/softcap, 2 1/temperature, 3 temperature,
#                      4 eps, 5 eps/V, 6 eps*Wsum/V, 7 2*lse_square_scale, 8 -inf, 9 one, 10 zero
# flags (int64):       0 has_softcap, 1 has_bias, 2 has_class_weight, 3 need_zsum


@pjit
def _stats_pass(L, offs, widths, nb, bias, cw, tcol, par, flags, m_out, s_out, zt_out, zs_out, am_out, col0):
    """z = softcap(L + bias)/T in place, then row max/argmax, Σexp(z-m), z[t], Σ w z."""
    nchunk = offs.shape[0]
    cap = par[0]
    icap = par[1]
    it = par[2]
    zero = par[10]
    ninf = par[8]
    for i in prange(nb):
        m = ninf
        am = -1
        for c in range(nchunk):
            base = offs[c] + i * widths[c]
            v0 = offs[c] // nb
            for j in range(widths[c]):
                x = L[base + j]
                if flags[1]:
                    x = x + bias[v0 + j]
                if flags[0]:
                    x = cap * np.tanh(x * icap)
                x = x * it
                L[base + j] = x
                if x > m:
                    m = x
                    am = v0 + j
        s = zero
        zs = zero
        for c in range(nchunk):
            base = offs[c] + i * widths[c]
            v0 = offs[c] // nb
            if m == ninf:
                break
            for j in range(widths[c]):
                x = L[base + j]
                s += _exp(x - m)
            if flags[3]:
                if flags[2]:
                    for j in range(widths[c]):
                        zs += cw[v0 + j] * L[base + j]
                else:
                    for j in range(widths[c]):
                        zs += L[base + j]
        m_out[i] = m
        s_out[i] = s
        zs_out[i] = zs
        am_out[i] = am + col0 if am >= 0 else -1
        t = tcol[i]
        zt_out[i] = zero
        if t >= 0:
            for c in range(nchunk):
                v0 = offs[c] // nb
                if t >= v0 and t < v0 + widths[c]:
                    zt_out[i] = L[offs[c] + i * widths[c] + (t - v0)]


@pjit
def _grad_pass(L, offs, widths, nb, cw, tcol, wt, lse, coef_ce, coef_z, par, flags, recompute, bias):
    """Overwrite z (or, with ``recompute``, the raw logits) by dloss/dL."""
    nchunk = offs.shape[0]
    cap = par[0]
    icap = par[1]
    it = par[2]
    T = par[3]
    one = par[9]
    one_m_eps = one - par[4]
    for i in prange(nb):
        cc = coef_ce[i]
        cz = coef_z[i]
        lz = lse[i]
        a = cc * (one_m_eps * wt[i] + par[6]) + cz * par[7] * lz
        b = cc * one_m_eps * wt[i]
        e = cc * par[5]
        t = tcol[i]
        for c in range(nchunk):
            base = offs[c] + i * widths[c]
            v0 = offs[c] // nb
            if a == 0 and b == 0 and e == 0:
                for j in range(widths[c]):
                    L[base + j] = par[10]
                continue
            for j in range(widths[c]):
                x = L[base + j]
                if recompute:
                    if flags[1]:
                        x = x + bias[v0 + j]
                    if flags[0]:
                        x = cap * np.tanh(x * icap)
                    x = x * it
                g = a * _exp(x - lz)
                if flags[2]:
                    g -= e * cw[v0 + j]
                else:
                    g -= e
                if v0 + j == t:
                    g -= b
                if flags[0]:
                    y = x * T * icap
                    g = g * (one - y * y)
                L[base + j] = g * it


@pjit
def _add_into(dst, src):
    n, h = dst.shape
    for i in prange(n):
        for j in range(h):
            dst[i, j] += src[i, j]


@pjit
def _colsum_into(L, off, width, nb, out, v0):
    for j in prange(width):
        acc = out[v0 + j]
        for i in range(nb):
            acc += L[off + i * width + j]
        out[v0 + j] = acc


@pjit
def _filter_flags(L, offs, widths, nb, tcol, thr, fb, flags):
    """``flags[i, jb]`` = 1 when some ``|G[i, v]|`` of column block ``jb`` (``fb`` columns) is
    not below ``thr[i]`` (NaN included) or the block holds row i's target column.  Read-only."""
    nchunk = offs.shape[0]
    nblk = flags.shape[1]
    for i in prange(nb):
        th = thr[i]
        for jb in range(nblk):
            flags[i, jb] = False
        for c in range(nchunk):
            base = offs[c] + i * widths[c]
            v0 = offs[c] // nb
            w = widths[c]
            j = 0
            while j < w:
                jb = (v0 + j) // fb
                j1 = min(w, (jb + 1) * fb - v0)
                hits = 0
                for jj in range(j, j1):
                    hits += not (abs(L[base + jj]) < th)
                if hits > 0:
                    flags[i, jb] = True
                j = j1
        t = tcol[i]
        if t >= 0:
            flags[i, t // fb] = True  # the target column is never filtered


@pjit
def _gather_cols(L, coff, cw, r0, r1, out):
    """out[i, q] = G[r0 + i, col q] from the chunked block layout (``coff``/``cw``: each gathered
    column's offset in its chunk's flat storage and the chunk's width)."""
    nq = coff.shape[0]
    for i in prange(r1 - r0):
        r = r0 + i
        for q in range(nq):
            out[i, q] = L[coff[q] + r * cw[q]]


@pjit
def _gather_rows(src, rows, dst):
    """dst[q, :] = src[rows[q], :] (same dtype)."""
    h = src.shape[1]
    for q in prange(rows.shape[0]):
        r = rows[q]
        for j in range(h):
            dst[q, j] = src[r, j]


@pjit
def _gather_rows_widen(src, rows, code, dst):
    """dst[q, :] = fp32(src[rows[q], :]) for a uint16 (bf16/fp16 bits) source, exactly."""
    h = src.shape[1]
    for q in prange(rows.shape[0]):
        r = rows[q]
        for j in range(h):
            dst[q, j] = D.to_f32(src[r, j], code)


@pjit
def _scatter_add_rows(dst, rows, src):
    """dst[rows[q], :] += src[q, :] (rows distinct)."""
    h = dst.shape[1]
    for q in prange(rows.shape[0]):
        r = rows[q]
        for j in range(h):
            dst[r, j] += src[q, j]


#: output columns of grad_input (resp. rows of grad_weight) per BLAS call of the filtered
#: products: fixed, never from the thread count (bitwise reproducible, as ``_gemm``)
_FILTER_H_BLOCK = 128
_FILTER_Q_BLOCK = 512


def _filtered_products(Lbuf, offs, widths, nb, keep, fb, rb, K, vc, wsrc, wcode, X, gi_rows, gw, bufs) -> None:
    """``gi_rows += G·W`` and ``gw += Gᵀ·X`` over the kept blocks only (module docstring)."""
    g_buf, w_buf, p_buf, q_buf = bufs
    H = X.shape[1]
    # per vocabulary column: its offset in the block's flat storage at row 0, its chunk's width
    chunk_w = np.repeat(widths, widths)
    coff = np.repeat(offs, widths) + np.arange(K) - np.repeat(offs // nb, widths)
    for r0, r1, cols in kept_blocks(keep, fb, rb, nb, K):
        nr = r1 - r0
        for q0 in range(0, cols.size, vc):
            cq = cols[q0 : q0 + vc]
            nq = cq.size
            Gc = g_buf[: nr * nq].reshape(nr, nq)
            _gather_cols(Lbuf, coff[cq], chunk_w[cq], r0, r1, Gc)
            tasks: list = []
            if gi_rows is not None:
                Wc = w_buf[: nq * H].reshape(nq, H)
                if wcode is None:
                    _gather_rows(wsrc, cq, Wc)
                else:
                    _gather_rows_widen(wsrc, cq, wcode, Wc)
                # rows r0:r1 of grad_input are zero until this row block's first chunk: write it
                P = gi_rows[r0:r1] if q0 == 0 else p_buf[: nr * H].reshape(nr, H)
                for a in range(0, H, _FILTER_H_BLOCK):
                    b = min(a + _FILTER_H_BLOCK, H)
                    tasks.append(functools.partial(np.matmul, Gc, Wc[:, a:b], out=P[:, a:b]))
            if gw is not None:
                Q = q_buf[: nq * H].reshape(nq, H)
                for a in range(0, nq, _FILTER_Q_BLOCK):
                    b = min(a + _FILTER_Q_BLOCK, nq)
                    tasks.append(functools.partial(np.matmul, Gc[:, a:b].T, X[r0:r1], out=Q[a:b]))
            _run_tasks(tasks)
            if gi_rows is not None and q0 > 0:
                _add_into(gi_rows[r0:r1], P)
            if gw is not None:
                _scatter_add_rows(gw, cq, Q)


def _block(a: np.ndarray, r0: int, r1: int, cdt, buf):
    """Rows r0:r1 as a C-contiguous array of the compute dtype (exact widening)."""
    if cdt == np.float64:
        return np.ascontiguousarray(a[r0:r1], dtype=np.float64)
    return fp32_block(a, r0, r1, buf)


@single_threaded_blas()
def linear_cross_entropy_cpu(
    *,
    input,
    weight,
    target_cols,
    bias,
    class_weight,
    target_weight,
    coef_ce,
    coef_z,
    params,
    block_rows,
    v_chunk,
    lse,
    combine,
    out,
    workspace=256 * 2**20,
):
    """The ``cpu`` backend's implementation of ``fastgrad.linear_cross_entropy``: the block loop
    (module docstring), BLAS single-threaded.  Arrays are validated by the op.

    ``params``: dict with softcap, temperature, eps, eps_over_V, eps_wsum_over_V, z_scale2,
    need_zsum, vocab_start_index (and optionally filter_eps, filter_rows, filter_cols).
    ``out``: dict of preallocated outputs (``lse``, ``max``, ``sum_exp``, ``z_target``,
    ``z_sum``, ``argmax``, ``grad_input``, ``grad_weight``, ``grad_bias``; absent or None: not
    computed) and ``filter_stats``, a dict receiving ``blocks_total`` / ``blocks_skipped``.
    """
    BT, H = input.shape
    K = weight.shape[0]
    cdt = np.float64 if input.dtype == np.float64 else np.float32
    gi, gw, gb = out.get("grad_input"), out.get("grad_weight"), out.get("grad_bias")
    want_grad = gi is not None or gw is not None or gb is not None
    recompute = lse is not None
    softcap = params.get("softcap")
    par = np.array(
        [
            softcap or 0.0,
            (1.0 / softcap) if softcap else 0.0,
            1.0 / params["temperature"],
            params["temperature"],
            params["eps"],
            params["eps_over_V"],
            params["eps_wsum_over_V"],
            params["z_scale2"],
            -np.inf,
            1.0,
            0.0,
        ],
        cdt,
    )
    flags = np.array(
        [softcap is not None, bias is not None, class_weight is not None, bool(params["need_zsum"])], np.int64
    )
    bias_c = bias.astype(cdt) if bias is not None else np.zeros(1, cdt)
    cw_c = class_weight.astype(cdt) if class_weight is not None else np.zeros(1, cdt)
    wt_c = target_weight.astype(cdt)
    coef_ce = coef_ce.astype(cdt) if coef_ce is not None else np.zeros(BT, cdt)
    coef_z = coef_z.astype(cdt) if coef_z is not None else np.zeros(BT, cdt)
    col0 = int(params["vocab_start_index"])
    tcol = np.ascontiguousarray(target_cols, dtype=np.int64)
    if gi is not None:
        gi[...] = 0
    if gw is not None:
        gw[...] = 0
    if gb is not None:
        gb[...] = 0
    if not recompute:
        lse_all = out["lse"]
    else:
        lse_all = np.ascontiguousarray(lse, dtype=cdt)
    if BT == 0:
        return
    nb_max = max(1, min(int(block_rows), BT))
    vc = max(1, min(int(v_chunk), max(K, 1)))
    chunks = [(v0, min(K, v0 + vc)) for v0 in range(0, K, vc)]
    W = weight if weight.flags.c_contiguous else np.ascontiguousarray(weight)
    widen = W.dtype != cdt
    # keep the whole weight in the compute dtype when it is small, else widen per chunk
    wfull = _block(W, 0, K, cdt, None) if (widen and K * H * 4 <= workspace // 4) else None
    wbuf = np.empty(vc * H, cdt) if (widen and wfull is None) else None
    xbuf = np.empty(nb_max * H, cdt) if input.dtype != cdt else None
    Lbuf = np.empty(nb_max * max(K, 1), cdt)
    tmp_h = np.empty(nb_max * H, cdt) if gi is not None else None
    tmp_w = np.empty(vc * H, cdt) if gw is not None else None

    def wchunk(v0, v1):
        if not widen:
            return W[v0:v1]
        if wfull is not None:
            return wfull[v0:v1]
        return _block(W, v0, v1, cdt, wbuf)

    feps = params.get("filter_eps")
    fstats = out.get("filter_stats")
    if fstats is not None:
        fstats.setdefault("blocks_total", 0)
        fstats.setdefault("blocks_skipped", 0)
    if feps is not None and want_grad and K:
        fb = int(params["filter_cols"])
        rb = max(1, min(int(params["filter_rows"]), nb_max))
        nblk = -(-K // fb)
        fflags = np.empty((nb_max, nblk), np.bool_)
        # the row scale: |upstream grad · 1/Σw| (coef_ce); a row whose gradient is identically 0
        # (ignored, or a zero upstream grad) is negligible everywhere
        thr_all = np.where((coef_ce == 0) & (coef_z == 0), np.inf, float(feps) * np.abs(coef_ce)).astype(cdt)
        if not widen:
            fwsrc, fwcode = W, None
        elif wfull is not None:
            fwsrc, fwcode = wfull, None
        else:
            fwsrc, fwcode = W.view(np.uint16), D.code_of(W.dtype)
        fbufs = (
            np.empty(min(rb, nb_max) * vc, cdt),
            np.empty(vc * H, cdt) if gi is not None else None,
            np.empty(min(rb, nb_max) * H, cdt) if gi is not None else None,
            np.empty(vc * H, cdt) if gw is not None else None,
        )
    else:
        feps = None
    empty_i = np.zeros(0, np.int64)
    first_w = True
    for b0 in range(0, BT, nb_max):
        b1 = min(BT, b0 + nb_max)
        nb = b1 - b0
        X = _block(input, b0, b1, cdt, xbuf)
        offs = np.array([nb * v0 for v0, _ in chunks], np.int64) if chunks else empty_i
        widths = np.array([v1 - v0 for v0, v1 in chunks], np.int64) if chunks else empty_i
        for (v0, v1), off in zip(chunks, offs):
            Lc = Lbuf[off : off + nb * (v1 - v0)].reshape(nb, v1 - v0)
            matmul_nt(X, wchunk(v0, v1), Lc)
        if not recompute:
            m = np.empty(nb, cdt)
            s = np.empty(nb, cdt)
            zt = np.empty(nb, cdt)
            zs = np.empty(nb, cdt)
            am = np.empty(nb, np.int64)
            if K:
                _stats_pass(Lbuf, offs, widths, nb, bias_c, cw_c, tcol[b0:b1], par, flags, m, s, zt, zs, am, col0)
            else:
                m[:] = -np.inf
                s[:] = 0
                zt[:] = 0
                zs[:] = 0
                am[:] = -1
            if combine is not None:
                m, s, zt, zs, am = combine(m, s, zt, zs, am)
            with np.errstate(divide="ignore", invalid="ignore"):
                lse_b = (m + np.log(s)).astype(cdt)
            lse_all[b0:b1] = lse_b
            for key, val in (("max", m), ("sum_exp", s), ("z_target", zt), ("z_sum", zs), ("argmax", am)):
                if out.get(key) is not None:
                    out[key][b0:b1] = val
        if not want_grad or not K:
            continue
        _grad_pass(
            Lbuf,
            offs,
            widths,
            nb,
            cw_c,
            tcol[b0:b1],
            wt_c[b0:b1],
            lse_all[b0:b1],
            coef_ce[b0:b1],
            coef_z[b0:b1],
            par,
            flags,
            recompute,
            bias_c,
        )
        if gb is not None:
            for (v0, v1), off in zip(chunks, offs):
                _colsum_into(Lbuf, off, v1 - v0, nb, gb, v0)
        if feps is not None:
            F = fflags[:nb]
            _filter_flags(Lbuf, offs, widths, nb, tcol[b0:b1], thr_all[b0:b1], fb, F)
            keep = np.logical_or.reduceat(F, np.arange(0, nb, rb), axis=0)
            n_keep = int(keep.sum())
            if fstats is not None:
                fstats["blocks_total"] += keep.size
                fstats["blocks_skipped"] += keep.size - n_keep
            if n_keep < keep.size:
                _filtered_products(
                    Lbuf,
                    offs,
                    widths,
                    nb,
                    keep,
                    fb,
                    rb,
                    K,
                    vc,
                    fwsrc,
                    fwcode,
                    X,
                    None if gi is None else gi[b0:b1],
                    gw,
                    fbufs,
                )
                first_w = False
                continue
        for (v0, v1), off in zip(chunks, offs):
            Gc = Lbuf[off : off + nb * (v1 - v0)].reshape(nb, v1 - v0)
            if gi is not None:
                Wc = wchunk(v0, v1)
                if v0 == 0:
                    matmul_nn(Gc, Wc, gi[b0:b1])
                else:
                    th = tmp_h[: nb * H].reshape(nb, H)
                    matmul_nn(Gc, Wc, th)
                    _add_into(gi[b0:b1], th)
            if gw is not None:
                if first_w:
                    matmul_tn(Gc, X, gw[v0:v1])
                else:
                    tw = tmp_w[: (v1 - v0) * H].reshape(v1 - v0, H)
                    matmul_tn(Gc, X, tw)
                    _add_into(gw[v0:v1], tw)
        first_w = False
