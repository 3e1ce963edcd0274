"""Property-based tests (hypothesis), one per op, against the float64 oracles of tests/naive.py.

Each example draws dtypes, shapes (empty, 1, primes, broadcast), memory layouts (strided,
transposed, reversed), attributes (in and out of their documented ranges) and hostile values
(NaN, ±Inf, huge, subnormal).  The property: when the contract says the input is valid the op
returns a result that matches the oracle within the op's forward-error bound with NaN/Inf
placement equal; when the contract says it is invalid the op raises ``fastgrad.AclnnError``
with status 161001/161002; where the contract leaves it open (marked "either") one of the two.
Never another exception type, never a crash.

Examples per op (derandomized, ``deadline=None``; the profile of tests/conftest.py):
    smooth_l1_loss_backward                 200
    embedding_dense_backward                200
    scaled_masked_softmax_backward          200
    cross_entropy_loss_grad                 200
    fused_cross_entropy_loss_with_max_sum   200
    fused_linear_online_max_sum             200
    fused_linear_cross_entropy_loss_grad    200
"""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
import naive as N  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastgrad as fg  # noqa: E402

EXAMPLES = 200
PROP = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [N.F32, N.F16, N.BF16]
DIMS = [0, 1, 2, 3, 5, 7]                       # empty, 1, primes
OK, ERROR, EITHER = "ok", "error", "either"


def _huge(dt):
    return {N.F32: 1.7e38, N.F16: 30000.0, N.BF16: 1.6e38}[np.dtype(dt)]


def _tiny(dt):
    return {N.F32: 1.4e-45, N.F16: 6e-8, N.BF16: 9.2e-41}[np.dtype(dt)]


def _values(rng, shape, dt, hostile, scale=1.0):
    v = rng.standard_normal(shape) * scale
    if hostile and v.size:
        pool = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, _huge(dt), -_huge(dt), _tiny(dt)])
        hit = rng.random(shape) < 0.25
        v = np.where(hit, pool[rng.integers(0, pool.size, shape)], v)
    with np.errstate(all="ignore"):
        return v.astype(np.float32).astype(dt)


def _layout(a, kind):
    """The same values in another memory layout (0 contiguous, 1 strided, 2 transposed, 3 reversed)."""
    a = np.asarray(a)
    if a.ndim == 0 or kind == 0:
        return a
    if kind == 1:
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        big[..., 1::2] = a
        return big[..., 1::2]
    if kind == 2 and a.ndim >= 2:
        return np.ascontiguousarray(a.T).T
    return np.ascontiguousarray(a[::-1])[::-1]


def _expect_outcome(expect, call, check):
    """Run ``call``; AclnnError 161001/161002 where the contract allows it, else ``check``."""
    try:
        got = call()
    except fg.AclnnError as e:
        assert expect in (ERROR, EITHER), f"valid input refused: {e}"
        assert e.status in (161001, 161002), e.status
        return
    assert expect in (OK, EITHER), "invalid input accepted"
    with np.errstate(all="ignore"):
        check(got)


common = dict(seed=st.integers(0, 2 ** 32 - 1), hostile=st.booleans(), layout=st.integers(0, 3))


# ---------------------------------------------------------------------------------------------

@PROP
@given(dts=st.lists(st.sampled_from(DTYPES), min_size=3, max_size=3),
       base=st.lists(st.sampled_from(DIMS), min_size=0, max_size=3),
       bcast=st.lists(st.integers(0, 7), min_size=3, max_size=3),
       reduction=st.sampled_from(["none", "mean", "sum", 0, 1, 2, "avg", 3]),
       beta=st.sampled_from([1.0, 0.5, 1.7, 0.0, 1e-3, 3e4, 1e-30, 1e-39, -1.0, np.nan, np.inf]),
       **common)
def test_smooth_l1_loss_backward(dts, base, bcast, reduction, beta, seed, hostile, layout):
    rng = np.random.default_rng(seed)
    shapes = []
    for k in range(3):        # each operand: base with some axes broadcast (1) or leading ones dropped
        s = [1 if (bcast[k] >> (i % 3)) & 1 and i else d for i, d in enumerate(base)]
        shapes.append(tuple(s[bcast[k] % 2:]))
    g, x, t = (_layout(_values(rng, s, dt, hostile, 2.0), layout) for s, dt in zip(shapes, dts))
    if x.size and t.size and x.shape == t.shape:
        x.reshape(-1)[:1] = t.reshape(-1)[:1] if x.flags.writeable and x.flags.c_contiguous else x.reshape(-1)[:1]
    expect = OK
    if reduction not in ("none", "mean", "sum", 0, 1, 2) or not beta >= 0:
        expect = ERROR
    elif not np.isfinite(beta) or beta < 1.2e-38:
        expect = EITHER            # inf / fp32-subnormal beta: a correct result or a clear refusal
    promoted = dts[0] if len(set(dts)) == 1 else N.F32

    def check(got):
        assert got.dtype == promoted and got.shape == np.broadcast_shapes(*shapes)
        N.check_smooth_l1_loss_backward(got, g, x, t, reduction, beta)

    _expect_outcome(expect, lambda: fg.smooth_l1_loss_backward(g, x, t, reduction, beta), check)


# ---------------------------------------------------------------------------------------------

@PROP
@given(dt=st.sampled_from(DTYPES),
       ishape=st.lists(st.sampled_from(DIMS), min_size=0, max_size=2),
       d=st.sampled_from([0, 1, 2, 3, 7]),
       nw=st.sampled_from([0, 1, 2, 5, 13, -1, 2 ** 62]),
       idt=st.sampled_from([np.int64, np.int32, np.int16, np.uint8, np.float32, np.float64, np.bool_]),
       padding_idx=st.sampled_from([-1, -5, 0, 1, 3, 13, 2 ** 40]),
       scale=st.booleans(), bad_index=st.integers(0, 3).map(lambda k: k == 0), **common)
def test_embedding_dense_backward(dt, ishape, d, nw, idt, padding_idx, scale, bad_index, seed, hostile,
                                  layout):
    rng = np.random.default_rng(seed)
    ishape = tuple(ishape)
    n = int(np.prod(ishape))
    hi = max(min(nw, 2 if idt == np.bool_ else 100), 0)
    raw = rng.integers(0, hi, ishape) if hi else np.zeros(ishape, np.int64)
    idx = raw.astype(idt)
    if np.dtype(idt).kind == "f" and n:
        idx = (raw + rng.uniform(0, 0.99, ishape)).astype(idt)      # truncates toward zero
        idx = np.where(idx >= hi, np.asarray(raw, idt), idx).astype(idt)
    expect = OK
    if bad_index and n and idt != np.bool_:
        bad = {np.uint8: 255}.get(idt, -1) if rng.random() < 0.5 else min(max(nw, 0), 127)
        if np.dtype(idt).kind == "f" and rng.random() < 0.5:
            bad = np.nan
        idx = idx.copy()
        idx.reshape(-1)[rng.integers(0, n)] = bad
        if not (0 <= bad < nw):
            expect = ERROR
    if n and not hi:
        expect = ERROR                                            # an index into an empty table
    if nw < 0:
        expect = ERROR
    if nw == 2 ** 62:
        expect = EITHER                                          # absurd table: result or refusal
    grad = _layout(_values(rng, ishape + (d,), dt, hostile), layout)
    idx = _layout(idx, layout)

    def check(got):
        assert got.dtype == dt and got.shape == (nw, d)
        if nw < 2 ** 20:
            N.check_embedding_dense_backward(got, grad, idx, nw, padding_idx, scale)

    _expect_outcome(expect, lambda: fg.embedding_dense_backward(grad, idx, nw, padding_idx, scale), check)


# ---------------------------------------------------------------------------------------------

@PROP
@given(dt=st.sampled_from(DTYPES),
       shape=st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=1, max_size=5),
       s2=st.sampled_from([0, 1, 2, 3, 7, 17]),
       mbits=st.integers(0, 63), mkind=st.sampled_from(["bool", "uint8", "none"]),
       scale=st.sampled_from([1.0, 0.125, -3.0, 0.0, 1e30, np.nan, np.inf]),
       triu=st.booleans(), **common)
def test_scaled_masked_softmax_backward(dt, shape, s2, mbits, mkind, scale, triu, seed, hostile, layout):
    rng = np.random.default_rng(seed)
    shape = tuple(shape[:-1]) + (s2,)
    z = np.exp(rng.standard_normal(shape))
    y = _layout((z / np.maximum(z.sum(-1, keepdims=True), 1e-30)).astype(np.float32).astype(dt), layout)
    if hostile:
        with np.errstate(all="ignore"):
            y = _layout(_values(rng, shape, dt, True) * 0 + y if rng.random() < 0.5
                        else _values(rng, shape, dt, True), layout)
    go = _layout(_values(rng, shape, dt, hostile), layout)
    # mask: broadcast over a subset of axes, maybe fewer dimensions
    mshape = tuple(1 if (mbits >> i) & 1 else s for i, s in enumerate(shape))[(mbits >> 5) & 1:]
    mask = None if mkind == "none" else (rng.random(mshape) < 0.3).astype(mkind)
    expect = OK
    if mask is None and not triu:
        expect = ERROR
    if triu and len(shape) < 2:
        expect = EITHER                                          # no S1 axis to take j > i from
    if not np.isfinite(scale):
        expect = EITHER if expect == OK else expect

    def check(got):
        assert got.dtype == dt and got.shape == shape
        N.check_scaled_masked_softmax_backward(got, go, y, mask, scale, triu)

    _expect_outcome(expect, lambda: fg.scaled_masked_softmax_backward(go, y, mask, scale, triu), check)


# ---------------------------------------------------------------------------------------------

@PROP
@given(dt=st.sampled_from(DTYPES), n=st.sampled_from([0, 1, 2, 3, 7, 9]), c=st.sampled_from([0, 1, 2, 3, 5, 11]),
       reduction=st.sampled_from(["mean", "sum", "none", 0, 1, 2, "mean", "none", "avg"]),
       ignore_index=st.sampled_from([-100, -100, -1, 0, 2, 2 ** 70]),
       weight_kind=st.sampled_from([None, N.F32, N.F16, N.BF16]),
       ls=st.sampled_from([0.0, 0.0, 0.1, 0.1, 1.0, -0.1, 1.5, np.nan]),
       zs=st.sampled_from([0.0, 0.0, 0.0, 1e-2, 1e-2, "missing-lse"]),
       bad_target=st.integers(0, 4).map(lambda k: k == 0), **common)
def test_cross_entropy_loss_grad(dt, n, c, reduction, ignore_index, weight_kind, ls, zs, bad_target, seed,
                                 hostile, layout):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, c)) * 2
    lp = z - np.log(np.exp(z).sum(1, keepdims=True)) if c else z
    lp = lp.astype(np.float32).astype(dt)
    clean = lp
    if hostile:
        lp = np.where(rng.random((n, c)) < 0.2, _values(rng, (n, c), dt, True), lp).astype(dt)
    t = rng.integers(0, max(c, 1), n).astype(np.int64)
    if n and ignore_index < 2 ** 63:
        t[rng.random(n) < 0.3] = ignore_index
    # hostile values in ignored rows too: the oracle computes them as the kernel, p·(s·0)
    del clean
    lp = _layout(lp, layout)
    expect = OK
    if c == 0 and n:
        t[:] = ignore_index if ignore_index < 2 ** 63 else 0
        if ignore_index >= 2 ** 63:
            expect = ERROR
    if bad_target and n:
        bad = [c, -3, c + 7][rng.integers(0, 3)]
        if bad != ignore_index:
            t[0] = bad
            if weight_kind is not None:  # the kernel reads weight[t] out of bounds; without a
                expect = ERROR           # weight the row is p·c_i with no -1 (issue 25 point 4)
    red = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)
    gshape = (n,) if red == "none" else ()
    g = _values(rng, gshape, dt, hostile and rng.random() < 0.3)
    if not hostile:
        g = np.abs(g) + np.asarray(0.1, dt)
    w = None if weight_kind is None else _layout(rng.uniform(0.1, 2, c).astype(np.float32).astype(weight_kind),
                                                 layout)
    kw = dict(weight=w, reduction=reduction, ignore_index=ignore_index, label_smoothing=ls)
    if zs == "missing-lse":  # accepted and ignored, as on the device (issue 25 point 1)
        kw.update(lse_square_scale_for_zloss=1e-2)
    elif zs:
        kw.update(grad_zloss=np.ones(gshape, dt), lse_for_zloss=rng.uniform(-1, 3, n).astype(np.float32),
                  lse_square_scale_for_zloss=zs)
    if red not in ("mean", "sum", "none") or not (0 <= ls <= 1) or ignore_index >= 2 ** 63:
        expect = ERROR

    def check(got):
        assert got.dtype == dt and got.shape == (n, c)
        N.check_cross_entropy_loss_grad(got, g, lp, t, **kw)

    _expect_outcome(expect, lambda: fg.cross_entropy_loss_grad(g, lp, t, **kw), check)


# ---------------------------------------------------------------------------------------------

@PROP
@given(dt=st.sampled_from(DTYPES), bt=st.sampled_from([0, 1, 2, 3, 7]), v=st.sampled_from([1, 2, 3, 5, 13]),
       ls=st.sampled_from([0.0, 0.0, 0.1, 0.1, 1.0, -0.1, 1.5]), with_logits=st.sampled_from([True, True, False]),
       **common)
def test_fused_cross_entropy_loss_with_max_sum(dt, bt, v, ls, with_logits, seed, hostile, layout):
    rng = np.random.default_rng(seed)
    lg = _values(rng, (bt, v), dt, False, 3.0)
    lf = N.f64(lg)
    m = lf.max(1)
    s = np.exp(lf - m[:, None]).sum(1)
    pr = lf[np.arange(bt), rng.integers(0, v, bt)] - m
    stats = [m.astype(np.float32), s.astype(np.float32), pr.astype(np.float32)]
    if hostile and bt:
        k = rng.integers(0, 3)
        stats[k] = stats[k].copy()
        stats[k][rng.integers(0, bt)] = [np.nan, np.inf, -np.inf, 0.0, 1e38, 1e-45][rng.integers(0, 6)]
    stats = [_layout(a, layout) for a in stats]
    logits = _layout(lg, layout) if with_logits else None
    expect = OK
    if not (0 <= ls <= 1) or (ls and not with_logits):
        expect = ERROR
    elif ls and v == 1:
        expect = EITHER                     # Megatron's s = α·K/(K-1) is undefined for K = 1

    def check(res):
        loss, sm = res
        if ls and v == 1:
            return
        N.check_fused_cross_entropy_loss_with_max_sum(loss, sm, *stats, ls, logits)

    _expect_outcome(expect, lambda: fg.fused_cross_entropy_loss_with_max_sum(*stats, ls, logits), check)


# ---------------------------------------------------------------------------------------------

@PROP
@given(dt=st.sampled_from(DTYPES), bt=st.sampled_from([0, 1, 2, 3, 7, 9]), h=st.sampled_from([1, 2, 3, 5]),
       v=st.sampled_from([0, 1, 2, 3, 13, 37]), start=st.sampled_from([0, 0, 1, 5, -1]),
       end_off=st.sampled_from([0, 0, 0, 0, 0, 0, 1, -1]), tdt=st.sampled_from([np.int32, np.int64]),
       return_logits=st.booleans(), ldt=st.sampled_from([None, None, N.F32]), **common)
def test_fused_linear_online_max_sum(dt, bt, h, v, start, end_off, tdt, return_logits, ldt, seed, hostile,
                                     layout):
    rng = np.random.default_rng(seed)
    scale = 30.0 if hostile else 1.0                  # large logits: exp underflows to 0
    x = _layout(_values(rng, (bt, h), dt, False, scale), layout)
    w = _layout(_values(rng, (v, h), dt, False, 1 / np.sqrt(h)), layout)
    t = rng.integers(-2, max(start, 0) + v + 3, bt).astype(tdt)
    end = start + v + end_off
    expect = OK
    if start < 0 or end < start:  # all the device checks (aclnn_fused_linear_online_max_sum.cpp:154-171)
        expect = ERROR
    kw = {} if ldt is None else {"logits_dtype": ldt}

    def check(got):
        N.check_fused_linear_online_max_sum(got, x, w, t, start, end, logits_dtype=ldt,
                                            return_logits=return_logits)

    _expect_outcome(expect, lambda: fg.fused_linear_online_max_sum(x, w, t, start, end, return_logits, **kw),
                    check)


# ---------------------------------------------------------------------------------------------

@PROP
@given(dt=st.sampled_from(DTYPES), bt=st.sampled_from([0, 1, 2, 3, 7, 9]), h=st.sampled_from([1, 2, 3, 5]),
       v=st.sampled_from([1, 2, 3, 13, 37]), mode=st.sampled_from(["memory-saving", "memory-saving", "high-performance", "high-performance", "missing"]),
       mkind=st.sampled_from(["packed", "packed-long", "bool"]),
       ls=st.sampled_from([0.0, 0.0, 0.1, 0.1, 1.0, -0.1, 1.5]), **common)
def test_fused_linear_cross_entropy_loss_grad(dt, bt, h, v, mode, mkind, ls, seed, hostile, layout):
    rng = np.random.default_rng(seed)
    x = _layout(_values(rng, (bt, h), dt, False), layout)
    w = _layout(_values(rng, (v, h), dt, False, 1 / np.sqrt(h)), layout)
    lg = N.f64(x) @ N.f64(w).T
    m = lg.max(1) if v else np.zeros(bt)
    s = np.exp(lg - m[:, None]).sum(1)
    masked = rng.random(bt) < 0.3
    mt = np.where(masked | (rng.random(bt) < 0.1), rng.integers(-3, v + 3, bt), rng.integers(0, v, bt))
    mt = _layout(mt.astype(np.int64 if seed % 2 else np.int32), layout)
    if mkind == "bool":
        mask = masked
    else:
        mask = N.pack_mask(masked, padding_bit=bool(seed & 4))
        if mkind == "packed-long":
            mask = np.concatenate([mask, [0xFF, 0x0F]]).astype(np.uint8)
    grad = rng.uniform(0.1, 1, bt).astype(np.float32)
    if hostile and bt:
        grad[rng.integers(0, bt)] = [np.nan, np.inf, -np.inf, 0.0, 1e30][rng.integers(0, 5)]
    grad = _layout(grad, layout)
    kw = dict(label_smoothing=ls)
    if mode == "memory-saving":
        kw.update(logits_max=m.astype(np.float32), sum_exp_logits=s.astype(np.float32))
    elif mode == "high-performance":
        kw.update(softmax=_layout((np.exp(lg - m[:, None]) / s[:, None]).astype(np.float32), layout))
    expect = OK
    if mode == "missing":
        expect = ERROR                                       # no statistics and no softmax: 161001
    if not (0 <= ls <= 1):
        expect = ERROR
    elif ls and v == 1 and expect == OK:
        expect = EITHER                                      # s = α·K/(K-1) undefined for K = 1

    def check(got):
        if ls and v == 1:
            return
        N.check_fused_linear_cross_entropy_loss_grad(got, grad, x, w, mask, mt, **kw)

    _expect_outcome(expect, lambda: fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, mt, **kw), check)


# ---------------------------------------------------------------------------------------------
# Bad inputs of issue 10 that a random draw may miss: each answered with AclnnError or a correct value
# ---------------------------------------------------------------------------------------------

def test_smooth_l1_subnormal_beta_is_finite_or_refused():
    x = np.array([0.0, 1e-40, 1.0, -2.0], np.float32)
    t = np.zeros(4, np.float32)
    _expect_outcome(EITHER, lambda: fg.smooth_l1_loss_backward(np.float32(1), x, t, "none", 1e-39),
                    lambda got: N.check_smooth_l1_loss_backward(got, np.float32(1), x, t, "none", 1e-39))


def test_cross_entropy_ignored_row_with_inf():
    """An ignored row is computed as p·(s·0), as the kernel does (docs/device_parity.md row 4c):
    0 where exp(log_prob) is finite, NaN where it overflows or is NaN."""
    lp = np.array([[-0.5, -1.0], [1.7e38, np.inf], [-np.inf, 0.0]], np.float32)
    t = np.array([0, -100, -100])
    g = np.array(0.5, np.float32)
    got = fg.cross_entropy_loss_grad(g, lp, t, reduction="mean")
    N.check_cross_entropy_loss_grad(got, g, lp, t, reduction="mean")
    assert np.isnan(got[1]).all() and (got[2] == 0).all()


def test_smooth_l1_subnormal_beta_0d():
    one = np.float32(1)
    _expect_outcome(EITHER, lambda: fg.smooth_l1_loss_backward(one, np.float32(2), one, "none", 1e-39),
                    lambda got: N.check_smooth_l1_loss_backward(got, one, np.float32(2), one, "none", 1e-39))


@pytest.mark.parametrize("op", ["cross_entropy_loss_grad", "embedding_dense_backward"])
def test_out_aliasing_an_input_is_correct_or_refused(op):
    rng = np.random.default_rng(3)
    if op == "cross_entropy_loss_grad":
        lp = np.log(np.full((3, 4), 0.25, np.float32))
        t = np.array([0, 1, 3])
        ref = N.cross_entropy_loss_grad(np.float32(1), lp.copy(), t)
        _expect_outcome(EITHER, lambda: fg.cross_entropy_loss_grad(np.float32(1), lp, t, out=lp),
                        lambda got: N.assert_matches(got, ref, N.F32, k32=20, mag=np.abs(ref) + 1))
    else:
        grad = rng.standard_normal((4, 4)).astype(np.float32)
        idx = np.array([0, 1, 1, 3])
        ref = N.embedding_dense_backward(grad.copy(), idx, 4)
        _expect_outcome(EITHER, lambda: fg.embedding_dense_backward(grad, idx, 4, out=grad),
                        lambda got: N.assert_matches(got, ref, N.F32, k32=4, mag=np.abs(ref) + 4))


@pytest.mark.parametrize("call", [
    lambda: fg.embedding_dense_backward(np.ones((2, 3), np.float32), np.array([0, 1]), 2 ** 62),
    lambda: fg.embedding_dense_backward(np.ones((2, 3), np.float32), np.array([0, 1]), 2 ** 64),
    lambda: fg.embedding_dense_backward(np.ones((2, 0), np.float32), np.array([9, 9]), 3),
    lambda: fg.embedding_dense_backward(np.ones((2, 3), np.float32), np.array([0, 1]), 3, 2 ** 70),
    lambda: fg.cross_entropy_loss_grad(np.float32(1), np.zeros((2, 3), np.float32), np.array([0, 1]),
                                       ignore_index=2 ** 70),
    lambda: fg.fused_linear_online_max_sum(np.ones((2, 3), np.float32), np.ones((4, 3), np.float32),
                                           np.array([0, 1]), 0, 2 ** 70),
    lambda: fg.fused_linear_online_max_sum(np.ones((2, 3), np.float32), np.ones((4, 3), np.float32),
                                           np.array([0, 1]), 3, 2),
    lambda: fg.cross_entropy_loss_grad(np.float32(1), np.zeros((2, 3), np.float32), np.array([0, 1]),
                                       label_smoothing=1.5),
    lambda: fg.fused_cross_entropy_loss_with_max_sum(np.zeros(2, np.float32), np.ones(2, np.float32),
                                                     np.zeros(2, np.float32), -0.5, np.zeros((2, 3), np.float32)),
], ids=["emb-nw-2**62", "emb-nw-2**64", "emb-D0-out-of-range", "emb-padding-2**70", "ce-ignore-2**70",
        "floms-end-2**70", "floms-end-below-start", "ce-ls-1.5", "fce-ls-neg"])
def test_issue10_bad_inputs_are_refused(call):
    with pytest.raises(fg.AclnnError) as e:
        call()
    assert e.value.status == 161002


@given(dt=st.sampled_from([N.F32, N.BF16, N.F16]), bt=st.sampled_from([0, 1, 2, 3, 7]),
       h=st.sampled_from([1, 2, 3, 5]), v=st.sampled_from([1, 2, 3, 5, 13]),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 300.0]), softcap=st.sampled_from([None, 5.0]),
       temperature=st.sampled_from([1.0, 0.3]), hostile=st.sampled_from(["none", "masked", "nan"]),
       seed=st.integers(0, 2**16))
@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_linear_cross_entropy_entropy(dt, bt, h, v, scale, softcap, temperature, hostile, seed):
    """The training op's entropy (per row) against a float64 oracle on the same rounded inputs:
    ``log Σe - Σ e·(z - m) / Σe`` (a term with e = 0 is 0), within the forward error of the fp32
    logits (``|ΔH| <= max|Δz|·(max z - min z)``); NaN exactly where the oracle's is; the gradient
    with the entropy's upstream term finite wherever the inputs are."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((bt, h)) * scale).astype(dt)
    w = rng.standard_normal((v, h)).astype(dt)
    b = (rng.standard_normal(v)).astype(dt)
    if hostile == "masked" and v > 1:
        b[rng.integers(0, v)] = -np.inf
    if hostile == "nan" and bt:
        x[rng.integers(0, bt), rng.integers(0, h)] = np.nan
    t = rng.integers(0, v, bt)
    r = fg.linear_cross_entropy(x, w, t, b, reduction="none", softcap=softcap, temperature=temperature,
                                return_entropy=True, return_grad=True, grad_entropy=rng.standard_normal(bt))
    ent = np.asarray(r.entropy, np.float64)
    assert ent.shape == (bt,)
    with np.errstate(all="ignore"):
        z = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
        if softcap is not None:
            z = softcap * np.tanh(z / softcap)
        z = z / temperature
        m = z.max(axis=1, keepdims=True) if v else np.zeros((bt, 1))
        e = np.exp(z - m)
        s = e.sum(axis=1)
        want = np.log(s) - np.where(e > 0, e * (z - m), 0.0).sum(axis=1) / s
        fin = np.isfinite(z)
        spread = np.where(fin, z, -np.inf).max(axis=1, initial=0) - np.where(fin, z, np.inf).min(axis=1, initial=0)
        dz = 1e-6 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T).max(axis=1, initial=0) * 8
    dz = dz / temperature + 1e-6 * np.abs(want)
    nan_want = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(ent), nan_want)
    ok = ~nan_want
    assert np.all(np.abs(ent[ok] - want[ok]) <= dz[ok] * (spread[ok] + 1) + 1e-5)
    if hostile != "nan":  # -inf columns have p = 0: no 0·inf anywhere in the gradient
        assert np.isfinite(r.grad_weight).all() and np.isfinite(r.grad_input).all()
