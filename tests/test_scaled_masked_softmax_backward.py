"""Tests of fg.scaled_masked_softmax_backward (aclnnScaledMaskedSoftmaxBackward).

Oracles: PyTorch autograd of ``softmax(masked_fill(x·scale))`` and PyTorch's
``_softmax_backward_data`` in float64 on the same (rounded) inputs, and the reference backend.
"""

import ml_dtypes
import numpy as np
import pytest
from common import BF16, DTYPES, F16, F32, torch_dt

import fastgrad as fg

EPS32 = 2.0 ** -24


def smb(*args, **kw):
    return fg.scaled_masked_softmax_backward(*args, **kw)


def make_case(rng, shape, dtype, mask_shape=None, p_mask=0.3):
    x = rng.standard_normal(shape) * 2
    z = np.exp(x - x.max(-1, keepdims=True))
    y = (z / z.sum(-1, keepdims=True)).astype(dtype)
    go = rng.standard_normal(shape).astype(dtype)
    mask = None if mask_shape is None else rng.random(mask_shape) < p_mask
    return go, y, mask


def oracle64(go, y, mask, scale, triu=False):
    """PyTorch's softmax backward in float64 on the given inputs, times scale, masked to 0."""
    torch = pytest.importorskip("torch")
    g = torch.from_numpy(np.asarray(go, np.float64))
    yy = torch.from_numpy(np.asarray(y, np.float64))
    r = torch.ops.aten._softmax_backward_data(g, yy, -1, torch.float64) * scale
    m = torch.zeros(r.shape, dtype=torch.bool)
    if mask is not None:
        m |= torch.from_numpy(np.broadcast_to(np.asarray(mask) != 0, r.shape).copy())
    if triu:
        s1, s2 = r.shape[-2], r.shape[-1]
        m |= torch.ones(s1, s2, dtype=torch.bool).triu(1)
    return r.masked_fill(m, 0.0).numpy()


def ulp(x, dtype):
    x = np.abs(np.asarray(x, np.float64)).astype(dtype).astype(np.float64)
    fin = ml_dtypes.finfo(dtype) if np.dtype(dtype) == BF16 else np.finfo(dtype)
    e = np.floor(np.log2(np.maximum(x, float(fin.smallest_normal))))
    return np.exp2(e - fin.nmant)


def error_bound(go, y, scale, dtype):
    """1 ulp of the output dtype plus the fp32 arithmetic's error on the cancelling terms."""
    g = np.asarray(go, np.float64)
    yy = np.asarray(y, np.float64)
    s2 = g.shape[-1]
    terms = np.abs(g * yy) + np.abs(yy) * np.abs(g * yy).sum(-1, keepdims=True)
    return lambda ref: (ulp(ref, dtype) if dtype != F32 else 0) + 4 * EPS32 * (s2 ** 0.5 + 2) * terms * abs(scale)


def check(out, ref, bound):
    out = np.asarray(out, np.float64)
    err = np.abs(out - ref)
    tol = bound(ref)
    bad = ~(err <= tol)
    assert not bad.any(), f"{bad.sum()} off; worst {np.max(err[bad] / np.maximum(tol[bad], 1e-300))}x tol"


# ---------------------------------------------------------------------------------------
# seed sample and oracles
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_seed_sample(dtype):
    go = np.arange(1, 17, dtype=np.float32).reshape(2, 2, 2, 2).astype(dtype)
    mask = np.array([1, 1, 0, 0] * 4, bool).reshape(2, 2, 2, 2)
    out = smb(go, go.copy(), mask, scale=1.0, fix_triu_mask=False)
    # row [a, b]: go·y = [a², b²], sum = a² + b², out = [a² - sum·a, b² - sum·b]; even rows masked
    expect = np.zeros(16)
    for r in range(1, 8, 2):
        a, b = 2 * r + 1, 2 * r + 2
        expect[2 * r:2 * r + 2] = [a * a - (a * a + b * b) * a, b * b - (a * a + b * b) * b]
    np.testing.assert_array_equal(expect[:8], [0, 0, -66, -84, 0, 0, -742, -840])
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float64).reshape(-1),
                                  expect.astype(dtype).astype(np.float64))


@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_fp32_matches_torch_autograd(rng, scale):
    shape = (2, 3, 5, 37)
    torch = pytest.importorskip("torch")
    x = torch.tensor(rng.standard_normal(shape), requires_grad=True)
    m = torch.from_numpy(rng.random((2, 1, 5, 37)) < 0.25)
    y = torch.softmax((x * scale).masked_fill(m, float("-inf")), -1)
    g = torch.tensor(rng.standard_normal(shape))
    (gx,) = torch.autograd.grad(y, x, g)
    out = smb(g.float().numpy(), y.detach().float().numpy(), m.numpy(), scale)
    np.testing.assert_allclose(out, gx.numpy(), rtol=1e-5, atol=1e-6 * np.abs(gx.numpy()).max())
    assert np.all(out[np.broadcast_to(m.numpy(), shape)] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(2, 3, 4, 33), (1, 3, 4, 33), (2, 1, 4, 33), (1, 1, 4, 33)])
def test_dtypes_and_mask_broadcast_vs_float64(rng, dtype, mask_shape):
    shape, scale = (2, 3, 4, 33), 0.7
    go, y, mask = make_case(rng, shape, dtype, mask_shape)
    out = smb(go, y, mask, scale)
    assert out.dtype == dtype and out.shape == shape
    ref = oracle64(go, y, mask, scale)
    check(out, ref, error_bound(go, y, scale, dtype))
    assert np.all(np.asarray(out, np.float64)[np.broadcast_to(mask, shape)] == 0)
    with fg.use_backend("reference"):
        gold = smb(go, y, mask, scale)
    # the golden takes the device's fp32 steps (its form, products and differences rounded)
    check(gold, ref, error_bound(go, y, scale, dtype))
    if dtype != F32:
        assert np.mean(np.asarray(out) == np.asarray(gold)) > 0.9


@pytest.mark.parametrize("s2", [1, 2, 3, 17, 64, 129, 4096, 4097])
def test_last_dim_lengths(rng, s2):
    shape = (1, 2, 3, s2)
    go, y, mask = make_case(rng, shape, F16, (1, 1, 3, s2))
    out = smb(go, y, mask, 2.0)
    check(out, oracle64(go, y, mask, 2.0), error_bound(go, y, 2.0, F16))
    with fg.strict():
        if s2 <= 4096:
            assert np.array_equal(smb(go, y, mask, 2.0).view(np.uint16), out.view(np.uint16))
        else:
            with pytest.raises(fg.AclnnError) as e:
                smb(go, y, mask, 2.0)
            assert e.value.status == 161002


@pytest.mark.parametrize("mask_shape", [(4, 9), (9,), (2, 1, 1, 9), (2, 3, 4, 1), (1,), ()])
def test_extended_mask_broadcast(rng, mask_shape):
    shape = (2, 3, 4, 9)
    go, y, mask = make_case(rng, shape, BF16, mask_shape, p_mask=0.4)
    mask = np.asarray(mask)
    out = smb(go, y, mask, 0.5)
    check(out, oracle64(go, y, mask, 0.5), error_bound(go, y, 0.5, BF16))
    with fg.strict():      # the device takes a 4-D mask with the last two dims of grad_output
        with pytest.raises(fg.AclnnError) as e:
            smb(go, y, mask, 0.5)
        assert e.value.status == 161002


@pytest.mark.parametrize("shape", [(7,), (5, 11), (2, 2, 2, 3, 6)])
def test_other_ranks_outside_strict(rng, shape):
    go, y, _ = make_case(rng, shape, F32)
    mask = rng.random(shape[-1:]) < 0.3
    out = smb(go, y, mask, 1.5)
    check(out, oracle64(go, y, mask, 1.5), error_bound(go, y, 1.5, F32))
    with fg.strict():
        with pytest.raises(fg.AclnnError) as e:
            smb(go, y, np.broadcast_to(mask, shape), 1.5)
        assert e.value.status == 161002


def test_integer_mask_outside_strict(rng):
    go, y, mask = make_case(rng, (1, 2, 3, 8), F32, (1, 1, 3, 8))
    a = smb(go, y, mask, 1.0)
    for dt in (np.uint8, np.int32):
        assert np.array_equal(smb(go, y, (mask * 3).astype(dt), 1.0), a)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("s1,s2", [(6, 6), (4, 9), (9, 4)])
def test_fix_triu_mask(rng, dtype, with_mask, s1, s2):
    shape = (2, 2, s1, s2)
    go, y, mask = make_case(rng, shape, dtype, (2, 1, s1, s2) if with_mask else None)
    out = smb(go, y, mask, 0.9, fix_triu_mask=True)
    ref = oracle64(go, y, mask, 0.9, triu=True)
    check(out, ref, error_bound(go, y, 0.9, dtype))
    upper = np.triu(np.ones((s1, s2), bool), 1)
    assert np.all(np.asarray(out, np.float64)[..., upper] == 0)
    with fg.use_backend("reference"):
        check(smb(go, y, mask, 0.9, fix_triu_mask=True), ref, error_bound(go, y, 0.9, dtype))
    with fg.strict():
        with pytest.raises(fg.AclnnError) as e:
            smb(go, y, mask if with_mask else np.zeros((1, 1, s1, s2), bool), 0.9, fix_triu_mask=True)
        assert e.value.status == 161002


def test_masked_positions_exactly_zero_even_for_nan(rng):
    shape = (1, 1, 2, 8)
    go, y, _ = make_case(rng, shape, F32)
    mask = np.zeros(shape, bool)
    mask[0, 0, 0, 3] = True
    go[0, 0, 0, 3] = np.nan
    mask[0, 0, 1, :] = True          # a fully masked row
    y[0, 0, 1, 2] = np.inf
    out = smb(go, y, mask, 1.0)
    assert np.all(out[mask] == 0) and np.all(~np.signbit(out[mask]))
    assert np.isnan(out[0, 0, 0, ~mask[0, 0, 0]]).all()      # NaN in the row sum elsewhere


# ---------------------------------------------------------------------------------------
# array handling
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_in_torch_out(rng, dtype):
    go, y, mask = make_case(rng, (2, 2, 3, 10), dtype, (2, 1, 3, 10))
    expect = smb(go, y, mask, 0.3)

    torch = pytest.importorskip("torch")
    def tt(a):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == BF16 else torch.from_numpy(a)
    out = smb(tt(go), tt(y), torch.from_numpy(mask), 0.3)
    assert isinstance(out, torch.Tensor) and out.dtype == torch_dt(dtype)
    got = out.view(torch.int16).numpy() if dtype == BF16 else out.numpy()
    assert got.tobytes() == expect.tobytes()
    tout = torch.full(out.shape, 5.0, dtype=torch_dt(dtype))
    r = smb(tt(go), tt(y), torch.from_numpy(mask), 0.3, out=tout)
    assert r is tout and torch.equal(tout, out)


def test_inputs_unmodified_out_param_noncontiguous(rng):
    shape = (2, 3, 4, 12)
    go, y, mask = make_case(rng, shape, F16, (2, 1, 4, 12))
    copies = [a.copy() for a in (go, y, mask)]
    expect = smb(go, y, mask, 0.5)
    for a, b in zip((go, y, mask), copies):
        assert a.tobytes() == b.tobytes()
    out = np.full(shape, 9.0, np.float16)
    assert smb(go, y, mask, 0.5, out=out) is out and out.tobytes() == expect.tobytes()
    big = np.zeros(shape[:-1] + (24,), np.float16)
    view = big[..., 1::2]
    assert smb(go, y, mask, 0.5, out=view) is view
    assert np.array_equal(view, expect) and np.all(big[..., ::2] == 0)
    # non-contiguous inputs (transposed storage, strided mask)
    go_nc = np.ascontiguousarray(np.swapaxes(go, 0, 2)).swapaxes(0, 2)
    y_nc = np.repeat(y, 2, axis=-1)[..., ::2]
    m_nc = np.repeat(mask, 3, axis=-1)[..., ::3]
    assert not go_nc.flags.c_contiguous and not m_nc.flags.c_contiguous
    assert smb(go_nc, y_nc, m_nc, 0.5).tobytes() == expect.tobytes()


@pytest.mark.parametrize("shape", [(0, 2, 3, 4), (2, 0, 3, 4), (1, 1, 0, 4), (1, 1, 3, 0)])
def test_empty(shape):
    go = np.zeros(shape, np.float32)
    mask = np.zeros((1, 1) + shape[2:], bool)
    out = smb(go, go, mask, 1.0)
    assert out.shape == shape
    with fg.use_backend("reference"):
        assert smb(go, go, mask, 1.0).shape == shape
    # strict: the op_api accepts dimensions >= 0 (aclnn_scaled_masked_softmax_backward.cpp:109);
    # every output is empty, so the generated aclnnInner API skips tiling and launch (opbase
    # indv_executor.cpp:1075-1082, indv_executor.h:400-403): success, out untouched
    with fg.strict():
        for soc in ("Ascend910B", "Ascend910_93", "Ascend950"):
            with fg.soc_version(soc):
                user = np.zeros(shape, np.float32)
                assert smb(go, go, mask, 1.0, out=user) is user and user.shape == shape


@pytest.mark.parametrize("dtype", [F32, F16])
def test_threads_bitwise_identical_and_deterministic(rng, dtype):
    go, y, mask = make_case(rng, (3, 4, 16, 257), dtype, (3, 1, 16, 257))
    with fg.num_threads(1):
        a = smb(go, y, mask, 0.3, fix_triu_mask=True)
    with fg.num_threads(2):
        b = smb(go, y, mask, 0.3, fix_triu_mask=True)
        c = smb(go, y, mask, 0.3, fix_triu_mask=True)
    assert a.tobytes() == b.tobytes() == c.tobytes()


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------

def _expect(status, *args, out=None, **kw):
    before = None if out is None else out.copy()
    with pytest.raises(fg.AclnnError) as e:
        smb(*args, out=out, **kw)
    assert e.value.status == status, str(e.value)
    if out is not None:
        assert out.tobytes() == before.tobytes()
    return e.value


def test_null_inputs(rng):
    go, y, mask = make_case(rng, (1, 2, 3, 4), F32, (1, 1, 3, 4))
    sentinel = np.full(go.shape, 7.0, np.float32)
    assert "grad_output" in str(_expect(161001, None, y, mask, out=sentinel))
    assert "y" in str(_expect(161001, go, None, mask, out=sentinel))
    assert "mask" in str(_expect(161001, go, y, None, out=sentinel))
    with fg.strict():
        _expect(161001, go, y, None, fix_triu_mask=True, out=sentinel)


@pytest.mark.parametrize("case", [
    "y_dtype", "y_shape", "go_dtype", "mask_dtype", "mask_bcast", "mask_ndim", "scalar", "scale", "triu_type",
    "out_shape", "out_dtype"])
def test_invalid(rng, case):
    go, y, mask = make_case(rng, (2, 2, 3, 4), F32, (2, 1, 3, 4))
    kw = dict(scale=1.0)
    out = np.full(go.shape, 7.0, np.float32)
    if case == "y_dtype":
        y = y.astype(np.float16)
    elif case == "y_shape":
        y = y[:, :, :2]
    elif case == "go_dtype":
        go, y = go.astype(np.float64), y.astype(np.float64)
    elif case == "mask_dtype":
        mask = mask.astype(np.float32)
    elif case == "mask_bcast":
        mask = np.zeros((2, 2, 3, 3), bool)
    elif case == "mask_ndim":
        mask = np.zeros((1, 2, 2, 3, 4), bool)
    elif case == "scalar":
        go, y = np.float32(1.0), np.float32(1.0)
        out = None
    elif case == "scale":
        kw["scale"] = "x"
    elif case == "triu_type":
        kw["fix_triu_mask"] = 1
    elif case == "out_shape":
        out = np.zeros((2, 2, 3, 5), np.float32)
    elif case == "out_dtype":
        out = np.zeros(go.shape, np.float16)
    _expect(161002, go, y, mask, out=out, **kw)


@pytest.mark.parametrize("case", ["ndim3", "mask_ndim3", "mask_last_dims", "mask_uint8", "triu"])
def test_strict_rejects_device_limits(rng, case):
    go, y, mask = make_case(rng, (2, 2, 3, 4), F32, (2, 1, 3, 4))
    kw = {}
    if case == "ndim3":
        go, y, mask = go[0], y[0], mask[0]
    elif case == "mask_ndim3":
        mask = mask[0]
    elif case == "mask_last_dims":
        mask = mask[..., :1]
    elif case == "mask_uint8":
        mask = mask.astype(np.uint8)
    elif case == "triu":
        kw["fix_triu_mask"] = True
    smb(go, y, mask, 1.0, **kw)                   # fine outside strict mode
    with fg.strict():
        _expect(161002, go, y, mask, 1.0, out=np.full(go.shape, 7.0, np.float32), **kw)


# ---------------------------------------------------------------------------------------
# issue 25: the kernel's two forms, its reduction order, the S2 limit per SoC
# ---------------------------------------------------------------------------------------

def _golden_reduce_sum(p):
    """CANN's golden reduce_sum (executor_aclnnScaledMaskedSoftmaxBackward.py), in fp32, on
    one row of products ``p`` (float32)."""
    p = np.asarray(p, np.float32)
    n = p.size
    if n <= 1024:
        L = (n + 63) // 64 * 64
        q = np.zeros(L, np.float32)
        q[:n] = p
        blocks = [q[i:i + 8] for i in range(0, L, 8)]
        bs = []
        for b in blocks:
            while b.size > 1:
                b = (b[0::2] + b[1::2]).astype(np.float32)
            bs.append(b[0])
        out = np.array(bs[:8], np.float32)
        for i in range(1, len(bs) // 8):
            out = (out + np.array(bs[8 * i:8 * i + 8], np.float32)).astype(np.float32)
        fin = out
    else:
        bs = []
        for i in range(0, n, 64):
            b = p[i:i + 64]
            while b.size > 1:
                if b.size % 2:
                    b = np.append(b, np.float32(0))
                b = (b[0::2] + b[1::2]).astype(np.float32)
            bs.append(b[0])
        fin = np.array(bs, np.float32)
    while fin.size > 1:
        if fin.size % 2:
            fin = np.append(fin, np.float32(0))
        fin = (fin[0::2] + fin[1::2]).astype(np.float32)
    return fin[0]


def _device_row(go, y, scale):
    """The kernel's row in NumPy fp32: SoftmaxGrad (dy - S)·y for padded S2 <= 1024, else dy·y - y·S."""
    go = np.asarray(go, np.float32)
    y = np.asarray(y, np.float32)
    prod = (go * y).astype(np.float32)
    S = _golden_reduce_sum(prod)
    sc = np.float32(scale)
    if (go.size + 63) // 64 * 64 <= 1024:
        return (((go - S).astype(np.float32) * y).astype(np.float32) * sc).astype(np.float32)
    return ((prod - (y * S).astype(np.float32)).astype(np.float32) * sc).astype(np.float32)


def test_issue_example_softmax_grad_form_is_not_zero():
    go = np.array([0.1, 0.1], np.float32).reshape(1, 1, 1, 2)
    y = np.array([0.1, 0.9], np.float32).reshape(1, 1, 1, 2)
    out = smb(go, y, np.zeros((1, 1, 1, 2), bool), 1.0)
    np.testing.assert_array_equal(out.reshape(-1), np.array([7.4505806e-10, 6.7055225e-09], np.float32))
    np.testing.assert_array_equal(out.reshape(-1), _device_row(go.reshape(-1), y.reshape(-1), 1.0))


@pytest.mark.parametrize("s2", [1, 7, 64, 65, 500, 960, 1000, 1024, 1025, 1088, 3000, 4096, 5000])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp32_rows_are_the_kernels_bit_for_bit(rng, s2, scale):
    # near cancellation: y a softmax, dy close to a constant, so Σ dy·y ~ dy_j
    rows = 3
    x = rng.standard_normal((rows, s2))
    y = np.exp(x - x.max(1, keepdims=True))
    y = (y / y.sum(1, keepdims=True)).astype(np.float32)
    go = (0.3 + 1e-4 * rng.standard_normal((rows, s2))).astype(np.float32)
    out = smb(go.reshape(1, 1, rows, s2), y.reshape(1, 1, rows, s2), np.zeros((1, 1, rows, s2), bool), scale)
    ref = np.stack([_device_row(go[r], y[r], scale) for r in range(rows)]).reshape(1, 1, rows, s2)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_16bit_rows_are_the_kernels(rng, dtype):
    for s2 in (33, 1024, 1030):
        go = rng.standard_normal((2, s2)).astype(dtype)
        y = rng.random((2, s2)).astype(dtype)
        out = smb(go.reshape(1, 1, 2, s2), y.reshape(1, 1, 2, s2), np.zeros((1, 1, 2, s2), bool), 0.5)
        ref = np.stack([_device_row(go[r].astype(np.float32), y[r].astype(np.float32), 0.5) for r in range(2)])
        np.testing.assert_array_equal(np.asarray(out).reshape(2, s2).view(np.uint16),
                                      ref.astype(dtype).view(np.uint16))


def test_s2_limit_follows_the_profile(rng):
    for s2, ok_a2, ok_950 in ((4096, True, True), (4097, False, True), (8192, False, True), (8193, False, False)):
        go, y, mask = make_case(rng, (1, 1, 1, s2), F16, (1, 1, 1, s2))
        for soc, ok in (("Ascend910B", ok_a2), ("Ascend910_93", ok_a2), ("Ascend950", ok_950)):
            with fg.soc_version(soc), fg.strict():
                if ok:
                    smb(go, y, mask, 1.0)
                else:
                    with pytest.raises(fg.AclnnError) as e:
                        smb(go, y, mask, 1.0)
                    assert e.value.status == 161002 and soc in str(e.value)
