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

Three GEMMs per row block, run in stages (``STAGED``): the logits tiles of chunk ``c`` beside
the widening of chunk ``c + 1`` and the statistics of chunk ``c - 1``; then chunk ``c``'s two
gradient GEMMs beside chunk ``c + 1``'s gradient pass and widening — one barrier per stage, the
same calls on the same operands as chunk by chunk (the same bits), the element-wise passes and
the widening hidden behind the GEMMs (Qwen2.5-0.5B head, bf16, Zen 3, 2 cores: 15.5 → 14.9 s).
The forward alone (no gradient) keeps one chunk of ``tiling.TRAIN_VM_CHUNK``
columns at a time instead of the block's whole row, with all rows in one block while
``[BT, TRAIN_VM_CHUNK]`` fits half the workspace (the weight widened once).  With ``lse`` given (the
backward of a forward that did not compute the gradient) the dense gradient is recomputed
**vocabulary-major** (``_vocab_major``): per chunk of ``TRAIN_VM_CHUNK`` columns, its logits for all
rows, steps 4's pass and products; a chunk's ``grad_weight`` is complete after its rows, so a
16-bit one is rounded once from fp32 and no ``[K, H]`` accumulator exists.

Gradient filtering (``params["filter_eps"]``, CCE's ``filter_eps``): after step 4's pass over
each vocabulary chunk (the chunk still in cache) a read-only pass flags, per row and per block
of ``filter_cols`` vocabulary columns, whether some ``|G[r, v]|`` is not below
``filter_eps·|coef_ce[r]|`` (the row's scale: the upstream gradient and the mean's ``1/Σw``;
a row whose gradient is identically 0 — ignored — has nothing to keep), or the block holds
the row's target column.  A block of ``filter_rows`` rows × ``filter_cols`` columns without a
flag is skipped in both GEMMs: the kept blocks' columns of ``G`` and rows of ``W`` are
gathered (at most ``v_chunk`` columns at a time) and the products accumulated.  A row block
with every block kept takes the dense path unchanged (bitwise).  ``grad_bias`` is the column
sum of the whole ``G``, never filtered.

Pure: imports only dtypes helpers, the JIT helpers, the allocator, the vector math and the GEMM helpers.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import dtypes as D
from .._jit import FASTMATH_SAFE, njit, tjit
from ..tiling import BLAS, FAST_E_GROUP, TrainingPlan
from . import _bf16dot
from ._gemm import (
    _spans,
    blas_for,
    matmul_nn,
    matmul_nt,
    matmul_tn,
    mm,
    nn_tasks,
    nt_tasks,
    row_tasks,
    run_rows,
    run_tasks,
    tn_tasks,
)
from ._linear import fp32_block, fp32_block_tasks, kept_blocks
from ._lm_head import Workspace
from ._lm_head import run as run_tiles
from ._vmath import exp_c, row_max, row_nan_count, row_sum_exp

__all__ = ["linear_cross_entropy_cpu"]


# ----------------------------------------------------------------------------------------------
# dtype-generic scalar helpers (fp32: the vectorizable exp; fp64: libm)
# ----------------------------------------------------------------------------------------------


# par (compute dtype): 0 softcap, 1 1/softcap, 2 1/temperature, 3 temperature,
#                      4 eps, 5 eps/V, 6 eps*Wsum/V, 7 2*lse_square_scale, 8 -inf, 9 one, 10 zero
# flags (int64):       0 has_softcap, 1 has_bias, 2 has_class_weight, 3 need_zsum,
#                      4 need the entropy's statistic, 5 has an entropy gradient


# Row helpers of the chunk passes (besides ``_vmath.row_*``): loops over one row of a chunk given
# as a 1-D slice, so that they vectorize (see ``_vmath``).


@njit
def _row_max_nan(r, ninf):
    """Row max ignoring NaN (a NaN never becomes the max; it propagates through the sum)."""
    m = ninf
    for j in range(r.shape[0]):
        x = r[j]
        if x > m:
            m = x
    return m


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
    cap = par[0]
    icap = par[1]
    it = par[2]
    for j in range(r.shape[0]):
        x = r[j]
        if flags[1]:
            x = x + bias[j]
        if flags[0]:
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
    max and its first index, ``Σ exp(z - max)`` and (``flags[4]``) ``Σ exp(z - max)·(z - max)``
    (both rescaled when the max grows), the target's ``z`` and ``Σ_v w_v z_v``.  NaN never
    becomes the max and propagates through the sums."""
    ninf = par[8]
    zero = par[10]
    v0 = off // nb + vshift
    for i in range(lo, hi):
        r = L[off + i * width : off + (i + 1) * width]
        if transform:
            _row_transform(r, bias[v0 : v0 + width] if flags[1] else bias, par, flags)
        if row_nan_count(r) == 0:
            cm = row_max(r, ninf)
        else:
            cm = _row_max_nan(r, ninf)
        m = m_io[i]
        s = s_io[i]
        sz = sz_io[i] if flags[4] else zero
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
            if flags[4]:
                sz += _row_sum_exp_dz(r, m, zero)
        m_io[i] = m
        s_io[i] = s
        if flags[4]:
            sz_io[i] = sz
        if flags[3]:
            if flags[2]:
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
    the entropy's upstream coefficient and ``μ = Σ p·z`` per row, read with ``flags[5]``).
    Chunk ``c`` starts at vocabulary column ``offs[c] // nb + vshift``."""
    nchunk = offs.shape[0]
    cap = par[0]
    icap = par[1]
    it = par[2]
    T = par[3]
    one = par[9]
    one_m_eps = one - par[4]
    for i in range(lo, hi):
        cc = coef_ce[i]
        cz = coef_z[i]
        lz = lse[i]
        a = cc * (one_m_eps * wt[i] + par[6]) + cz * par[7] * lz
        b = cc * one_m_eps * wt[i]
        e = cc * par[5]
        t = tcol[i]
        h = coef_h[i] if flags[5] else par[10]
        mu = zmean[i] if flags[5] else par[10]
        # no per-column transform but the temperature: the vectorized loops (z = L·s, the
        # product by 1 exact for stored z, the same operations as the general loop below)
        plain = not flags[0] and not flags[2] and not (recompute and flags[1])
        s = it if recompute else one
        for c in range(nchunk):
            base = offs[c] + i * widths[c]
            v0 = offs[c] // nb + vshift
            if a == 0 and b == 0 and e == 0 and h == 0:
                for j in range(widths[c]):
                    L[base + j] = par[10]
                continue
            if plain:
                # the target column's term is applied after the vectorized loop, in the same
                # order of operations as the general loop below
                tin = t >= v0 and t < v0 + widths[c]
                xt = L[base + t - v0] * s if tin else par[10]
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
                    if flags[1]:
                        x = x + bias[v0 + j]
                    if flags[0]:
                        x = cap * np.tanh(x * icap)
                    x = x * it
                p = exp_c(x - lz)
                g = a * p
                if h != 0 and p != 0:
                    g = p * (a + h * (mu - x))
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


@tjit
def _add_into(lo, hi, dst, src):
    n, h = dst.shape
    for i in range(lo, hi):
        for j in range(h):
            dst[i, j] += src[i, j]


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


#: output columns of grad_input (resp. rows of grad_weight) per BLAS call of the filtered
#: products: fixed, never from the thread count (bitwise reproducible, as ``_gemm``)
_FILTER_H_BLOCK = 128
_FILTER_Q_BLOCK = 512


def _filtered_products(
    Lbuf, offs, widths, nb, keep, fb, rb, K, vc, wsrc, wcode, X, gi_rows, gw, bufs, gw_code, eng="blas"
) -> None:
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
            run_rows(_gather_cols, r1 - r0, Lbuf, coff[cq], chunk_w[cq], r0, r1, Gc)
            tasks: list = []
            if gi_rows is not None:
                Wc = w_buf[: nq * H].reshape(nq, H)
                if wcode is None:
                    run_rows(_gather_rows, nq, wsrc, cq, Wc)
                else:
                    run_rows(_gather_rows_widen, nq, wsrc, cq, wcode, Wc)
                # rows r0:r1 of grad_input are zero until this row block's first chunk: write it
                P = gi_rows[r0:r1] if q0 == 0 else p_buf[: nr * H].reshape(nr, H)
                for a, b in _spans(H, _FILTER_H_BLOCK):
                    tasks.append(functools.partial(mm, Gc, Wc[:, a:b], P[:, a:b], eng))
            if gw is not None:
                Q = q_buf[: nq * H].reshape(nq, H)
                for a, b in _spans(nq, _FILTER_Q_BLOCK):
                    tasks.append(functools.partial(mm, Gc[:, a:b].T, X[r0:r1], Q[a:b], eng))
            run_tasks(tasks, eng)
            if gi_rows is not None and q0 > 0:
                run_rows(_add_into, nr, gi_rows[r0:r1], P)
            if gw is not None:
                if gw_code is None:
                    run_rows(_scatter_add_rows, nq, gw, cq, Q)
                else:
                    run_rows(_scatter_add_rounded, nq, gw, cq, Q, gw_code)


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
    return _bf16dot.Logits(input, W, vc, take=ws.take, form=gemm.a_form)


#: Run the row block's chunks in stages (one stage: chunk c's GEMM tiles beside chunk c + 1's
#: widening and element-wise pass, one barrier).  False: chunk by chunk, one barrier per step —
#: the same calls on the same operands, so the same bits (tests/test_linear_cross_entropy_staged.py).
STAGED = True


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


def _reporting(blocks: list, progress):
    """``blocks`` in order, ``progress(k, len(blocks))`` once the loop's body for block ``k`` is
    done (also when it ends with ``continue``)."""
    for k, blk in enumerate(blocks):
        yield blk
        if progress is not None:
            progress(k + 1, len(blocks))


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
                _bf16dot.matmul_tn(G, X, H, acc, acc=k > 0, form=self.gemm.a_form)
                run_rows(_add_outer, w, acc, ec.sum(0), self.x_bar[k])
            if gi is not None:
                _bf16dot.matmul(_bf16dot.pairs_in_place(G, self.gemm.a_form), self.Wc, H, gi[b0:b1], acc=v0 > 0)
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
    need_zsum, vocab_start_index (and optionally filter_eps, filter_rows, filter_cols).
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
    need_ent = not recompute and (coef_h is not None or any(out.get(k) is not None for k in ("z_mean", "entropy")))
    flags = np.array(
        [
            softcap is not None,
            bias is not None,
            class_weight is not None,
            bool(params["need_zsum"]),
            need_ent,
            coef_h is not None,
        ],
        np.int64,
    )
    bias_c = bias.astype(cdt) if bias is not None else np.zeros(1, cdt)
    cw_c = class_weight.astype(cdt) if class_weight is not None else np.zeros(1, cdt)
    wt_c = target_weight.astype(cdt)
    coef_ce = coef_ce.astype(cdt) if coef_ce is not None else np.zeros(BT, cdt)
    coef_z = coef_z.astype(cdt) if coef_z is not None else np.zeros(BT, cdt)
    coef_h = coef_h.astype(cdt) if coef_h is not None else np.zeros(BT, cdt)
    col0 = int(params["vocab_start_index"])
    tcol = np.ascontiguousarray(target_cols, dtype=np.int64)
    # the dense products write every element of grad_input / grad_weight (the first chunk, the
    # first row block) in parallel: no serial first touch of fresh memory; zeros only where
    # something may be left unwritten (filtering skips blocks; K = 0 or BT = 0 writes nothing)
    partial = params.get("filter_eps") is not None or K == 0 or BT == 0
    if gi is not None and partial:
        gi[...] = 0
    # the recompute of the gradient alone runs vocabulary-major (``_vocab_major``)
    vmajor = recompute and want_grad and params.get("filter_eps") is None and K > 0 and BT > 0
    if gw is not None and (partial or (gw_code is not None and not vmajor)):  # 16-bit: accumulated from zero
        gw[...] = 0
    if gb is not None:
        gb[...] = 0
    if not recompute:
        lse_all = out["lse"]
        zmean_all = out.get("z_mean")
    else:
        lse_all = np.ascontiguousarray(lse, dtype=cdt)
        zmean_all = np.ascontiguousarray(z_mean, dtype=cdt) if flags[5] else None
    if zmean_all is None:  # computed (need_ent) or read (flags[5]) only when wanted
        zmean_all = np.zeros(BT, cdt)
    if BT == 0:
        return
    # the plan's row blocks and chunks (made by the op layer: tiling.plan_training_loss): the
    # forward alone keeps one chunk at a time, for all rows while they fit half the budget; with
    # the gradient, the row block's whole row; from the global V, so every rank of a
    # vocabulary-parallel group plans the same row blocks (the combine runs per block)
    nb_max = plan.block_rows
    fwd_only = not want_grad
    vc = plan.v_chunk
    chunks = [(v0, min(K, v0 + vc)) for v0 in range(0, K, vc)]
    W = weight if weight.flags.c_contiguous else np.ascontiguousarray(weight)
    widen = W.dtype != cdt
    if vmajor != plan.vocab_major:
        raise ValueError(f"plan.vocab_major is {plan.vocab_major}, the call's arguments say {vmajor}")
    # every buffer from the plan's list (tiling.training_buffers): the memory estimate is what runs
    ws = Workspace(plan)
    take = ws.take
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
    # the logits of bf16 operands on the exact-product bf16 kernel where it may run; the weight
    # then needs no widening for the forward alone
    bfl = _bf16_logits(input, W, vc, plan, gemm, ws)
    # keep the whole weight in the compute dtype when it is small, else widen per chunk; the
    # buffers on recycled memory (fastgrad._outcache): a training loop's next step takes no
    # fresh pages
    wfull = _block(W, 0, K, cdt, take("w_whole", K * H, cdt)) if (widen and plan.whole_weight) else None
    # (with the logits on the bf16 kernel the chunk is read by grad_input's GEMM alone)
    wbuf = take("w_chunk", vc * H, cdt) if (widen and wfull is None and (bfl is None or gi is not None)) else None
    # pipelined stages (``_pipelined_*``): one stage's GEMM tiles run beside the next chunk's
    # element-wise pass and widening, one barrier per stage; the widened chunks double-buffered
    pipe = STAGED and bfl is None and not fwd_only and not recompute
    pipe_grad = pipe and gw_code is None and params.get("filter_eps") is None and K > 0
    wbufs = (wbuf, take("w_chunk_next", vc * H, cdt)) if (pipe and wbuf is not None) else None
    # the equal row blocks' largest (at most nb_max rows): the row-block buffers' size
    nb_rows = plan.largest_block
    # the row block's X in the compute dtype: for the BLAS logits and the gradient GEMMs (the
    # forward alone on the bf16 logits kernel reads none)
    need_x = bfl is None or want_grad
    xbuf = take("x_block", nb_rows * H, cdt) if (input.dtype != cdt and need_x) else None
    Lbuf = take("logits_block", nb_rows * (vc if fwd_only else max(K, 1)), cdt)  # the row block's logits
    tmp_h = take("grad_input_product", nb_rows * H, cdt) if gi is not None else None
    tmp_w = take("grad_weight_product", vc * H, cdt) if gw is not None else None
    all_rows = None
    if gw_code is not None:  # a 16-bit grad_weight's rows, for the rounded scatter-add
        all_rows = take("vocab_rows", K, np.int64)[:K]
        all_rows[:] = np.arange(K, dtype=np.int64)

    def wchunk(v0, v1):
        if not widen:
            return W[v0:v1]
        if wfull is not None:
            return wfull[v0:v1]
        return _block(W, v0, v1, cdt, wbuf)

    def wchunk_staged(c):
        """Chunk ``c`` of the weight in the compute dtype and the tasks that fill it (double
        buffered: chunk ``c`` may be widened while chunk ``c - 1`` is read)."""
        v0, v1 = chunks[c]
        if wbufs is None:
            return wchunk(v0, v1), []
        return fp32_block_tasks(W, v0, v1, wbufs[c % 2])

    feps = params.get("filter_eps")
    fstats = out.get("filter_stats")
    if fstats is not None:
        fstats.setdefault("blocks_total", 0)
        fstats.setdefault("blocks_skipped", 0)
    if feps is not None and want_grad and K:
        fb = int(params["filter_cols"])
        rb = max(1, min(int(params["filter_rows"]), nb_max))
        nblk = -(-K // fb)
        fflags = take("filter_flags", nb_max * nblk, np.bool_)[: nb_max * nblk].reshape(nb_max, nblk)
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
            take("kept_g", min(rb, nb_max) * vc, cdt),
            take("kept_w", vc * H, cdt) if gi is not None else None,
            take("kept_product", min(rb, nb_max) * H, cdt) if gi is not None else None,
            take("kept_grad_weight", vc * H, cdt) if gw is not None else None,
        )
    else:
        feps = None
    empty_i = np.zeros(0, np.int64)
    transform = bool(flags[0] or flags[1] or par[2] != 1)
    first_w = True

    def product_tasks(b0, b1, v0, v1, off, first, X, Wc):
        """Dense, as tasks: ``grad_input[b] (+)= G·W[v]`` and (in the compute dtype)
        ``grad_weight[v] (+)= Gᵀ·X[b]`` for one chunk."""
        nb = b1 - b0
        Gc = Lbuf[off : off + nb * (v1 - v0)].reshape(nb, v1 - v0)
        t = []
        if gi is not None:
            t += nn_tasks(Gc, Wc, gi[b0:b1], None if v0 == 0 else tmp_h[: nb * H].reshape(nb, H), eng)
        if gw is not None and gw_code is None:
            t += tn_tasks(Gc, X, gw[v0:v1], None if first else tmp_w[: (v1 - v0) * H].reshape(v1 - v0, H), eng)
        return t

    def products(b0, b1, v0, v1, off, first, X):
        """:func:`product_tasks` run; a 16-bit ``grad_weight`` (``accum_dtype``) accumulated
        (rounded) in the output itself (zeroed)."""
        run_tasks(product_tasks(b0, b1, v0, v1, off, first, X, wchunk(v0, v1) if gi is not None else None), eng)
        if gw is not None and gw_code is not None:
            nb = b1 - b0
            Gc = Lbuf[off : off + nb * (v1 - v0)].reshape(nb, v1 - v0)
            tw = tmp_w[: (v1 - v0) * H].reshape(v1 - v0, H)
            matmul_tn(Gc, X, tw, engine=eng)
            run_rows(_scatter_add_rounded, v1 - v0, gw_acc, all_rows[v0:v1], tw, gw_code)

    def grad_args(b0, b1, offs, widths):
        """``_grad_pass``'s arguments after ``(lo, hi)`` for rows ``b0:b1`` and the chunks ``offs``/``widths``."""
        rows = (tcol, wt_c, lse_all, coef_ce, coef_z, coef_h, zmean_all)
        return (Lbuf, offs, widths, b1 - b0, cw_c, *(a[b0:b1] for a in rows), par, flags, recompute, bias_c, 0)

    def grad(b0, b1, offs, widths):
        run_rows(_grad_pass, b1 - b0, *grad_args(b0, b1, offs, widths))
        if gb is not None:
            for off, w in zip(offs, widths):
                run_rows(_colsum_into, w, Lbuf, off, w, b1 - b0, gb, off // (b1 - b0))

    def _staged_products(b0, b1, offs, widths, X, first):
        """``grad`` and ``products`` of every chunk, in stages: chunk c's two gradient GEMMs
        (and ``grad_bias``'s column sums) beside chunk c + 1's gradient pass and widening.
        The same calls on the same operands as ``grad`` + ``products`` chunk by chunk, and
        ``grad_input`` still takes the chunks in order (one stage holds one chunk's products)."""
        nb = b1 - b0

        def grad_tasks(c):
            return row_tasks(_grad_pass, nb, *grad_args(b0, b1, offs[c : c + 1], widths[c : c + 1]))

        Wn, wt = wchunk_staged(0)
        run_tasks(grad_tasks(0) + wt, eng)
        for c, (v0, v1) in enumerate(chunks):
            Wc, w = Wn, v1 - v0
            tasks = product_tasks(b0, b1, v0, v1, offs[c], first, X, Wc)
            if gb is not None:
                tasks += row_tasks(_colsum_into, w, Lbuf, offs[c], w, nb, gb, offs[c] // nb)
            if c + 1 < len(chunks):
                Wn, wt = wchunk_staged(c + 1)
                tasks += grad_tasks(c + 1) + wt
            run_tasks(tasks, eng)

    # equal row blocks of at most nb_max rows (balanced; from BT and the budget only)
    for b0, b1 in _reporting(list(plan.row_blocks()), progress):
        nb = b1 - b0
        X = _block(input, b0, b1, cdt, xbuf) if need_x else input[b0:b1]  # (else: a view nothing reads)
        offs = np.array([0 if fwd_only else nb * v0 for v0, _ in chunks], np.int64) if chunks else empty_i
        widths = np.array([v1 - v0 for v0, v1 in chunks], np.int64) if chunks else empty_i
        # dense gradient, chunk by chunk while the chunk is hot in cache
        interleave = want_grad and K > 0 and feps is None
        if not recompute:
            m = np.full(nb, -np.inf, cdt)
            s = np.zeros(nb, cdt)
            zt = np.zeros(nb, cdt)
            zs = np.zeros(nb, cdt)
            am = np.full(nb, -1, np.int64)
            sz = np.zeros(nb, cdt)
        # the statistics pass's arguments after the chunk (its last: the column shift)
        stat_args = () if recompute else (bias_c, cw_c, tcol[b0:b1], par, flags, transform, m, s, zt, zs, am, sz)
        if pipe:
            # the same calls as the loop below, in stages: the logits tiles of chunk c beside
            # the widening of chunk c + 1 and the statistics of chunk c - 1
            Wc, wt = wchunk_staged(0) if chunks else (None, [])
            run_tasks(wt, eng)
            for c in range(len(chunks) + 1):
                tasks = []
                if c < len(chunks):
                    v0, v1 = chunks[c]
                    Lc = Lbuf[offs[c] : offs[c] + nb * (v1 - v0)].reshape(nb, v1 - v0)
                    tasks += nt_tasks(X, Wc, Lc, engine=eng)
                    if c + 1 < len(chunks):
                        Wc, wt = wchunk_staged(c + 1)
                        tasks += wt
                if c > 0:
                    tasks += row_tasks(_stats_chunk, nb, Lbuf, offs[c - 1], widths[c - 1], nb, *stat_args, 0)
                run_tasks(tasks, eng)
        else:
            # (with lse the gradient is vocabulary-major unless filtered: here the logits only)
            for (v0, v1), off in zip(chunks, offs):
                Lc = Lbuf[off : off + nb * (v1 - v0)].reshape(nb, v1 - v0)
                if bfl is not None:
                    bfl.chunk(v0, v1)
                    bfl.logits(b0, b1, Lc)
                else:
                    matmul_nt(X, wchunk(v0, v1), Lc, engine=eng)
                if not recompute:
                    run_rows(_stats_chunk, nb, Lbuf, off, v1 - v0, nb, *stat_args, v0 if fwd_only else 0)
        if not recompute:
            zs[m == -np.inf] = 0  # a row without a finite logit: Σ w z is 0, as Σ exp
            am = np.where(am >= 0, am + col0, -1)
            if combine is not None:
                if need_ent:
                    m, s, zt, zs, am, sz = combine(m, s, zt, zs, am, sz)
                else:
                    m, s, zt, zs, am = combine(m, s, zt, zs, am)
            with np.errstate(divide="ignore", invalid="ignore"):
                lse_b = (m + np.log(s)).astype(cdt)
                if need_ent:  # μ = Σ p·z = max + Σ e·(z - max) / Σ e; entropy = lse - μ
                    dz = np.asarray(sz) / s
                    zmean_all[b0:b1] = (m + dz).astype(cdt)
                    if out.get("entropy") is not None:
                        out["entropy"][b0:b1] = np.log(s) - dz
            lse_all[b0:b1] = lse_b
            for key, val in (("max", m), ("sum_exp", s), ("z_target", zt), ("z_sum", zs), ("argmax", am)):
                if out.get(key) is not None:
                    out[key][b0:b1] = val
            if interleave and pipe_grad:
                _staged_products(b0, b1, offs, widths, X, first_w)
            elif interleave:
                for c, ((v0, v1), off) in enumerate(zip(chunks, offs)):
                    grad(b0, b1, offs[c : c + 1], widths[c : c + 1])
                    products(b0, b1, v0, v1, off, first_w, X)
        if interleave:
            first_w = False
            continue
        if not want_grad or not K:
            continue
        # chunk by chunk, the flags read the gradient just written (still in cache)
        F = fflags[:nb]
        F[...] = False
        for c, off in enumerate(offs):
            grad(b0, b1, offs[c : c + 1], widths[c : c + 1])
            run_rows(_filter_flags, nb, Lbuf, off, widths[c], nb, thr_all[b0:b1], fb, F)
        own = np.flatnonzero(tcol[b0:b1] >= 0)
        F[own, tcol[b0:b1][own] // fb] = True  # the target column is never filtered
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
                gw_acc,
                fbufs,
                gw_code,
                eng,
            )
        else:
            for (v0, v1), off in zip(chunks, offs):
                products(b0, b1, v0, v1, off, first_w, X)
        first_w = False
