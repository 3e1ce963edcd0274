"""The training loss's element-wise passes (Numba) and row helpers: the statistics and gradient
passes over a row block's logits, the ``precision="fast"`` rounding, gradient filtering's flags,
gathers and scatters (``kernels/linear_cross_entropy.py``: the module doc)."""

from __future__ import annotations

import numpy as np

from .. import dtypes as D
from .._jit import FASTMATH_SAFE, njit, tjit
from ..kernels._bf16dot import group_pairs
from ..kernels._gemm import row_tasks, run_rows, run_tasks
from ..kernels._linear import _add_rows_at, _take_rows, fp32_block, kept_products
from ..kernels._vmath import exp_c, row_max_nan, row_sum_exp
from .params import (  # noqa: F401  (the passes' indices: compile-time constants of the Numba passes)
    F_BIAS,
    F_CLASS_WEIGHT,
    F_ENTROPY_GRAD,
    F_ENTROPY_STAT,
    F_SOFTCAP,
    F_ZSUM,
    P_EPS,
    P_EPS_OVER_V,
    P_EPS_WSUM_OVER_V,
    P_INV_SOFTCAP,
    P_INV_TEMPERATURE,
    P_NEG_INF,
    P_ONE,
    P_SOFTCAP,
    P_TEMPERATURE,
    P_Z_SCALE2,
    P_ZERO,
    kernel_arrays,
)
from .plan_types import FAST_E_GROUP

# ----------------------------------------------------------------------------------------------
# dtype-generic scalar helpers (fp32: the vectorizable exp; fp64: libm)
# ----------------------------------------------------------------------------------------------


# Row helpers of the chunk passes (besides ``_vmath.row_*``): loops over one row of a chunk given
# as a 1-D slice, so that they vectorize (see ``_vmath``).


@njit
def _row_first(r, m):
    for j in range(r.shape[0]):
        if r[j] == m:
            return j
    return -1


@njit(fastmath=FASTMATH_SAFE)
def _row_sum(r, zero):
    acc = zero
    for j in range(r.shape[0]):
        acc += r[j]
    return acc


@njit(fastmath=FASTMATH_SAFE)
def _row_wsum(r, cw, zero):
    acc = zero
    for j in range(r.shape[0]):
        acc += cw[j] * r[j]
    return acc


@njit(fastmath=FASTMATH_SAFE)
def _row_sum_exp_dz(r, m, zero):
    """``Σ_j exp(r[j] - m)·(r[j] - m)``; a term whose ``exp`` is 0 adds 0 (``r[j] = -inf``)."""
    acc = zero
    for j in range(r.shape[0]):
        d = r[j] - m
        e = exp_c(d)
        acc += e * d if e != zero else zero
    return acc


@njit
def _row_transform(r, bias, par, flags):
    """z = softcap(L + bias) / T in place (``bias`` the row's slice of the bias)."""
    cap = par[P_SOFTCAP]
    icap = par[P_INV_SOFTCAP]
    it = par[P_INV_TEMPERATURE]
    for j in range(r.shape[0]):
        x = r[j]
        if flags[F_BIAS]:
            x = x + bias[j]
        if flags[F_SOFTCAP]:
            x = cap * np.tanh(x * icap)
        r[j] = x * it


@njit
def _row_grad_plain(r, a, e, lz, it, s):
    """The common gradient (no softcap, no class weights, no bias): ``(a·p - e)/T`` with
    ``z = r·s`` (``s``: 1 for stored z, ``1/T`` for recomputed raw logits)."""
    for j in range(r.shape[0]):
        r[j] = (a * exp_c(r[j] * s - lz) - e) * it


@njit
def _row_grad_entropy(r, a, e, h, mu, lz, it, s):
    """With the entropy's term: ``(p·(a + h·(μ - z)) - e)/T`` (0·anything = 0 where p = 0)."""
    for j in range(r.shape[0]):
        x = r[j] * s
        p = exp_c(x - lz)
        q = p * (a + h * (mu - x))
        r[j] = ((q if p != 0 else p) - e) * it


@tjit
def _stats_chunk(
    lo, hi, L, off, width, nb, bias, cw, tcol, par, flags, transform, m_io, s_io, zt_io, zs_io, am_io, sz_io, vshift
):
    """One vocabulary chunk of the block (``L[off:off + nb·width]``, rows of ``width`` columns
    starting at column ``v0 = off // nb + vshift``), while it is hot in cache: ``z = softcap(L + bias)/T``
    in place (only with ``transform``), then the running row statistics are updated online:
    max and its first index, ``Σ exp(z - max)`` and (``flags[F_ENTROPY_STAT]``) ``Σ exp(z - max)·(z - max)``
    (both rescaled when the max grows), the target's ``z`` and ``Σ_v w_v z_v``.  NaN never
    becomes the max and propagates through the sums."""
    ninf = par[P_NEG_INF]
    zero = par[P_ZERO]
    v0 = off // nb + vshift
    for i in range(lo, hi):
        r = L[off + i * width : off + (i + 1) * width]
        if transform:
            _row_transform(r, bias[v0 : v0 + width] if flags[F_BIAS] else bias, par, flags)
        cm, n_nan = row_max_nan(r, ninf)  # a NaN never becomes the max
        m = m_io[i]
        s = s_io[i]
        sz = sz_io[i] if flags[F_ENTROPY_STAT] else zero
        if cm > m:
            if m != ninf:
                f = exp_c(m - cm)
                # Σ e'·(z - m') with e' = e·f and z - m' = (z - m) + (m - m')
                sz = f * (sz + (m - cm) * s)
                s = s * f
            m = cm
            am_io[i] = v0 + _row_first(r, cm)
        if m != ninf:
            s += row_sum_exp(r, m, zero)
            if flags[F_ENTROPY_STAT]:
                sz += _row_sum_exp_dz(r, m, zero)
        elif n_nan:
            # NaN logits and no other but -inf so far: the sums skipped here are NaN (a later
            # chunk's max then keeps them NaN, as the NaN terms do where a max exists)
            s = s + (ninf - ninf)
            sz = sz + (ninf - ninf)
        m_io[i] = m
        s_io[i] = s
        if flags[F_ENTROPY_STAT]:
            sz_io[i] = sz
        if flags[F_ZSUM]:
            if flags[F_CLASS_WEIGHT]:
                zs_io[i] += _row_wsum(r, cw[v0 : v0 + width], zero)
            else:
                zs_io[i] += _row_sum(r, zero)
        t = tcol[i]
        if t >= v0 and t < v0 + width:
            zt_io[i] = r[t - v0]


@tjit
def _grad_pass(
    lo, hi, L, offs, widths, nb, cw, tcol, wt, lse, coef_ce, coef_z, coef_h, zmean, par, flags, recompute, bias, vshift
):
    """Overwrite z (or, with ``recompute``, the raw logits) by dloss/dL (``coef_h``, ``zmean``:
    the entropy's upstream coefficient and ``μ = Σ p·z`` per row, read with ``flags[F_ENTROPY_GRAD]``).
    Chunk ``c`` starts at vocabulary column ``offs[c] // nb + vshift``."""
    nchunk = offs.shape[0]
    cap = par[P_SOFTCAP]
    icap = par[P_INV_SOFTCAP]
    it = par[P_INV_TEMPERATURE]
    T = par[P_TEMPERATURE]
    one = par[P_ONE]
    one_m_eps = one - par[P_EPS]
    for i in range(lo, hi):
        cc = coef_ce[i]
        cz = coef_z[i]
        lz = lse[i]
        a = cc * (one_m_eps * wt[i] + par[P_EPS_WSUM_OVER_V]) + cz * par[P_Z_SCALE2] * lz
        b = cc * one_m_eps * wt[i]
        e = cc * par[P_EPS_OVER_V]
        t = tcol[i]
        h = coef_h[i] if flags[F_ENTROPY_GRAD] else par[P_ZERO]
        mu = zmean[i] if flags[F_ENTROPY_GRAD] else par[P_ZERO]
        # no per-column transform but the temperature: the vectorized loops (z = L·s, the
        # product by 1 exact for stored z, the same operations as the general loop below)
        plain = not flags[F_SOFTCAP] and not flags[F_CLASS_WEIGHT] and not (recompute and flags[F_BIAS])
        s = it if recompute else one
        for c in range(nchunk):
            base = offs[c] + i * widths[c]
            v0 = offs[c] // nb + vshift
            if a == 0 and b == 0 and e == 0 and h == 0:
                for j in range(widths[c]):
                    L[base + j] = par[P_ZERO]
                continue
            if plain:
                # the target column's term is applied after the vectorized loop, in the same
                # order of operations as the general loop below
                tin = t >= v0 and t < v0 + widths[c]
                xt = L[base + t - v0] * s if tin else par[P_ZERO]
                if h == 0:
                    _row_grad_plain(L[base : base + widths[c]], a, e, lz, it, s)
                else:
                    _row_grad_entropy(L[base : base + widths[c]], a, e, h, mu, lz, it, s)
                if tin:
                    p = exp_c(xt - lz)
                    g = a * p
                    if h != 0 and p != 0:
                        g = p * (a + h * (mu - xt))
                    g -= e
                    g -= b
                    L[base + t - v0] = g * it
                continue
            for j in range(widths[c]):
                x = L[base + j]
                if recompute:
                    if flags[F_BIAS]:
                        x = x + bias[v0 + j]
                    if flags[F_SOFTCAP]:
                        x = cap * np.tanh(x * icap)
                    x = x * it
                p = exp_c(x - lz)
                g = a * p
                if h != 0 and p != 0:
                    g = p * (a + h * (mu - x))
                if flags[F_CLASS_WEIGHT]:
                    g -= e * cw[v0 + j]
                else:
                    g -= e
                if v0 + j == t:
                    g -= b
                if flags[F_SOFTCAP]:
                    y = x * T * icap
                    g = g * (one - y * y)
                L[base + j] = g * it


@tjit
def _round_rows(lo, hi, dst, src, code):
    """dst[q, :] = round(src[q, :]) to the 16-bit dtype ``code`` (RNE; bits)."""
    h = dst.shape[1]
    for q in range(lo, hi):
        for j in range(h):
            dst[q, j] = D.from_f32(src[q, j], code)


@tjit
def _round_g_bf16(lo, hi, G, e_row, e_col, tcol, v0, e_t):
    """Row groups ``lo:hi`` of ``G`` (``FAST_E_GROUP`` rows each; columns from vocabulary column
    ``v0``) rounded to bf16 in place (RNE; a bf16 subnormal to ±0, as the kernel reads it), with
    the rounding error ``e = g - round(g)`` (exact in fp32) summed per row into ``e_row[i]`` and
    per group and column into ``e_col[q, v]`` — except at the row's target column ``tcol[i]``
    (this shard's, -1 for none), whose error goes to ``e_t[i]`` alone: the target's ``g`` is the
    row's one large value (``≈ -c_r``), its error ``W[t]``'s or ``X[i]``'s own, not the mean
    row's (:func:`add_target_rows`, :func:`add_target_weight`).  A non-finite ``e`` (NaN/Inf
    ``g``) counts 0: the GEMM carries it."""
    nb, w = G.shape
    zero = G.dtype.type(0)
    inf = G.dtype.type(np.inf)
    e = np.empty(w, G.dtype)
    for q in range(lo, hi):
        ec = e_col[q]
        ec[:] = zero
        for i in range(q * FAST_E_GROUP, min(nb, (q + 1) * FAST_E_GROUP)):
            r = G[i]
            tj = tcol[i] - v0
            own = tj >= 0 and tj < w
            before = ec[tj] if own else zero
            for j in range(w):
                g = r[j]
                b = np.uint32(D.f32_to_bf16(g))
                if np.uint32(b & np.uint32(0x7F80)) == 0:
                    b = np.uint32(b & np.uint32(0x8000))
                h = D.bf16_to_f32(b)
                r[j] = h
                d = g - h
                d = d if abs(d) < inf else zero
                e[j] = d
                ec[j] += d
            if own:  # the target's error apart: out of the sums (the column's sum as before the row)
                e_t[i] = e[tj]
                e[tj] = zero
                ec[tj] = before
            e_row[i] = _row_sum(e, zero)


@tjit
def _grad_round_bf16(
    lo, hi, L, offs, widths, nb, cw, rows, par, flags, recompute, bias, vshift, G, e_row, e_col, e_t, pairs
):
    """``precision="fast"``'s passes over one chunk fused, row group by row group (``lo:hi``,
    ``FAST_E_GROUP`` rows each, while the group is in cache): :func:`_grad_pass` over the group's
    rows (``L``, ``offs``, ``widths``: one chunk; its arguments as there), :func:`_round_g_bf16`
    of the group (``G``: the chunk's ``[nb, w]`` view of the same memory; the targets' errors
    into ``e_t``), then, with ``pairs`` = ``(u, up, gt)`` (the kernel's ``vdpbf16ps`` form; empty
    arrays skip it), the gradient GEMMs' ``A`` operands: ``gᵀ``'s pairs into ``gt``
    ``[w, ceil(nb/2)]`` (grad_weight's, where ``gt`` has rows) and the group's rows paired in
    place (grad_input's; ``u``: ``G``'s uint32 view, ``up`` = ``u[:, :ceil(w/2)]``, where ``up``
    has rows) — one pass over the chunk instead of four, the same operations in the same order
    (the separate passes' bits: tests pin them).
    ``rows``: ``_grad_pass``'s per-row arrays ``(tcol, wt, lse, coef_ce, coef_z, coef_h, zmean)``."""
    tcol, wt, lse, coef_ce, coef_z, coef_h, zmean = rows
    u, up, gt = pairs
    for q in range(lo, hi):
        i0 = q * FAST_E_GROUP
        i1 = min(nb, i0 + FAST_E_GROUP)
        _grad_pass(
            i0,
            i1,
            L,
            offs,
            widths,
            nb,
            cw,
            tcol,
            wt,
            lse,
            coef_ce,
            coef_z,
            coef_h,
            zmean,
            par,
            flags,
            recompute,
            bias,
            vshift,
        )
        _round_g_bf16(q, q + 1, G, e_row, e_col, tcol, offs[0] // nb + vshift, e_t)
        group_pairs(u, i0, i1, gt, up)


@tjit
def _col_mean16(lo, hi, u, code, out):
    """out[j] = mean over rows of the 16-bit ``u[:, j]`` (fp32 sums), columns ``lo:hi``.  The loops
    run over views indexed from 0: over ``range(lo, hi)`` Numba keeps a wraparound select for the
    index and the loop does not vectorize (5x slower here: 3.2 against 0.6 ms per 8192 x 896 bf16
    chunk, one thread, Zen 4; the same bits)."""
    n = u.shape[0]
    w = hi - lo
    acc = np.zeros(w, out.dtype)
    for i in range(n):
        row = u[i, lo:hi]
        for j in range(w):
            acc[j] += D.to_f32(row[j], code)
    o = out[lo:hi]
    for j in range(w):
        o[j] = acc[j] / n if n else acc[j]


def col_means16(H: int, u: np.ndarray, code: int, out: np.ndarray) -> None:
    """``out[j]`` = the mean over rows of the 16-bit ``u[:, j]`` (fp32 sums, rows in order) on the
    GEMM pool, in column spans of at least 256 values: each task reads its rows' spans as whole
    cache lines (16 spans of 56 values at H = 896 re-read every line of a 58 MB weight 16 times:
    slow; the figure in bench/results/README.md).  The sums do not depend on the split: the same
    bits at any thread count."""
    run_tasks(col_means16_tasks(H, u, code, out))


def col_means16_tasks(H: int, u: np.ndarray, code: int, out: np.ndarray) -> list:
    """:func:`col_means16`'s tasks, to run with other independent ones (one barrier for all: the
    weight's chunks at once, ``H // 256`` tasks each)."""
    return row_tasks(_col_mean16, H, u, code, out, parts=max(1, H // 256))


def live_rows(coef_ce: np.ndarray, coef_z: np.ndarray, coef_h: np.ndarray) -> np.ndarray | None:
    """The rows whose gradient is not identically 0 (not ignored, a non-zero upstream gradient):
    ``precision="fast"``'s mean row of ``X`` is theirs — an ignored row carries no rounding error,
    and its ``X`` (a padding position's, however large) must not enter the correction of the
    others.  None: every row."""
    live = (coef_ce != 0) | (coef_z != 0) | (coef_h != 0)
    return None if bool(live.all()) else np.flatnonzero(live)


@tjit
def _add_target_rows(lo, hi, dst, tcol, v0, e_t, xu, code):
    """``precision="fast"``'s target correction of a chunk's ``grad_weight`` (``dst``: its rows
    from vocabulary column ``v0``), columns ``lo:hi``: ``dst[t_i - v0] += e_t[i]·X[i]`` for the
    rows ``i`` of ``xu`` (16-bit ``X``, dtype ``code``) whose target ``t_i = tcol[i]`` is in the
    chunk, rows in order (rows sharing a target add in one fixed order)."""
    n = dst.shape[0]
    for i in range(tcol.shape[0]):
        t = tcol[i] - v0
        if t >= 0 and t < n:
            a = e_t[i]
            row, x = dst[t], xu[i]
            for j in range(lo, hi):
                row[j] += a * D.to_f32(x[j], code)


def add_target_rows(dst: np.ndarray, tcol: np.ndarray, v0: int, e_t: np.ndarray, xu: np.ndarray, code: int) -> None:
    """:func:`_add_target_rows` on the calling thread: a chunk holds few rows' targets (a pool
    call cost more than the work: 0.3 ms a call, measured at the Qwen2.5 head)."""
    _add_target_rows(0, dst.shape[1], dst, tcol, v0, e_t, xu, code)


@tjit
def _add_target_weight(lo, hi, dst, tcol, e_t, wu, code):
    """``precision="fast"``'s target correction of ``grad_input`` (``dst``: the row block's rows),
    rows ``lo:hi``: ``dst[i] += e_t[i]·W[tcol[i]]`` (``wu``: this shard's 16-bit weight, dtype
    ``code``) where the row's target is on this shard (``tcol[i] >= 0``)."""
    for i in range(lo, hi):
        t = tcol[i]
        if t >= 0:
            a = e_t[i]
            row, wt = dst[i], wu[t]
            for j in range(row.shape[0]):
                row[j] += a * D.to_f32(wt[j], code)


def add_target_weight(dst: np.ndarray, tcol: np.ndarray, e_t: np.ndarray, wu: np.ndarray, code: int) -> None:
    """:func:`_add_target_weight` over the rows of ``dst`` on the calling thread (one row of
    ``W`` per row: less work than a pool call costs)."""
    _add_target_weight(0, dst.shape[0], dst, tcol, e_t, wu, code)


@tjit
def _add_outer(lo, hi, dst, a, b):
    """dst[i, :] += a[i]·b for the rows ``lo:hi``."""
    for i in range(lo, hi):
        ai = a[i]
        for j in range(dst.shape[1]):
            dst[i, j] += ai * b[j]


@tjit
def _colsum_into(lo, hi, L, off, width, nb, out, v0):
    for j in range(lo, hi):
        acc = out[v0 + j]
        for i in range(nb):
            acc += L[off + i * width + j]
        out[v0 + j] = acc


@njit
def _any_not_below(seg, th):
    """Whether some ``|x|`` of the 1-D slice is not below ``th`` (NaN counts), vectorized."""
    hits = 0
    for j in range(seg.shape[0]):
        hits += not (abs(seg[j]) < th)
    return hits > 0


@tjit
def _filter_flags(lo, hi, L, off, width, nb, thr, fb, flags):
    """For one vocabulary chunk (``L[off:off + nb·width]``, column ``v0 = off // nb`` on), set
    ``flags[i, jb]`` when some ``|G[i, v]|`` of column block ``jb`` (``fb`` columns) is not
    below ``thr[i]`` (NaN included); flags already set stay set.  Read-only on ``L``."""
    v0 = off // nb
    for i in range(lo, hi):
        th = thr[i]
        r = L[off + i * width : off + (i + 1) * width]
        j = 0
        while j < width:
            jb = (v0 + j) // fb
            j1 = min(width, (jb + 1) * fb - v0)
            if _any_not_below(r[j:j1], th):
                flags[i, jb] = True
            j = j1


@tjit
def _gather_cols(lo, hi, L, coff, cw, r0, r1, out):
    """out[i, q] = G[r0 + i, col q] from the chunked block layout (``coff``/``cw``: each gathered
    column's offset in its chunk's flat storage and the chunk's width)."""
    nq = coff.shape[0]
    for i in range(lo, hi):
        r = r0 + i
        for q in range(nq):
            out[i, q] = L[coff[q] + r * cw[q]]


@tjit
def _gather_rows_widen(lo, hi, src, rows, code, dst):
    """dst[q, :] = fp32(src[rows[q], :]) for a uint16 (bf16/fp16 bits) source, exactly."""
    h = src.shape[1]
    for q in range(lo, hi):
        r = rows[q]
        for j in range(h):
            dst[q, j] = D.to_f32(src[r, j], code)


@tjit
def _scatter_add_rounded(lo, hi, dst, rows, src, code):
    """dst[rows[q], :] = round(dst[rows[q], :] + src[q, :]) (rows distinct; 16-bit bits)."""
    h = dst.shape[1]
    for q in range(lo, hi):
        r = rows[q]
        for j in range(h):
            dst[r, j] = D.from_f32(D.to_f32(dst[r, j], code) + src[q, j], code)


def _filtered_products(Lbuf, offs, widths, nb, keep, fb, rb, K, vc, wsrc, wcode, X, gi_rows, gw, bufs, gw_code, eng):
    """``gi_rows += G·W`` and ``gw += Gᵀ·X`` over the kept blocks only (module docstring), on
    ``_linear.kept_products`` (the rule the FLCE grad's filter shares): the kept columns of ``G``
    gathered from the row block's chunked logits, at most ``vc`` at a time; the kept weight rows
    (widened exactly from ``wsrc``'s bits with ``wcode``); ``grad_weight``'s rows summed onto
    (a 16-bit one with rounding, ``gw_code``)."""
    # per vocabulary column: its offset in the block's flat storage at row 0, its chunk's width
    chunk_w = np.repeat(widths, widths)
    coff = np.repeat(offs, widths) + np.arange(K) - np.repeat(offs // nb, widths)

    def gather_g(r0, r1, cq, out):
        run_rows(_gather_cols, r1 - r0, Lbuf, coff[cq], chunk_w[cq], r0, r1, out)
        return out

    # 16-bit weight rows widened as gathered; a 16-bit grad_weight summed onto with rounding
    gather_rows, widen_code = (_take_rows, ()) if wcode is None else (_gather_rows_widen, (wcode,))
    scatter_add, gw_round = (_add_rows_at, ()) if gw_code is None else (_scatter_add_rounded, (gw_code,))

    def gather_w(cq, out):
        run_rows(gather_rows, cq.size, wsrc, cq, *widen_code, out)
        return out

    def add_gw(cq, Q):
        run_rows(scatter_add, cq.size, gw, cq, Q, *gw_round)

    kept_products(
        keep,
        fb,
        rb,
        nb,
        K,
        group=vc,
        gather_g=gather_g,
        gather_w=gather_w,
        X=X,
        gi_rows=gi_rows,
        add_gw=None if gw is None else add_gw,
        bufs=bufs,
        engine=eng,
    )


def _block(a: np.ndarray, r0: int, r1: int, cdt, buf):
    """Rows r0:r1 as a C-contiguous array of the compute dtype (exact widening)."""
    if cdt == np.float64:
        return np.ascontiguousarray(a[r0:r1], dtype=np.float64)
    return fp32_block(a, r0, r1, buf)
