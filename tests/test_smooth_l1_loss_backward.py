"""Tests of fg.smooth_l1_loss_backward (aclnnSmoothL1LossBackward)."""

import numpy as np
import pytest
from common import BF16, DTYPES, F16, F32, torch_dt

import fastgrad as fg

RED_ID = {"none": 0, "mean": 1, "sum": 2}


@pytest.fixture(autouse=True)
def _arch35_dag_profile(request):
    """Most tests here pin the Ascend 950 (arch35) DAG bit for bit; the A2/A3 TBE kernel (the
    default profile) has its own tests (``test_tbe_*``, ``test_beta_inf_*``) at the end of the file."""
    if request.node.name.startswith(("test_tbe", "test_beta_inf")):
        yield
        return
    with fg.soc_version("Ascend950"):
        yield


def _inputs(rng, shape, dtype, beta=1.0, grad_shape=None):
    """x, t, g of ``dtype`` with |d| spread around beta, some d == 0 and |d| == beta exactly."""
    t = rng.standard_normal(shape).astype(dtype)
    d = (rng.standard_normal(shape) * 1.5 * max(beta, 0.5)).astype(dtype)
    flat = d.reshape(-1)
    if flat.size >= 4:
        flat[0] = 0
        flat[1] = beta
        flat[2] = -beta
    x = (t.astype(np.float32) + d.astype(np.float32)).astype(dtype)
    if flat.size >= 4:  # make the boundary cases exact in the dtype
        xf = x.reshape(-1)
        tf = t.reshape(-1)
        xf[0] = tf[0]
        tf[1] = 0
        xf[1] = np.asarray(beta, dtype)
        tf[2] = 0
        xf[2] = np.asarray(-beta, dtype)
    gs = shape if grad_shape is None else grad_shape
    g = rng.standard_normal(gs).astype(dtype)
    return g, x, t


def _torch64(g, x, t, reduction, beta):
    """PyTorch's aten op in float64 on the broadcast (materialized) inputs."""
    torch = pytest.importorskip("torch")
    shape = np.broadcast_shapes(g.shape, x.shape, t.shape)
    T = [torch.from_numpy(np.broadcast_to(a.astype(np.float64), shape).copy()) for a in (g, x, t)]
    return torch.ops.aten.smooth_l1_loss_backward(T[0], T[1], T[2], RED_ID[reduction], beta).numpy()


def _emulate(g, x, t, reduction, beta, dtype):
    """The device's DAG in NumPy float32 (bit-exact expectation), rounded to ``dtype``."""
    shape = np.broadcast_shapes(g.shape, x.shape, t.shape)
    # a tensor grad_out takes the DAG with strict compares (|d| > beta: sign), a one-element
    # grad_out the scalar DAG (|d| >= beta) -- smooth_l1_loss_grad_v2_dag.h (device)
    strict = np.asarray(g).size != 1
    g, x, t = (np.broadcast_to(a.astype(np.float32), shape) for a in (g, x, t))
    b = np.float32(beta)
    # the tiling's invertSigma: NaN for |beta| < 1e-6, beta = 0 included (arch35 tiling.cpp:145)
    inv = np.float32(np.nan) if abs(b) < np.float32(1e-6) else np.float32(1) / b
    with np.errstate(invalid="ignore"):
        d = x - t
        sign_branch = (np.abs(d) > b) if strict else (np.abs(d) >= b)
        s = np.where(sign_branch, np.sign(d).astype(np.float32), d * inv)
        r = (s * g).astype(np.float32)
    if reduction == "mean" and r.size:
        r = r * np.float32(1.0 / r.size)
    return np.array(np.asarray(r).astype(dtype), order="C")  # (ascontiguousarray makes 0-d 1-d)


def assert_close(out, ref64, dtype):
    """fp32: rtol 1e-6; 16-bit: |out - ref| <= 2*|round(ref) - ref| + tiny (adaptive)."""
    out = np.asarray(out).astype(np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    assert out.shape == ref64.shape
    assert np.array_equal(np.isnan(out), np.isnan(ref64))
    ok = ~np.isnan(ref64)
    o, r = out[ok], ref64[ok]
    if np.dtype(dtype) == F32:
        tol = 1e-6 * np.abs(r) + 1e-30
    else:
        rl = r.astype(dtype).astype(np.float64)
        tol = 2 * np.abs(rl - r) + 1e-6 * np.abs(r) + 1e-30
    bad = np.abs(o - r) > tol
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. out={o[bad][:5]} ref={r[bad][:5]}"


# ----------------------------------------------------------------------------------------
# Seed sample and formula
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("reduction", ["none", 0])
def test_seed_sample(backend, reduction):
    g = np.ones((4, 2), np.float32)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    t = np.ones((4, 2), np.float32)
    with fg.use_backend(backend):
        out = fg.smooth_l1_loss_backward(g, x, t, reduction, 1.0)
    assert out.dtype == np.float32 and out.shape == (4, 2)
    np.testing.assert_array_equal(out.reshape(-1), [-1, 0, 1, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("beta", [1.0, 0.5, 1.7])
def test_matches_torch_and_device_formula(rng, dtype, reduction, beta):
    shape = (3, 37)
    gshape = shape if reduction == "none" else ()
    g, x, t = _inputs(rng, shape, dtype, beta, gshape)
    out = fg.smooth_l1_loss_backward(g, x, t, reduction, beta)
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, _torch64(g, x, t, reduction, beta), dtype)
    # bit-exact against the device's fp32 DAG emulated in NumPy
    np.testing.assert_array_equal(out.view(np.uint8), _emulate(g, x, t, reduction, beta, dtype).view(np.uint8))
    with fg.use_backend("reference"):
        ref = fg.smooth_l1_loss_backward(g, x, t, reduction, beta)
    assert ref.dtype == dtype
    assert_close(out, ref.astype(np.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_beta_zero_d_zero_per_dag(dtype):
    x = np.array([-2.0, -0.5, 0.0, 0.0, 0.25, 3.0], dtype)
    t = np.array([0.0, 0.0, 0.0, 1.5, 0.0, 3.0], dtype)
    g = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype)
    d0 = x.astype(np.float64) == t.astype(np.float64)
    # 950, tensor grad_out (SmoothL1LossGradV2OpDag): invertSigma = NaN at beta = 0 (tiling.cpp:145)
    # and |d| > 0 fails at d = 0, so the Select takes d·NaN: NaN there, ±grad elsewhere
    expect = np.array([-1, -2, np.nan, -4, 5, np.nan], np.float64)
    out = fg.smooth_l1_loss_backward(g, x, t, "none", 0.0)
    np.testing.assert_array_equal(out.astype(np.float64), expect)
    with fg.use_backend("reference"):
        np.testing.assert_array_equal(fg.smooth_l1_loss_backward(g, x, t, "none", 0.0).astype(np.float64), expect)
    # 950, one-element grad_out (the scalar DAG, >= / <=): d = 0 gives (1 + -1) + 0 = 0
    for backend in ("cpu", "reference"):
        with fg.use_backend(backend):
            one = fg.smooth_l1_loss_backward(np.ones(1, dtype), x, t, "none", 0.0).astype(np.float64)
        np.testing.assert_array_equal(one, [-1, -1, 0, -1, 1, 0])
    # A2/A3 (TBE): sign(0) = 0 for every grad_out
    with fg.soc_version("Ascend910B"):
        tbe = fg.smooth_l1_loss_backward(g, x, t, "none", 0.0).astype(np.float64)
    np.testing.assert_array_equal(tbe, [-1, -2, 0, -4, 5, 0])
    # PyTorch's aten op differs only where d == 0 (it gives -grad there)
    tor = _torch64(g, x, t, "none", 0.0)
    np.testing.assert_array_equal(tor[~d0], expect[~d0])
    np.testing.assert_array_equal(tor[d0], -g.astype(np.float64)[d0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_nan_and_inf_propagate(dtype, beta):
    nan, inf = np.nan, np.inf
    x = np.array([nan, 1.0, 1.0, inf, inf, 2.0, 0.5], dtype)
    t = np.array([0.0, nan, 1.0, inf, 0.0, -inf, 0.0], dtype)
    g = np.array([1.0, 1.0, nan, 1.0, 1.0, 1.0, inf], dtype)
    out = fg.smooth_l1_loss_backward(g, x, t, "none", beta).astype(np.float64)
    assert np.isnan(out[:4]).all()
    assert out[4] == 1.0 and out[5] == 1.0
    assert out[6] == (inf if beta == 0 else inf)  # 0.5*inv*inf or sign*inf
    with fg.use_backend("reference"):
        ref = fg.smooth_l1_loss_backward(g, x, t, "none", beta).astype(np.float64)
    np.testing.assert_array_equal(out, ref)


# ----------------------------------------------------------------------------------------
# Broadcasting, promotion, layouts
# ----------------------------------------------------------------------------------------

BROADCASTS = [
    ((), (4, 3, 5), (4, 3, 5)),
    ((4, 3, 5), (4, 1, 5), (3, 1)),
    ((1, 5), (4, 3, 5), (5,)),
    ((3, 1), (1,), (4, 1, 7)),
    ((2, 1, 1, 3), (1, 3, 1, 1), (5, 1)),
    ((17,), (17,), ()),
]


@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_broadcast(rng, shapes, dtype, reduction):
    gs, xs, ts = shapes
    g = rng.standard_normal(gs).astype(dtype)
    x = (rng.standard_normal(xs) * 2).astype(dtype)
    t = rng.standard_normal(ts).astype(dtype)
    out = fg.smooth_l1_loss_backward(g, x, t, reduction, 0.75)
    shape = np.broadcast_shapes(gs, xs, ts)
    assert out.shape == shape and out.dtype == dtype
    # mean divides by the broadcast output's element count (seed text)
    assert_close(out, _torch64(g, x, t, reduction, 0.75), dtype)
    np.testing.assert_array_equal(out.view(np.uint8), _emulate(g, x, t, reduction, 0.75, dtype).view(np.uint8))


@pytest.mark.parametrize("dts,expect", [
    ((BF16, F16, BF16), F32), ((F32, BF16, BF16), F32), ((F16, F16, F32), F32),
    ((F16, F16, F16), F16), ((BF16, BF16, BF16), BF16)], ids=str)
def test_dtype_promotion(rng, dts, expect):
    g, x, t = (rng.standard_normal((5, 6)).astype(dt) for dt in dts)
    out = fg.smooth_l1_loss_backward(g, x, t, "sum", 1.0)
    assert out.dtype == expect
    ref = _torch64(g, x, t, "sum", 1.0)
    assert_close(out, ref, expect)
    np.testing.assert_array_equal(out.view(np.uint8), _emulate(g, x, t, "sum", 1.0, expect).view(np.uint8))


@pytest.mark.parametrize("out_dt", DTYPES, ids=str)
@pytest.mark.parametrize("in_dt", [F32, BF16, F16], ids=str)
def test_out_of_other_float_dtype_is_cast(rng, in_dt, out_dt):
    g, x, t = _inputs(rng, (4, 9), in_dt)
    out = np.full((4, 9), 7, out_dt)
    res = fg.smooth_l1_loss_backward(g, x, t, "none", 1.0, out=out)
    assert res is out
    expect = _emulate(g, x, t, "none", 1.0, in_dt).astype(out_dt)  # promoted dtype, then cast
    np.testing.assert_array_equal(out.view(np.uint8), expect.view(np.uint8))


def _noncontig_views(rng, dtype):
    base = rng.standard_normal((6, 10)).astype(dtype)
    return {
        "transposed": base.T,
        "negative": base[::-1, ::-2],
        "step": base[::2, 1::3],
    }


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "negative", "step"])
def test_non_contiguous_inputs(rng, dtype, layout):
    a = _noncontig_views(rng, dtype)[layout]
    b = _noncontig_views(rng, dtype)[layout]
    c = _noncontig_views(rng, dtype)[layout]
    assert not a.flags.c_contiguous
    out = fg.smooth_l1_loss_backward(a, b, c, "none", 0.5)
    ref = fg.smooth_l1_loss_backward(*(np.ascontiguousarray(v) for v in (a, b, c)), "none", 0.5)
    np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8))
    # mixed: contiguous grad broadcast over a transposed input
    out2 = fg.smooth_l1_loss_backward(np.ascontiguousarray(a[0]), b, c[:, :1], "mean", 0.5)
    ref2 = _emulate(a[0], b, c[:, :1], "mean", 0.5, dtype)
    np.testing.assert_array_equal(out2.view(np.uint8), ref2.view(np.uint8))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)], ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_empty(shape, reduction):
    z = np.zeros(shape, BF16)
    out = fg.smooth_l1_loss_backward(z, z, z, reduction, 1.0)
    assert out.shape == shape and out.dtype == BF16
    with fg.use_backend("reference"):
        assert fg.smooth_l1_loss_backward(z, z, z, reduction, 1.0).shape == shape


def test_scalar_inputs():
    out = fg.smooth_l1_loss_backward(np.float32(2), np.float32(0.25), np.float32(0.0), "mean", 0.5)
    assert out.shape == () and out == np.float32(1.0)


# ----------------------------------------------------------------------------------------
# out=, kinds, threads, inputs untouched
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_out_contiguous_and_strided(rng, dtype):
    g, x, t = _inputs(rng, (5, 8), dtype)
    expect = fg.smooth_l1_loss_backward(g, x, t, "none", 1.0)
    out = np.zeros((5, 8), dtype)
    assert fg.smooth_l1_loss_backward(g, x, t, "none", 1.0, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint8), expect.view(np.uint8))
    big = np.full((5, 16), 3, dtype)
    view = big[:, ::2]
    assert fg.smooth_l1_loss_backward(g, x, t, "none", 1.0, out=view) is view
    np.testing.assert_array_equal(view.astype(np.float32), expect.astype(np.float32))
    np.testing.assert_array_equal(big[:, 1::2].astype(np.float32), 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_in_torch_out(rng, dtype):
    g, x, t = _inputs(rng, (3, 11), dtype)
    expect = fg.smooth_l1_loss_backward(g, x, t, "mean", 1.0)
    torch = pytest.importorskip("torch")
    T = [torch.from_numpy(a.astype(np.float32)).to(torch_dt(dtype)) for a in (g, x, t)]
    res = fg.smooth_l1_loss_backward(T[0], T[1], T[2], "mean", 1.0)
    assert isinstance(res, torch.Tensor) and res.dtype == torch_dt(dtype)
    np.testing.assert_array_equal(res.float().numpy(), expect.astype(np.float32))
    out = torch.empty(3, 11, dtype=torch_dt(dtype))
    assert fg.smooth_l1_loss_backward(T[0], T[1], T[2], "mean", 1.0, out=out) is out
    np.testing.assert_array_equal(out.float().numpy(), expect.astype(np.float32))
    # against PyTorch's own op in its dtype (fp32 only: torch's 16-bit path rounds differently)
    if dtype == F32:
        tor = torch.ops.aten.smooth_l1_loss_backward(T[0].reshape(()) if T[0].dim() == 0 else T[0],
                                                     T[1], T[2], 1, 1.0)
        np.testing.assert_allclose(res.numpy(), tor.numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_threads_bitwise_and_deterministic(rng, dtype):
    shape = (3, 40000)  # several tasks per row
    g, x, t = _inputs(rng, shape, dtype)
    with fg.num_threads(1):
        a = fg.smooth_l1_loss_backward(g, x[:, ::-1], t, "none", 0.9)
    with fg.num_threads(2):
        b = fg.smooth_l1_loss_backward(g, x[:, ::-1], t, "none", 0.9)
        c = fg.smooth_l1_loss_backward(g, x[:, ::-1], t, "none", 0.9)
    np.testing.assert_array_equal(a.view(np.uint16 if dtype != F32 else np.uint32),
                                  b.view(np.uint16 if dtype != F32 else np.uint32))
    np.testing.assert_array_equal(b.view(np.uint8), c.view(np.uint8))
    np.testing.assert_array_equal(a.view(np.uint8), _emulate(g, x[:, ::-1], t, "none", 0.9, dtype).view(np.uint8))


def test_inputs_not_modified(rng):
    g, x, t = _inputs(rng, (4, 6), BF16)
    copies = [a.copy() for a in (g, x, t)]
    fg.smooth_l1_loss_backward(g, x, t, "none", 1.0)
    with fg.use_backend("reference"):
        fg.smooth_l1_loss_backward(g, x, t, "none", 1.0)
    for a, c in zip((g, x, t), copies):
        np.testing.assert_array_equal(a.view(np.uint16), c.view(np.uint16))


# ----------------------------------------------------------------------------------------
# Errors (seed error table) — out= untouched
# ----------------------------------------------------------------------------------------

def _call_err(status, *args, out_shape=(2, 3), out_dtype=F32, **kw):
    out = np.full(out_shape, 42, out_dtype)
    with pytest.raises(fg.AclnnError) as ei:
        fg.smooth_l1_loss_backward(*args, out=out, **kw)
    assert ei.value.status == status
    assert (out.astype(np.float64) == 42).all()
    return ei.value


OK = np.ones((2, 3), np.float32)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_null_inputs(which):
    args = [OK, OK, OK]
    args[which] = None
    e = _call_err(161001, *args)
    assert e.param == ["grad_out", "input", "target"][which]


@pytest.mark.parametrize("bad", [np.float64, np.int32, np.bool_])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_bad_input_dtype(bad, which):
    args = [OK, OK, OK]
    args[which] = np.ones((2, 3), bad)
    _call_err(161002, *args)


def test_shapes_not_broadcastable():
    _call_err(161002, OK, np.ones((2, 4), np.float32), OK)
    _call_err(161002, np.ones((4,), np.float32), OK, OK)
    _call_err(161002, OK, OK, np.ones((3, 3), np.float32))


@pytest.mark.parametrize("reduction", ["avg", 3, -1, True, None, 1.0])
def test_bad_reduction(reduction):
    _call_err(161002, OK, OK, OK, reduction=reduction)


@pytest.mark.parametrize("beta", [-1.0, -1e-30, float("nan"), float("-inf"), "1", None])
def test_bad_beta(beta):
    _call_err(161002, OK, OK, OK, beta=beta)


def test_bad_out():
    _call_err(161002, OK, OK, OK, out_shape=(3, 2))
    _call_err(161002, OK, OK, OK, out_dtype=np.float64)
    _call_err(161002, OK, OK, OK, out_shape=(2, 3, 1))
    ro = np.zeros((2, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(fg.AclnnError) as ei:
        fg.smooth_l1_loss_backward(OK, OK, OK, out=ro)
    assert ei.value.status == 161002


def test_strict_rank_limit():
    a = np.ones((1,) * 9, np.float32)
    out = fg.smooth_l1_loss_backward(a, a, a, "sum", 1.0)  # extension outside strict mode
    assert out.shape == (1,) * 9 and out.item() == 0.0
    with fg.strict():
        with pytest.raises(fg.AclnnError) as ei:
            fg.smooth_l1_loss_backward(a, a, a, "sum", 1.0)
        assert ei.value.status == 161002
        # the device accepts beta = 0 and every listed dtype
        fg.smooth_l1_loss_backward(OK.astype(BF16), OK, OK.astype(F16), 1, 0.0)


# ----------------------------------------------------------------------------------------
# Property: random broadcast shapes and strided views, bit-exact with the device DAG
# ----------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st


@st.composite
def _broadcast_case(draw):
    nd = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(nd))
    views = []
    for _ in range(3):
        # drop leading axes and set some axes to 1 (broadcast); maybe a strided/reversed view
        k = draw(st.integers(0, nd))
        s = tuple(1 if draw(st.booleans()) else n for n in shape[k:])
        step = draw(st.sampled_from([1, 2, -1]))
        views.append((s, step))
    dtype = draw(st.sampled_from(DTYPES))
    red = draw(st.sampled_from(["none", "mean", "sum"]))
    beta = draw(st.sampled_from([0.0, 0.5, 1.0, 1.3]))
    seed = draw(st.integers(0, 2**32 - 1))
    return shape, views, dtype, red, beta, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_broadcast_case())
def test_property_broadcast_strides(case):
    shape, views, dtype, red, beta, seed = case
    r = np.random.default_rng(seed)
    arrs = []
    for s, step in views:
        if s and step != 1:  # a view with a non-unit stride on the last axis
            big = (r.standard_normal(s[:-1] + (s[-1] * abs(step),)) * 2).astype(dtype)
            a = big[..., ::step] if step > 0 else big[..., ::-1][..., :s[-1]]
        else:
            a = np.asarray(r.standard_normal(s) * 2).astype(dtype)
        arrs.append(a)
    out = fg.smooth_l1_loss_backward(*arrs, red, beta)
    expect = _emulate(*arrs, red, beta, dtype)
    assert out.shape == expect.shape and out.dtype == expect.dtype
    np.testing.assert_array_equal(out.reshape(-1).view(np.uint8), expect.reshape(-1).view(np.uint8))


# ----------------------------------------------------------------------------------------
# The A2/A3 TBE kernel (the default profile) and beta = +inf (issue 25)
# ----------------------------------------------------------------------------------------

def _tbe_emulate(g, x, t, reduction, beta, dtype):
    """The 910B TBE kernel in NumPy float32 (impl/dynamic/smooth_l1_loss_grad_v2.py):
    temp = d / (beta + 1e-6); NaN d read as 0 by the compares;
    -[d <= -beta] + [d >= beta] + [|d| < beta]·temp; times grad_out; mean: times fp32(1/n)."""
    shape = np.broadcast_shapes(g.shape, x.shape, t.shape)
    g, x, t = (np.broadcast_to(a.astype(np.float32), shape) for a in (g, x, t))
    b = np.float32(beta)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = x - t
        temp = d / (b + np.float32(1e-6))
        z = np.where(np.isnan(d), np.float32(0), d)
        s = ((-(z <= -b).astype(np.float32) + (z >= b).astype(np.float32))
             + np.where(np.abs(z) < b, temp, np.float32(0))).astype(np.float32)
        r = (s * g).astype(np.float32)
    if reduction == "mean" and r.size:
        r = r * np.float32(1.0 / r.size)
    return np.array(np.asarray(r).astype(dtype), order="C")


@pytest.mark.parametrize("soc", [None, "Ascend910B", "Ascend910B4", "Ascend910_93"])
@pytest.mark.parametrize("grad_shape", [None, ()], ids=["tensor", "scalar"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_tbe_kernel_bitwise(rng, soc, grad_shape, reduction, dtype, backend):
    beta = 1.7
    g, x, t = _inputs(rng, (5, 37), dtype, beta=beta, grad_shape=grad_shape)
    ctx = fg.soc_version(soc) if soc else fg.soc_version(fg.get_soc_version())
    with ctx, fg.use_backend(backend):
        out = fg.smooth_l1_loss_backward(g, x, t, reduction, beta)
    ref = _tbe_emulate(g, x, t, reduction, beta, dtype)
    if backend == "cpu":  # the kernel: bit for bit
        np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8))
    else:  # the float64 golden: one rounding
        assert_close(out, ref.astype(np.float64), dtype)


def test_tbe_against_dag_at_the_boundary_and_in_the_quadratic_zone():
    # |d| == beta: TBE exactly ±1 (>=), the 950 tensor DAG d·fp32(1/beta) = 1 - 2**-24 for 1.7;
    # inside the zone TBE divides by beta + 1e-6
    beta = np.float32(1.7)
    x = np.array([1.7, -1.7, 0.5, 0.0, np.nan, 3.0], np.float32)
    t = np.zeros(6, np.float32)
    g = np.ones(6, np.float32)
    tbe = fg.smooth_l1_loss_backward(g, x, t, "none", float(beta))
    assert tbe[0] == 1.0 and tbe[1] == -1.0
    assert tbe[2] == np.float32(np.float32(0.5) / (beta + np.float32(1e-6)))
    assert tbe[3] == 0 and np.isnan(tbe[4]) and tbe[5] == 1.0
    with fg.soc_version("Ascend950"):
        dag = fg.smooth_l1_loss_backward(g, x, t, "none", float(beta))
    assert dag[0] == np.float32(1.7) * (np.float32(1) / beta) and dag[0] != 1.0
    assert dag[2] == np.float32(0.5) * (np.float32(1) / beta) and dag[2] != tbe[2]
    # beta = 0: a NaN d gives 0 on the TBE kernel, NaN on the DAG
    t0 = fg.smooth_l1_loss_backward(g, x, t, "none", 0.0)
    assert t0[4] == 0 and t0[3] == 0 and t0[0] == 1.0
    with fg.soc_version("Ascend950"):
        assert np.isnan(fg.smooth_l1_loss_backward(g, x, t, "none", 0.0)[4])


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_beta_inf_gives_zero_gradient(soc, dtype):
    # op_api checks beta >= 0 only: +inf is accepted (strict mode too), gradient 0 for finite d
    x = np.array([6e4, -3.0, 0.0, 1e3], np.float32).astype(dtype)
    t = np.zeros(4, dtype)
    g = np.ones(4, dtype)
    with fg.soc_version(soc), fg.strict():
        out = fg.smooth_l1_loss_backward(g, x, t, "sum", float("inf"))
    assert out.dtype == dtype and np.all(out.astype(np.float32) == 0)
    with fg.soc_version(soc):
        inf_d = fg.smooth_l1_loss_backward(np.ones(2, np.float32), np.array([np.inf, -np.inf], np.float32),
                                           np.zeros(2, np.float32), "none", float("inf"))
    if soc == "Ascend910B":   # TBE: [d >= inf] - [d <= -inf] + 0
        np.testing.assert_array_equal(inf_d, [1.0, -1.0])
    else:                     # the tensor DAG: |d| > inf never, d·(1/inf) = inf·0 = NaN
        assert np.all(np.isnan(inf_d))
