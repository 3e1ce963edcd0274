"""The FLCE grad's epilogue of the LM-head loop (:class:`FlceGrad`): the device's vector epilogue
with its rounding (memory-saving: from the logits and the saved statistics; high-performance: from
``softmax``), gradient filtering's kept blocks, then ``g·W`` and ``gᵀ·X`` on the plan's GEMMs; the
buffers it takes are declared here (:func:`FlceGrad.buffers`), once.  The op's steps and sources:
``kernels/fused_linear_cross_entropy_loss_grad.py`` (the entry point)."""

from __future__ import annotations

import numpy as np

from ... import dtypes as D
from ..._jit import tjit, tjit_ieee
from ...errors import InternalError
from ...kernels import _bf16dot
from ...kernels._bf16dot import group_pairs
from ...kernels._gemm import row_tasks, run_rows, run_tasks
from ...kernels._linear import _add_rows_at, add_rows_at, kept_products, narrow, take_cols, take_rows
from ...kernels._vmath import exp_f32
from ..loop import Operands
from ..plan_types import FILTER_COLS, FILTER_ROWS, Buffer, LinearCrossEntropyPlan


@tjit_ieee
def _epilogue_span(L, i, j0, j1, m, se, g, s_over_k, code):
    """L[i, j0:j1] <- round((exp(L - m) / se - s/K)·g) (the non-target columns of the epilogue).
    On a view of the span, indexed from 0: an index Numba cannot prove non-negative (``j0 + j``)
    takes a wraparound select per element, and the loop did not vectorize (several times slower:
    bench/results/README.md, "Measurements behind the source's choices")."""
    row = L[i, j0:j1]
    if s_over_k != 0.0:
        for j in range(row.size):
            p = exp_f32(row[j] - m) / se - s_over_k
            row[j] = D.round_f32(p * g, code)
    else:
        for j in range(row.size):
            p = exp_f32(row[j] - m) / se
            row[j] = D.round_f32(p * g, code)


@tjit_ieee
def _epilogue_memory_saving(lo, hi, L, row0, col0, logits_max, sum_exp, grad, tcol, code, smooth, inv_k, keep, fb, rb):
    """In place on the fp32 logits tile L [nb, nv]: L <- round((softmax - onehot·(1-s) - s/K)·grad).

    ``keep`` [row blocks of ``rb`` rows, column blocks of ``fb`` columns] (gradient filtering):
    only the kept blocks are computed (the others are never read); no columns: every block."""
    nb, nv = L.shape
    one_minus_s = np.float32(1.0) - smooth
    s_over_k = smooth * inv_k
    nkb = keep.shape[1]
    for i in range(lo, hi):
        r = row0 + i
        m = logits_max[r]
        se = sum_exp[r]
        g = grad[r]
        t = tcol[r] - col0
        if t >= 0 and t < nv:
            pt = exp_f32(L[i, t] - m) / se - one_minus_s
        else:
            pt = np.float32(0.0)
        if nkb == 0:
            _epilogue_span(L, i, 0, nv, m, se, g, s_over_k, code)
        else:
            kr = i // rb
            for jb in range(nkb):
                if keep[kr, jb]:
                    _epilogue_span(L, i, jb * fb, min(nv, jb * fb + fb), m, se, g, s_over_k, code)
        if t >= 0 and t < nv:
            L[i, t] = D.round_f32((pt - s_over_k) * g, code)


#: rows per task group of the epilogue that also makes the bf16 kernel's ``A`` operands (even: a
#: group's rows pair among themselves)
_PAIR_ROWS = 32


@tjit
def _epilogue_pairs(
    lo, hi, L, row0, col0, logits_max, sum_exp, grad, tcol, code, smooth, inv_k, keep, fb, rb, u, up, gt
):
    """:func:`_epilogue_memory_saving` over the row groups ``lo:hi`` (``_PAIR_ROWS`` rows each),
    each group then, while in cache, made into both gradient GEMMs' ``A`` on ``vdpbf16ps``:
    ``gᵀ``'s pairs into ``gt`` ``[nv, ceil(nb/2)]`` and the rows paired in place (``up`` =
    ``u[:, :ceil(nv/2)]``, ``u`` the tile's uint32 view; ``_bf16dot.group_pairs``) — what
    ``matmul_tn`` and ``pairs_in_place`` make from the finished tile, one pass over it instead of
    three: the same bits."""
    nb = L.shape[0]
    for q in range(lo, hi):
        i0 = q * _PAIR_ROWS
        i1 = min(nb, i0 + _PAIR_ROWS)
        _epilogue_memory_saving(
            i0, i1, L, row0, col0, logits_max, sum_exp, grad, tcol, code, smooth, inv_k, keep, fb, rb
        )
        group_pairs(u, i0, i1, gt, up)


@tjit
def _block_flags(lo, hi, L, row0, col0, logits_max, sum_exp, tcol, lim, fb, flags):
    """``flags[i, jb]`` = 1 when a logit of row i in column block jb (``fb`` columns) is >=
    ``logits_max[r] + log(lim·sum_exp[r])`` — i.e. its softmax value may reach ``lim`` — or is
    NaN, or the block holds the row's target column.  Reads the fp32 logits tile L [nb, nv]
    before the epilogue overwrites it.  The caller's ``lim`` carries a safety margin, so a
    block without a flag has every value strictly below the filtering threshold."""
    nb, nv = L.shape
    nblk = flags.shape[1]
    for i in range(lo, hi):
        r = row0 + i
        thr = np.float32(logits_max[r] + np.log(np.float64(lim) * np.float64(sum_exp[r])))
        for jb in range(nblk):
            j0 = jb * fb
            blk = L[i, j0 : min(j0 + fb, nv)]  # a view indexed from 0 (see _epilogue_span)
            hits = np.float32(0.0)  # a float count: the loop vectorizes (faster than an int one)
            for j in range(blk.size):
                hits += np.float32(not (blk[j] < thr))  # or NaN
            flags[i, jb] = hits > 0
        t = tcol[r] - col0
        if t >= 0 and t < nv:
            flags[i, t // fb] = True  # the target column is never filtered


def _filtered_products(G, Xb, W32, keep, fb, rb, gi_rows, gwt, bufs, engine="blas") -> None:
    """``gi_rows += g·W`` and ``gwt += gᵀ·X`` over the kept blocks only (see the module doc) on
    the fp32 engines: ``_linear.kept_products`` (the rule the training loss's filter shares), the
    tile's kept columns of ``G`` and rows of ``W32`` gathered (``bufs``)."""
    nb, nv = G.shape
    g_c, w_c, q_c, p_c = bufs
    kept_products(
        keep,
        fb,
        rb,
        nb,
        nv,
        group=nv,
        gather_g=lambda r0, r1, cols, out: take_cols(G[r0:r1], cols, out),
        gather_w=lambda cols, out: take_rows(W32, cols, out),
        X=Xb,
        gi_rows=gi_rows,
        add_gw=lambda cols, Q: add_rows_at(gwt, cols, Q),
        bufs=(g_c, w_c, p_c, q_c),
        engine=engine,
    )


#: columns of ``G`` per ``gᵀ·X`` task of the kept blocks on the bf16 kernel (16 filter blocks)
_GW_GROUP = 1024


def _kept_runs(keep_row: np.ndarray, fb: int, ncols: int) -> list[tuple[int, int]]:
    """The maximal runs ``[j0, j1)`` of kept column blocks of one row block (``j1`` ≤ ``ncols``)."""
    kb = np.flatnonzero(keep_row)
    if kb.size == 0:
        return []
    cut = np.flatnonzero(np.diff(kb) != 1) + 1
    return [(int(a[0]) * fb, min(ncols, (int(a[-1]) + 1) * fb)) for a in np.split(kb, cut)]


def _filtered_products_b16(G, keep, fb, rb, gi_rows, gwt, xinter, wi, form, spec) -> None:
    """``gwt[kept cols] += gᵀ·X`` then ``gi_rows += g·W`` over the kept blocks of a tile on the
    exact-product bf16 kernel, ``G`` fp32 ``[nb, nv]`` of bf16 values (the epilogue rounds it;
    overwritten by its pairs), ``xinter`` the row tile's ``X`` and ``wi`` the tile's ``W`` as the
    kernel's ``B`` (:func:`_bf16dot.interleave`; ``rb`` even, so a row block starts on a pair).

    Three task lists on the pool, no gathered copy of ``G`` or ``W``: ``gᵀ·X`` in groups of
    :data:`_GW_GROUP` columns, each task for its columns' kept blocks, row block after row block,
    ``gᵀ``'s kept columns transposed into its thread's scratch run by run
    (``_bf16dot._top_pairs_t`` / ``_transpose_rows``, as ``matmul_tn`` makes them), the product
    there and added onto ``gwt``'s rows; ``G`` paired in place; ``g·W`` per row block and
    512-column span of ``H``, one call per run of adjacent kept blocks summed onto ``gi_rows``
    (A and B read in place).  The kernel sums each output over ``k`` in order
    (``_native``), so every element gets the additions of the gathered form: the kept columns in
    order, each row block's ``gᵀ·X`` summed apart and then added — the same bits as gathering
    the kept blocks and multiplying once per row block."""
    nb, nv = G.shape
    H = gwt.shape[1]
    nrb = keep.shape[0]
    rows = [(k * rb, min(nb, (k + 1) * rb)) for k in range(nrb)]
    runs = [_kept_runs(keep[k], fb, nv) for k in range(nrb)]
    spans = _bf16dot._col_spans(H)
    u = G.view(np.uint32)
    f32a = form == "f32"
    gsz = max(fb, (_GW_GROUP // fb) * fb)

    def gw_task(c0: int, c1: int) -> None:
        for k, (r0, r1) in enumerate(rows):
            cut = [(max(a, c0), min(b, c1)) for a, b in runs[k] if a < c1 and b > c0]
            if not cut:
                continue
            cols = np.concatenate([np.arange(a, b) for a, b in cut])
            nk, nr = cols.size, r1 - r0
            kw = _bf16dot._a_stride(nr) if f32a else (nr + 1) // 2
            buf = _bf16dot._local(nk * kw + nk * H)
            Q = buf[nk * kw : nk * kw + nk * H].view(np.float32).reshape(nk, H)
            # gᵀ's kept columns, run by run, as the A matmul_tn makes of a whole tile (exact)
            xp = buf[: nk * kw].view(np.float32).reshape(nk, kw)[:, :nr] if f32a else buf[: nk * kw].reshape(nk, kw)
            o = 0
            for a, b in cut:
                if f32a:
                    _bf16dot._transpose_rows(0, b - a, G[r0:r1, a:b], xp[o : o + b - a])
                else:
                    _bf16dot._top_pairs_t(0, b - a, u[r0:r1, a:b], xp[o : o + b - a])
                o += b - a
            xb = xinter[r0 // 2 : (r1 + 1) // 2]
            for s0, s1 in spans:
                _bf16dot.gemm_tile(xp, xb, s0, s1, Q[:, s0:s1], spec=spec)
            _add_rows_at(0, nk, gwt, cols, Q)

    run_tasks([(lambda c0=c0: gw_task(c0, min(nv, c0 + gsz))) for c0 in range(0, nv, gsz)])
    A = _bf16dot.pairs_in_place(G, form)
    per = 1 if f32a else 2  # values of G per column of A

    def gi_task(k: int, s0: int, s1: int) -> None:
        r0, r1 = rows[k]
        out = gi_rows[r0:r1, s0:s1]
        for j0, j1 in runs[k]:
            a = A[r0:r1, j0 // per : -(-j1 // per)]
            _bf16dot.gemm_tile(a, wi[j0 // 2 :], s0, s1, out, True, spec=spec)

    run_tasks([(lambda k=k, s0=s0, s1=s1: gi_task(k, s0, s1)) for k in range(nrb) if runs[k] for s0, s1 in spans])


@tjit
def _epilogue_high_performance(lo, hi, S, G, row0, col0, grad, tcol, code, smooth, inv_k):
    """G [nb, nv] <- round((S[row0+i, col0+j] - onehot·(1-s) - s/K)·grad); S is not written."""
    nb, nv = G.shape
    one_minus_s = np.float32(1.0) - smooth
    s_over_k = smooth * inv_k
    for i in range(lo, hi):
        r = row0 + i
        g = grad[r]
        t = tcol[r] - col0
        for j in range(nv):
            G[i, j] = D.round_f32((S[r, col0 + j] - s_over_k) * g, code)
        if t >= 0 and t < nv:
            G[i, t] = D.round_f32((S[r, col0 + t] - one_minus_s - s_over_k) * g, code)


@tjit
def _epilogue_hp_pairs(lo, hi, S, G, row0, col0, grad, tcol, code, smooth, inv_k, u, up, gt):
    """:func:`_epilogue_high_performance` over the row groups ``lo:hi`` (``_PAIR_ROWS`` rows
    each), each group then made into both gradient GEMMs' ``A`` as :func:`_epilogue_pairs` does."""
    nb = G.shape[0]
    for q in range(lo, hi):
        i0 = q * _PAIR_ROWS
        i1 = min(nb, i0 + _PAIR_ROWS)
        _epilogue_high_performance(i0, i1, S, G, row0, col0, grad, tcol, code, smooth, inv_k)
        group_pairs(u, i0, i1, gt, up)


class FlceGrad:
    """The FLCE grad's epilogue of the LM-head loop (``lm_head/loop.py``), per tile: the
    device's vector epilogue with its rounding (memory-saving: from the logits and the saved
    statistics; high-performance: from ``softmax``), gradient filtering, then
    ``gi32[b] += g·W[v]`` and ``gw32[v] (+)= gᵀ·X[b]`` on the plan's GEMMs; per vocabulary tile
    the finished ``grad_weight`` rows rounded into ``gw_out``.  ``stat``: ``(logits_max,
    sum_exp)`` (memory-saving) or the fp32 softmax (high-performance)."""

    def __init__(
        self,
        input: np.ndarray,
        plan: LinearCrossEntropyPlan,
        ops: Operands,
        stat: tuple[np.ndarray, np.ndarray] | np.ndarray,
        grad32: np.ndarray,
        tcol: np.ndarray,
        code: int,
        smooth: np.float32,
        inv_k: np.float32,
        eps: float | None,
        s_over_k: float,
        gw_out: np.ndarray,
        stats: dict[str, int],
    ):
        BT, H = input.shape
        self.ops, self.H = ops, H
        self.hp = not isinstance(stat, tuple)
        self.stat = stat
        self.grad32, self.tcol, self.code, self.smooth, self.inv_k = grad32, tcol, code, smooth, inv_k
        self.eps, self.gw_out, self.stats = eps, gw_out, stats
        # the buffers of :meth:`buffers` (the plan's list), on recycled memory (fastgrad._outcache):
        # no fresh pages on the next call
        take = ops.ws.take
        self.gi32 = take("grad_input_acc").reshape(BT, H)
        self.gi32[...] = 0  # grad_input accumulator
        self.g_buf = take("g_tile")  # logits / g tile
        self.gw32 = take("grad_weight_tile")  # grad_weight tile accumulator
        self.gt_buf = ops.ws.get("g_pairs_t")  # gᵀ's pairs (vdpbf16ps), made by the epilogue
        b16 = ops.b16
        self.fb, self.rb = plan.filter_cols, plan.filter_rows
        self.no_keep = np.zeros((1, 0), np.bool_)  # the epilogue's "every block"
        if eps is not None:
            rb = self.rb
            # |p - s/K| < eps  <=>  p < eps + s/K (p >= 0; no block is negligible when s/K >= eps),
            # tested on the logits with a 1e-3 relative margin against the rounding of exp and log
            self.lim = (eps + s_over_k) * np.exp(-1e-3)
            self.flags = take("filter_flags")
            # the fp32 engines gather the kept blocks (the bf16 kernel reads them in place)
            names = ("kept_g", "kept_w", "kept_grad_weight", "kept_product")
            self.fbufs = None if b16 else tuple(take(n) for n in names)
            if b16 and rb % 2:  # the bf16 pair layout starts a row block on a pair
                raise ValueError(f"plan row block must be even for bf16 operands, got {rb}")

    @staticmethod
    def buffers(BT: int, H: int, bt: int, vt: int, *, b16: bool, filtered: bool, paired: bool = False) -> list[Buffer]:
        """The buffers a :class:`FlceGrad` takes for ``bt × vt`` tiles over ``[BT, H]``: the fp32
        ``grad_input`` accumulator, the logits/``g`` tile, the ``grad_weight`` tile's accumulator;
        ``filtered`` (gradient filtering in memory-saving mode): the block flags, and on the fp32
        engines the kept blocks' gathers and products (the bf16 kernel, ``b16``, reads the kept
        blocks in place: :func:`_filtered_products_b16`); ``paired`` (the bf16 kernel's
        ``vdpbf16ps`` form): ``gᵀ``'s pairs, made by the epilogue of a dense tile
        (:func:`_epilogue_pairs`, :func:`_epilogue_hp_pairs`)."""
        out = [
            Buffer("grad_input_acc", (BT, H), "float32", "call"),
            Buffer("g_tile", (bt, vt), "float32", "tile"),
            Buffer("grad_weight_tile", (vt, H), "float32", "tile"),
        ]
        if paired:
            out.append(Buffer("g_pairs_t", (vt, (bt + 1) // 2), "uint32", "tile"))
        if filtered:
            fb, rb = FILTER_COLS, min(FILTER_ROWS, bt)
            out.append(Buffer("filter_flags", (bt, -(-vt // fb)), "bool", "tile"))
            if not b16:
                out += [
                    Buffer("kept_g", (rb, vt), "float32", "tile"),
                    Buffer("kept_w", (vt, H), "float32", "tile"),
                    Buffer("kept_product", (rb, H), "float32", "tile"),
                    Buffer("kept_grad_weight", (vt, H), "float32", "tile"),
                ]
        return out

    def begin(self, v0: int, v1: int) -> None:
        self.gwt = self.gw32[: (v1 - v0) * self.H].reshape(v1 - v0, self.H)
        self.first = True

    def tile(self, b0: int, b1: int, v0: int, v1: int) -> None:
        ops, eng = self.ops, self.ops.engine
        nb, nv = b1 - b0, v1 - v0
        G = self.g_buf[: nb * nv].reshape(nb, nv)
        Xb = ops.X32[b0:b1] if ops.X32 is not None else None
        W32 = ops.W32
        keep = None
        tcol, code, smooth, inv_k, grad32 = self.tcol, self.code, self.smooth, self.inv_k, self.grad32
        fb, rb = self.fb, self.rb
        if not self.hp:
            lmax, sexp = self.stat
            ops.logits(b0, b1, G)
            if self.eps is not None:
                nblk = -(-nv // fb)
                F = self.flags[: nb * nblk].reshape(nb, nblk)
                run_rows(_block_flags, G.shape[0], G, b0, v0, lmax, sexp, tcol, self.lim, fb, F)
                keep = np.logical_or.reduceat(F, np.arange(0, nb, rb), axis=0)
                n_keep = int(keep.sum())
                self.stats["blocks_total"] += keep.size
                self.stats["blocks_skipped"] += keep.size - n_keep
                if n_keep == keep.size:
                    keep = None  # nothing negligible: the dense path
            # g of the kept blocks only (every block on the dense path)
            kp = self.no_keep if keep is None else keep
            epi = (lmax, sexp, grad32, tcol, code, smooth, inv_k, kp, fb, rb)
            if keep is None and self.gt_buf is not None:  # dense on vdpbf16ps: A made by the epilogue
                self._paired(_epilogue_pairs, G, (G, b0, v0, *epi), b0, b1)
                return
            run_rows(_epilogue_memory_saving, nb, G, b0, v0, *epi)
        else:
            # the tile's rows (S.shape[0] ran past G and S beyond the first row tile)
            hp = (self.stat, G, b0, v0, grad32, tcol, code, smooth, inv_k)
            if self.gt_buf is not None:
                self._paired(_epilogue_hp_pairs, G, hp, b0, b1)
                return
            run_rows(_epilogue_high_performance, nb, *hp)
        gwt, gi_rows = self.gwt, self.gi32[b0:b1]
        if keep is not None:
            if self.first:
                gwt[...] = 0
                self.first = False
            if ops.b16:
                _filtered_products_b16(G, keep, fb, rb, gi_rows, gwt, ops.xinter[b0], ops.w_pairs(), ops.form, ops.spec)
            else:
                _filtered_products(G, Xb, W32, keep, fb, rb, gi_rows, gwt, self.fbufs, eng)
        else:  # the dense tile: the plan's GEMMs (Operands: BLAS, oneDNN or the native kernel)
            ops.grad_products(G, b0, b1, gwt, not self.first, gi_rows)  # may overwrite G (bf16 pairs)
            self.first = False

    def _paired(self, epilogue, G: np.ndarray, args: tuple, b0: int, b1: int) -> None:
        """A dense tile on ``vdpbf16ps``: ``epilogue(lo, hi, *args, u, gp, gt)`` over row groups
        of ``_PAIR_ROWS`` (the device epilogue, then both GEMMs' ``A``: ``gᵀ``'s pairs into the
        plan's ``g_pairs_t``, the rows paired in place), then the two products on them."""
        nb, nv = G.shape
        u = G.view(np.uint32)
        gp = u[:, : (nv + 1) // 2]
        if self.gt_buf is None:
            raise InternalError("a paired tile without the plan's g_pairs_t buffer")
        gt = self.gt_buf[: nv * ((nb + 1) // 2)].reshape(nv, (nb + 1) // 2)
        run_tasks(row_tasks(epilogue, -(-nb // _PAIR_ROWS), *args, u, gp, gt))
        self.ops.grad_products_paired(gt, gp, b0, self.gwt, not self.first, self.gi32[b0:b1])
        self.first = False

    def end(self, v0: int, v1: int) -> None:
        narrow(self.gwt, self.gw_out[v0:v1])  # on the pool: no OpenMP region (fork-safe)
