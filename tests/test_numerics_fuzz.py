"""Adversarial numerics of the five standalone ops, bit for bit, against oracles written here from
docs/spec.md and docs/device_parity.md (importing nothing from fastgrad's kernels or goldens).

Unlike tests/naive.py (float64, judged within a forward-error bound), these oracles follow the
contract's fp32 order of operations step by step in NumPy fp32 (each ``f32(a op b)`` is the IEEE
fp32 result) and round once with ml_dtypes, so where the contract promises the device's order the
comparison is **bitwise** (NaN payloads aside): smooth-L1 (both kernels), the softmax backward
(the golden's reduce order), the embedding backward (index order, ``1.0f / count``).  The
cross-entropy grad and the fused CE's softmax go through ``exp``, which no contract makes
correctly rounded: there the values agree within the exp's error and NaN/±inf/sign of zero
exactly.  Inputs are hostile (NaN, ±inf, subnormals, fp16's 65504/65520, fp32's max), shapes sit
around the kernels' widths, layouts are reversed/Fortran/read-only, on each SoC profile.
"""

import math

import ml_dtypes
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastgrad as fg  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [F32, F16, BF16]
SOCS = ["Ascend910B", "Ascend950"]
f32 = np.float32

FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SPECIAL = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1e-40, 6e-8, 65504.0,
                    65520.0, -65504.0, 3.38e38, 3.4028235e38, 1.0, -1.0, 0.5, 1e-6, 88.0, 89.0,
                    -104.0, -105.0], np.float64)


def w32(a):
    """fp32 view of the values (16-bit widen exactly)."""
    return np.asarray(a).astype(np.float32)


def hostile(rng, shape, dtype, p_special=0.25):
    """Normal values at a random scale with a fraction replaced by SPECIAL, as ``dtype``."""
    v = rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 100.0, 1e5])
    v = np.where(rng.random(shape) < p_special, rng.choice(SPECIAL, size=shape), v)
    with np.errstate(over="ignore"):
        return np.asarray(v).astype(np.float32).astype(dtype)


def relayout(rng, a):
    """The same logical values in another memory layout: reversed, Fortran, read-only."""
    if a.ndim and rng.random() < 0.3:
        ax = int(rng.integers(a.ndim))
        a = np.flip(np.flip(a, ax).copy(), ax)
    if a.ndim >= 2 and rng.random() < 0.3:
        a = np.asfortranarray(a)
    if rng.random() < 0.2:
        a = a.copy()
        a.setflags(write=False)
    return a


def bits_equal(got, exp):
    """Bitwise equal with the same dtype and shape; any NaN equals any NaN."""
    got, exp = np.asarray(got), np.asarray(exp)
    assert got.dtype == exp.dtype and got.shape == exp.shape, (got.dtype, got.shape, exp.dtype, exp.shape)
    u = np.uint16 if got.itemsize == 2 else np.uint32
    g32, e32 = got.astype(np.float32), exp.astype(np.float32)
    ok = (np.ascontiguousarray(got).view(u) == np.ascontiguousarray(exp).view(u)) | (np.isnan(g32) & np.isnan(e32))
    if not ok.all():
        i = np.nonzero(~ok)
        raise AssertionError(f"{(~ok).sum()} elements differ, e.g. at {[x[:3].tolist() for x in i]}: "
                             f"got {g32[i][:3]} expected {e32[i][:3]}")


def ulp_of(x, dtype):
    """Spacing of ``dtype`` at |x| (float64)."""
    fi = ml_dtypes.finfo(dtype)
    x = np.abs(np.asarray(x, np.float64))
    e = np.floor(np.log2(np.maximum(x, float(fi.smallest_normal))))
    return np.exp2(e - fi.nmant)


def close_specials_exact(got, exp32, dtype, mag, n_ulp32=4):
    """``got`` (dtype) against the oracle's fp32 ``exp32``: NaN, ±inf and the sign of an exact
    zero equal; finite values within one ulp of dtype (a rounding boundary the exp's error may
    cross) plus ``n_ulp32`` fp32 ulps of ``mag`` (the terms' magnitude, float64)."""
    g = np.asarray(got).astype(np.float32).astype(np.float64)
    with np.errstate(over="ignore"):
        e = np.asarray(exp32).astype(dtype).astype(np.float32).astype(np.float64)
    ok = np.isnan(g) == np.isnan(e)
    ok &= np.isinf(g) == np.isinf(e)
    ok &= ~np.isinf(e) | (g == e)
    fin = np.isfinite(g) & np.isfinite(e)
    with np.errstate(invalid="ignore", over="ignore"):
        tol = (0.0 if dtype == F32 else 1.01) * ulp_of(e, dtype) + n_ulp32 * (np.abs(e) + mag) * 2.0**-23 + 1e-44
        ok &= ~fin | (np.abs(g - e) <= tol)
    zero = (e == 0) & (g == 0) & (mag == 0)
    ok &= ~zero | (np.signbit(g) == np.signbit(e))
    if not ok.all():
        i = np.nonzero(~ok)
        raise AssertionError(f"{(~ok).sum()} elements off, e.g. at {[x[:3].tolist() for x in i]}: "
                             f"got {g[i][:3]} expected {e[i][:3]}")


# ---------------------------------------------------------------------------------------------
# oracles (docs/spec.md; fp32 step by step)
# ---------------------------------------------------------------------------------------------

def promote(*dts):
    dts = {np.dtype(d) for d in dts}
    return dts.pop() if len(dts) == 1 else F32


def oracle_smooth_l1(g, x, t, red, beta, soc):
    """A2/A3 TBE: ``−[d ≤ −β] + [d ≥ β] + [|d| < β]·d/fp32(β + 1e-6)``, NaN d read as 0 by the
    compares; 950 DAG: ``([d > β] − [d < −β]) + ([|d| > β] ? 0 : d·invβ)`` (≥/≤ for a
    one-element grad_out), ``invβ = |β| < 1e-6 ? NaN : fp32(1/β)``; then ``(s·g)·fp32(1/n)``."""
    shape = np.broadcast_shapes(g.shape, x.shape, t.shape)
    G, X, T = (np.broadcast_to(w32(a), shape).reshape(-1) for a in (g, x, t))
    n = int(np.prod(shape))
    b = f32(beta)
    scalar = g.size == 1
    out = np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        cof = f32(1.0 / n) if (red == "mean" and n) else f32(1)
        for k in range(n):
            d = f32(X[k] - T[k])
            if soc != "Ascend950":
                temp = f32(d / f32(b + f32(1e-6)))
                xx = d if d == d else f32(0)
                s1 = f32(-1) if xx <= -b else f32(0)
                s2 = f32(1) if xx >= b else f32(0)
                s3 = temp if abs(xx) < b else f32(0)
                s = f32(f32(s1 + s2) + s3)
            else:
                inv = f32(np.nan) if abs(b) < f32(1e-6) else f32(f32(1) / b)
                if scalar:
                    pos, neg, big = f32(d >= b), f32(d <= -b), abs(d) >= b
                else:
                    pos, neg, big = f32(d > b), f32(d < -b), abs(d) > b
                s = f32(f32(pos - neg) + (f32(0) if big else f32(d * inv)))
            out[k] = f32(f32(s * G[k]) * cof)
    with np.errstate(over="ignore"):
        return out.reshape(shape).astype(promote(g.dtype, x.dtype, t.dtype))


def _pairwise(v):
    v = np.asarray(v, np.float32)
    while len(v) > 1:
        v = (v[0::2] + v[1::2]).astype(np.float32)
    return f32(v[0])


def _row_sum(prod):
    """Σ in the golden's reduce order (docs/device_parity.md point 7a)."""
    s = len(prod)
    pad = (s + 63) // 64 * 64
    p = np.zeros(pad, np.float32)
    p[:s] = prod
    if pad <= 1024:
        blocks = [_pairwise(p[k:k + 8]) for k in range(0, pad, 8)]
        lanes = blocks[:8]
        for r in range(1, pad // 64):
            lanes = [f32(lanes[j] + blocks[8 * r + j]) for j in range(8)]
        return _pairwise(lanes)
    sums = [_pairwise(p[k:k + 64]) for k in range(0, pad, 64)]
    while len(sums) > 1:
        if len(sums) % 2:
            sums.append(f32(0))
        sums = [f32(sums[2 * i] + sums[2 * i + 1]) for i in range(len(sums) // 2)]
    return sums[0]


def oracle_softmax_backward(go, y, mask, scale, triu):
    shape = go.shape
    if go.size == 0:
        return np.zeros(shape, go.dtype)
    s2 = shape[-1]
    s1 = shape[-2] if len(shape) >= 2 else 1
    G, Y = w32(go).reshape(-1, s2), w32(y).reshape(-1, s2)
    M = np.zeros(shape, bool) if mask is None else np.broadcast_to(np.asarray(mask) != 0, shape)
    M = M.reshape(-1, s2).copy()
    if triu:
        for r in range(M.shape[0]):
            M[r, np.arange(s2) > r % s1] = True
    sc = f32(scale)
    out = np.empty_like(G)
    with np.errstate(all="ignore"):
        for r in range(G.shape[0]):
            prod = (G[r] * Y[r]).astype(np.float32)
            S = _row_sum(prod)
            if (s2 + 63) // 64 * 64 <= 1024:  # SoftmaxGrad: ((dy − Σ)·y)·scale
                v = ((G[r] - S).astype(np.float32) * Y[r]).astype(np.float32) * sc
            else:  # (dy·y − y·Σ)·scale
                v = (prod - (Y[r] * S).astype(np.float32)).astype(np.float32) * sc
            out[r] = np.where(M[r], f32(0), v.astype(np.float32))
        return out.reshape(shape).astype(go.dtype)


def oracle_embedding(grad, idx, nw, pad, scale, out_dtype, soc):
    d = grad.shape[-1]
    ind = np.asarray(idx).reshape(-1)
    if ind.dtype.kind == "f" or ind.dtype == BF16:
        ind = np.trunc(ind.astype(np.float64)).astype(np.int64)
    ind = ind.astype(np.int64)
    G = w32(grad).reshape(len(ind), d)
    out = np.zeros((nw, d), np.float32)
    with np.errstate(all="ignore"):
        for k in range(nw):
            pos = np.nonzero(ind == k)[0]
            if len(pos) == 0 or k == pad:
                continue
            acc = np.zeros(d, np.float32)  # from +0, in index order
            for p in pos:
                acc = (acc + G[p]).astype(np.float32)
            if scale:
                acc = (acc * (f32(1) / f32(len(pos)))).astype(np.float32)
            out[k] = acc
    # IsNeedCast (docs/spec.md): the A2/A3 op_api widens a small 16-bit grad to fp32
    widened = soc != "Ascend950" and ((grad.size + nw * d) * 2 < 100 << 20 or len(ind) < 512 or scale)
    with np.errstate(over="ignore"):
        res = out if (grad.dtype == F32 or widened) else out.astype(grad.dtype)
        return res.astype(out_dtype)


def oracle_ce_grad(g, lp, t, w, red, ii, ls, soc):
    """docs/spec.md and rows 4b-4m: ``c = fl(fl(fl(g·(1−ls))/W)·m)·w_t``, ``sm = fl(fl(g/W)·
    fl(ls/C))·m``; ls = 0: ``x = fl(e·c)``, ``x[t] = fl(x − c)``; ls ≠ 0: on 950
    ``fl(fl(fl(e·S) − fl(w_j·sm)) + x)``, on A2/A3 ``fl(fl(e·fl(c + S)) − fl(w_j·sm))`` then
    ``− c`` at t; ``S = fl(sm·fl(Σw))`` (term by term for a non-finite sm).  ``e`` is the
    correctly rounded fp32 exp.  Returns (fp32 values, the terms' magnitude)."""
    n, c = lp.shape
    any_sign = soc != "Ascend950"
    with np.errstate(all="ignore"):
        e = np.exp(w32(lp).astype(np.float64)).astype(np.float32)
        G = w32(g).reshape(-1)
        G = G if red == "none" else np.full(n, G[0], np.float32)
        wv = np.ones(c, np.float32) if w is None else w32(w)
        ign = (t == ii) & (any_sign or ii >= 0)
        m = np.where(ign, f32(0), f32(1))
        inside = (t >= 0) & (t < c)
        tw = np.where(inside, t, 0)
        wt = np.ones(n, np.float32) if w is None else np.where(inside, wv[tw], f32(0)).astype(np.float32)
        W = f32(np.sum(np.where(ign, 0.0, wt.astype(np.float64))))
        lsf = f32(ls)
        keep, lsc = f32(f32(1) - lsf), f32(lsf / f32(c))
        wc = f32(np.sum(wv.astype(np.float64)))
        out = np.empty((n, c), np.float32)
        mag = np.zeros((n, c))
        for i in range(n):
            gi = G[i]
            if red == "mean":
                ci = f32(f32(f32(f32(gi * keep) / W) * m[i]) * wt[i])
                sm = f32(f32(f32(gi / W) * lsc) * m[i])
            else:
                ci = f32(f32(f32(gi * keep) * m[i]) * wt[i])
                sm = f32(f32(gi * lsc) * m[i])
            row = e[i]
            mag[i] = np.abs(row * np.float64(ci)) + abs(float(ci))
            if lsf == 0:
                x = (row * ci).astype(np.float32)
                if inside[i]:
                    x[t[i]] = f32(x[t[i]] - ci)
            else:
                if np.isfinite(sm):
                    S = f32(sm * wc)
                else:
                    S = f32(0)
                    for j in range(c):
                        S = f32(S + f32(sm * wv[j]))
                u = (sm * wv).astype(np.float32)
                mag[i] += np.abs(row * np.float64(S)) + np.abs(np.float64(sm) * wv)
                if soc == "Ascend950":
                    x = (row * ci).astype(np.float32)
                    if inside[i]:
                        x[t[i]] = f32(x[t[i]] - ci)
                    x = (((row * S).astype(np.float32) - u).astype(np.float32) + x).astype(np.float32)
                else:
                    x = ((row * f32(ci + S)).astype(np.float32) - u).astype(np.float32)
                    if inside[i]:
                        x[t[i]] = f32(x[t[i]] - ci)
            out[i] = x
    return out, mag


# ---------------------------------------------------------------------------------------------
# property tests of the cpu kernels
# ---------------------------------------------------------------------------------------------

WIDTHS = [1, 2, 3, 15, 16, 17, 31, 32, 33, 127, 128, 129]


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), nd=st.integers(0, 3), red=st.sampled_from(["none", "mean", "sum"]),
       beta=st.sampled_from([0.0, 1.0, 1.7, 1e-7, 1e-6, 0.5, math.inf, 1e-45, 65504.0, 3.4e38]),
       soc=st.sampled_from(SOCS), mixed=st.booleans())
def test_smooth_l1_bitwise_on_hostile_values(seed, nd, red, beta, soc, mixed):
    rng = np.random.default_rng(seed)
    base = tuple(int(rng.choice([1, 2, 3, 15, 16, 17, 33])) for _ in range(nd))

    def sub():
        s = [1 if rng.random() < 0.3 else k for k in base]
        return tuple(s[int(rng.integers(0, len(s) + 1)):])

    dts = [DTYPES[int(rng.integers(3))] for _ in range(3)] if mixed else [DTYPES[int(rng.integers(3))]] * 3
    g, x, t = (relayout(rng, hostile(rng, s, dt)) for s, dt in zip((sub(), base, sub()), dts))
    with fg.soc_version(soc):
        got = fg.smooth_l1_loss_backward(g, x, t, red, beta)
    bits_equal(got, oracle_smooth_l1(g, x, t, red, beta, soc))


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), s2=st.sampled_from(WIDTHS + [63, 64, 65, 1024, 1025]),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1.0, 0.125, -2.0, 0.0, 1e30, math.inf]),
       triu=st.booleans(), mask_kind=st.sampled_from(["none", "bool", "u8", "i32", "all"]))
def test_softmax_backward_bitwise_on_hostile_values(seed, s2, dtype, scale, triu, mask_kind):
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 3])), s2)
    go, y = (relayout(rng, hostile(rng, shape, dtype, 0.05)) for _ in range(2))
    if mask_kind == "none" and not triu:
        mask_kind = "bool"
    mask = None
    if mask_kind != "none":
        ms = tuple(1 if rng.random() < 0.3 else k for k in shape)
        mask = rng.random(ms) < (1.0 if mask_kind == "all" else 0.3)
        if mask_kind == "u8":
            mask = mask.astype(np.uint8) * 3
        elif mask_kind == "i32":
            mask = mask.astype(np.int32) * -7
    got = fg.scaled_masked_softmax_backward(go, y, mask, scale, triu)
    bits_equal(got, oracle_softmax_backward(go, y, mask, scale, triu))


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), nw=st.sampled_from([1, 2, 3, 17, 64, 65, 129]),
       d=st.sampled_from([0, 1, 3, 16, 17, 33]), dtype=st.sampled_from(DTYPES), out_dtype=st.sampled_from(DTYPES),
       scale=st.booleans(), soc=st.sampled_from(SOCS), pad_kind=st.integers(0, 6),
       idx_kind=st.sampled_from(["i64", "i32", "f32", "u8", "dup"]))
def test_embedding_bitwise_on_hostile_values(seed, nw, d, dtype, out_dtype, scale, soc, pad_kind, idx_kind):
    rng = np.random.default_rng(seed)
    ishape = tuple(int(rng.choice([0, 1, 2, 5, 17])) for _ in range(int(rng.integers(0, 3))))
    idx = rng.integers(0, nw, size=ishape)
    if idx_kind == "i32":
        idx = idx.astype(np.int32)
    elif idx_kind == "f32":  # truncated toward zero
        idx = (idx + rng.random(ishape) * 0.99).astype(np.float32)
    elif idx_kind == "u8":
        idx = idx.astype(np.uint8)
    elif idx_kind == "dup":
        idx = np.full(ishape, rng.integers(0, nw))
    grad = relayout(rng, hostile(rng, ishape + (d,), dtype, 0.1))
    pad = [-1, 0, 1, nw - 1, nw, nw + 5, -5][pad_kind]
    out = np.full((nw, 2 * d), 7, np.float32).astype(out_dtype)[:, ::2]  # strided out=
    with fg.soc_version(soc):
        got = fg.embedding_dense_backward(grad, idx, nw, pad, scale, out=out)
    assert got is out
    bits_equal(got, oracle_embedding(grad, idx, nw, pad, scale, out_dtype, soc))


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([1, 2, 5, 17]), c=st.sampled_from(WIDTHS),
       dtype=st.sampled_from(DTYPES), red=st.sampled_from(["none", "mean", "sum"]), soc=st.sampled_from(SOCS),
       ii=st.sampled_from([-100, 0, 1, -1]), weighted=st.booleans(), ls=st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0]),
       p_special=st.sampled_from([0.0, 0.2]))
def test_ce_grad_on_hostile_values(seed, n, c, dtype, red, soc, ii, weighted, ls, p_special):
    rng = np.random.default_rng(seed)
    lp = relayout(rng, hostile(rng, (n, c), dtype, p_special))
    t = np.where(rng.random(n) < 0.25, ii, rng.integers(0, c, n)).astype(np.int64)
    w = None
    if weighted:
        w = np.zeros(c, np.float32) if rng.random() < 0.2 else hostile(rng, (c,), F32, p_special / 2)
        t = np.where(((t < 0) | (t >= c)) & ~((t == ii) & (soc != "Ascend950" or ii >= 0)), 0, t)  # row 4g
    elif rng.random() < 0.2:
        t[0] = c + 3  # row 4f: no −1, counts in W
    g = hostile(rng, (n,) if red == "none" else (), dtype, p_special)
    with fg.soc_version(soc):
        got = fg.cross_entropy_loss_grad(g, lp, t, w, red, ii, ls)
    exp, mag = oracle_ce_grad(g, lp, t, w, red, ii, ls, soc)
    close_specials_exact(got, exp, dtype, mag)


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), bt=st.sampled_from([1, 2, 17]), v=st.sampled_from([1, 2, 16, 17, 129]),
       dtype=st.sampled_from(DTYPES))
def test_fused_ce_softmax_on_hostile_values(seed, bt, v, dtype):
    """``softmax = fl(fl(exp(fl(l − max)))·fl(1/sum_exp))``, ``loss = fl(fl(log s) − predicted)``."""
    rng = np.random.default_rng(seed)
    L = relayout(rng, hostile(rng, (bt, v), dtype, 0.1))
    L32 = w32(L)
    with np.errstate(all="ignore"):
        m = np.where(np.isnan(L32), -np.inf, L32).max(1).astype(np.float32)
        se = np.exp((L32 - m[:, None]).astype(np.float64)).sum(1).astype(np.float32)
    pr = hostile(rng, (bt,), F32, 0.1)
    for a in (m, se):
        if rng.random() < 0.3:
            a[int(rng.integers(bt))] = rng.choice(SPECIAL)
    loss, sm = fg.fused_cross_entropy_loss_with_max_sum(m, se, pr, 0.0, L)
    with np.errstate(all="ignore"):
        e = np.exp((L32 - m[:, None]).astype(np.float32).astype(np.float64)).astype(np.float32)
        exp_sm = (e * (f32(1) / se)[:, None]).astype(np.float32)
        exp_loss = (np.log(se.astype(np.float64)).astype(np.float32) - pr).astype(np.float32)
    close_specials_exact(sm, exp_sm, F32, np.zeros(exp_sm.shape), n_ulp32=2)
    # log is not correctly rounded either: one ulp of log(se) on top
    close_specials_exact(loss, exp_loss, F32, np.abs(np.log(np.abs(se.astype(np.float64)) + 1e-300)), n_ulp32=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_thread_counts_give_the_same_bits_on_hostile_values(dtype):
    rng = np.random.default_rng(7)
    lp = hostile(rng, (9, 16385 + 16), dtype, 0.05)
    t = rng.integers(0, lp.shape[1], 9)
    x = hostile(rng, (3, 16384 + 7), dtype, 0.05)
    grad = hostile(rng, (700, 17), dtype, 0.05)
    idx = rng.integers(0, 130, 700)
    v = hostile(rng, (2, 2, 9, 1100), dtype, 0.01)
    calls = [
        lambda: fg.cross_entropy_loss_grad(np.array(1.5, dtype), lp, t, None, "mean", -100, 0.1),
        lambda: fg.smooth_l1_loss_backward(np.array(2, dtype), x, x[::-1].copy(), "mean", 0.5),
        lambda: fg.embedding_dense_backward(grad, idx, 130, 3, True),
        lambda: fg.scaled_masked_softmax_backward(v, v, None, 0.3, True),
    ]
    for call in calls:
        with fg.num_threads(1):
            one = np.asarray(call())
        with fg.num_threads(2):
            two = np.asarray(call())
        assert one.tobytes() == two.tobytes()


# ---------------------------------------------------------------------------------------------
# the "reference" backend (fastgrad.reference's float64 goldens) on the same hostile values
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_reference_ce_grad_exp_overflows_in_fp32_as_the_device(soc, ls):
    """An ignored row whose ``exp(log_prob)`` overflows fp32 (log_prob 89 > log(FLT_MAX)) is
    ``p·0 = NaN`` there on the device (docs/device_parity.md row 4e); with label smoothing the
    reference took exp in float64 (finite) and gave 0."""
    lp = np.array([[89.0, 0.0, -1.0], [0.0, -1.0, -2.0]], np.float32)
    t = np.array([0, 1])
    with fg.soc_version(soc), fg.use_backend("reference"):
        got = fg.cross_entropy_loss_grad(np.float32(1.0), lp, t, None, "sum", 0, ls)
    exp, mag = oracle_ce_grad(np.float32(1.0), lp, t, None, "sum", 0, ls, soc)
    assert np.isnan(got[0, 0]) and np.isnan(exp[0, 0])
    assert (got[0, 1:] == 0).all()
    close_specials_exact(got, exp, F32, mag)


@pytest.mark.parametrize("soc", SOCS)
@pytest.mark.parametrize("n", [1, 2], ids=["scalar_grad", "tensor_grad"])
def test_reference_smooth_l1_difference_is_fp32(soc, n):
    """``d = input − target`` in fp32 (docs/spec.md): 3e38 − (−3e38) is +inf, so at β = inf the
    TBE gives ±1, the tensor DAG NaN, the scalar DAG ±1 (row 5c) — the reference's float64 d
    (finite) gave 0; and 1 − 2**-30 rounds to 1.0 = β, the TBE's ±1, where the float64 d gave
    d/(β + 1e-6) = 0.999999."""
    with fg.soc_version(soc), fg.use_backend("reference"):
        for x, t, beta in [(3e38, -3e38, math.inf), (-3e38, 3e38, math.inf), (1.0, 2.0**-30, 1.0)]:
            xs, ts, gs = np.full(n, x, np.float32), np.full(n, t, np.float32), np.full(n, -2.0, np.float32)
            got = fg.smooth_l1_loss_backward(gs, xs, ts, "none", beta)
            bits_equal(got, oracle_smooth_l1(gs, xs, ts, "none", beta, soc))


def _both_backends(call):
    """``call()`` on the cpu and the reference backend: (kind, value) each, kind "ok" or the
    AclnnError's status; any other exception propagates (a crash is a failure)."""
    res = []
    for backend in ("cpu", "reference"):
        with fg.use_backend(backend):
            try:
                res.append(("ok", call()))
            except fg.AclnnError as e:
                res.append((e.status, None))
    return res


@FUZZ
@given(shape=st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=1, max_size=5), triu=st.booleans(),
       mask_from=st.integers(0, 5), dtype=st.sampled_from(DTYPES), soc=st.sampled_from(SOCS))
def test_reference_softmax_backward_takes_every_shape_the_cpu_backend_takes(shape, triu, mask_from, dtype, soc):
    """Ranks 1 to 5 and empty axes (fix_triu_mask with a 1-D input: row i = 0 of the causal mask;
    the reference raised a bare ValueError broadcasting its (S1, S2) triangle into (S2,))."""
    rng = np.random.default_rng(len(shape) * 31 + sum(shape))
    go, y = (rng.standard_normal(tuple(shape)).astype(np.float32).astype(dtype) for _ in range(2))
    mask = None if triu and mask_from == 5 else rng.random(tuple(shape)[min(mask_from, len(shape)):]) < 0.4
    with fg.soc_version(soc):
        (k1, cpu), (k2, ref) = _both_backends(lambda: fg.scaled_masked_softmax_backward(go, y, mask, 0.5, triu))
    assert k1 == k2
    if k1 == "ok":
        exp = oracle_softmax_backward(go, y, mask, 0.5, triu)
        bits_equal(cpu, exp)
        masked = np.asarray(exp).astype(np.float32) == 0
        assert (np.asarray(ref).astype(np.float32)[masked & (np.asarray(cpu).astype(np.float32) == 0)] == 0).all()
        np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(cpu, np.float32), rtol=2e-2, atol=1e-6)


@FUZZ
@given(n=st.sampled_from([0, 1, 3]), c=st.sampled_from([0, 1, 3]), red=st.sampled_from(["none", "mean", "sum"]),
       weighted=st.booleans(), ls=st.sampled_from([0.0, 0.3]), ii=st.sampled_from([-100, 0]),
       soc=st.sampled_from(SOCS))
def test_reference_ce_grad_takes_every_shape_the_cpu_backend_takes(n, c, red, weighted, ls, ii, soc):
    """Empty N or C, every reduction, weight and label smoothing (C = 0 with a weight, label
    smoothing and all rows ignored: the reference indexed the empty weight, a bare IndexError)."""
    t = np.full(n, ii, np.int64)
    w = np.ones(c, np.float32) if weighted else None
    g = np.ones(n if red == "none" else (), np.float32)
    lp = np.full((n, c), -1.0, np.float32)
    with fg.soc_version(soc):
        (k1, cpu), (k2, ref) = _both_backends(lambda: fg.cross_entropy_loss_grad(g, lp, t, w, red, ii, ls))
    assert k1 == k2
    if k1 == "ok":
        assert cpu.shape == ref.shape == (n, c)
        np.testing.assert_allclose(ref, cpu, rtol=1e-6)
