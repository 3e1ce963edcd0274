"""op_kernel: FusedLinearCrossEntropyLossGrad on the CPU.

Memory-saving mode (``softmax is None``), per tile of the plan (``tiling.LinearCETiling``):

1. ``L = X[b] · W[v]ᵀ``                         fp32 GEMM (BLAS), never rounded (device: mm0, fp32 out)
2. ``g = round_dtype((exp(L - logits_max) / sum_exp_logits - onehot) · grad)``
                                                parallel Numba epilogue, in place (device: V1 + cast)
3. ``gi32[b] += g · W[v]``                      fp32 GEMM (device: mm1 accumulated in fp32)
4. ``gw32 += gᵀ · X[b]``                        fp32 GEMM (device: mm2 accumulated in fp32)

after the row tiles of one vocabulary tile, ``grad_weight[v] = round(gw32)``; at the end
``grad_input = round(gi32)``.  High-performance mode reads ``softmax`` instead of steps 1–2's
exponential and never writes to it.

All scratch is tile-sized or ``[BT, H]``-sized: nothing grows with BT×V.

bf16 ``input`` and ``weight`` on the GEMM setting ``"auto"``, on a CPU with AVX-512 BF16: the
three GEMMs run on the exact-product bf16 kernel (``_bf16dot``), at about twice sgemm's rate.
Every operand of steps 1, 3 and 4 is a bf16 value (``g`` is rounded to bf16 by step 2, as on the
device), so each product is exact in fp32 and the result is the same fp32 GEMM of the same
values, summed in fp32 in another fixed order — as the device's Cube unit multiplies bf16
operands into fp32.  The one further difference: the instruction reads bf16 subnormals
(|x| < 2⁻¹²⁶, e.g. a ``g`` of a probability below ~1e-38) as zero.  Filtered tiles run their
kept blocks on the kernel too (the kept weight rows gathered as bits, then interleaved).

Gradient filtering (``plan.filter_eps``, memory-saving mode; an extension, as Cut
Cross-Entropy's ``filter_eps``): before the epilogue a read-only pass over the logits tile
records, per row and per block of ``plan.filter_cols`` columns, whether any
``|softmax - onehot·(1-s) - s/K|`` may reach eps (a threshold on the logit:
``l >= logits_max + log(eps'·sum_exp)``, with a margin); a block of
``plan.filter_rows`` rows × ``filter_cols`` columns where none is (the target column never is
negligible) contributes nothing to steps 3–4: the kept blocks' columns of ``g`` and rows of ``W``
are gathered and the two GEMMs run on them.  A tile with every block kept takes the dense path
unchanged (bitwise equal to the unfiltered op).
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as D
from .._jit import tjit
from .._outcache import empty as scratch
from ..tiling import LinearCrossEntropyPlan
from ..vocab_parallel import megatron_smoothing, target_columns, unpack_target_mask
from . import _bf16dot
from ._gemm import bf16_auto, matmul_nn, matmul_nt, matmul_tn, run_rows, single_threaded_blas
from ._linear import fp32_block, kept_blocks
from ._vmath import exp_f32

OP = "fused_linear_cross_entropy_loss_grad"


@tjit
def _epilogue_memory_saving(lo, hi, L, row0, col0, logits_max, sum_exp, grad, tcol, code, smooth, inv_k):
    """In place on the fp32 logits tile L [nb, nv]: L <- round((softmax - onehot·(1-s) - s/K)·grad)."""
    nb, nv = L.shape
    one_minus_s = np.float32(1.0) - smooth
    s_over_k = smooth * inv_k
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
        if smooth != 0.0:
            for j in range(nv):
                p = exp_f32(L[i, j] - m) / se - s_over_k
                L[i, j] = D.round_f32(p * g, code)
            if t >= 0 and t < nv:
                L[i, t] = D.round_f32((pt - s_over_k) * g, code)
        else:
            for j in range(nv):
                p = exp_f32(L[i, j] - m) / se
                L[i, j] = D.round_f32(p * g, code)
            if t >= 0 and t < nv:
                L[i, t] = D.round_f32(pt * g, code)


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
            hits = np.float32(0.0)  # a float count: the loop vectorizes (2.5x an int one)
            for j in range(j0, j1):
                hits += np.float32(not (L[i, j] < thr))  # or NaN
            flags[i, jb] = hits > 0
        t = tcol[r] - col0
        if t >= 0 and t < nv:
            flags[i, t // fb] = True  # the target column is never filtered


def _filtered_products(G, Xb, W32, keep, fb, rb, gi_rows, gwt, bufs, b16=None) -> None:
    """``gi_rows += g·W`` and ``gwt += gᵀ·X`` over the kept blocks only (see the module doc).

    ``b16``: None (fp32 operands ``Xb``, ``W32`` on BLAS) or ``(xinter, W16, w16_buf, wi_buf)``
    for the exact-product bf16 kernel: the row tile interleaved as ``B``
    (:func:`_bf16dot.interleave`; ``rb`` even, so a row block starts on a pair), the tile's bf16
    weight rows (uint16 bits), and scratch for the gathered rows and their interleaving.  ``g`` holds bf16 values
    (the epilogue rounds it), so both ways compute every product exactly."""
    nb, nv = G.shape
    g_c, w_c, q_c, p_c = bufs
    for r0, r1, cols in kept_blocks(keep, fb, rb, nb, nv):
        nk, nr = cols.size, r1 - r0
        Gc = g_c[: nr * nk].reshape(nr, nk)
        np.take(G[r0:r1], cols, axis=1, out=Gc)
        if b16 is not None:
            xinter, W16, w16_buf, wi_buf = b16
            H = W16.shape[1]
            Q = q_c[: nk * H].reshape(nk, H)
            _bf16dot.matmul_tn(Gc, xinter[r0 // 2 : (r1 + 1) // 2], H, Q)
            Wg = w16_buf[: nk * H].reshape(nk, H)
            np.take(W16, cols, axis=0, out=Wg)
            wp = _bf16dot.interleave(Wg, wi_buf)
            _bf16dot.matmul(_bf16dot.pairs_in_place(Gc), wp, H, gi_rows[r0:r1], acc=True)
        else:
            H = W32.shape[1]
            Wc = w_c[: nk * H].reshape(nk, H)
            np.take(W32, cols, axis=0, out=Wc)
            matmul_nn(Gc, Wc, gi_rows[r0:r1], tmp=p_c[: nr * H].reshape(nr, H))
            Q = q_c[: nk * H].reshape(nk, H)
            matmul_tn(Gc, Xb[r0:r1], Q)
        gwt[cols] += Q


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


@single_threaded_blas()
def fused_linear_cross_entropy_loss_grad(
    *,
    grad,
    input,
    weight,
    target_mask,
    masked_target,
    label_smoothing,
    logits_max,
    sum_exp_logits,
    softmax,
    out,
    plan: LinearCrossEntropyPlan,
    progress=None,
    stats=None,
):
    """The ``"cpu"`` entry point (arguments validated by the op): the op over its tile plan, BLAS
    single-threaded (the tile grid is the parallelism).  ``out = (grad_input, grad_weight)``,
    C-contiguous.

    ``progress``: optional callable(done, total) invoked after each tile (the CLI's bar).
    ``stats``: optional dict receiving ``blocks_total`` / ``blocks_skipped`` (filtering).
    """
    stats = {} if stats is None else stats
    stats.setdefault("blocks_total", 0)
    stats.setdefault("blocks_skipped", 0)
    gi_out, gw_out = out
    BT, H = input.shape
    V = weight.shape[0]
    widen = input.dtype != D.FLOAT32
    if BT == 0 or V == 0 or H == 0:
        gi_out[...] = 0
        gw_out[...] = 0
        return plan
    code = D.code_of(input.dtype)
    grad32 = np.ascontiguousarray(grad, dtype=np.float32)
    masked = unpack_target_mask(target_mask, BT)
    tcol = target_columns(masked_target, masked, V)
    s_, s_over_k = megatron_smoothing(float(label_smoothing), V)
    smooth, inv_k = np.float32(s_), np.float32(1.0 / V if s_ else 0.0)

    bt, vt = plan.bt_tile, plan.v_tile
    eps = plan.filter_eps if softmax is None else None
    if eps is not None and s_over_k >= eps:
        eps = None  # the uniform smoothing term alone is not negligible
    # bf16 operands: the three GEMMs on the exact-product bf16 kernel where it may run
    b16 = bf16_auto() and input.dtype == D.BFLOAT16 and weight.dtype == D.BFLOAT16
    X32 = None if b16 else fp32_block(input, 0, BT)  # [BT, H] exact fp32 (the BLAS path)
    gi32 = np.zeros((BT, H), np.float32)  # grad_input accumulator
    # scratch on recycled memory (fastgrad._outcache): no fresh pages on the next call
    g_buf = scratch(bt * vt, np.float32)  # logits / g tile
    w_buf = scratch(vt * H, np.float32) if widen else None
    gw32 = scratch(vt * H, np.float32)  # grad_weight tile accumulator
    prod = scratch(bt * H, np.float32)  # g·W product of one tile
    gw_tmp = scratch(vt * H if plan.n_bt_tiles > 1 or plan.filter_eps is not None else 0, np.float32)
    if softmax is None:
        lmax = np.ascontiguousarray(logits_max, dtype=np.float32)
        sexp = np.ascontiguousarray(sum_exp_logits, dtype=np.float32)
    else:
        S = np.ascontiguousarray(softmax, dtype=np.float32)  # a view when already contiguous
    W = weight if weight.flags.c_contiguous else np.ascontiguousarray(weight)
    lg = _bf16dot.Logits(input, W, vt) if (b16 and softmax is None) else None  # the logits on the kernel
    if b16:
        # X's row tiles as the grad_weight GEMM's B, once
        xinter = {b0: _bf16dot.interleave(input[b0:b1]) for b0, b1 in plan.bt_ranges()}
        wt_inter = scratch(_bf16dot.b_size(vt, H), np.uint32)  # the W tile as grad_input's B
    fb16_bufs = None
    if eps is not None:
        fb, rb = plan.filter_cols, plan.filter_rows
        # |p - s/K| < eps  <=>  p < eps + s/K (p >= 0; no block is negligible when s/K >= eps),
        # tested on the logits with a 1e-3 relative margin against the rounding of exp and log
        lim = (eps + float(s_over_k)) * np.exp(-1e-3)
        flags = np.empty(bt * (-(-vt // fb)), np.bool_)
        fbufs = (
            scratch(min(rb, bt) * vt, np.float32),
            None if b16 else scratch(vt * H, np.float32),
            scratch(vt * H, np.float32),
            None if b16 else scratch(min(rb, bt) * H, np.float32),
        )
        # the kept blocks on the bf16 kernel: the weight rows gathered as bits, then interleaved
        fb16_bufs = (scratch(vt * H, np.uint16), scratch(_bf16dot.b_size(vt, H), np.uint32)) if b16 else None
        assert rb % 2 == 0 or not b16
    done = 0
    for v0, v1 in plan.v_ranges():
        nv = v1 - v0
        W32 = None if b16 else fp32_block(W, v0, v1, w_buf)
        # the kept blocks on the bf16 kernel: the tile's weight rows as bits, the gather buffers
        fb16 = None if fb16_bufs is None else (W[v0:v1].view(np.uint16), *fb16_bufs)
        if b16:
            if lg is not None:
                lg.chunk(v0, v1)
            bp_i = None  # the W tile as grad_input's B, interleaved when a dense row tile needs it
        gwt = gw32[: nv * H].reshape(nv, H)
        first = True
        for b0, b1 in plan.bt_ranges():
            nb = b1 - b0
            G = g_buf[: nb * nv].reshape(nb, nv)
            Xb = X32[b0:b1] if X32 is not None else None
            keep = None
            if softmax is None:
                if lg is not None:
                    lg.logits(b0, b1, G)
                else:
                    assert Xb is not None and W32 is not None
                    matmul_nt(Xb, W32, G)
                if eps is not None:
                    nblk = -(-nv // fb)
                    F = flags[: nb * nblk].reshape(nb, nblk)
                    run_rows(_block_flags, G.shape[0], G, b0, v0, lmax, sexp, tcol, lim, fb, F)
                run_rows(_epilogue_memory_saving, G.shape[0], G, b0, v0, lmax, sexp, grad32, tcol, code, smooth, inv_k)
                if eps is not None:
                    keep = np.logical_or.reduceat(F, np.arange(0, nb, rb), axis=0)
                    n_keep = int(keep.sum())
                    stats["blocks_total"] += keep.size
                    stats["blocks_skipped"] += keep.size - n_keep
                    if n_keep == keep.size:
                        keep = None  # nothing negligible: the dense path
            else:
                run_rows(_epilogue_high_performance, S.shape[0], S, G, b0, v0, grad32, tcol, code, smooth, inv_k)
            if keep is not None:
                if first:
                    gwt[...] = 0
                    first = False
                b16_ops = None if fb16 is None else (xinter[b0], *fb16)
                _filtered_products(G, Xb, W32, keep, fb, rb, gi32[b0:b1], gwt, fbufs, b16_ops)
            elif b16:
                # gᵀ paired per task (thread scratch), then g paired in place over itself
                _bf16dot.matmul_tn(G, xinter[b0], H, gwt, acc=not first)
                first = False
                gp = _bf16dot.pairs_in_place(G)
                if bp_i is None:
                    bp_i = _bf16dot.interleave(W[v0:v1], wt_inter)
                _bf16dot.matmul(gp, bp_i, H, gi32[b0:b1], acc=True)
            else:
                assert Xb is not None and W32 is not None
                matmul_nn(G, W32, gi32[b0:b1], tmp=prod[: nb * H].reshape(nb, H))
                if first:
                    matmul_tn(G, Xb, gwt)
                    first = False
                else:
                    matmul_tn(G, Xb, gwt, tmp=gw_tmp[: nv * H].reshape(nv, H))
            done += 1
            if progress is not None:
                progress(done, plan.n_tiles)
        D.from_float32(gwt, gw_out.dtype, out=gw_out[v0:v1])
    D.from_float32(gi32, gi_out.dtype, out=gi_out)
    return plan
