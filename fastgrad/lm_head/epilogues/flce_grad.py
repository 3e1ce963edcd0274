"""The FLCE grad's epilogue of the LM-head loop (:class:`FlceGrad`): the device's vector epilogue
with its rounding (memory-saving: from the logits and the saved statistics; high-performance: from
``softmax``), gradient filtering's kept blocks, then ``g·W`` and ``gᵀ·X`` on the plan's GEMMs; the
buffers it takes are declared here (:func:`FlceGrad.buffers`), once.  The op's steps and sources:
``kernels/fused_linear_cross_entropy_loss_grad.py`` (the entry point)."""

from __future__ import annotations

import numpy as np

from ... import dtypes as D
from ..._jit import tjit
from ...kernels import _bf16dot
from ...kernels._gemm import run_rows
from ...kernels._linear import add_rows_at, kept_blocks, kept_products, narrow, take_cols, take_rows
from ...kernels._vmath import exp_f32
from ..loop import Operands
from ..plan_types import FILTER_COLS, FILTER_ROWS, Buffer, LinearCrossEntropyPlan


@tjit
def _epilogue_span(L, i, j0, j1, m, se, g, s_over_k, code):
    """L[i, j0:j1] <- round((exp(L - m) / se - s/K)·g) (the non-target columns of the epilogue)."""
    if s_over_k != 0.0:
        for j in range(j0, j1):
            p = exp_f32(L[i, j] - m) / se - s_over_k
            L[i, j] = D.round_f32(p * g, code)
    else:
        for j in range(j0, j1):
            p = exp_f32(L[i, j] - m) / se
            L[i, j] = D.round_f32(p * g, code)


@tjit
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
            j1 = min(j0 + fb, nv)
            hits = np.float32(0.0)  # a float count: the loop vectorizes (faster than an int one)
            for j in range(j0, j1):
                hits += np.float32(not (L[i, j] < thr))  # or NaN
            flags[i, jb] = hits > 0
        t = tcol[r] - col0
        if t >= 0 and t < nv:
            flags[i, t // fb] = True  # the target column is never filtered


def _filtered_products(
    G, Xb, W32, keep, fb, rb, gi_rows, gwt, bufs, b16=None, engine="blas", form=None, spec=None
) -> None:
    """``gi_rows += g·W`` and ``gwt += gᵀ·X`` over the kept blocks only (see the module doc): on
    the fp32 engines ``_linear.kept_products`` (the rule the training loss's filter shares), the
    tile's kept columns of ``G`` and rows of ``W32`` gathered.

    ``b16``: None (fp32 operands ``Xb``, ``W32`` on BLAS) or ``(xinter, W16, w16_buf, wi_buf)``
    for the exact-product bf16 kernel: the row tile interleaved as ``B``
    (:func:`_bf16dot.interleave`; ``rb`` even, so a row block starts on a pair), the tile's bf16
    weight rows (uint16 bits), and scratch for the gathered rows and their interleaving; ``form``:
    the plan's A form of the bf16 kernel (``GemmChoice.a_form``), ``spec`` its variant.  ``g`` holds bf16 values
    (the epilogue rounds it), so both ways compute every product exactly."""
    nb, nv = G.shape
    g_c, w_c, q_c, p_c = bufs
    if b16 is None:
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
        return
    xinter, W16, w16_buf, wi_buf = b16
    H = W16.shape[1]
    for r0, r1, cols in kept_blocks(keep, fb, rb, nb, nv):
        # the gathers and the scatter-add on the pool (NumPy's take / fancy += ran on one thread:
        # at 2 nats of entropy, 2 threads, a third of the filtered grad's time)
        nk, nr = cols.size, r1 - r0
        Gc = take_cols(G[r0:r1], cols, g_c[: nr * nk].reshape(nr, nk))
        Q = q_c[: nk * H].reshape(nk, H)
        _bf16dot.matmul_tn(Gc, xinter[r0 // 2 : (r1 + 1) // 2], H, Q, form=form, spec=spec)
        Wg = take_rows(W16, cols, w16_buf[: nk * H].reshape(nk, H))
        wp = _bf16dot.interleave(Wg, wi_buf)
        _bf16dot.matmul(_bf16dot.pairs_in_place(Gc, form), wp, H, gi_rows[r0:r1], acc=True, spec=spec)
        add_rows_at(gwt, cols, Q)


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
        b16 = ops.b16
        self.fb16_bufs = None
        self.fb, self.rb = plan.filter_cols, plan.filter_rows
        self.no_keep = np.zeros((1, 0), np.bool_)  # the epilogue's "every block"
        if eps is not None:
            rb = self.rb
            # |p - s/K| < eps  <=>  p < eps + s/K (p >= 0; no block is negligible when s/K >= eps),
            # tested on the logits with a 1e-3 relative margin against the rounding of exp and log
            self.lim = (eps + s_over_k) * np.exp(-1e-3)
            get = ops.ws.get
            self.flags = take("filter_flags")
            self.fbufs = (take("kept_g"), get("kept_w"), take("kept_grad_weight"), get("kept_product"))
            # the kept blocks on the bf16 kernel: the weight rows gathered as bits, then interleaved
            self.fb16_bufs = (take("kept_w16"), take("kept_w_pairs")) if b16 else None
            if b16 and rb % 2:  # the bf16 pair layout starts a row block on a pair
                raise ValueError(f"plan row block must be even for bf16 operands, got {rb}")

    @staticmethod
    def buffers(BT: int, H: int, bt: int, vt: int, *, b16: bool, filtered: bool) -> list[Buffer]:
        """The buffers a :class:`FlceGrad` takes for ``bt × vt`` tiles over ``[BT, H]``: the fp32
        ``grad_input`` accumulator, the logits/``g`` tile, the ``grad_weight`` tile's accumulator;
        ``filtered`` (gradient filtering in memory-saving mode): the block flags and the kept blocks'
        gathers and products — the weight rows as bits and their pairs on the bf16 kernel (``b16``),
        fp32 rows and a product otherwise."""
        out = [
            Buffer("grad_input_acc", (BT, H), "float32", "call"),
            Buffer("g_tile", (bt, vt), "float32", "tile"),
            Buffer("grad_weight_tile", (vt, H), "float32", "tile"),
        ]
        if filtered:
            fb, rb = FILTER_COLS, min(FILTER_ROWS, bt)
            out += [
                Buffer("filter_flags", (bt, -(-vt // fb)), "bool", "tile"),
                Buffer("kept_g", (rb, vt), "float32", "tile"),
            ]
            if b16:
                out += [
                    Buffer("kept_w16", (vt, H), "uint16", "tile"),
                    Buffer("kept_w_pairs", (_bf16dot.b_size(vt, H),), "uint32", "tile"),
                ]
            else:
                out += [
                    Buffer("kept_w", (vt, H), "float32", "tile"),
                    Buffer("kept_product", (rb, H), "float32", "tile"),
                ]
            out.append(Buffer("kept_grad_weight", (vt, H), "float32", "tile"))
        return out

    def begin(self, v0: int, v1: int) -> None:
        ops = self.ops
        # the kept blocks on the bf16 kernel: the tile's weight rows as bits, the gather buffers
        self.fb16 = None if self.fb16_bufs is None else (ops.W[v0:v1].view(np.uint16), *self.fb16_bufs)
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
            run_rows(_epilogue_memory_saving, nb, G, b0, v0, *epi)
        else:
            # the tile's rows (S.shape[0] ran past G and S beyond the first row tile)
            run_rows(_epilogue_high_performance, nb, self.stat, G, b0, v0, grad32, tcol, code, smooth, inv_k)
        gwt, gi_rows = self.gwt, self.gi32[b0:b1]
        if keep is not None:
            if self.first:
                gwt[...] = 0
                self.first = False
            b16_ops = None if self.fb16 is None else (ops.xinter[b0], *self.fb16)
            _filtered_products(G, Xb, W32, keep, fb, rb, gi_rows, gwt, self.fbufs, b16_ops, eng, ops.form, ops.spec)
        else:  # the dense tile: the plan's GEMMs (Operands: BLAS, oneDNN or the native kernel)
            ops.grad_products(G, b0, b1, gwt, not self.first, gi_rows)  # may overwrite G (bf16 pairs)
            self.first = False

    def end(self, v0: int, v1: int) -> None:
        narrow(self.gwt, self.gw_out[v0:v1])  # on the pool: no OpenMP region (fork-safe)
