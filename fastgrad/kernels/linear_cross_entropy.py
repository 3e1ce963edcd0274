"""Kernel: the training linear cross-entropy, forward and backward fused by row blocks.

Not a device op (docs/spec.md, "Training loss").  For each block of ``nb`` rows (``nb`` from the
memory budget, never from BT or the thread count):

1. ``L = X[b] · Wᵀ`` in the compute dtype (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64) by
   BLAS, vocabulary chunk by vocabulary chunk (16-bit weights widened exactly per chunk);
2. a parallel Numba pass turns the logits into ``z = softcap(L + bias) / temperature`` in place
   and computes this shard's row statistics: max (and its first index), ``Σ exp(z - max)``, the
   target's ``z``, ``Σ_v w_v z_v`` (label smoothing) and, for the entropy,
   ``Σ exp(z - max)·(z - max)``;
3. ``combine`` (optional, the caller's all-reduce for vocabulary parallelism) makes them global;
4. when gradients are wanted, a second pass overwrites ``z`` with ``dloss/dL``
   (``G = (a·p - b·onehot - e·w + h·p·(μ - z))·dz/dL``, ``p = exp(z - lse)`` from the *same*
   logits as the statistics, not rounded; ``h·p·(μ - z)`` the entropy's term, ``μ = Σ p·z``) and two
   GEMMs accumulate ``grad_input[b] = G·W`` and ``grad_weight += Gᵀ·X[b]`` in the compute dtype.

The row blocks run on the LM-head loop's row-major order (``_lm_head.run_row_blocks``;
:class:`_RowStep` is its epilogue: steps 1-2 its statistics sweep, 3 ``end_statistics``, 4 its
gradient sweep).  Three GEMMs per row block, run in stages where the plan says so
(``TrainingPlan.staged_statistics`` / ``staged_gradient``, ``_lm_head.sweep``): the logits tiles of
chunk ``c`` beside the widening of chunk ``c + 1`` and the statistics of chunk ``c - 1``; then chunk
``c``'s two gradient GEMMs beside chunk ``c + 1``'s gradient pass and widening — the same calls on
the same operands as chunk by chunk (the same bits), the element-wise passes and the widening
hidden behind the GEMMs (Qwen2.5-0.5B head, bf16, Zen 3, 2 cores: 15.5 → 14.9 s).  Each step
declares what it reads and writes (``_stats_uses`` / ``_grad_uses``: a chunk's part of the
logits, a widening buffer, the running statistics, ``grad_input``'s accumulator, a chunk's rows
of ``grad_weight``), so the stages run as a dependency graph, not between barriers.  Where the
plan says so (``TrainingPlan.accumulate_in_gemm``) the accumulating tiles add their product in
the BLAS call (``beta = 1``) instead of through a scratch product.
The forward alone (no gradient) keeps one chunk of ``tiling.TRAIN_VM_CHUNK``
columns at a time instead of the block's whole row, with all rows in one block while
``[BT, TRAIN_VM_CHUNK]`` fits half the workspace (the weight widened once).  With ``lse`` given (the
backward of a forward that did not compute the gradient) the dense gradient is recomputed
**vocabulary-major** (``_vocab_major``): per chunk of ``TRAIN_VM_CHUNK`` columns, its logits for all
rows, steps 4's pass and products; a chunk's ``grad_weight`` is complete after its rows, so a
16-bit one is rounded once from fp32 and no ``[K, H]`` accumulator exists.

Gradient filtering (``params["filter_eps"]``, CCE's ``filter_eps``): after step 4's pass over
each vocabulary chunk (the chunk still in cache) a read-only pass flags, per row and per block
of ``plan.filter_cols`` vocabulary columns, whether some ``|G[r, v]|`` is not below
``filter_eps·|coef_ce[r]|`` (the row's scale: the upstream gradient and the mean's ``1/Σw``;
a row whose gradient is identically 0 — ignored — has nothing to keep), or the block holds
the row's target column.  A block of ``plan.filter_rows`` rows × ``filter_cols`` columns without a
flag is skipped in both GEMMs: the kept blocks' columns of ``G`` and rows of ``W`` are
gathered (at most ``v_chunk`` columns at a time) and the products accumulated.  A row block
with every block kept takes the dense path unchanged (bitwise).  ``grad_bias`` is the column
sum of the whole ``G``, never filtered.

Pure: imports only dtypes helpers, the JIT helpers, the allocator, the vector math and the GEMM helpers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from .. import dtypes as D
from .._jit import FASTMATH_SAFE, njit, tjit
from ..errors import InternalError
from ..tiling import BLAS, FAST_E_GROUP, TrainingPlan, fast_fused, training_modes
from . import _bf16dot
from ._gemm import (
    IN_BLAS,
    blas_for,
    matmul_nn,
    matmul_nt,
    matmul_tn,
    nn_tasks,
    nt_tasks,
    row_tasks,
    run_rows,
    tn_tasks,
)
from ._linear import fp32_block, fp32_block_tasks, kept_products
from ._lm_head import Sweep, Workspace, run_row_blocks, sweep
from ._lm_head import run as run_tiles
from ._vmath import exp_c, row_max_nan, row_sum_exp

__all__ = ["linear_cross_entropy_cpu"]


# ----------------------------------------------------------------------------------------------
# dtype-generic scalar helpers (fp32: the vectorizable exp; fp64: libm)
# ----------------------------------------------------------------------------------------------


# The passes' scalar parameters, one array each (Numba types one array of the compute dtype and
# one of int64 for every combination of features: one compiled pass, not one per combination),
# read by name: ``par[P_SOFTCAP]``, ``flags[F_BIAS]`` (module constants: compile-time indices).
# par (compute dtype): softcap, 1/softcap, 1/temperature, temperature, eps (label smoothing),
#                      eps/V, eps·Σw/V, 2·lse_square_scale, -inf, one, zero
P_SOFTCAP, P_INV_SOFTCAP, P_INV_TEMPERATURE, P_TEMPERATURE = 0, 1, 2, 3
P_EPS, P_EPS_OVER_V, P_EPS_WSUM_OVER_V, P_Z_SCALE2 = 4, 5, 6, 7
P_NEG_INF, P_ONE, P_ZERO = 8, 9, 10
# flags (int64): has a softcap, has a bias, has class weights, needs Σ w·z (smoothing),
#                needs the entropy's statistic Σ e·(z - max), has an entropy gradient (coef_h, μ)
F_SOFTCAP, F_BIAS, F_CLASS_WEIGHT, F_ZSUM, F_ENTROPY_STAT, F_ENTROPY_GRAD = 0, 1, 2, 3, 4, 5


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
        cm = row_max_nan(r, ninf)[0]  # a NaN never becomes the max
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


#: rows per group of the rounding pass's partial column sums (fixed: bitwise at any thread count;
#: the plan sizes its buffer from it)
_E_GROUP = FAST_E_GROUP


@tjit
def _round_g_bf16(lo, hi, G, e_row, e_col):
    """Row groups ``lo:hi`` of ``G`` (``_E_GROUP`` rows each) rounded to
    bf16 in place (RNE; a bf16 subnormal to ±0, as the kernel reads it), with the rounding error
    ``e = g - round(g)`` (exact in fp32) summed per row into ``e_row[i]`` and per group and
    column into ``e_col[q, v]``.  A non-finite ``e`` (NaN/Inf ``g``) counts 0: the GEMM carries
    it."""
    nb, w = G.shape
    zero = G.dtype.type(0)
    inf = G.dtype.type(np.inf)
    e = np.empty(w, G.dtype)
    for q in range(lo, hi):
        ec = e_col[q]
        ec[:] = zero
        for i in range(q * _E_GROUP, min(nb, (q + 1) * _E_GROUP)):
            r = G[i]
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
            e_row[i] = _row_sum(e, zero)


@tjit
def _col_mean16(lo, hi, u, code, out):
    """out[j] = mean over rows of the 16-bit ``u[:, j]`` (fp32 sums), columns ``lo:hi``."""
    n = u.shape[0]
    acc = np.zeros(hi - lo, out.dtype)
    for i in range(n):
        for j in range(lo, hi):
            acc[j - lo] += D.to_f32(u[i, j], code)
    for j in range(lo, hi):
        out[j] = acc[j - lo] / n if n else acc[j - lo]


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
def _gather_rows(lo, hi, src, rows, dst):
    """dst[q, :] = src[rows[q], :] (same dtype)."""
    h = src.shape[1]
    for q in range(lo, hi):
        r = rows[q]
        for j in range(h):
            dst[q, j] = src[r, j]


@tjit
def _gather_rows_widen(lo, hi, src, rows, code, dst):
    """dst[q, :] = fp32(src[rows[q], :]) for a uint16 (bf16/fp16 bits) source, exactly."""
    h = src.shape[1]
    for q in range(lo, hi):
        r = rows[q]
        for j in range(h):
            dst[q, j] = D.to_f32(src[r, j], code)


@tjit
def _scatter_add_rows(lo, hi, dst, rows, src):
    """dst[rows[q], :] += src[q, :] (rows distinct)."""
    h = dst.shape[1]
    for q in range(lo, hi):
        r = rows[q]
        for j in range(h):
            dst[r, j] += src[q, j]


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
    gather_rows, widen_code = (_gather_rows, ()) if wcode is None else (_gather_rows_widen, (wcode,))
    scatter_add, gw_round = (_scatter_add_rows, ()) if gw_code is None else (_scatter_add_rounded, (gw_code,))

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


def _bf16_logits(input, W, vc, plan, gemm, ws):
    """A :class:`_bf16dot.Logits` (its buffers from the plan's ``ws``) where the plan runs the
    logits on the bf16 kernel (``plan.logits16``, in the GEMM choice's ``a_form``), else None;
    a ``ValueError`` for such a plan on other operands."""
    if not plan.logits16:
        return None
    if input.dtype != D.BFLOAT16 or W.dtype != D.BFLOAT16:
        raise ValueError(f"plan.logits16 with {input.dtype} / {W.dtype} operands (bf16 expected)")
    return _bf16dot.Logits(input, W, vc, take=ws.take, form=gemm.a_form, spec=_bf16dot.spec_named(gemm.variant))


def _vocab_major(input, W, cdt, grads, rows, consts, plan, ws, round_grad=False, gemm=BLAS, progress=None):
    """The gradient from a saved log-sum-exp, vocabulary chunk by vocabulary chunk, on the LM-head
    loop (``_lm_head.run`` over ``plan.recompute_grid``: vocabulary chunks outer, equal row blocks
    inner; :class:`_RecomputeGrad` is its operands and its epilogue).

    For each chunk of ``recompute_chunk`` columns: the weight's rows widened once; for each row
    block of at most ``recompute_rows`` rows (all rows while ``[BT, chunk]`` fits half the
    budget): the logits recomputed, turned into the gradient in place,
    ``grad_input[b] (+)= G·W[v]`` and ``grad_weight[v] (+)= Gᵀ·X[b]``.  A
    chunk's ``grad_weight`` is complete when its row loop ends, so a 16-bit ``grad_weight`` is
    rounded once from its fp32 sum (as the fp32 result rounded at the end) and no fp32 ``[K, H]``
    is held: the memory is the output plus ``O(vc·(BT + H))`` scratch.

    ``round_grad`` (``precision="fast"``), with the logits on the bf16 kernel: the gradient is
    rounded to bf16 in place and both gradient GEMMs run on the kernel (``W``'s chunk and ``X``'s
    rows interleaved as its ``B``), then the rounding error's mean part is added back (the op's
    docstring); the fp32 copies of ``X`` and of ``W``'s chunk are not made.

    ``grads``: (grad_input, grad_weight, its 16-bit bits or itself, its dtype code or None,
    grad_bias); ``rows``: the per-row arrays of ``_grad_pass`` (target column, target weight,
    lse, upstream coefficients, μ); ``consts``: (class weights, bias, par, flags); ``ws``: the
    plan's buffers (``tiling.training_buffers``); ``progress(done, total)`` after each tile.
    """
    grid = plan.recompute_grid
    rc = _RecomputeGrad(input, W, cdt, grads, rows, consts, plan, ws, round_grad, gemm)
    run_tiles(grid, rc, rc, progress)
    rc.finish()


class _RecomputeGrad:
    """The recompute's operands (:meth:`chunk`: the weight's chunk in the forms its GEMMs take)
    and its epilogue (:meth:`begin`, :meth:`tile`, :meth:`end`) for ``_lm_head.run``, then
    :meth:`finish` (``precision="fast"``: the rounding error's mean part of ``grad_input``).
    Arguments as :func:`_vocab_major`'s (its tiles: ``plan.recompute_grid``)."""

    def __init__(self, input, W, cdt, grads, rows, consts, plan, ws, round_grad, gemm):
        self.gi, self.gw, self.gw_acc, self.gw_code, self.gb = grads
        gi, gw = self.gi, self.gw
        self.rows, self.consts = rows, consts
        self.input, self.W, self.cdt, self.gemm = input, W, cdt, gemm
        self.spec = _bf16dot.spec_named(gemm.variant)  # the plan's native variant (None: BLAS)
        BT, H = input.shape
        self.BT, self.H = BT, H
        K = W.shape[0]
        grid = plan.recompute_grid
        vc, nblocks, nr = grid.v_tile, grid.n_bt, grid.largest_bt
        self.block_of = {b0: k for k, (b0, _) in enumerate(grid.bt_ranges())}
        self.nblocks = nblocks
        self.vc = vc
        self.bfl = bfl = _bf16_logits(input, W, vc, plan, gemm, ws)
        self.eng = gemm.engine
        # precision="fast": the gradient GEMMs on the kernel too, g rounded and compensated
        self.b16 = b16 = bfl is not None and round_grad
        widen_x = input.dtype != cdt and not b16
        self.take = take = ws.take
        self.xall = None
        if nblocks == 1 and not b16:
            self.xall = _block(input, 0, BT, cdt, take("x_whole", BT * H, cdt) if widen_x else None)
        self.xbuf = take("x_block", nr * H, cdt) if (self.xall is None and widen_x) else None
        self.wbuf = take("w_chunk", vc * H, cdt) if W.dtype != cdt and not b16 else None
        self.Lt = take("logits_block", nr * vc, cdt)
        self.th = take("grad_input_product", nr * H, cdt) if gi is not None and not b16 else None
        # a 16-bit grad_weight: the chunk summed in fp32 here, then rounded once
        self.tw = take("grad_weight_chunk", vc * H, cdt) if (gw is not None and self.gw_code is not None) else None
        self.tw2 = take("grad_weight_product", vc * H, cdt) if (gw is not None and nblocks > 1 and not b16) else None
        self.offs = np.zeros(1, np.int64)
        self.xint = None
        if b16:
            nchunks = -(-K // vc)
            ngrp = -(-nr // _E_GROUP)

            def zeros(name, shape):
                a = take(name, shape[0] * shape[1], cdt)[: shape[0] * shape[1]].reshape(shape)
                a[...] = 0
                return a

            self.e_col = take("fast_e_col", ngrp * vc, cdt)  # the rounding error's partial column sums
            self.e_row = zeros("fast_e_row", (BT, nchunks))  # its row sums, per chunk
            self.w_bar = zeros("fast_w_mean", (nchunks, H))  # the chunk's mean row of W
            self.x_bar = zeros("fast_x_mean", (nblocks, H))  # the block's mean row of X
            xu = input.view(np.uint16)
            for k, (b0, b1) in enumerate(grid.bt_ranges()):
                run_rows(_col_mean16, H, xu[b0:b1], D.BF16, self.x_bar[k])
            # X's rows as grad_weight's B (once with one row block), W's chunk as grad_input's B
            self.xi_buf = take("x_pairs_block", _bf16dot.b_size(nr, H), np.uint32) if gw is not None else None
            self.xint = _bf16dot.interleave(input, self.xi_buf) if (gw is not None and nblocks == 1) else None
            self.wi_buf = take("w_pairs_chunk", _bf16dot.b_size(vc, H), np.uint32) if gi is not None else None
        self.Wc = None
        self.widths = np.zeros(1, np.int64)

    # -- operands: the chunk's forms
    def chunk(self, v0: int, v1: int) -> None:
        W, H, bfl = self.W, self.H, self.bfl
        if self.b16:
            if bfl is None:  # b16 implies the kernel's logits (not an assert: python -O)
                raise ValueError("precision='fast' needs the bf16 logits kernel")
            bfl.chunk(v0, v1)
            self.Wc = _bf16dot.interleave(W[v0:v1], self.wi_buf) if self.gi is not None else None
            run_rows(_col_mean16, H, W[v0:v1].view(np.uint16), D.BF16, self.w_bar[v0 // self.vc])
        else:
            self.Wc = W[v0:v1] if W.dtype == self.cdt else _block(W, v0, v1, self.cdt, self.wbuf)
            if bfl is not None:
                bfl.chunk(v0, v1)

    # -- epilogue
    def begin(self, v0: int, v1: int) -> None:
        self.widths = np.array([v1 - v0], np.int64)

    def tile(self, b0: int, b1: int, v0: int, v1: int) -> None:
        gi, gw, gb, H, eng, Lt = self.gi, self.gw, self.gb, self.H, self.eng, self.Lt
        tcol, wt_c, lse, coef_ce, coef_z, coef_h, zmean = self.rows
        cw_c, bias_c, par, flags = self.consts
        k = self.block_of[b0]
        nb, w = b1 - b0, v1 - v0
        if self.b16:
            X = self.xint
            if X is None and gw is not None:
                X = _bf16dot.interleave(self.input[b0:b1], self.xi_buf)
        else:
            X = self.xall[b0:b1] if self.xall is not None else _block(self.input, b0, b1, self.cdt, self.xbuf)
        G = Lt[: nb * w].reshape(nb, w)
        if self.bfl is not None:
            self.bfl.logits(b0, b1, G)
        else:
            matmul_nt(X, self.Wc, G, engine=eng)
        run_rows(
            _grad_pass,
            nb,
            Lt,
            self.offs,
            self.widths,
            nb,
            cw_c,
            tcol[b0:b1],
            wt_c[b0:b1],
            lse[b0:b1],
            coef_ce[b0:b1],
            coef_z[b0:b1],
            coef_h[b0:b1],
            zmean[b0:b1],
            par,
            flags,
            True,
            bias_c,
            v0,
        )
        if gb is not None:
            run_rows(_colsum_into, w, Lt, 0, w, nb, gb, v0)
        acc = None
        if gw is not None:
            acc = gw[v0:v1] if self.tw is None else self.tw[: w * H].reshape(w, H)
        if self.b16:
            # g rounded to bf16 in place; gradient GEMMs of exact products on the kernel; the
            # rounding error's mean part restored: grad_input += (Σ_v e)·mean_v W (finish, one
            # GEMM over the chunks), grad_weight += (Σ_t e)·mean_t X
            ng = -(-nb // _E_GROUP)
            ec = self.e_col[: ng * w].reshape(ng, w)
            run_rows(_round_g_bf16, ng, G, self.e_row[b0:b1, v0 // self.vc], ec)
            if acc is not None:
                _bf16dot.matmul_tn(G, X, H, acc, acc=k > 0, form=self.gemm.a_form, spec=self.spec)
                run_rows(_add_outer, w, acc, ec.sum(0), self.x_bar[k])
            if gi is not None:
                _bf16dot.matmul(
                    _bf16dot.pairs_in_place(G, self.gemm.a_form), self.Wc, H, gi[b0:b1], acc=v0 > 0, spec=self.spec
                )
            return
        if gi is not None:
            th = None if v0 == 0 else self.th[: nb * H].reshape(nb, H)
            matmul_nn(G, self.Wc, gi[b0:b1], tmp=th, engine=eng)
        if acc is not None:
            matmul_tn(G, X, acc, tmp=None if k == 0 else self.tw2[: w * H].reshape(w, H), engine=eng)

    def end(self, v0: int, v1: int) -> None:
        if self.tw is not None:
            w = v1 - v0
            run_rows(_round_rows, w, self.gw_acc[v0:v1], self.tw[: w * self.H].reshape(w, self.H), self.gw_code)

    def finish(self) -> None:
        """``precision="fast"``: ``grad_input += e_row · w_bar`` (the rounding error's mean part)."""
        if self.b16 and self.gi is not None:
            BT, H = self.BT, self.H
            tmp = self.take("fast_product", BT * H, self.cdt)[: BT * H].reshape(BT, H)
            matmul_nn(self.e_row, self.w_bar, self.gi, tmp=tmp, engine=self.eng)


@blas_for(lambda kw: kw["params"].get("gemm", BLAS).engine)
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
    plan: TrainingPlan,
    coef_h=None,
    z_mean=None,
    lse,
    combine,
    out,
    progress=None,
):
    """The ``cpu`` backend's implementation of ``fastgrad.linear_cross_entropy``: the block loop
    (module docstring), BLAS single-threaded, on the GEMMs ``params["gemm"]`` names (a
    ``tiling.GemmChoice``: the op layer's choice from the settings; default BLAS).  Arrays are
    validated by the op.

    ``params``: dict with softcap, temperature, eps, eps_over_V, eps_wsum_over_V, z_scale2,
    need_zsum, vocab_start_index (and optionally filter_eps: the block sizes are the plan's).
    ``coef_h`` [BT]: the entropy's upstream coefficient per row (None: no entropy term in the
    gradient); ``z_mean`` [BT]: ``μ = Σ p·z`` for the recompute (with ``lse``).
    ``out``: dict of preallocated outputs (``lse``, ``max``, ``sum_exp``, ``z_target``, ``z_sum``,
    ``argmax``, ``z_mean``, ``entropy``, ``grad_input``, ``grad_weight``, ``grad_bias``; absent or
    None: not computed) and ``filter_stats``, a dict receiving ``blocks_total`` /
    ``blocks_skipped``.  With ``z_mean`` or ``entropy`` (or ``coef_h`` in the forward) the
    statistics include ``Σ exp(z - max)·(z - max)`` and ``combine`` takes and returns it as a sixth value.
    ``progress(done, total)``: after each row block (the recompute: after each tile of its grid).
    """
    gemm = params.get("gemm", BLAS)
    eng = gemm.engine
    BT, H = input.shape
    K = weight.shape[0]
    cdt = np.float64 if input.dtype == np.float64 else np.float32
    gi, gw, gb = out.get("grad_input"), out.get("grad_weight"), out.get("grad_bias")
    # grad_weight in a 16-bit dtype (``accum_dtype``): its bits, accumulated with rounding
    gw_code = D.code_of(gw.dtype) if (gw is not None and gw.dtype != cdt) else None
    gw_acc = gw.view(np.uint16) if gw_code is not None else gw
    want_grad = gi is not None or gw is not None or gb is not None
    recompute = lse is not None
    softcap = params.get("softcap")
    par = np.zeros(11, cdt)
    par[P_SOFTCAP] = softcap or 0.0
    par[P_INV_SOFTCAP] = (1.0 / softcap) if softcap else 0.0
    par[P_INV_TEMPERATURE] = 1.0 / params["temperature"]
    par[P_TEMPERATURE] = params["temperature"]
    par[P_EPS] = params["eps"]
    par[P_EPS_OVER_V] = params["eps_over_V"]
    par[P_EPS_WSUM_OVER_V] = params["eps_wsum_over_V"]
    par[P_Z_SCALE2] = params["z_scale2"]
    par[P_NEG_INF], par[P_ONE], par[P_ZERO] = -np.inf, 1.0, 0.0
    need_ent = not recompute and (coef_h is not None or any(out.get(k) is not None for k in ("z_mean", "entropy")))
    flags = np.zeros(6, np.int64)
    flags[F_SOFTCAP] = softcap is not None
    flags[F_BIAS] = bias is not None
    flags[F_CLASS_WEIGHT] = class_weight is not None
    flags[F_ZSUM] = bool(params["need_zsum"])
    flags[F_ENTROPY_STAT] = need_ent
    flags[F_ENTROPY_GRAD] = coef_h is not None
    bias_c = bias.astype(cdt) if bias is not None else np.zeros(1, cdt)
    cw_c = class_weight.astype(cdt) if class_weight is not None else np.zeros(1, cdt)
    wt_c = target_weight.astype(cdt)
    coef_ce = coef_ce.astype(cdt) if coef_ce is not None else np.zeros(BT, cdt)
    coef_z = coef_z.astype(cdt) if coef_z is not None else np.zeros(BT, cdt)
    coef_h = coef_h.astype(cdt) if coef_h is not None else np.zeros(BT, cdt)
    tcol = np.ascontiguousarray(target_cols, dtype=np.int64)
    # the dense products write every element of grad_input / grad_weight (the first chunk, the
    # first row block) in parallel: no serial first touch of fresh memory; zeros only where
    # something may be left unwritten (filtering skips blocks; K = 0 or BT = 0 writes nothing)
    partial = params.get("filter_eps") is not None or K == 0 or BT == 0
    if gi is not None and partial:
        gi[...] = 0
    # the recompute of the gradient alone runs vocabulary-major (``_vocab_major``); the plan was
    # made by the same rule (a plan made for other arguments is refused below)
    vmajor, filtering = training_modes(
        want_grad=want_grad, recompute=recompute, filtered=params.get("filter_eps") is not None, K=K, BT=BT
    )
    if gw is not None and (partial or (gw_code is not None and not vmajor)):  # 16-bit: accumulated from zero
        gw[...] = 0
    if gb is not None:
        gb[...] = 0
    if not recompute:
        lse_all = out["lse"]
        zmean_all = out.get("z_mean")
    else:
        lse_all = np.ascontiguousarray(lse, dtype=cdt)
        zmean_all = np.ascontiguousarray(z_mean, dtype=cdt) if flags[F_ENTROPY_GRAD] else None
    if zmean_all is None:  # computed (need_ent) or read (flags[F_ENTROPY_GRAD]) only when wanted
        zmean_all = np.zeros(BT, cdt)
    if BT == 0:
        return
    # the plan's row blocks and chunks (made by the op layer: tiling.plan_training_loss): the
    # forward alone keeps one chunk at a time, for all rows while they fit half the budget; with
    # the gradient, the row block's whole row; from the global V, so every rank of a
    # vocabulary-parallel group plans the same row blocks (the combine runs per block)
    W = weight if weight.flags.c_contiguous else np.ascontiguousarray(weight)
    if vmajor != plan.vocab_major:
        raise ValueError(f"plan.vocab_major is {plan.vocab_major}, the call's arguments say {vmajor}")
    if filtering != (plan.filter_rows > 0):
        raise ValueError(f"plan.filter_rows is {plan.filter_rows}, the call's arguments say filtering={filtering}")
    # every buffer from the plan's list (tiling.training_buffers): the memory estimate is what runs
    ws = Workspace(plan)
    if vmajor:
        _vocab_major(
            input,
            W,
            cdt,
            (gi, gw, gw_acc, gw_code, gb),
            (tcol, wt_c, lse_all, coef_ce, coef_z, coef_h, zmean_all),
            (cw_c, bias_c, par, flags),
            plan,
            ws,
            bool(params.get("round_grad")),
            gemm,
            progress,
        )
        return
    # the fused step / the forward: row blocks outer on the LM-head loop's row-major order
    step = _RowStep(
        input,
        W,
        cdt,
        plan,
        gemm,
        ws,
        grads=(gi, gw, gw_acc, gw_code, gb),
        rows=(tcol, wt_c, lse_all, coef_ce, coef_z, coef_h, zmean_all),
        consts=(cw_c, bias_c, par, flags),
        out=out,
        params=params,
        combine=combine,
        recompute=recompute,
        need_ent=need_ent,
    )
    run_row_blocks(plan, step, eng, progress)


class _RowStep:
    """The fused step's and the forward's epilogue of the LM-head loop's row-major order
    (``_lm_head.run_row_blocks`` over ``plan.row_blocks()``; the module doc's steps 1-4).  Per row block:

    * :meth:`statistics` — the sweep over the vocabulary chunks: the chunk's weight widened
      (16-bit, unless the whole weight was widened once), its logits (BLAS tiles, or the bf16
      kernel), its statistics (``_stats_chunk``; none with a saved ``lse``);
    * :meth:`end_statistics` — the row's statistics made global (``combine``) and written (lse,
      max, sum_exp, z_target, z_sum, argmax, z_mean, entropy); returns the gradient sweep:
      dense — the gradient pass (``_grad_pass``) and the chunk's weight, then the two gradient
      GEMMs and ``grad_bias``'s column sums (a 16-bit ``grad_weight``: its product, then its rounded
      scatter-add) — or, filtered, the gradient pass then ``grad_bias`` and the block flags;
    * :meth:`end_rows` — filtered: the kept blocks' products (``_filtered_products``), or the
      dense products where every block is kept.

    The sweeps run in stages where the plan says so (``plan.staged_statistics`` /
    ``plan.staged_gradient``).  Every buffer from the plan's list (``ws``).  Arguments after
    ``ws`` as :func:`_vocab_major`'s, and ``out``/``params``/``combine`` as
    :func:`linear_cross_entropy_cpu`'s; ``need_ent``: the entropy's statistic is computed."""

    def __init__(
        self, input, W, cdt, plan, gemm, ws, *, grads, rows, consts, out, params, combine, recompute, need_ent
    ):
        self.input, self.W, self.cdt, self.plan = input, W, cdt, plan
        self.gi, self.gw, self.gw_acc, self.gw_code, self.gb = grads
        gi, gw, gw_code = self.gi, self.gw, self.gw_code
        self.tcol, self.wt_c, self.lse_all, self.coef_ce, self.coef_z, self.coef_h, self.zmean_all = rows
        self.rows = rows
        self.cw_c, self.bias_c, self.par, self.flags = consts
        self.out, self.combine, self.recompute, self.need_ent = out, combine, recompute, need_ent
        self.col0 = int(params["vocab_start_index"])
        self.eng = gemm.engine
        H, K = input.shape[1], W.shape[0]
        self.H, self.K = H, K
        self.want_grad = gi is not None or gw is not None or self.gb is not None
        self.fwd_only = fwd_only = not self.want_grad
        vc = plan.v_chunk
        self.chunks = [(v0, min(K, v0 + vc)) for v0 in range(0, K, vc)]
        self.widen = widen = W.dtype != cdt
        take = ws.take
        # the logits of bf16 operands on the exact-product bf16 kernel where the plan says so;
        # the weight then needs no widening for the forward alone
        self.bfl = bfl = _bf16_logits(input, W, vc, plan, gemm, ws)
        # precision="fast" (plan.grad16): g rounded to bf16, both gradient GEMMs on the kernel too
        self.b16 = b16 = plan.grad16
        if b16 != fast_fused(
            logits16=plan.logits16,
            fast=bool(params.get("round_grad")),
            want_grad=gi is not None or gw is not None or self.gb is not None,
            recompute=recompute,
            filtering=plan.filter_rows > 0,
            accum16_gw=gw_code is not None,
            K=W.shape[0],
            BT=input.shape[0],
        ):
            raise InternalError(f"plan.grad16 is {b16}, the call's arguments say otherwise")
        # the whole weight in the compute dtype when it is small, else widened per chunk (double
        # buffered where a sweep runs in stages: chunk c + 1 widened while chunk c is read); the
        # buffers on recycled memory (fastgrad._outcache): a training loop's next step takes no
        # fresh pages
        self.wfull = _block(W, 0, K, cdt, take("w_whole", K * H, cdt)) if (widen and plan.whole_weight) else None
        # (with the logits on the bf16 kernel the chunk is read by grad_input's GEMM alone)
        chunked = widen and self.wfull is None and (bfl is None or (gi is not None and not b16))
        wbuf = take("w_chunk", vc * H, cdt) if chunked else None
        self.wbufs: tuple = ()
        if wbuf is not None:
            self.wbufs = (wbuf, take("w_chunk_next", vc * H, cdt)) if plan.staged_statistics else (wbuf,)
        nb_rows = plan.largest_block  # the equal row blocks' largest: the row-block buffers' size
        # the row block's X in the compute dtype: for the BLAS logits and the gradient GEMMs (the
        # forward alone on the bf16 logits kernel reads none)
        self.need_x = bfl is None or (self.want_grad and not b16)
        self.xbuf = take("x_block", nb_rows * H, cdt) if (input.dtype != cdt and self.need_x) else None
        self.Lbuf = take("logits_block", nb_rows * (vc if fwd_only else max(K, 1)), cdt)  # the row block's logits
        # the accumulating tiles' scratch products, unless they add in the BLAS call
        acc = plan.accumulate_in_gemm
        self.tmp_h = take("grad_input_product", nb_rows * H, cdt) if (gi is not None and not acc and not b16) else None
        need_w = gw is not None and (gw_code is not None or not acc) and not b16  # (a 16-bit grad_weight's products)
        self.tmp_w = take("grad_weight_product", vc * H, cdt) if need_w else None
        self.all_rows = None
        if gw_code is not None:  # a 16-bit grad_weight's rows, for the rounded scatter-add
            self.all_rows = take("vocab_rows", K, np.int64)[:K]
            self.all_rows[:] = np.arange(K, dtype=np.int64)
        par, flags = self.par, self.flags
        self.transform = bool(flags[F_SOFTCAP] or flags[F_BIAS] or par[P_INV_TEMPERATURE] != 1)
        self.first = True  # the first row block: grad_weight written, not summed onto
        self._filters(params, ws)
        self._w: dict[int, np.ndarray] = {}
        if b16:
            self._fast_buffers(gemm, ws)

    def _fast_buffers(self, gemm, ws) -> None:
        """``precision="fast"``'s state (``plan.grad16``): the rounding error's sums, the chunks'
        mean rows of ``W`` (once per call), the row block's mean row of ``X``, the bf16 pairs of
        ``X[b]`` (``grad_weight``'s ``B``) and of ``W``'s chunk (``grad_input``'s ``B``)."""
        cdt, H, take, vc = self.cdt, self.H, ws.take, self.plan.v_chunk
        nb_rows, nch = self.plan.largest_block, len(self.chunks)
        self.spec = _bf16dot.spec_named(gemm.variant)
        self.form = gemm.a_form
        self.e_col = take("fast_e_col", -(-nb_rows // _E_GROUP) * vc, cdt)
        self.e_row_buf = take("fast_e_row", nb_rows * nch, cdt)
        self.w_bar = take("fast_w_mean", nch * H, cdt)[: nch * H].reshape(nch, H)
        self.x_bar = take("fast_x_mean", H, cdt)[:H]
        wu = self.W.view(np.uint16)
        for c, (v0, v1) in enumerate(self.chunks):
            run_rows(_col_mean16, H, wu[v0:v1], D.BF16, self.w_bar[c])
        self.xi_buf = take("x_pairs_block", _bf16dot.b_size(nb_rows, H), np.uint32) if self.gw is not None else None
        self.wi_buf = take("w_pairs_chunk", _bf16dot.b_size(vc, H), np.uint32) if self.gi is not None else None
        self.prod = take("fast_product", nb_rows * H, cdt) if self.gi is not None else None
        self.xint = None

    def _filters(self, params, ws) -> None:
        """Gradient filtering's state (module doc): on when ``filter_eps`` is given with a gradient."""
        cdt, K, H, take = self.cdt, self.K, self.H, ws.take
        feps = params.get("filter_eps")
        self.fstats = self.out.get("filter_stats")
        if self.fstats is not None:
            self.fstats.setdefault("blocks_total", 0)
            self.fstats.setdefault("blocks_skipped", 0)
        self.filtered = self.plan.filter_rows > 0  # (training_modes: filter_eps given, a gradient, K > 0)
        if not self.filtered:
            return
        nb_max, vc = self.plan.block_rows, self.plan.v_chunk
        fb, rb = self.plan.filter_cols, self.plan.filter_rows
        self.fb, self.rb = fb, rb
        nblk = -(-K // fb)
        self.fflags = take("filter_flags", nb_max * nblk, np.bool_)[: nb_max * nblk].reshape(nb_max, nblk)
        # the row scale: |upstream grad · 1/Σw| (coef_ce); a row whose gradient is identically 0
        # (ignored, or a zero upstream grad) is negligible everywhere
        coef_ce, coef_z = self.coef_ce, self.coef_z
        self.thr_all = np.where((coef_ce == 0) & (coef_z == 0), np.inf, float(feps) * np.abs(coef_ce)).astype(cdt)
        if not self.widen:
            self.fwsrc, self.fwcode = self.W, None
        elif self.wfull is not None:
            self.fwsrc, self.fwcode = self.wfull, None
        else:
            self.fwsrc, self.fwcode = self.W.view(np.uint16), D.code_of(self.W.dtype)
        gi, gw = self.gi, self.gw
        self.fbufs = (
            take("kept_g", rb * vc, cdt),
            take("kept_w", vc * H, cdt) if gi is not None else None,
            take("kept_product", rb * H, cdt) if gi is not None else None,
            take("kept_grad_weight", vc * H, cdt) if gw is not None else None,
        )

    # -- the row block
    def begin_rows(self, b0: int, b1: int) -> None:
        nb, cdt = b1 - b0, self.cdt
        self.b0, self.b1, self.nb = b0, b1, nb
        self.X = _block(self.input, b0, b1, cdt, self.xbuf) if self.need_x else self.input[b0:b1]
        ch = self.chunks
        self.offs = np.array([0 if self.fwd_only else nb * v0 for v0, _ in ch], np.int64) if ch else _EMPTY_I
        self.widths = np.array([v1 - v0 for v0, v1 in ch], np.int64) if ch else _EMPTY_I
        self._w = {}
        if self.b16:
            nch = len(self.chunks)
            self.e_row = self.e_row_buf[: nb * nch].reshape(nb, nch)
            self.e_row[...] = 0
            run_rows(_col_mean16, self.H, self.input[b0:b1].view(np.uint16), D.BF16, self.x_bar)
            self.xint = None if self.xi_buf is None else _bf16dot.interleave(self.input[b0:b1], self.xi_buf)
        if not self.recompute:
            self.m = np.full(nb, -np.inf, cdt)
            self.s = np.zeros(nb, cdt)
            self.zt = np.zeros(nb, cdt)
            self.zs = np.zeros(nb, cdt)
            self.am = np.full(nb, -1, np.int64)
            self.sz = np.zeros(nb, cdt)

    def _chunk_block(self, c: int) -> np.ndarray:
        """Chunk ``c``'s part of the row block's logits (or gradient): ``[nb, v1 - v0]``."""
        v0, v1 = self.chunks[c]
        off = self.offs[c]
        return self.Lbuf[off : off + self.nb * (v1 - v0)].reshape(self.nb, v1 - v0)

    def _weight(self, c: int) -> list:
        """Chunk ``c``'s weight rows in the compute dtype (recorded for the chunk's GEMMs) and the
        tasks that widen them (none: already in the compute dtype, or widened whole)."""
        v0, v1 = self.chunks[c]
        if not self.widen:
            self._w[c] = self.W[v0:v1]
            return []
        if self.wfull is not None:
            self._w[c] = self.wfull[v0:v1]
            return []
        Wc, tasks = fp32_block_tasks(self.W, v0, v1, self.wbufs[c % len(self.wbufs)])
        self._w[c] = Wc
        return tasks

    # -- the statistics sweep
    def statistics(self) -> Sweep:
        """Per chunk: its weight, its logits, its statistics (the logits' GEMM tiles lead a stage)."""
        steps = (self._logits_weight, self._logits, self._stats)
        return Sweep(len(self.chunks), steps, staged=self.plan.staged_statistics, lead=1, uses=self._stats_uses)

    def _wkey(self, c: int) -> set:
        """The widened weight's buffer chunk ``c`` takes, as a resource (none: read-only)."""
        return {("w", c % len(self.wbufs))} if self.wbufs else set()

    def _stats_uses(self, k: int, c: int) -> tuple[set, set]:
        """What step ``k`` of the statistics sweep reads and writes for chunk ``c`` (``Sweep.uses``)."""
        L = ("L", c)
        if k == 0:  # the weight widened into its buffer
            return set(), self._wkey(c)
        if k == 1:  # the logits
            return self._wkey(c), {L}
        return set(), {L, "row_stats"}  # the transform in place, the running statistics

    def _logits_weight(self, c: int) -> list:
        return [] if self.bfl is not None else self._weight(c)

    def _logits(self, c: int) -> list:
        Lc = self._chunk_block(c)
        if self.bfl is not None:  # one task: the kernel's own parallel call, on this thread
            v0, v1 = self.chunks[c]
            return [functools.partial(self._logits16, v0, v1, Lc)]
        r, k = self.plan.logits_tile
        return nt_tasks(self.X, self._w[c], Lc, engine=self.eng, rows=r, cols=k)

    def _logits16(self, v0: int, v1: int, Lc: np.ndarray) -> None:
        self.bfl.chunk(v0, v1)
        self.bfl.logits(self.b0, self.b1, Lc)

    def _stats(self, c: int) -> list:
        """``_stats_chunk``'s tasks for chunk ``c`` (its last argument: the column shift — the forward
        alone keeps one chunk at a time at offset 0)."""
        if self.recompute:
            return []
        nb, b0, b1 = self.nb, self.b0, self.b1
        stats = (self.m, self.s, self.zt, self.zs, self.am, self.sz)
        shift = self.chunks[c][0] if self.fwd_only else 0
        consts = (self.bias_c, self.cw_c, self.tcol[b0:b1], self.par, self.flags, self.transform)
        return row_tasks(_stats_chunk, nb, self.Lbuf, self.offs[c], self.widths[c], nb, *consts, *stats, shift)

    def end_statistics(self) -> Sweep | None:
        """The row's statistics complete (made global, written); the gradient sweep, or None."""
        if not self.recompute:
            self._row_statistics()
        if not self.want_grad or not self.K:
            return None
        if self.filtered:
            self.fflags[: self.nb] = False
            return Sweep(len(self.chunks), (self._grad, self._colsum_flags))
        return self._gradient_sweep(with_pass=True, staged=self.plan.staged_gradient)

    def _row_statistics(self) -> None:
        b0, b1, cdt, out = self.b0, self.b1, self.cdt, self.out
        m, s, zt, zs, am, sz = self.m, self.s, self.zt, self.zs, self.am, self.sz
        zs[m == -np.inf] = 0  # a row without a finite logit: Σ w z is 0, as Σ exp
        am = np.where(am >= 0, am + self.col0, -1)
        if self.combine is not None:
            if self.need_ent:
                m, s, zt, zs, am, sz = self.combine(m, s, zt, zs, am, sz)
            else:
                m, s, zt, zs, am = self.combine(m, s, zt, zs, am)
        with np.errstate(divide="ignore", invalid="ignore"):
            lse_b = (m + np.log(s)).astype(cdt)
            if self.need_ent:  # μ = Σ p·z = max + Σ e·(z - max) / Σ e; entropy = lse - μ
                dz = np.asarray(sz) / s
                self.zmean_all[b0:b1] = (m + dz).astype(cdt)
                if out.get("entropy") is not None:
                    out["entropy"][b0:b1] = np.log(s) - dz
        self.lse_all[b0:b1] = lse_b
        for key, val in (("max", m), ("sum_exp", s), ("z_target", zt), ("z_sum", zs), ("argmax", am)):
            if out.get(key) is not None:
                out[key][b0:b1] = val

    # -- the gradient sweep
    def _gradient_sweep(self, *, with_pass: bool, staged: bool) -> Sweep:
        """Per chunk: (``with_pass``) its gradient pass, and its weight; its two gradient GEMMs
        (and ``grad_bias``'s column sums, ``with_pass``); a 16-bit ``grad_weight``'s product, then
        its rounded scatter-add.  The GEMM tiles lead a stage.  ``precision="fast"``
        (``plan.grad16``, chunk by chunk): the pass, ``grad_bias``'s sums, ``g`` rounded to bf16,
        then the two GEMMs on the bf16 kernel (:meth:`_fast_products`)."""
        if self.b16:
            return Sweep(len(self.chunks), (self._grad, self._colsum, self._round16, self._fast_products))
        steps: list[Callable[[int], list]] = [
            functools.partial(self._pass_and_weight, with_pass),
            self._grad_input_product,
            functools.partial(self._grad_weight_product, with_pass),
        ]
        if self.gw is not None and self.gw_code is not None:
            steps += [self._grad_weight16, self._grad_weight16_add]
        uses = functools.partial(self._grad_uses, with_pass)
        return Sweep(len(self.chunks), tuple(steps), staged=staged, lead=(1, 2), uses=uses)

    def _grad_uses(self, with_pass: bool, k: int, c: int) -> tuple[set, set]:
        """What step ``k`` of the gradient sweep reads and writes for chunk ``c`` (``Sweep.uses``)."""
        L = ("L", c)
        if k == 0:  # the gradient pass in place, the weight widened for grad_input's GEMM
            return set(), ({L} if with_pass else set()) | (self._wkey(c) if self.gi is not None else set())
        if k == 1:  # grad_input[b] (+)= G·W[v]: one accumulator over the chunks
            return {L} | self._wkey(c), ({"grad_input"} if self.gi is not None else set())
        if k == 2:  # grad_weight[v] (+)= Gᵀ·X[b] (a shared scratch unless summed in the call), grad_bias[v]
            w: set = {("grad_weight", c), ("grad_bias", c)}
            if self.gw is not None and self.gw_code is None and not self.first and not self.plan.accumulate_in_gemm:
                w.add("grad_weight_product")
            return {L}, w
        if k == 3:  # a 16-bit grad_weight: the chunk's product into scratch
            return {L}, {"grad_weight_product"}
        return {"grad_weight_product"}, {"grad_weight"}  # ... rounded onto the output

    def _grad(self, c: int) -> list:
        """``_grad_pass``'s tasks: chunk ``c``'s logits overwritten by the gradient ``G``."""
        b0, b1, nb = self.b0, self.b1, self.nb
        rows = tuple(a[b0:b1] for a in self.rows)
        args = (self.Lbuf, self.offs[c : c + 1], self.widths[c : c + 1], nb, self.cw_c, *rows)
        return row_tasks(_grad_pass, nb, *args, self.par, self.flags, self.recompute, self.bias_c, 0)

    def _round16(self, c: int) -> list:
        """``precision="fast"``: chunk ``c``'s ``G`` rounded to bf16 in place, its rounding error
        summed per row (``e_row[:, c]``) and per row group and column (``e_col``)."""
        nb, w = self.nb, self.widths[c]
        ng = -(-nb // _E_GROUP)
        ec = self.e_col[: ng * w].reshape(ng, w)
        return row_tasks(_round_g_bf16, ng, self._chunk_block(c), self.e_row[:, c], ec)

    def _fast_products(self, c: int) -> list:
        """``precision="fast"``: chunk ``c``'s two gradient GEMMs on the bf16 kernel (one task:
        the kernel's own parallel calls, on this thread) — ``grad_weight[v] (+)= Gᵀ·X[b]`` and
        the mean part of the rounding error ``(Σ_t e)·mean_t X[b]``, then ``grad_input[b] (+)=
        G·W[v]`` (``G`` overwritten by its pairs)."""
        return [functools.partial(self._fast_products_run, c)]

    def _fast_products_run(self, c: int) -> None:
        v0, v1 = self.chunks[c]
        G, H, nb, w = self._chunk_block(c), self.H, self.nb, v1 - v0
        if self.gw is not None:
            acc = self.gw[v0:v1]
            _bf16dot.matmul_tn(G, self.xint, H, acc, acc=not self.first, form=self.form, spec=self.spec)
            ng = -(-nb // _E_GROUP)
            run_rows(_add_outer, w, acc, self.e_col[: ng * w].reshape(ng, w).sum(0), self.x_bar)
        if self.gi is not None:
            wi = _bf16dot.interleave(self.W[v0:v1], self.wi_buf)
            gi = self.gi[self.b0 : self.b1]
            _bf16dot.matmul(_bf16dot.pairs_in_place(G, self.form), wi, H, gi, acc=v0 > 0, spec=self.spec)

    def _colsum(self, c: int) -> list:
        if self.gb is None:
            return []
        nb, off, w = self.nb, self.offs[c], self.widths[c]
        return row_tasks(_colsum_into, w, self.Lbuf, off, w, nb, self.gb, off // nb)

    def _pass_and_weight(self, with_pass: bool, c: int) -> list:
        return (self._grad(c) if with_pass else []) + (self._weight(c) if self.gi is not None else [])

    def _grad_input_product(self, c: int) -> list:
        """``grad_input[b] (+)= G·W[v]`` for chunk ``c``, as tasks (summed over the chunks: in the
        BLAS call, or through the scratch product)."""
        if self.gi is None:
            return []
        v0 = self.chunks[c][0]
        nb, H, b0, b1 = self.nb, self.H, self.b0, self.b1
        tmp = self._sum_with(v0 == 0, self.tmp_h, (nb, H))
        r, k = self.plan.grad_input_tile
        return nn_tasks(self._chunk_block(c), self._w[c], self.gi[b0:b1], tmp, self.eng, rows=r, cols=k)

    def _sum_with(self, first: bool, scratch, shape: tuple[int, int]):
        """An accumulating tile's ``tmp`` (``_gemm._mm_into``): None for the first term (written),
        else ``IN_BLAS`` where the plan sums in the BLAS call, or ``scratch``'s first ``shape``."""
        if first:
            return None
        if self.plan.accumulate_in_gemm:
            return IN_BLAS
        return scratch[: shape[0] * shape[1]].reshape(shape)

    def _grad_weight_product(self, with_colsum: bool, c: int) -> list:
        """(In the compute dtype) ``grad_weight[v] (+)= Gᵀ·X[b]`` for chunk ``c``, as tasks (summed
        over the row blocks), and ``grad_bias``'s column sums (``with_colsum``)."""
        t = []
        if self.gw is not None and self.gw_code is None:
            v0, v1 = self.chunks[c]
            tmp = self._sum_with(self.first, self.tmp_w, (v1 - v0, self.H))
            t = tn_tasks(self._chunk_block(c), self.X, self.gw[v0:v1], tmp, self.eng, rows=self.plan.grad_weight_rows)
        return t + (self._colsum(c) if with_colsum else [])

    def _grad_weight16(self, c: int) -> list:
        """A 16-bit ``grad_weight`` (``accum_dtype``): chunk ``c``'s ``Gᵀ·X[b]`` into scratch."""
        v0, v1 = self.chunks[c]
        tw = self.tmp_w[: (v1 - v0) * self.H].reshape(v1 - v0, self.H)
        return tn_tasks(self._chunk_block(c), self.X, tw, None, self.eng, rows=self.plan.grad_weight_rows)

    def _grad_weight16_add(self, c: int) -> list:
        """... then summed onto the output's rows with rounding (the output zeroed first)."""
        v0, v1 = self.chunks[c]
        tw = self.tmp_w[: (v1 - v0) * self.H].reshape(v1 - v0, self.H)
        return row_tasks(_scatter_add_rounded, v1 - v0, self.gw_acc, self.all_rows[v0:v1], tw, self.gw_code)

    def _colsum_flags(self, c: int) -> list:
        """Filtered: ``grad_bias``'s column sums and the block flags of chunk ``c`` (read-only on ``G``)."""
        nb, b0, b1 = self.nb, self.b0, self.b1
        F = self.fflags[:nb]
        thr = self.thr_all[b0:b1]
        flags = row_tasks(_filter_flags, nb, self.Lbuf, self.offs[c], self.widths[c], nb, thr, self.fb, F)
        return self._colsum(c) + flags

    def end_rows(self) -> None:
        """Filtered: the kept blocks' products (or the dense ones where every block is kept).
        ``precision="fast"``: ``grad_input[b] += e_row · w_bar``, the rounding error's mean part
        over the chunks."""
        if self.filtered:
            self._kept_products()
        if self.b16 and self.gi is not None and self.want_grad and self.K:
            nb, H = self.nb, self.H
            tmp = self.prod[: nb * H].reshape(nb, H)
            matmul_nn(self.e_row, self.w_bar, self.gi[self.b0 : self.b1], tmp=tmp, engine=self.eng)
        self.first = False

    def _kept_products(self) -> None:
        nb, b0, b1, fb, rb, K = self.nb, self.b0, self.b1, self.fb, self.rb, self.K
        F = self.fflags[:nb]
        tc = self.tcol[b0:b1]
        own = np.flatnonzero(tc >= 0)
        F[own, tc[own] // fb] = True  # the target column is never filtered
        keep = np.logical_or.reduceat(F, np.arange(0, nb, rb), axis=0)
        n_keep = int(keep.sum())
        if self.fstats is not None:
            self.fstats["blocks_total"] += keep.size
            self.fstats["blocks_skipped"] += keep.size - n_keep
        if n_keep == keep.size:  # every block kept: the dense path, unchanged (bitwise)
            sweep(self._gradient_sweep(with_pass=False, staged=False), self.eng)
            return
        _filtered_products(
            self.Lbuf,
            self.offs,
            self.widths,
            nb,
            keep,
            fb,
            rb,
            K,
            self.plan.v_chunk,
            self.fwsrc,
            self.fwcode,
            self.X,
            None if self.gi is None else self.gi[b0:b1],
            self.gw_acc,
            self.fbufs,
            self.gw_code,
            self.eng,
        )


_EMPTY_I = np.zeros(0, np.int64)
