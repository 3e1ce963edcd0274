"""Tests of fg.cross_entropy_loss_grad (aclnnCrossEntropyLossGrad).

Oracles: PyTorch autograd of F.cross_entropy in float64 (w.r.t. the logits), PyTorch's own
backward ops in float64 on the same (rounded) log_prob, and the reference backend.
"""

import ml_dtypes
import numpy as np
import pytest
from common import BF16, DTYPES, F16, F32, torch_dt

import fastgrad as fg

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def make_case(rng, n, c, dtype=F32, n_ignored=1, ignore_index=-100, weighted=True, red="mean"):
    """logits (float64), log_prob in ``dtype``, targets (some ignored), weight, grad_loss."""
    logits = rng.standard_normal((n, c)) * 2.0
    lp64 = logits - logits.max(-1, keepdims=True)
    lp64 = lp64 - np.log(np.exp(lp64).sum(-1, keepdims=True))
    lp = lp64.astype(dtype)
    t = rng.integers(0, c, n).astype(np.int64)
    if n_ignored and n:
        t[rng.choice(n, min(n_ignored, n), replace=False)] = ignore_index
    w = (rng.random(c) + 0.5).astype(np.float32) if weighted else None
    g = (rng.standard_normal(n) if red == "none" else np.array(rng.standard_normal())).astype(dtype)
    return logits, lp, t, w, g


def torch_ops_oracle(g, lp, t, w, red, ignore_index=-100, ls=0.0):
    """float64 PyTorch: NLL(+smoothing) backward w.r.t. log_prob via autograd, then
    ``_log_softmax_backward_data`` (uses exp(log_prob) as is, like the op)."""
    torch = pytest.importorskip("torch")
    lp_t = torch.tensor(np.asarray(lp, np.float64), requires_grad=True)
    tt = torch.from_numpy(np.asarray(t, np.int64))
    wt = None if w is None else torch.tensor(np.asarray(w, np.float64))
    gg = torch.tensor(np.asarray(g, np.float64))
    nll = torch.nn.functional.nll_loss(lp_t, tt, weight=wt, ignore_index=ignore_index, reduction=red)
    loss = (1 - ls) * nll
    if ls:
        c = lp_t.shape[1]
        keep = (tt != ignore_index).double()
        wv = wt if wt is not None else torch.ones(c, dtype=torch.float64)
        smooth = -(lp_t * wv).sum(1) * keep
        if red == "mean":
            wsum = (wv[torch.where(tt != ignore_index, tt, 0)] * keep).sum()
            smooth = smooth.sum() / wsum
        elif red == "sum":
            smooth = smooth.sum()
        loss = loss + ls / c * smooth
    (glp,) = torch.autograd.grad(loss, lp_t, gg)
    return torch.ops.aten._log_softmax_backward_data(glp, lp_t.detach(), 1, torch.float64).numpy()


def torch_autograd_oracle(g, logits, t, w, red, ignore_index=-100, ls=0.0):
    torch = pytest.importorskip("torch")
    x = torch.tensor(logits, requires_grad=True)
    wt = None if w is None else torch.tensor(np.asarray(w, np.float64))
    loss = torch.nn.functional.cross_entropy(x, torch.from_numpy(t), weight=wt,
                                             ignore_index=ignore_index, reduction=red,
                                             label_smoothing=ls)
    (gx,) = torch.autograd.grad(loss, x, torch.tensor(np.asarray(g, np.float64)))
    return gx.numpy()


def ulp(x, dtype):
    """Spacing of ``dtype`` at |x| (float64 array)."""
    x = np.abs(np.asarray(x, np.float64)).astype(dtype).astype(np.float64)
    fin = ml_dtypes.finfo(dtype) if np.dtype(dtype) == BF16 else np.finfo(dtype)
    e = np.floor(np.log2(np.maximum(x, float(fin.smallest_normal))))
    return np.exp2(e - fin.nmant)


def assert_close_ulps(out, ref64, dtype, n_ulp=1.0, abs_floor=0.0):
    out = np.asarray(out).astype(np.float64)
    err = np.abs(out - ref64)
    tol = n_ulp * ulp(ref64, dtype) + abs_floor
    bad = err > tol
    assert not bad.any(), (f"{bad.sum()} elements off; worst err {err[bad].max()} "
                           f"at ref {ref64[bad][np.argmax(err[bad])]}")


def cegrad(*args, **kw):
    return fg.cross_entropy_loss_grad(*args, **kw)


# ---------------------------------------------------------------------------------------
# seed sample
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
def test_seed_sample(dtype):
    lp = np.full((2, 3), -0.2, np.float32).astype(dtype)
    out = cegrad(np.array(0.1, dtype), lp, np.array([0, 0]), weight=np.ones(3, np.float32),
                 reduction="mean", ignore_index=-100, label_smoothing=0.0,
                 lse_square_scale_for_zloss=0.0)
    assert out.dtype == dtype and out.shape == (2, 3)
    p = np.exp(np.float64(np.asarray(lp, np.float64)[0, 0]))
    g = float(np.array(0.1, dtype))
    golden = np.array([[g / 2 * (p - 1), g / 2 * p, g / 2 * p]] * 2)
    np.testing.assert_allclose(golden[0], [-0.0090635, 0.0409365, 0.0409365], atol=2e-3)
    if dtype == F32:
        np.testing.assert_allclose(np.asarray(out, np.float64), golden, rtol=1e-6)
        np.testing.assert_allclose(out[0], [-0.0090635, 0.0409365, 0.0409365], atol=1e-7)
    else:
        assert_close_ulps(out, golden, dtype)


# ---------------------------------------------------------------------------------------
# against PyTorch
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("red", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.25])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n,c", [(7, 13), (1, 1), (3, 16384 + 5), (16, 2)])
def test_fp32_matches_torch_autograd(rng, red, ls, weighted, n, c):
    logits, lp, t, w, g = make_case(rng, n, c, F32, n_ignored=1 if n > 1 else 0,
                                    weighted=weighted, red=red)
    out = cegrad(g, lp, t, weight=w, reduction=red, label_smoothing=ls)
    ref = torch_autograd_oracle(g, logits, t, w, red, ls=ls)
    # magnitude of the terms (the result may cancel to ~0, e.g. C = 1)
    scale = np.abs(ref).max() + np.abs(g).max() * (1.0 if w is None else w.max())
    # exp(rounded log_prob) vs softmax(logits): |lp| * 2**-24 relative, plus fp32 arithmetic
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-6 * scale)
    # and tightly against PyTorch's backward ops on the same fp32 log_prob
    ref2 = torch_ops_oracle(g, lp, t, w, red, ls=ls)
    np.testing.assert_allclose(out, ref2, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("red", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_lowprec_within_one_ulp_of_float64(rng, dtype, red, ls):
    n, c = 29, 131
    _, lp, t, w, g = make_case(rng, n, c, dtype, n_ignored=3, red=red)
    out = cegrad(g, lp, t, weight=w, reduction=red, label_smoothing=ls)
    assert out.dtype == dtype
    ref = torch_ops_oracle(np.asarray(g, np.float64), np.asarray(lp, np.float64), t, w, red, ls=ls)
    tiny = np.abs(ref).max() * 2e-6   # fp32 arithmetic on the near-cancelling target column
    assert_close_ulps(out, ref, dtype, n_ulp=1.0, abs_floor=tiny if dtype == F32 else 0.0)
    with fg.use_backend("reference"):
        gold = cegrad(g, lp, t, weight=w, reduction=red, label_smoothing=ls)
    assert gold.dtype == dtype
    if dtype == F32 and ls == 0.0:  # device order: c, p·c and p·c - c each rounded to fp32
        assert_close_ulps(gold, ref, dtype, n_ulp=1.0, abs_floor=tiny)
    else:
        assert_close_ulps(gold, ref, dtype, n_ulp=0.51)  # (16-bit: fp32, then the dtype)
    if dtype != F32:  # after one rounding, kernel and golden agree bit for bit almost everywhere
        assert np.mean(np.asarray(out) == np.asarray(gold)) > 0.9


def test_reference_backend_matches_torch_float64(rng):
    logits, lp, t, w, g = make_case(rng, 11, 23, F32, n_ignored=2)
    with fg.use_backend("reference"):
        gold = cegrad(g, lp, t, weight=w, label_smoothing=0.3)
    ref = torch_ops_oracle(g, lp, t, w, "mean", ls=0.3)
    np.testing.assert_allclose(gold, ref, rtol=1e-6, atol=1e-9)


def test_nonnegative_ignore_index(rng):
    logits, lp, t, w, g = make_case(rng, 9, 5, F32, n_ignored=0)
    t[[1, 4]] = 2
    out = cegrad(g, lp, t, weight=w, ignore_index=2)
    ref = torch_autograd_oracle(g, logits, t, w, "mean", ignore_index=2)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-7)
    assert np.all(out[[1, 4]] == 0)


def test_negative_ignore_index_target_is_ignored(rng):
    logits, lp, t, w, g = make_case(rng, 6, 4, F32, n_ignored=2, ignore_index=-1)
    out = cegrad(g, lp, t, weight=w, ignore_index=-1)
    ref = torch_autograd_oracle(g, logits, t, w, "mean", ignore_index=-1)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------
# z-loss (extension)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("red", ["mean", "sum", "none"])
def test_zloss_inputs_are_accepted_and_ignored_with_one_warning(rng, monkeypatch, red, strict):
    # issue 25 point 1: the doc at ops-nn e5c3fa9 (:392) says the z-loss inputs have no effect,
    # and no kernel reads grad_zloss / lse_for_zloss: same bits as without them, in strict mode
    # too; one UserWarning per process
    import warnings

    from fastgrad.ops import cross_entropy_loss_grad as mod

    monkeypatch.setattr(mod, "_zloss_warned", False)
    _, lp, t, w, g = make_case(rng, 8, 19, F32, n_ignored=2, red=red)
    ref = cegrad(g, lp, t, weight=w, reduction=red)
    gzl = np.asarray(rng.standard_normal(g.shape), np.float32)
    lse = rng.uniform(-1, 3, 8).astype(np.float32)
    with fg.strict(strict), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for kw in (dict(grad_zloss=gzl, lse_for_zloss=lse, lse_square_scale_for_zloss=1e-2),
                   dict(lse_square_scale_for_zloss=0.5),                  # no lse: accepted too
                   dict(lse_for_zloss=lse[:3]), dict(grad_zloss=np.ones((2, 2), np.float32))):
            out = cegrad(g, lp, t, weight=w, reduction=red, **kw)
            assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    msgs = [str(r.message) for r in rec if issubclass(r.category, UserWarning)]
    assert len(msgs) == 1 and "ignored" in msgs[0], msgs
    with fg.use_backend("reference"):
        gold = cegrad(g, lp, t, weight=w, reduction=red, grad_zloss=gzl, lse_for_zloss=lse,
                      lse_square_scale_for_zloss=1e-2)
    np.testing.assert_allclose(gold, ref, rtol=1e-5, atol=1e-7)


def test_zloss_scale_zero_ignores_zloss_inputs(rng):
    _, lp, t, w, g = make_case(rng, 5, 7, F32)
    a = cegrad(g, lp, t, weight=w)
    b = cegrad(g, lp, t, weight=w, grad_zloss=np.float32(3.0), lse_for_zloss=np.ones(5, np.float32))
    assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------
# special values
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_all_ignored_mean_is_nan_like_device(rng, backend):
    _, lp, t, w, g = make_case(rng, 4, 6, F32, n_ignored=0)
    t[:] = -100
    with fg.use_backend(backend):
        out = cegrad(g, lp, t, weight=w, reduction="mean")
        assert np.isnan(out).all()
        out_sum = cegrad(g, lp, t, weight=w, reduction="sum")
        assert np.array_equal(out_sum, np.zeros_like(out_sum))
        out_none = cegrad(np.ones(4, np.float32), lp, t, weight=w, reduction="none")
        assert np.array_equal(out_none, np.zeros_like(out_none))


def test_zero_probability_and_nan_propagate(rng):
    with np.errstate(divide="ignore"):
        lp = np.log(np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], np.float64)).astype(np.float32)
    lp[1, 1] = np.nan
    out = cegrad(np.float32(1.0), lp, np.array([0, 2]), reduction="sum")
    np.testing.assert_allclose(out[0], [-0.5, 0.5, 0.0], atol=1e-7)
    assert np.isnan(out[1, 1]) and np.isfinite(out[1, [0, 2]]).all()


def test_ignored_rows_zero_and_nan_propagates(rng):
    _, lp, t, w, g = make_case(rng, 5, 9, F32, n_ignored=0)
    t[[1, 2]] = -100
    lp[2, 3] = np.nan       # the device computes exp(log_prob)·0 on ignored rows: NaN stays NaN
    out = cegrad(g, lp, t, weight=w)
    assert np.array_equal(out[1], np.zeros(9, np.float32))
    assert np.isnan(out[2, 3]) and np.array_equal(np.delete(out[2], 3), np.zeros(8, np.float32))
    assert np.isfinite(np.delete(out, [1, 2], axis=0)).all()


# ---------------------------------------------------------------------------------------
# array handling
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_in_torch_out(rng, dtype):
    _, lp, t, w, g = make_case(rng, 6, 10, dtype)
    expect = cegrad(g, lp, t, weight=w, label_smoothing=0.1)
    torch = pytest.importorskip("torch")
    tl = torch.from_numpy(lp.view(np.int16)).view(torch.bfloat16) if dtype == BF16 else torch.from_numpy(lp)
    tg = torch.from_numpy(g.reshape(1).view(np.int16)).view(torch.bfloat16).reshape(()) if dtype == BF16 \
        else torch.from_numpy(g)
    out = cegrad(tg, tl, torch.from_numpy(t), weight=torch.from_numpy(w), label_smoothing=0.1)
    assert isinstance(out, torch.Tensor) and out.dtype == torch_dt(dtype)
    got = out.view(torch.int16).numpy().view(BF16) if dtype == BF16 else out.numpy()
    assert np.array_equal(got.view(np.uint8), np.asarray(expect).view(np.uint8))


def test_inputs_not_modified_and_out_param(rng):
    _, lp, t, w, g = make_case(rng, 8, 33, BF16, n_ignored=2)
    copies = [a.copy() for a in (lp, t, w, g)]
    expect = cegrad(g, lp, t, weight=w, label_smoothing=0.2)
    for a, b in zip((lp, t, w, g), copies):
        assert a.tobytes() == b.tobytes()
    out = np.empty((8, 33), BF16)
    r = cegrad(g, lp, t, weight=w, label_smoothing=0.2, out=out)
    assert r is out and np.array_equal(out.view(np.uint16), expect.view(np.uint16))
    big = np.zeros((8, 66), BF16)
    view = big[:, ::2]                     # non-contiguous out
    r = cegrad(g, lp, t, weight=w, label_smoothing=0.2, out=view)
    assert r is view and np.array_equal(np.asarray(view, np.float32), np.asarray(expect, np.float32))
    assert np.all(np.asarray(big[:, 1::2], np.float32) == 0)
    torch = pytest.importorskip("torch")
    tout = torch.empty((8, 33), dtype=torch.bfloat16)
    r = cegrad(torch.from_numpy(g.reshape(1).view(np.int16)).view(torch.bfloat16).reshape(()),
               torch.from_numpy(lp.view(np.int16)).view(torch.bfloat16), torch.from_numpy(t),
               weight=torch.from_numpy(w), label_smoothing=0.2, out=tout)
    assert r is tout and np.array_equal(tout.view(torch.int16).numpy(), expect.view(np.int16))


def test_noncontiguous_inputs(rng):
    _, lp, t, w, g = make_case(rng, 12, 7, F32, red="none")
    expect = cegrad(g, lp, t, weight=w, reduction="none")
    lp_t = np.ascontiguousarray(lp.T).T              # Fortran order
    t2 = np.repeat(t, 2)[::2]
    w2 = np.repeat(w, 3)[::3]
    g2 = np.repeat(g, 2)[::2]
    out = cegrad(g2, lp_t, t2, weight=w2, reduction="none")
    assert np.array_equal(out, expect)
    torch = pytest.importorskip("torch")
    out2 = cegrad(torch.from_numpy(g2), torch.from_numpy(lp_t), torch.from_numpy(t2),
                  weight=torch.from_numpy(w2), reduction="none")
    assert np.array_equal(out2.numpy(), expect)


def test_int32_target_and_scalars(rng):
    _, lp, t, w, g = make_case(rng, 5, 8, F32)
    a = cegrad(g, lp, t, weight=w)
    b = cegrad(g, lp, t.astype(np.int32), weight=w)
    c = cegrad(float(g), lp, t, weight=w, reduction=1, ignore_index=np.int64(-100))
    assert np.array_equal(a, b) and np.array_equal(a, c)
    # fp16 weight outside strict mode: widened exactly
    w16 = w.astype(np.float16)
    np.testing.assert_array_equal(cegrad(g, lp, t, weight=w16), cegrad(g, lp, t, weight=w16.astype(np.float32)))


@pytest.mark.parametrize("n,c,red", [(0, 5, "mean"), (0, 5, "none"), (3, 0, "sum"), (0, 0, "mean")])
def test_empty(n, c, red):
    lp = np.zeros((n, c), np.float32)
    t = np.full(n, -100, np.int64)
    g = np.ones(n, np.float32) if red == "none" else np.float32(1)
    out = cegrad(g, lp, t, reduction=red)
    assert out.shape == (n, c) and out.dtype == F32
    with fg.use_backend("reference"):
        assert cegrad(g, lp, t, reduction=red).shape == (n, c)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_threads_bitwise_identical_and_deterministic(rng, dtype):
    _, lp, t, w, g = make_case(rng, 67, 16384 + 301, dtype, n_ignored=5)
    with fg.num_threads(1):
        a = cegrad(g, lp, t, weight=w, label_smoothing=0.05)
    with fg.num_threads(2):
        b = cegrad(g, lp, t, weight=w, label_smoothing=0.05)
        c = cegrad(g, lp, t, weight=w, label_smoothing=0.05)
    v = np.uint32 if dtype == F32 else np.uint16
    assert np.array_equal(a.view(v), b.view(v)) and np.array_equal(b.view(v), c.view(v))


def test_exp_accuracy_over_range():
    """The kernel's branch-free exp: within 1 ulp over [-104, 0] incl. subnormal results."""
    lp = np.concatenate([np.linspace(-104, 0, 200001), [-np.inf, -87.33, -87.34, -103.9]])
    lp = lp.astype(np.float32).reshape(1, -1)
    c = lp.shape[1]
    out = cegrad(np.ones(1, np.float32), lp, np.array([-100 + 100]), reduction="none")
    ref = np.exp(lp.astype(np.float64))[0]
    ref[0] -= 1.0
    err = np.abs(out[0].astype(np.float64) - ref)
    tol = np.maximum(ulp(ref, np.float32), 2.0 ** -149)
    assert np.all(err <= 1.01 * tol), float(np.max(err / tol))
    assert out[0, c - 4] == 0.0


# ---------------------------------------------------------------------------------------
# errors (status codes; out untouched)
# ---------------------------------------------------------------------------------------

def _args(rng, dtype=F32):
    _, lp, t, w, g = make_case(rng, 4, 6, dtype)
    return dict(grad_loss=g, log_prob=lp, target=t, weight=w)


def _expect(status, out=None, **kw):
    sentinel = None if out is None else out.copy()
    with pytest.raises(fg.AclnnError) as e:
        fg.cross_entropy_loss_grad(**kw, out=out)
    assert e.value.status == status, str(e.value)
    if out is not None:
        assert np.array_equal(out.view(np.uint8), sentinel.view(np.uint8))
    return e.value


@pytest.mark.parametrize("missing", ["grad_loss", "log_prob", "target"])
def test_null_inputs(rng, missing):
    kw = _args(rng)
    kw[missing] = None
    e = _expect(161001, out=np.full((4, 6), 7.0, np.float32), **kw)
    assert missing in str(e)


@pytest.mark.parametrize("change", [
    dict(log_prob=np.zeros((4, 6), np.float64)),
    dict(log_prob=np.zeros((4, 6), np.int32)),
    dict(log_prob=np.zeros((4, 6, 1), np.float32)),
    dict(log_prob=np.zeros(6, np.float32)),
    dict(target=np.zeros(4, np.float32)),
    dict(target=np.zeros(4, np.uint8)),
    dict(target=np.zeros(5, np.int64)),
    dict(target=np.array([0, 1, 6, 2])),            # out of [0, C)
    dict(target=np.array([0, 1, -1, 2])),
    dict(weight=np.ones(6, np.int64)),
    dict(weight=np.ones(5, np.float32)),
    dict(grad_loss=np.zeros(0, np.float32)),        # mean reads element 0: none there
    dict(grad_loss=np.array(1.0, np.float64)),
    dict(grad_loss=np.float64(1.0)),
    dict(reduction="avg"),
    dict(reduction=3),
    dict(label_smoothing=1.5),
    dict(label_smoothing=-0.1),
    dict(label_smoothing=float("nan")),
    dict(ignore_index=1.5),
    dict(lse_square_scale_for_zloss=float("inf")),
])
def test_invalid_inputs(rng, change):
    kw = _args(rng)
    kw.update(change)
    _expect(161002, out=np.full((4, 6), 7.0, np.float32), **kw)


def test_none_reduction_shapes(rng):
    kw = _args(rng)
    kw["reduction"] = "none"                         # grad_loss is 0-d: needs (N,)
    _expect(161002, **kw)


def test_zloss_scale_without_lse_is_accepted(rng):
    kw = _args(rng)  # the device checks nothing of the z-loss inputs (they are optional, unread)
    np.testing.assert_array_equal(fg.cross_entropy_loss_grad(**kw, lse_square_scale_for_zloss=0.5),
                                  fg.cross_entropy_loss_grad(**kw))


@pytest.mark.parametrize("bad_out", [np.zeros((4, 6), np.float16), np.zeros((6, 4), np.float32),
                                     np.zeros((4, 6), np.float32)[:, :5]])
def test_bad_out(rng, bad_out):
    _expect(161002, out=bad_out, **_args(rng))


def test_readonly_out(rng):
    o = np.zeros((4, 6), np.float32)
    o.flags.writeable = False
    _expect(161002, out=o, **_args(rng))


@pytest.mark.parametrize("change", [
    dict(label_smoothing=0.1),                        # A2/A3: output never written (strict refuses)
    dict(target=np.array([0, 1, 2, 3], np.int32)),    # A2/A3 kernels take int64 only
    dict(weight=np.ones(6, np.float16)),
    dict(grad_loss=np.array(1.0, np.float16)),
    dict(grad_zloss=np.float16(1.0)),                 # one dtype column with log_prob (the def)
    dict(lse_for_zloss=np.ones(4, np.float16)),
])
def test_strict_rejects_device_limits(rng, change):
    kw = _args(rng)
    kw.update(change)
    fg.cross_entropy_loss_grad(**kw)                  # an extension outside strict mode
    with fg.strict():
        _expect(161002, out=np.full((4, 6), 7.0, np.float32), **kw)


def test_strict_has_no_n_or_ignore_index_limit(rng):
    # issue 25 point 3: N < 200000 and ignore_index < C came from old doc revisions; neither
    # today's doc nor the tiling (cross_entropy_loss_grad_tiling.cpp:238-266) checks them
    n = 200000
    lp = np.broadcast_to(np.zeros((1, 1), np.float32), (n, 1))
    t = np.broadcast_to(np.zeros(1, np.int64), (n,))
    with fg.strict():
        out = fg.cross_entropy_loss_grad(np.float32(1.0), lp, t)
        assert out.shape == (n, 1) and np.all(out == 0)
        kw = _args(rng)
        kw.update(ignore_index=6, target=np.array([0, 1, 2, 3]))
        np.testing.assert_array_equal(fg.cross_entropy_loss_grad(**kw), cegrad(**{**kw, "ignore_index": -100}))


def test_strict_z_loss_inputs_accepted(rng):
    kw = _args(rng)
    ref = fg.cross_entropy_loss_grad(**kw)
    with fg.strict():
        for z in (dict(lse_square_scale_for_zloss=0.1, lse_for_zloss=np.ones(4, np.float32)),
                  dict(grad_zloss=np.float32(1.0)), dict(lse_for_zloss=np.ones(4, np.float32))):
            np.testing.assert_array_equal(fg.cross_entropy_loss_grad(**kw, **z), ref)


def test_strict_accepts_device_inputs(rng):
    with fg.strict():
        for dtype in DTYPES:
            kw = _args(rng, dtype)
            out = fg.cross_entropy_loss_grad(**kw, ignore_index=-100)
            assert out.dtype == dtype


# ---------------------------------------------------------------------------------------
# issue 25: what the kernels of each SoC compute (point 4, the ignore rule, target dtype, ls)
# ---------------------------------------------------------------------------------------

def _oracle_no_weight(g, lp, t, red, ignored):
    """float64 oracle of the device without weight: ignored rows 0; a target outside [0, C)
    subtracts nothing (no column matches) but counts in the mean's denominator."""
    lp64 = lp.astype(np.float64)
    n, c = lp64.shape
    keep = ~ignored
    g64 = np.asarray(g, np.float64)
    scale = g64.reshape(n) if red == "none" else np.full(n, g64.reshape(()) / (keep.sum() if red == "mean" else 1))
    res = np.exp(lp64) * (scale * keep)[:, None]
    for i in range(n):
        if keep[i] and 0 <= t[i] < c:
            res[i, t[i]] -= scale[i]
    return res


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("red", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_of_range_target_without_weight_is_the_devices_row(rng, soc, red, dtype):
    # weight_none.h:97-100 (910B) / arch35 base.h ComputeLogPre (uint64 compare): never matches
    n, c = 9, 7
    logits, lp, t, _, g = make_case(rng, n, c, dtype, red=red)
    t = t.copy()
    t[:4] = [c, c + 5, -1, -7]
    t[4] = -100                                        # ignore_index: ignored on 910B only
    with fg.soc_version(soc), fg.strict(soc == "Ascend910B"):
        out = cegrad(g, lp, t, reduction=red)
    ignored = (t == -100) & (soc == "Ascend910B")
    ref = _oracle_no_weight(g, lp, t, red, ignored)
    tol = {F32: 3e-6, F16: 2e-3, BF16: 1.6e-2}[np.dtype(dtype)]
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())
    # no -1 anywhere in the out-of-range rows: all of them are p·c (same sign as c)
    assert np.all(np.sign(out[:4].astype(np.float64)) == np.sign(ref[:4])) or red == "none"
    with fg.use_backend("reference"), fg.soc_version(soc):
        gold = cegrad(g, lp, t, reduction=red)
    np.testing.assert_allclose(gold.astype(np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_out_of_range_target_with_weight_still_refused(rng):
    _, lp, t, w, g = make_case(rng, 5, 6, F32)
    for bad in (6, -1):
        t2 = t.copy()
        t2[1] = bad
        e = _expect(161002, grad_loss=g, log_prob=lp, target=t2, weight=w)
        assert "out of bounds" in str(e)
        with fg.soc_version("Ascend950"):  # a negative ignore_index ignores nothing there
            t3 = t.copy()
            t3[1] = -100
            _expect(161002, grad_loss=g, log_prob=lp, target=t3, weight=w, ignore_index=-100)


@pytest.mark.parametrize("weighted", [False, True])
def test_ignore_rule_follows_the_profile(rng, weighted):
    n, c = 6, 5
    _, lp, t, w, g = make_case(rng, n, c, F32)
    w = w if weighted else None
    t = np.array([0, 3, 1, 2, 4, 1])
    pos = fg.cross_entropy_loss_grad(g, lp, t, weight=w, ignore_index=3)    # >= 0: every profile
    with fg.soc_version("Ascend950"):
        np.testing.assert_array_equal(fg.cross_entropy_loss_grad(g, lp, t, weight=w, ignore_index=3), pos)
    assert np.all(pos[1] == 0)
    tn = t.copy()
    tn[1] = -5
    a = fg.cross_entropy_loss_grad(g, lp, tn, weight=w, ignore_index=-5)   # 910B: row 1 ignored
    np.testing.assert_array_equal(a, pos)
    with fg.soc_version("Ascend950"):  # arch35: ignore_index < 0 ignores nothing, mean over all rows
        if weighted:
            _expect(161002, grad_loss=g, log_prob=lp, target=tn, weight=w, ignore_index=-5)
        else:
            b = fg.cross_entropy_loss_grad(g, lp, tn, ignore_index=-5)
            ref = _oracle_no_weight(g, lp, tn, "mean", np.zeros(n, bool))
            np.testing.assert_allclose(b, ref, rtol=3e-6, atol=3e-7)
            assert np.all(b[1] > 0)  # p·g/N, no -1: the -5 target matches no column


def test_target_dtype_per_profile(rng):
    kw = _args(rng)
    kw["target"] = np.array([0, 1, 5, 3], np.int32)
    ref = fg.cross_entropy_loss_grad(**{**kw, "target": kw["target"].astype(np.int64)})
    for soc in ("Ascend910B", "Ascend910B2", "Ascend910_93", "Ascend910_9381"):
        with fg.soc_version(soc), fg.strict():
            e = _expect(161002, **kw)
            assert "int64" in str(e) and "target" in str(e)
    with fg.soc_version("Ascend950"), fg.strict():
        np.testing.assert_array_equal(fg.cross_entropy_loss_grad(**kw), ref)


def test_label_smoothing_per_profile(rng):
    kw = _args(rng)
    kw.update(label_smoothing=0.1, target=np.array([0, 1, 5, 3]))  # no negative ignore_index (950 rule)
    ref = fg.cross_entropy_loss_grad(**kw)                  # computed outside strict mode
    with fg.strict():
        e = _expect(161002, **kw)
        assert "never writes" in str(e)
    with fg.soc_version("Ascend950"):                       # the arch35 kernel computes it
        got = fg.cross_entropy_loss_grad(**kw)                 # in its own order (issue 46 N4)
        with fg.strict():
            np.testing.assert_array_equal(fg.cross_entropy_loss_grad(**kw), got)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
