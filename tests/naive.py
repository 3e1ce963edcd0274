"""Slow, obvious float64 oracles for the seven ops, written from the contract (docs/spec.md
and the operators' CANN docs, aclnnFusedLinearCrossEntropyLossGrad.md, aclnnCrossEntropyLossGrad.md,
aclnnScaledMaskedSoftmaxBackward.md, aclnnSmoothL1LossBackward.md, aclnnEmbeddingDenseBackward.md,
aclnnFusedLinearOnlineMaxSum.md, aclnnFusedCrossEntropyLossWithMaxSum.md), in the spirit of stumpy's ``tests/naive.py``.

Nothing here imports fastgrad: these functions are the independent oracle that both the CPU
kernels and the in-package "reference" backend are tested against.

Conventions
-----------
* Every function widens its inputs to float64 (16-bit floats widen exactly) and computes the
  formula of docs/spec.md with plain loops or plain vectorized float64 math.
* Functions return **unrounded float64** results (``ref64``); tests compare the op's rounded
  output with them within a tolerance derived from the precision model.  ``round_like_device``
  gives the device's rounding of such a result when a bit-level expectation is wanted.
* Where docs/spec.md names an intermediate rounding that changes results by more than accumulated
  fp32 error (the FLCE grad's rounding of ``g`` to the input dtype before the GEMMs; the forward's
  rounding of the logits to the input dtype), the oracle performs it with ``round_like_device``.

Precision model and double rounding
-----------------------------------
The device computes in fp32 and rounds each output once (RNE) to its dtype.  ``round_like_device``
mimics this from a float64 value: float64 -> fp32 (RNE) -> dtype (RNE, ``ml_dtypes`` astype).
The first step stands for "the value the fp32 pipeline holds"; the double rounding
float64 -> fp32 -> bf16 can differ from a direct float64 -> bf16 rounding by one bf16 ulp when the
fp32 value lands exactly on a bf16 midpoint (the direct rounding would have seen the discarded
bits).  That is the device's behaviour too (its value *is* an fp32 number), so the two-step form is
the faithful one; but because the device's fp32 value carries its own accumulation error, an
oracle value within a few fp32 ulps of a dtype midpoint may legitimately round either way.  Tests
therefore allow one ulp of the output dtype (plus the fp32 error bound) instead of bit equality.
"""

import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def f64(a):
    """Widen to float64 (exact for fp32/fp16/bf16; bool and integers as numbers)."""
    a = np.asarray(a)
    if a.dtype == BF16:
        return a.astype(np.float32).astype(np.float64)
    return a.astype(np.float64)


def round_like_device(x64, dtype):
    """float64 -> fp32 (RNE) -> dtype (RNE): the value an fp32 pipeline stores in ``dtype``."""
    x32 = np.asarray(x64, np.float64).astype(np.float32)
    return x32.astype(np.dtype(dtype))


def unpack_mask(target_mask, bt):
    """Bit i of a packed LSB-first uint8 mask ((mask[i >> 3] >> (i & 7)) & 1), or a bool[BT] mask."""
    m = np.asarray(target_mask)
    if m.dtype == np.bool_:
        return np.array([bool(m[i]) for i in range(bt)], dtype=bool)
    return np.array([(int(m[i >> 3]) >> (i & 7)) & 1 == 1 for i in range(bt)], dtype=bool)


def pack_mask(bits, padding_bit=False):
    """Pack a bool[BT] LSB-first into ceil(BT/8) bytes, padding bits set to ``padding_bit``."""
    bits = [bool(b) for b in np.asarray(bits).reshape(-1)]
    nbytes = (len(bits) + 7) // 8
    bits = bits + [bool(padding_bit)] * (8 * nbytes - len(bits))
    out = np.zeros(nbytes, np.uint8)
    for i, b in enumerate(bits):
        if b:
            out[i >> 3] |= 1 << (i & 7)
    return out


def megatron_smoothing(alpha, k):
    """Megatron's label-smoothing scalar s = α·K/(K-1) over the local vocabulary K."""
    return alpha * k / (k - 1)


# ---------------------------------------------------------------------------------------------
# fused_linear_online_max_sum
# ---------------------------------------------------------------------------------------------

def fused_linear_online_max_sum(input, weight, target, vocab_start_index, vocab_end_index,
                                logits_dtype=None):
    """Returns a dict with the six outputs of docs/spec.md (float64 statistics, exact mask/target).

    ``logits`` = input·weightᵀ (float64, standing for the fp32 accumulation) rounded to
    ``logits_dtype`` (default the input dtype, the device's matmul output type).
    """
    x, w = f64(input), f64(weight)
    t = np.asarray(target).astype(np.int64)
    bt, v = x.shape[0], w.shape[0]
    ldt = np.dtype(input.dtype) if logits_dtype is None else np.dtype(logits_dtype)
    logits = x @ w.T if bt * v else np.zeros((bt, v))
    if ldt != np.float64:
        logits = f64(round_like_device(logits, ldt))
    start, end = int(vocab_start_index), int(vocab_end_index)
    masked = np.array([t[i] < start or t[i] >= end for i in range(bt)], dtype=bool)
    masked_target = np.array([0 if masked[i] else t[i] - start for i in range(bt)], np.int64)
    mx = np.full(bt, -np.inf)
    se = np.zeros(bt)
    pred = np.zeros(bt)
    for r in range(bt):
        if v:
            mx[r] = max(logits[r, c] for c in range(v))
            se[r] = sum(math.exp(logits[r, c] - mx[r]) if np.isfinite(logits[r, c] - mx[r])
                        else float(np.exp(logits[r, c] - mx[r])) for c in range(v))
        if not masked[r] and v:
            # the kernel's atomic sum of the gathered logit over the vocabulary tiles: 0 when no
            # tile holds the column (masked_target >= V), then - max on every unmasked row
            picked = logits[r, masked_target[r]] if masked_target[r] < v else 0.0
            pred[r] = picked - mx[r]
    # padding bits: the kernel pads the target with 0 before comparing
    pad = (0 < start) or (0 >= end)
    return {"logits_max_local": mx, "sum_exp_logits_local": se, "predicted_logits_local": pred,
            "target_mask": pack_mask(masked, pad), "masked": masked,
            "masked_target": masked_target.astype(np.asarray(target).dtype),
            "vocab_parallel_logits": logits}


def combine_shards(stats):
    """SPEC's combination of shard statistics: list of (max, sum_exp, predicted, owned)."""
    gmax = np.max([s[0] for s in stats], axis=0)
    tot = sum(s[1] * np.exp(s[0] - gmax) for s in stats)
    pred = sum(s[2] + (s[0] - gmax) * s[3] for s in stats)
    return gmax, tot, pred


# ---------------------------------------------------------------------------------------------
# fused_cross_entropy_loss_with_max_sum
# ---------------------------------------------------------------------------------------------

def fused_cross_entropy_loss_with_max_sum(logits_max, sum_exp_logits, predicted_logits,
                                          label_smoothing=0.0, vocab_parallel_logits=None):
    """(loss float64[BT], softmax float64[BT,V] or None).

    loss = log(sum_exp) - predicted; with label smoothing (Megatron, K = local V):
    loss = (1-s)·loss - s·mean_v(log softmax_v), s = α·K/(K-1).
    """
    m, se, pr = f64(logits_max), f64(sum_exp_logits), f64(predicted_logits)
    loss = np.array([math.log(se[i]) - pr[i] if se[i] > 0 else float(np.log(se[i]) - pr[i])
                     for i in range(m.shape[0])]) if m.shape[0] else np.zeros(0)
    if vocab_parallel_logits is None:
        return loss, None
    lg = f64(vocab_parallel_logits)
    sm = np.exp(lg - m[:, None]) / se[:, None]
    if label_smoothing:
        k = lg.shape[1]
        s = megatron_smoothing(label_smoothing, k)
        mean_log = np.log(sm).mean(axis=1)
        loss = (1.0 - s) * loss - s * mean_log
    return loss, sm


# ---------------------------------------------------------------------------------------------
# fused_linear_cross_entropy_loss_grad
# ---------------------------------------------------------------------------------------------

def flce_g(grad, input, weight, target_mask, masked_target, label_smoothing=0.0,
           logits_max=None, sum_exp_logits=None, softmax=None):
    """The logits gradient g[BT,V] in float64, before its rounding to the input dtype."""
    x, w = f64(input), f64(weight)
    bt, v = x.shape[0], w.shape[0]
    gr = f64(grad)
    masked = unpack_mask(target_mask, bt)
    mt = np.asarray(masked_target).astype(np.int64)
    if softmax is None:
        logits = x @ w.T
        p = np.exp(logits - f64(logits_max)[:, None]) / f64(sum_exp_logits)[:, None]
    else:
        p = f64(softmax).copy()
    if label_smoothing:
        s = megatron_smoothing(label_smoothing, v)
        hit = 1.0 - s
    else:
        s, hit = 0.0, 1.0
    g = p.copy()
    for r in range(bt):
        if not masked[r] and 0 <= mt[r] < v:
            g[r, mt[r]] -= hit
        if label_smoothing:
            g[r, :] -= s / v
        g[r, :] *= gr[r]
    return g


def fused_linear_cross_entropy_loss_grad(grad, input, weight, target_mask, masked_target,
                                         label_smoothing=0.0, logits_max=None,
                                         sum_exp_logits=None, softmax=None, return_g=False):
    """(grad_input, grad_weight) in float64 (unrounded), from g rounded to the input dtype.

    SPEC: g is rounded to the input dtype (RNE) before grad_input = g·weight and
    grad_weight = gᵀ·input, which accumulate in fp32 (float64 here).
    """
    g = flce_g(grad, input, weight, target_mask, masked_target, label_smoothing, logits_max,
               sum_exp_logits, softmax)
    gq = f64(round_like_device(g, np.asarray(input).dtype))
    gi = gq @ f64(weight)
    gw = gq.T @ f64(input)
    return (gi, gw, g) if return_g else (gi, gw)


# ---------------------------------------------------------------------------------------------
# cross_entropy_loss_grad
# ---------------------------------------------------------------------------------------------

def cross_entropy_loss_grad(grad_loss, log_prob, target, weight=None, reduction="mean",
                            ignore_index=-100, label_smoothing=0.0, grad_zloss=None,
                            lse_for_zloss=None, lse_square_scale_for_zloss=0.0):
    red = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction) \
        if not isinstance(reduction, str) else reduction
    lp = f64(log_prob)
    n, c = lp.shape
    t = np.asarray(target).astype(np.int64)
    wt = np.ones(c) if weight is None else f64(weight)
    ls = float(label_smoothing)
    keep = np.array([t[i] != ignore_index for i in range(n)], dtype=bool)
    # a target outside [0, C) (no weight: the device computes it) has weight 1 and matches no column
    w_row = np.array([(wt[t[i]] if 0 <= t[i] < c else 1.0) if keep[i] else 0.0 for i in range(n)])
    W = sum(w_row)
    g = f64(grad_loss)
    with np.errstate(all="ignore"):
        if red == "mean":
            s = np.full(n, np.float64(g) / np.float64(W))      # W = 0: ±inf or NaN, as IEEE
        elif red == "sum":
            s = np.full(n, float(g))
        else:
            s = g.reshape(n).copy()
    sum_w = sum(wt) if c else 0.0
    out = np.zeros((n, c))
    for i in range(n):
        if not keep[i]:
            # an ignored row is p·c_i with c_i = s_i·0 (the kernel computes it: ops-nn
            # cross_entropy_loss_grad_weight_none.h:94-95): 0 for a finite p = exp(log_prob) (fp32:
            # overflowing past log_prob 88.72) and a finite scale; NaN where p is Inf/NaN or the scale
            # is not finite (mean with W = 0: the device's "NaN everywhere")
            with np.errstate(all="ignore"):
                p32 = np.exp(lp[i].astype(np.float32)).astype(np.float64)
                out[i, :] = p32 * (s[i] * 0.0)
            out[i, :] = np.where(np.isnan(out[i, :]), np.nan, 0.0)
            continue
        for j in range(c):
            p = math.exp(lp[i, j]) if lp[i, j] < 700 else float(np.exp(lp[i, j]))
            delta = 1.0 if j == t[i] else 0.0
            v = (1.0 - ls) * w_row[i] * (p - delta)
            if ls:                                   # with ls = 0 the term is absent (SPEC)
                v += (ls / c) * (p * sum_w - wt[j])
            out[i, j] = s[i] * v
    # grad_zloss, lse_for_zloss, lse_square_scale_for_zloss: accepted and ignored, as on the device
    # (aclnnCrossEntropyLossGrad.md at ops-nn e5c3fa9: the z-loss inputs "不会生效")
    return out


# ---------------------------------------------------------------------------------------------
# scaled_masked_softmax_backward
# ---------------------------------------------------------------------------------------------

def scaled_masked_softmax_backward(grad_output, y, mask, scale=1.0, fix_triu_mask=False):
    """out = (go·y - Σ_last(go·y)·y)·scale, 0 where mask (broadcast) or (triu) j > i."""
    go, yy = f64(grad_output), f64(y)
    shape = go.shape
    m = np.zeros(shape, bool)
    if mask is not None:
        m |= np.broadcast_to(np.asarray(mask) != 0, shape)
    if fix_triu_mask:
        s1, s2 = (shape[-2] if len(shape) >= 2 else 1), shape[-1]   # 1-D: one row, i = 0
        tri = np.zeros((s1, s2), bool)
        for i in range(s1):
            for j in range(s2):
                tri[i, j] = j > i
        m |= np.broadcast_to(tri if len(shape) >= 2 else tri[0], shape)
    out = np.zeros(shape)
    go2 = go.reshape(-1, shape[-1]) if go.size else go.reshape(0, shape[-1] if shape else 0)
    y2 = yy.reshape(go2.shape)
    o2 = out.reshape(go2.shape)
    m2 = m.reshape(go2.shape)
    for r in range(go2.shape[0]):
        tot = sum(go2[r, k] * y2[r, k] for k in range(go2.shape[1]))
        for j in range(go2.shape[1]):
            o2[r, j] = 0.0 if m2[r, j] else (go2[r, j] * y2[r, j] - tot * y2[r, j]) * scale
    return o2.reshape(shape)


# ---------------------------------------------------------------------------------------------
# smooth_l1_loss_backward
# ---------------------------------------------------------------------------------------------

def smooth_l1_loss_backward(grad_out, input, target, reduction="mean", beta=1.0, tbe=True):
    """d = input - target (in fp32, as the device computes it); |d| < beta: d/beta, else sign(d)
    with sign(0) = 0; times grad_out; mean divides by the broadcast output's element count.

    ``tbe`` (the A2/A3 SoC profiles, the default): the 910B TBE kernel divides by
    ``fp32(beta + 1e-6)`` instead, and a NaN d gives 0 when beta = 0 (its compares read NaN as 0).
    ``tbe=False`` (the 950's arch35 kernel): for beta < 1e-6 (0 included) the tiling's ``1/beta``
    is NaN (``smooth_l1_loss_grad_v2_tiling.cpp:145``), so the quadratic zone is NaN — ``|d| <=
    beta`` for a per-element grad_out (the tensor DAG), ``|d| < beta`` for a one-element one (the
    scalar DAG, ``smooth_l1_loss_grad_v2_dag.h``; docs/device_parity.md rows 5a, 5f)."""
    red = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction) \
        if not isinstance(reduction, str) else reduction
    g, x, t = (f64(a) for a in (grad_out, input, target))
    shape = np.broadcast_shapes(g.shape, x.shape, t.shape)
    g, x, t = (np.broadcast_to(a, shape).reshape(-1) for a in (g, x, t))
    beta = float(np.float32(beta))
    n = int(np.prod(shape))
    out = np.zeros(n)
    nan_zone = not tbe and beta < 1e-6
    scalar_grad = f64(grad_out).size == 1
    for k in range(n):
        d = float(np.float32(x[k] - t[k]))          # the device's fp32 difference
        if nan_zone and (abs(d) < beta or (abs(d) <= beta and not scalar_grad)):
            s = math.nan
        elif abs(d) < beta:
            s = d / (float(np.float32(np.float32(beta) + np.float32(1e-6))) if tbe else beta)
        elif d != d:
            s = 0.0 if (tbe and beta == 0) else d
        else:
            s = (d > 0) - (d < 0)
        v = s * g[k]
        if red == "mean":
            v = v / n
        out[k] = v
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# embedding_dense_backward
# ---------------------------------------------------------------------------------------------

def embedding_dense_backward(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    """out[k] = Σ_{i: idx_i = k} grad[i]; row padding_idx zero; scale: /count(k)."""
    g = f64(grad)
    d = g.shape[-1]
    idx = np.asarray(indices).reshape(-1)
    idx = [int(math.trunc(float(i))) for i in idx]    # floats truncate toward zero
    g2 = g.reshape(len(idx), d) if d else np.zeros((len(idx), 0))
    out = np.zeros((num_weights, d))
    count = [0] * num_weights
    for i, k in enumerate(idx):
        count[k] += 1
        if k != padding_idx:
            out[k] += g2[i]
    if scale_grad_by_freq:
        for k in range(num_weights):
            if count[k]:
                out[k] /= count[k]
    return out


# ---------------------------------------------------------------------------------------------
# Comparison with the precision model
# ---------------------------------------------------------------------------------------------

U32 = 2.0 ** -24                                                  # fp32 unit roundoff
_PREC = {BF16: (8, -126), F16: (11, -14), F32: (24, -126)}          # (precision p, emin)
F32_MAX = float(np.finfo(np.float32).max)


def ulp(x64, dtype):
    """The spacing of ``dtype`` at |x| (subnormal spacing below the normal range)."""
    p, emin = _PREC[np.dtype(dtype)]
    a = np.abs(np.asarray(x64, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.where((a > 0) & np.isfinite(a), a, 2.0 ** emin)))
    e = np.maximum(e, emin)
    return np.ldexp(1.0, (e - (p - 1)).astype(np.int64))


def assert_matches(got, ref64, dtype, mag=None, k32=0.0, extra=0.0, ulps=1.0, what="", overflow=None,
                   inf_arith=None):
    """Check an fp32-pipeline result rounded to ``dtype`` against a float64 oracle.

    Bound (rigorous for the precision model):  |got - ref| <= ulps·ulp_dtype(ref)
    + k32·u32·mag + extra, where ``mag`` bounds the absolute values of the terms the fp32
    pipeline combined (its forward error is <= k32·u32·mag, Higham's γ_n bound) and ``extra``
    is an additional absolute bound (e.g. the effect of an intermediate rounding).  One ulp of
    the dtype covers the final RNE rounding (half an ulp) plus a binade crossing.

    NaN placement must be equal.  Where the oracle's magnitude exceeds the fp32 range the fp32
    pipeline may legitimately overflow (inf, or NaN from inf - inf): only a NaN in the oracle is
    required there (``overflow`` marks further elements whose intermediates leave the fp32
    range).  Otherwise ±Inf in the rounded oracle must be matched exactly.
    """
    got = f64(got)
    ref64 = np.asarray(ref64, np.float64)
    assert got.shape == ref64.shape, f"{what}: shape {got.shape} != {ref64.shape}"
    if got.size == 0:
        return
    mag = np.abs(ref64) if mag is None else np.broadcast_to(np.asarray(mag, np.float64), ref64.shape)
    extra = np.broadcast_to(np.asarray(extra, np.float64), ref64.shape)
    with np.errstate(all="ignore"):
        care = np.isfinite(mag) & (mag < F32_MAX / 4) & np.isfinite(extra)
        if overflow is not None:
            care &= ~np.broadcast_to(np.asarray(overflow, bool), ref64.shape)
        rr = f64(round_like_device(ref64, dtype))
        nan_ref = np.isnan(ref64)
        bad_nan = nan_ref & ~np.isnan(got)
        if inf_arith is not None:       # NaN from inf - inf / 0·inf: another evaluation order of
            # the same formula may give ±inf there (undefined by the contract beyond "not finite")
            bad_nan &= ~(np.broadcast_to(np.asarray(inf_arith, bool), ref64.shape) & ~np.isfinite(got))
        bad_nan |= care & ~nan_ref & np.isnan(got)
        fin = care & ~nan_ref
        tol = ulps * ulp(ref64, dtype) + k32 * U32 * np.where(care, mag, 0) + np.where(care, extra, 0)
        inf_ok = np.isinf(rr) & (got == rr)
        err = np.abs(got - ref64)
        bad_val = fin & ~inf_ok & ~(err <= tol)
    bad = bad_nan | bad_val
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements off (dtype {np.dtype(dtype)}); "
            f"first at {tuple(int(k) for k in i)}: got {got[i]!r}, oracle {ref64[i]!r}, "
            f"tol {tol[i]!r}, mag {mag[i]!r}")


# ---------------------------------------------------------------------------------------------
# Per-op checks: the oracle plus the forward-error bound of the op's fp32 pipeline
# ---------------------------------------------------------------------------------------------

def _abs64(a):
    return None if a is None else np.abs(f64(a))


def check_smooth_l1_loss_backward(got, grad_out, input, target, reduction="mean", beta=1.0, tbe=True):
    """Each element is a handful of fp32 operations (d·fp32(1/β), ·grad, ·1/N): <= 8 u32 relative."""
    ref = smooth_l1_loss_backward(grad_out, input, target, reduction, beta, tbe)
    red = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction) \
        if not isinstance(reduction, str) else reduction
    pre = np.abs(ref) * (ref.size if red == "mean" else 1)       # s·grad before the 1/N
    gb = np.abs(np.broadcast_to(f64(grad_out), ref.shape))
    with np.errstate(all="ignore"):
        under = 4 * 2.0 ** -149 * (np.where(np.isfinite(gb), gb, 0) + 1)   # d·(1/β) underflow, then ·grad
    assert_matches(got, ref, np.asarray(got).dtype, mag=np.abs(ref), k32=8, what="smooth_l1", extra=under,
                   overflow=~(pre < F32_MAX / 4))
    return ref


def check_embedding_dense_backward(got, grad, indices, num_weights, padding_idx=-1,
                                   scale_grad_by_freq=False):
    """fp32 sum of m terms in index order: error <= (m-1)·u32·Σ|g| (+ one division)."""
    ref = embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    mag = embedding_dense_backward(_abs64(grad), indices, num_weights, padding_idx, scale_grad_by_freq)
    idx = [int(math.trunc(float(i))) for i in np.asarray(indices).reshape(-1)]
    m = max([idx.count(k) for k in set(idx)], default=0)
    total = embedding_dense_backward(_abs64(grad), indices, num_weights, padding_idx, False)
    assert_matches(got, ref, np.asarray(got).dtype, mag=mag, k32=m + 2, what="embedding",
                   overflow=~(total < F32_MAX / 4))                 # the running fp32 sum
    return ref


def check_scaled_masked_softmax_backward(got, grad_output, y, mask, scale=1.0, fix_triu_mask=False):
    """Row sum of S2 products then go·y - S·y, ·scale: error <= (S2 + 4)·u32·mag with
    mag = (|go·y| + Σ|go·y|·|y|)·|scale|."""
    ref = scaled_masked_softmax_backward(grad_output, y, mask, scale, fix_triu_mask)
    go, yy = np.abs(f64(grad_output)), np.abs(f64(y))
    if go.size:
        with np.errstate(all="ignore"):
            mag = (go * yy + (go * yy).sum(-1, keepdims=True) * yy) * abs(float(scale))
        mag = np.where(ref == 0, np.where(np.isnan(mag), 0, mag), mag)
    else:
        mag = go
    s2 = go.shape[-1] if go.ndim else 1
    with np.errstate(all="ignore"):
        inter = go * yy
        inter = np.maximum(inter, inter.sum(-1, keepdims=True)) if go.size else inter
    over = ~(inter < F32_MAX / 4)                              # go·y or the row sum leave fp32
    with np.errstate(all="ignore"):
        row_inf = np.isinf(go).any(-1, keepdims=True) | np.isinf(yy).any(-1, keepdims=True) if go.size else go
        row_nan = np.isnan(go).any(-1, keepdims=True) | np.isnan(yy).any(-1, keepdims=True) if go.size else go
    tiny = 2.0 ** -149                         # fp32 underflow: <= one subnormal per operation,
    with np.errstate(all="ignore"):            # amplified by the later products with |y|, |scale|
        under = (s2 + 2) * tiny * (yy + 1) * max(abs(float(scale)), 1.0) if go.size else 0.0
    assert_matches(got, ref, np.asarray(got).dtype, mag=mag, k32=s2 + 4, what="smsb", overflow=over,
                   extra=np.where(np.isfinite(under), under, 0.0),
                   inf_arith=np.broadcast_to(row_inf & ~row_nan, ref.shape) if go.size else None)
    return ref


def check_cross_entropy_loss_grad(got, grad_loss, log_prob, target, weight=None, reduction="mean",
                                  ignore_index=-100, label_smoothing=0.0, grad_zloss=None,
                                  lse_for_zloss=None, lse_square_scale_for_zloss=0.0):
    """p = exp(log_prob) (a few u32), Σ_c weight_c (C·u32), a handful of products:
    error <= (C + 10)·u32·mag, mag the formula with every term in absolute value."""
    kw = dict(weight=weight, reduction=reduction, ignore_index=ignore_index,
              label_smoothing=label_smoothing, grad_zloss=grad_zloss, lse_for_zloss=lse_for_zloss,
              lse_square_scale_for_zloss=lse_square_scale_for_zloss)
    ref = cross_entropy_loss_grad(grad_loss, log_prob, target, **kw)
    lp = f64(log_prob)
    n, c = lp.shape
    with np.errstate(all="ignore"):
        # magnitude: the same formula on |terms| (p + 1 for p - δ; p·Σ|w| + |w_j|)
        p = np.exp(lp)
        wt = np.ones(c) if weight is None else np.abs(f64(weight))
        t = np.asarray(target).astype(np.int64)
        keep = t != ignore_index
        red = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction) \
            if not isinstance(reduction, str) else reduction
        g = np.abs(f64(grad_loss))
        inside = (t >= 0) & (t < c)  # a target outside [0, C) (no weight) has weight 1
        w_row = np.where(keep, np.where(inside, wt[np.where(keep & inside, t, 0)], 1.0) if c else 0.0, 0.0)
        if red == "mean":
            W = abs(sum(f64(weight)[t[i]] if weight is not None else 1.0 for i in range(n) if keep[i]))
            s = np.full(n, g / W if W else np.inf)
        elif red == "sum":
            s = np.full(n, float(g))
        else:
            s = np.broadcast_to(g, (n,)).astype(np.float64)
        ls = float(label_smoothing)
        mag = s[:, None] * ((1 - ls) * w_row[:, None] * (p + 1) + (ls / max(c, 1)) * (p * wt.sum() + wt[None, :]))
        mag = np.where(keep[:, None], mag, 0.0)
    with np.errstate(all="ignore"):
        over = keep[:, None] & ~(p * max(1.0, float(wt.sum()) if c else 1.0) < F32_MAX / 4)
    with np.errstate(all="ignore"):
        fin = [np.isfinite(f64(a)).all() for a in (grad_loss, weight) if a is not None]
        row_inf = (np.isinf(lp).any(1) | (not all(fin)))[:, None] & ~np.isnan(lp).any(1)[:, None]
    with np.errstate(all="ignore"):
        under = 4 * 2.0 ** -149 * (s[:, None] * (1 + wt.sum() if c else 1) + 1)   # p underflow, then ·s
        under = np.where(np.isfinite(under), under, 0.0)
    assert_matches(got, ref, np.asarray(got).dtype, mag=mag, k32=c + 10, what="cross_entropy", extra=under,
                   overflow=over, inf_arith=np.broadcast_to(row_inf, ref.shape))                             # exp(log_prob) or p·Σw leave fp32
    return ref


def check_fused_cross_entropy_loss_with_max_sum(got_loss, got_softmax, logits_max, sum_exp_logits,
                                                predicted_logits, label_smoothing=0.0,
                                                vocab_parallel_logits=None):
    """loss: log (1-2 u32 of |log se|) and one subtraction, + the smoothing mean over V terms;
    softmax: exp(l - m)·(1/se): the rounding of l - m is an absolute u32·|l - m| in the exponent."""
    loss, sm = fused_cross_entropy_loss_with_max_sum(logits_max, sum_exp_logits, predicted_logits,
                                                     label_smoothing, vocab_parallel_logits)
    m, se, pr = f64(logits_max), f64(sum_exp_logits), f64(predicted_logits)
    with np.errstate(all="ignore"):
        lmag = np.abs(np.log(se)) + np.abs(pr) + 1e-300
        k = 4
        if vocab_parallel_logits is not None:
            lg = f64(vocab_parallel_logits)
            v = lg.shape[1]
            d = np.abs(lg - m[:, None])
            if label_smoothing and v:
                s = abs(megatron_smoothing(label_smoothing, v))
                lmag = abs(1 - s) * lmag + s * (d.mean(axis=1) + np.abs(np.log(se)))
                k = v + 8
            recip_over = ~(1.0 / se < F32_MAX / 4)             # fp32 reciprocal 1/sum_exp overflows
            assert_matches(got_softmax, sm, F32, mag=sm * (d + 6), k32=1, what="softmax",
                           overflow=np.broadcast_to(recip_over[:, None], sm.shape))
            if label_smoothing:
                lmag = np.where(recip_over, np.inf, lmag)
        else:
            assert got_softmax is None
    assert_matches(got_loss, loss, F32, mag=lmag, k32=k, what="loss")
    return loss, sm


def _bracket(x64, delta, dtype):
    """The values an fp32 pipeline whose result lies within ±delta of x64 can round to."""
    with np.errstate(all="ignore"):
        lo = f64(round_like_device(x64 - delta, dtype))
        hi = f64(round_like_device(x64 + delta, dtype))
    return lo, hi


def check_fused_linear_online_max_sum(got, input, weight, target, vocab_start_index,
                                      vocab_end_index, logits_dtype=None, return_logits=False):
    """The logits are the fp32 accumulation of H products (error <= (H+1)·u32·|x|·|w|ᵀ) rounded
    to the logits dtype; where that error straddles a rounding boundary both neighbours are
    legitimate, so the statistics are checked against the oracle run on each bracket end."""
    x, w = f64(input), f64(weight)
    bt, h = x.shape
    v = w.shape[0]
    ldt = np.dtype(input.dtype) if logits_dtype is None else np.dtype(logits_dtype)
    exact = x @ w.T
    delta = (h + 1) * U32 * (np.abs(x) @ np.abs(w).T)
    lo, hi = _bracket(exact, delta, ldt)
    ref = fused_linear_online_max_sum(input, weight, target, vocab_start_index, vocab_end_index,
                                      logits_dtype)
    # exact outputs
    assert np.array_equal(np.asarray(got.target_mask), ref["target_mask"]), \
        (np.asarray(got.target_mask), ref["target_mask"])
    assert np.asarray(got.target_mask).dtype == np.uint8
    assert np.array_equal(np.asarray(got.masked_target), ref["masked_target"])
    assert np.asarray(got.masked_target).dtype == np.asarray(target).dtype
    if return_logits:
        gl = f64(got.vocab_parallel_logits)
        assert np.asarray(got.vocab_parallel_logits).dtype == ldt
        assert ((gl >= lo) & (gl <= hi) | (np.isnan(gl) & np.isnan(exact))).all(), "logits"
    else:
        assert got.vocab_parallel_logits is None
    outs = []
    for L in (lo, hi):
        mx = L.max(axis=1) if v else np.full(bt, -np.inf)
        with np.errstate(all="ignore"):
            e = np.exp(L - mx[:, None])
        se = e.sum(axis=1)
        # unmasked rows: the picked logit (0 when masked_target >= V: no tile holds it) - max
        pr = np.array([(L[r, ref["masked_target"][r]] if ref["masked_target"][r] < v else 0.0) - mx[r]
                       if not ref["masked"][r] and v else 0.0 for r in range(bt)])
        outs.append((mx, se, pr, e))
    for name, i in (("logits_max_local", 0), ("sum_exp_logits_local", 1), ("predicted_logits_local", 2)):
        g = np.asarray(getattr(got, name))
        assert g.dtype == np.float32 and g.shape == (bt,), name
        a, b = outs[0][i], outs[1][i]
        lo_v, hi_v = np.minimum(a, b), np.maximum(a, b)
        if i == 0:
            tol = 0.0
        elif i == 1:
            tol = (v + 4) * U32 * hi_v                      # V exp terms, each ~2 u32, summed in fp32
        else:
            tol = U32 * np.abs(hi_v) + U32 * np.abs(lo_v)
        gg = f64(g)
        ok = ((gg >= lo_v - tol) & (gg <= hi_v + tol)) | (gg == lo_v) | (np.isnan(gg) & (np.isnan(a) | np.isnan(b)))
        assert ok.all(), (name, gg[~ok][:5], lo_v[~ok][:5], hi_v[~ok][:5])
    return ref


def check_fused_linear_cross_entropy_loss_grad(got, grad, input, weight, target_mask, masked_target,
                                               label_smoothing=0.0, logits_max=None,
                                               sum_exp_logits=None, softmax=None):
    """Bound: g is computed in fp32 with error δ_g (the logits' GEMM error (H+2)·u32·|x||w|ᵀ
    amplified by exp, plus a few u32 for the division, the subtraction and ·grad), then rounded
    to the input dtype; the element can round to either end of [g-δ_g, g+δ_g] (``_bracket``),
    a deviation Δg that is 0 except near rounding midpoints.  The GEMMs then add Δg·|w| (resp.
    Δgᵀ·|x|) and (V+2)·u32·|g_q|·|w| (resp. (BT+2)·u32·|g_q|ᵀ·|x|) of fp32 accumulation, and the
    final rounding one ulp."""
    x, w = f64(input), f64(weight)
    dt = np.asarray(input).dtype
    bt, h = x.shape
    v = w.shape[0]
    gi_ref, gw_ref, g = fused_linear_cross_entropy_loss_grad(
        grad, input, weight, target_mask, masked_target, label_smoothing, logits_max,
        sum_exp_logits, softmax, return_g=True)
    gq = f64(round_like_device(g, dt))
    gr = np.abs(f64(grad))[:, None]
    s = abs(megatron_smoothing(label_smoothing, v)) if label_smoothing else 0.0
    with np.errstate(all="ignore"):
        if softmax is None:
            L = x @ w.T
            p = np.exp(L - f64(logits_max)[:, None]) / f64(sum_exp_logits)[:, None]
            dl = (h + 2) * U32 * (np.abs(x) @ np.abs(w).T) + U32 * np.abs(L - f64(logits_max)[:, None])
            dp = p * (np.expm1(dl) + 4 * U32)
        else:
            p = np.abs(f64(softmax))
            dp = 0.0 * p
        delta = gr * (dp + 3 * U32 * (p + 1 + 2 * s))
    lo, hi = _bracket(g, delta, dt)
    dg = np.maximum(np.abs(lo - gq), np.abs(hi - gq))
    dg = np.where(np.isnan(dg), 0.0, dg)
    gi, gw = got
    assert np.asarray(gi).dtype == dt and np.asarray(gw).dtype == dt
    assert np.asarray(gi).shape == (bt, h) and np.asarray(gw).shape == (v, h)
    with np.errstate(all="ignore"):
        agq = np.abs(gq)
        assert_matches(gi, gi_ref, dt, mag=agq @ np.abs(w), k32=v + 2, extra=dg @ np.abs(w),
                       what="grad_input")
        assert_matches(gw, gw_ref, dt, mag=agq.T @ np.abs(x), k32=bt + 2, extra=dg.T @ np.abs(x),
                       what="grad_weight")
    return gi_ref, gw_ref
