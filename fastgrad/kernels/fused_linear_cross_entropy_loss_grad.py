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
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as D
from .._jit import pjit, prange
from ..backends import implements
from ..tiling import plan_linear_cross_entropy
from ._gemm import matmul_nn, matmul_nt, matmul_tn, single_threaded_blas
from ._linear import fp32_block, mask_bits, target_columns
from ._vmath import exp_f32

OP = "fused_linear_cross_entropy_loss_grad"


@pjit
def _epilogue_memory_saving(L, row0, col0, logits_max, sum_exp, grad, tcol, code, smooth, inv_k):
    """In place on the fp32 logits tile L [nb, nv]: L <- round((softmax - onehot·(1-s) - s/K)·grad)."""
    nb, nv = L.shape
    one_minus_s = np.float32(1.0) - smooth
    s_over_k = smooth * inv_k
    for i in prange(nb):
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


@pjit
def _epilogue_high_performance(S, G, row0, col0, grad, tcol, code, smooth, inv_k):
    """G [nb, nv] <- round((S[row0+i, col0+j] - onehot·(1-s) - s/K)·grad); S is not written."""
    nb, nv = G.shape
    one_minus_s = np.float32(1.0) - smooth
    s_over_k = smooth * inv_k
    for i in prange(nb):
        r = row0 + i
        g = grad[r]
        t = tcol[r] - col0
        for j in range(nv):
            G[i, j] = D.round_f32((S[r, col0 + j] - s_over_k) * g, code)
        if t >= 0 and t < nv:
            G[i, t] = D.round_f32((S[r, col0 + t] - one_minus_s - s_over_k) * g, code)


def _scalars(label_smoothing: float, V: int):
    """Megatron's label smoothing with K = local vocabulary: s = α·K/(K-1), applied as s/K."""
    a = float(label_smoothing)
    if a == 0.0 or V <= 1:
        return np.float32(0.0), np.float32(0.0)
    s = a * V / (V - 1)
    return np.float32(s), np.float32(1.0 / V)


def run(grad, input, weight, target_mask, masked_target, label_smoothing, logits_max,
        sum_exp_logits, softmax, out, plan=None, progress=None):
    """Execute the op over a tile plan. ``out = (grad_input, grad_weight)`` C-contiguous.

    ``progress``: optional callable(n_tiles_done) invoked after each tile (the CLI's bar).
    """
    gi_out, gw_out = out
    BT, H = input.shape
    V = weight.shape[0]
    mode = "memory_saving" if softmax is None else "high_performance"
    widen = input.dtype != D.FLOAT32
    if plan is None:
        plan = plan_linear_cross_entropy(BT, V, H, mode=mode, widen=widen)
    if BT == 0 or V == 0 or H == 0:
        gi_out[...] = 0
        gw_out[...] = 0
        return plan
    code = D.code_of(input.dtype)
    grad32 = np.ascontiguousarray(grad, dtype=np.float32)
    masked = mask_bits(target_mask, BT)
    tcol = target_columns(masked_target, masked, V)
    smooth, inv_k = _scalars(label_smoothing, V)

    X32 = fp32_block(input, 0, BT)                       # [BT, H] exact fp32 copy
    gi32 = np.zeros((BT, H), np.float32)                 # grad_input accumulator
    bt, vt = plan.bt_tile, plan.v_tile
    g_buf = np.empty(bt * vt, np.float32)                # logits / g tile
    w_buf = np.empty(vt * H, np.float32) if widen else None
    gw32 = np.empty(vt * H, np.float32)                  # grad_weight tile accumulator
    prod = np.empty(bt * H, np.float32)                  # g·W product of one tile
    gw_tmp = np.empty(vt * H, np.float32) if plan.n_bt_tiles > 1 else None
    if softmax is None:
        lmax = np.ascontiguousarray(logits_max, dtype=np.float32)
        sexp = np.ascontiguousarray(sum_exp_logits, dtype=np.float32)
    else:
        S = np.ascontiguousarray(softmax, dtype=np.float32)  # a view when already contiguous
    W = weight if weight.flags.c_contiguous else np.ascontiguousarray(weight)
    done = 0
    for v0, v1 in plan.v_ranges():
        nv = v1 - v0
        W32 = fp32_block(W, v0, v1, w_buf)
        gwt = gw32[: nv * H].reshape(nv, H)
        first = True
        for b0, b1 in plan.bt_ranges():
            nb = b1 - b0
            G = g_buf[: nb * nv].reshape(nb, nv)
            Xb = X32[b0:b1]
            if softmax is None:
                matmul_nt(Xb, W32, G)
                _epilogue_memory_saving(G, b0, v0, lmax, sexp, grad32, tcol, code, smooth, inv_k)
            else:
                _epilogue_high_performance(S, G, b0, v0, grad32, tcol, code, smooth, inv_k)
            P = prod[: nb * H].reshape(nb, H)
            matmul_nn(G, W32, P)
            np.add(gi32[b0:b1], P, out=gi32[b0:b1])
            if first:
                matmul_tn(G, Xb, gwt)
                first = False
            else:
                Q = gw_tmp[: nv * H].reshape(nv, H)
                matmul_tn(G, Xb, Q)
                np.add(gwt, Q, out=gwt)
            done += 1
            if progress is not None:
                progress(done)
        D.from_float32(gwt, gw_out.dtype, out=gw_out[v0:v1])
    D.from_float32(gi32, gi_out.dtype, out=gi_out)
    return plan


@implements("cpu", OP)
def fused_linear_cross_entropy_loss_grad(*, grad, input, weight, target_mask, masked_target,
                                         label_smoothing, logits_max, sum_exp_logits, softmax, out):
    with single_threaded_blas():
        run(grad, input, weight, target_mask, masked_target, label_smoothing, logits_max,
            sum_exp_logits, softmax, out)
