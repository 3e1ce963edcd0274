"""Tests of fg.embedding_dense_backward (aclnnEmbeddingDenseBackward)."""

import numpy as np
import pytest
from common import BF16, DTYPES, F16, F32, torch_dt

import fastgrad as fg

INDEX_DTYPES = [np.int64, np.int32, np.int16, np.int8, np.uint8, np.float32, np.float16, np.float64]


def _torch64(grad, idx, nw, padding_idx, scale):
    """PyTorch's aten op in float64 (the index dtype cast to int64 with truncation)."""
    torch = pytest.importorskip("torch")
    g = torch.from_numpy(np.ascontiguousarray(grad.astype(np.float64)))
    i = torch.from_numpy(np.trunc(np.asarray(idx, np.float64)).astype(np.int64))
    return torch.ops.aten.embedding_dense_backward(g, i, nw, padding_idx, scale).numpy()


def _emulate(grad, idx, nw, padding_idx, scale, dtype):
    """The device's order in NumPy float32 (bit-exact expectation).

    ``np.add.at`` is unbuffered: it adds the rows one by one in index order into an fp32
    table that starts at +0, exactly the kernel's accumulation.
    """
    d = grad.shape[-1]
    i = np.trunc(np.asarray(idx, np.float64)).astype(np.int64).reshape(-1)
    acc = np.zeros((nw, d), np.float32)
    np.add.at(acc, i, grad.astype(np.float32).reshape(-1, d))
    if scale:
        c = np.bincount(i, minlength=nw).astype(np.float32)
        seen = c > 0
        acc[seen] = acc[seen] * (np.float32(1.0) / c[seen])[:, None]  # reciScale = 1.0f / count
    if 0 <= padding_idx < nw:
        acc[padding_idx] = 0
    return acc.astype(dtype)


def assert_close(out, ref64, dtype, mag):
    """fp32 sums: |out - ref| <= 4*eps32*mag (mag = per-row sum of |grad|); 16-bit: adaptive."""
    out = np.asarray(out).astype(np.float64)
    r = np.asarray(ref64, np.float64)
    assert out.shape == r.shape
    tol = 4 * 2.0 ** -24 * mag + 1e-30
    if np.dtype(dtype) != F32:
        rl = r.astype(dtype).astype(np.float64)
        tol = tol + 2 * np.abs(rl - r)
    bad = np.abs(out - r) > tol
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. out={out[bad][:5]} ref={r[bad][:5]}"


def _case(rng, n, d, nw, dtype, repeats=True):
    idx = rng.integers(0, nw if not repeats else max(1, nw // 3), n)
    grad = rng.standard_normal((n, d)).astype(dtype)
    return grad, idx


def _mag(grad, idx, nw):
    d = grad.shape[-1]
    m = np.zeros((nw, d))
    np.add.at(m, np.asarray(idx).reshape(-1).astype(np.int64), np.abs(grad.astype(np.float64).reshape(-1, d)))
    return m


# ----------------------------------------------------------------------------------------
# Seed sample and semantics
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_seed_sample(backend):
    grad = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    with fg.use_backend(backend):
        out = fg.embedding_dense_backward(grad, np.array([1, 2], np.int64), 4, 0, False)
    assert out.dtype == np.float32 and out.shape == (4, 3)
    np.testing.assert_array_equal(out, [[0, 0, 0], [1, 2, 3], [4, 5, 6], [0, 0, 0]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("padding_idx", [-1, 0, 5])
@pytest.mark.parametrize("scale", [False, True])
def test_matches_torch_and_device_order(rng, dtype, padding_idx, scale):
    nw, d = 23, 37
    grad, idx = _case(rng, 97, d, nw, dtype)
    idx[:5] = 5  # padding row is referenced
    out = fg.embedding_dense_backward(grad, idx, nw, padding_idx, scale)
    assert out.dtype == dtype and out.shape == (nw, d)
    mag = _mag(grad, idx, nw)
    assert_close(out, _torch64(grad, idx, nw, padding_idx, scale), dtype, mag)
    np.testing.assert_array_equal(out.view(np.uint8), _emulate(grad, idx, nw, padding_idx, scale, dtype).view(np.uint8))
    with fg.use_backend("reference"):
        ref = fg.embedding_dense_backward(grad, idx, nw, padding_idx, scale)
    assert ref.dtype == dtype
    assert_close(out, ref.astype(np.float64), dtype, mag)
    if 0 <= padding_idx < nw:
        assert (out[padding_idx].astype(np.float32) == 0).all()


def test_bf16_accumulates_in_fp32():
    grad = np.ones((4096, 2), BF16)
    idx = np.zeros(4096, np.int64)
    out = fg.embedding_dense_backward(grad, idx, 3)
    np.testing.assert_array_equal(out.astype(np.float32), [[4096, 4096], [0, 0], [0, 0]])
    with fg.use_backend("reference"):
        np.testing.assert_array_equal(fg.embedding_dense_backward(grad, idx, 3).astype(np.float32)[0], 4096)
    # PyTorch's CPU kernel accumulates in bf16 and stalls at 256 (documented deviation)
    torch = pytest.importorskip("torch")
    tor = torch.ops.aten.embedding_dense_backward(torch.ones(4096, 2, dtype=torch.bfloat16),
                                                  torch.zeros(4096, dtype=torch.int64), 3, -1, False)
    assert tor[0, 0].item() == 256


def test_accumulation_is_in_index_order():
    # fp32 sums are order-dependent: 1e8 + 1 - 1e8 = 0 but 1e8 - 1e8 + 1 = 1
    grad = np.array([[1e8], [1.0], [-1e8], [1e8], [-1e8], [1.0]], np.float32)
    idx = np.array([0, 0, 0, 1, 1, 1])
    out = fg.embedding_dense_backward(grad, idx, 2)
    np.testing.assert_array_equal(out[:, 0], [0.0, 1.0])
    grad = np.array([[-0.0], [-0.0]], np.float32)  # the sum starts from +0
    out = fg.embedding_dense_backward(grad, np.array([1, 1]), 2)
    assert out[1, 0] == 0 and not np.signbit(out[1, 0])


@pytest.mark.parametrize("idt", INDEX_DTYPES + [np.bool_], ids=lambda d: np.dtype(d).name)
def test_index_dtypes(rng, idt):
    nw = 2 if idt == np.bool_ else 40
    grad, idx = _case(rng, 30, 8, nw, F32, repeats=False)
    iv = idx.astype(idt)
    out = fg.embedding_dense_backward(grad, iv, nw, -1, True)
    np.testing.assert_array_equal(out, _emulate(grad, idx, nw, -1, True, F32))
    with fg.strict():  # every dtype of the aclnn list is accepted by the device
        np.testing.assert_array_equal(fg.embedding_dense_backward(grad, iv, nw, -1, True), out)


def test_float_indices_truncate_toward_zero():
    grad = np.arange(12, dtype=np.float32).reshape(4, 3)
    idx = np.array([2.7, -0.5, 0.99, 1.0], np.float32)  # -> 2, 0, 0, 1
    out = fg.embedding_dense_backward(grad, idx, 3)
    np.testing.assert_array_equal(out, [[3 + 6, 4 + 7, 5 + 8], [9, 10, 11], [0, 1, 2]])
    with fg.use_backend("reference"):
        np.testing.assert_array_equal(fg.embedding_dense_backward(grad, idx, 3), out)


def test_index_extension_dtypes():
    grad = np.ones((3, 2), np.float32)
    for idt in (np.uint16, np.uint32, np.uint64, BF16):
        out = fg.embedding_dense_backward(grad, np.array([0, 2, 2]).astype(idt), 3)
        np.testing.assert_array_equal(out[:, 0], [1, 0, 2])
        with fg.strict(), pytest.raises(fg.AclnnError) as ei:
            fg.embedding_dense_backward(grad, np.array([0, 2, 2]).astype(idt), 3)
        assert ei.value.status == 161002


@pytest.mark.parametrize("gshape,ishape", [((2, 3, 5), (2, 3)), ((6, 5), (2, 3)), ((1, 6, 5), (6,)),
                                          ((2, 1, 3, 5), (6, 1))], ids=str)
def test_multidim(rng, gshape, ishape):
    grad = rng.standard_normal(gshape).astype(BF16)
    idx = rng.integers(0, 4, ishape)
    out = fg.embedding_dense_backward(grad, idx, 4)
    np.testing.assert_array_equal(out.view(np.uint16), _emulate(grad, idx, 4, -1, False, BF16).view(np.uint16))


def test_padding_idx_out_of_range_is_no_op(rng):
    grad, idx = _case(rng, 20, 4, 6, F32, repeats=False)
    a = fg.embedding_dense_backward(grad, idx, 6, 6)
    b = fg.embedding_dense_backward(grad, idx, 6, -3)
    np.testing.assert_array_equal(a, _emulate(grad, idx, 6, -1, False, F32))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_empty(dtype):
    out = fg.embedding_dense_backward(np.zeros((0, 4), dtype), np.zeros(0, np.int64), 5)
    assert out.shape == (5, 4) and out.dtype == dtype and (out.astype(np.float32) == 0).all()
    out = fg.embedding_dense_backward(np.zeros((3, 0), dtype), np.array([1, 2, 4]), 5)  # D == 0
    assert out.shape == (5, 0)
    with pytest.raises(fg.AclnnError) as e:       # D == 0 does not excuse an out-of-range index
        fg.embedding_dense_backward(np.zeros((3, 0), dtype), np.array([9, 9, 9]), 5)
    assert e.value.status == 161002 and e.value.param == "indices"
    out = fg.embedding_dense_backward(np.zeros((0, 4), dtype), np.zeros(0, np.int64), 0)
    assert out.shape == (0, 4)
    sentinel = np.full((5, 4), 7, dtype)
    fg.embedding_dense_backward(np.zeros((0, 4), dtype), np.zeros((0,), np.int32), 5, out=sentinel)
    assert (sentinel.astype(np.float32) == 0).all()
    with fg.use_backend("reference"):
        out = fg.embedding_dense_backward(np.zeros((0, 4), dtype), np.zeros(0, np.int64), 5)
        assert out.shape == (5, 4) and (out.astype(np.float32) == 0).all()


# ----------------------------------------------------------------------------------------
# Layouts, out=, kinds, threads, inputs untouched
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_non_contiguous(rng, dtype):
    base = rng.standard_normal((16, 30)).astype(dtype)
    idx_base = rng.integers(0, 7, 32)
    views = {
        "transposed": (base.T[:, :16], idx_base[:30]),          # (30, 16), column-major
        "negative": (base[::-1, ::-1], idx_base[::-2]),         # negative strides
        "rows_step": (base[::2, 3:20], idx_base[1:17:2]),        # row stride > D
        "broadcast_rows": (np.broadcast_to(base[0], (9, 30)), idx_base[:9]),  # row stride 0
    }
    for name, (g, i) in views.items():
        out = fg.embedding_dense_backward(g, i, 7, 2, True)
        expect = _emulate(np.ascontiguousarray(g), i, 7, 2, True, dtype)
        np.testing.assert_array_equal(out.view(np.uint8), expect.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_out(rng, dtype):
    grad, idx = _case(rng, 40, 6, 9, dtype)
    expect = fg.embedding_dense_backward(grad, idx, 9)
    out = np.full((9, 6), 5, dtype)  # stale contents must be overwritten (zero rows too)
    assert fg.embedding_dense_backward(grad, idx, 9, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint8), expect.view(np.uint8))
    big = np.full((9, 12), 3, dtype)
    view = big[:, 1::2]
    assert fg.embedding_dense_backward(grad, idx, 9, out=view) is view
    np.testing.assert_array_equal(view.astype(np.float32), expect.astype(np.float32))
    np.testing.assert_array_equal(big[:, ::2].astype(np.float32), 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_in_torch_out(rng, dtype):
    grad, idx = _case(rng, 25, 8, 10, dtype)
    expect = fg.embedding_dense_backward(grad, idx, 10, 1, False)
    torch = pytest.importorskip("torch")
    G = torch.from_numpy(grad.astype(np.float32)).to(torch_dt(dtype))
    res = fg.embedding_dense_backward(G, torch.from_numpy(idx), 10, 1, False)
    assert isinstance(res, torch.Tensor) and res.dtype == torch_dt(dtype) and res.shape == (10, 8)
    np.testing.assert_array_equal(res.float().numpy(), expect.astype(np.float32))
    out = torch.empty(10, 8, dtype=torch_dt(dtype))
    assert fg.embedding_dense_backward(G, torch.from_numpy(idx), 10, 1, False, out=out) is out
    np.testing.assert_array_equal(out.float().numpy(), expect.astype(np.float32))
    if dtype == F32:  # PyTorch's own fp32 op, also in index order
        tor = torch.ops.aten.embedding_dense_backward(G, torch.from_numpy(idx), 10, 1, False)
        np.testing.assert_array_equal(res.numpy(), tor.numpy())


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("scale", [False, True])
def test_threads_bitwise_and_deterministic(rng, dtype, scale):
    nw, d = 300, 33  # several row blocks
    grad, idx = _case(rng, 3000, d, nw, dtype)
    with fg.num_threads(1):
        a = fg.embedding_dense_backward(grad, idx, nw, 7, scale)
    with fg.num_threads(2):
        b = fg.embedding_dense_backward(grad, idx, nw, 7, scale)
        c = fg.embedding_dense_backward(grad, idx, nw, 7, scale)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    np.testing.assert_array_equal(b.view(np.uint8), c.view(np.uint8))
    np.testing.assert_array_equal(a.view(np.uint8), _emulate(grad, idx, nw, 7, scale, dtype).view(np.uint8))


def test_inputs_not_modified(rng):
    grad, idx = _case(rng, 20, 5, 8, BF16)
    gc, ic = grad.copy(), idx.copy()
    fg.embedding_dense_backward(grad, idx, 8, 0, True)
    with fg.use_backend("reference"):
        fg.embedding_dense_backward(grad, idx, 8, 0, True)
    np.testing.assert_array_equal(grad.view(np.uint16), gc.view(np.uint16))
    np.testing.assert_array_equal(idx, ic)


# ----------------------------------------------------------------------------------------
# Errors (seed error table) — out= untouched
# ----------------------------------------------------------------------------------------

G = np.ones((4, 3), np.float32)
I = np.array([0, 1, 2, 3])


def _call_err(status, grad, indices, num_weights=5, *args, out_shape=(5, 3), out_dtype=F32, **kw):
    out = np.full(out_shape, 42, out_dtype)
    with pytest.raises(fg.AclnnError) as ei:
        fg.embedding_dense_backward(grad, indices, num_weights, *args, out=out, **kw)
    assert ei.value.status == status
    assert (out.astype(np.float64) == 42).all()
    return ei.value


def test_null_inputs():
    assert _call_err(161001, None, I).param == "grad"
    assert _call_err(161001, G, None).param == "indices"


@pytest.mark.parametrize("bad", [np.float64, np.int32, np.bool_])
def test_bad_grad_dtype(bad):
    _call_err(161002, G.astype(bad), I)


@pytest.mark.parametrize("bad", [np.complex64, np.str_])
def test_bad_index_dtype(bad):
    _call_err(161002, G, I.astype(bad))


@pytest.mark.parametrize("bad", [[0, 1, 2, 5], [0, -1, 2, 3], [0, 1, 2, 99999]])
def test_index_out_of_range(bad):
    e = _call_err(161002, G, np.array(bad))
    assert e.param == "indices"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 5.0, -1.0])
def test_float_index_out_of_range(bad):
    _call_err(161002, G, np.array([0, 1, 2, bad], np.float32))


def test_shape_mismatch():
    _call_err(161002, G, np.array([0, 1, 2]))
    _call_err(161002, np.ones((2, 3, 3), np.float32), I)
    _call_err(161002, np.ones((3,), np.float32), I)


def test_bad_attributes():
    _call_err(161002, G, I, -1, out_shape=(5, 3))
    _call_err(161002, G, I, 5.0)
    _call_err(161002, G, I, 5, 1.5)
    _call_err(161002, G, I, 5, -1, 1)  # scale_grad_by_freq must be a bool
    _call_err(161002, G, I, 5, -1, "yes")


def test_bad_out():
    _call_err(161002, G, I, 5, out_shape=(4, 3))
    _call_err(161002, G, I, 5, out_shape=(5, 3, 1))
    _call_err(161002, G, I, 5, out_dtype=np.float64)  # out: a float dtype of the device
    _call_err(161002, G, I, 5, out_dtype=np.int32)
    ro = np.zeros((5, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(fg.AclnnError) as ei:
        fg.embedding_dense_backward(G, I, 5, out=ro)
    assert ei.value.status == 161002


def test_strict_rank_limits():
    g1 = np.ones(3, np.float32)
    out = fg.embedding_dense_backward(g1, np.array(2), 4)  # 1-D grad, 0-d indices
    np.testing.assert_array_equal(out[2], 1)
    g9 = np.ones((1,) * 8 + (3,), np.float32)
    assert fg.embedding_dense_backward(g9, np.zeros((1,) * 8, np.int64), 2).shape == (2, 3)
    with fg.strict():
        # the op_api bounds both ranks by 8 only (CheckMaxDimension, aclnn_embedding_dense_backward.cpp:
        # 95-99); CheckDimension (:101-123) compares prod(grad.shape[:-1]) with indices.size: a 1-D
        # grad with 0-d or one-element indices is 1 == 1 (F.embedding(scalar_index, W)'s backward)
        for idx in (np.array(2), np.array([2])):
            np.testing.assert_array_equal(fg.embedding_dense_backward(g1, idx, 4), out)
        for grad, idx in ((G, np.array(2).reshape(())), (g9, np.zeros((1,) * 8, np.int64))):
            with pytest.raises(fg.AclnnError) as ei:
                fg.embedding_dense_backward(grad, idx, 4)
            assert ei.value.status == 161002
        fg.embedding_dense_backward(np.ones((1,) * 7 + (3,), np.float32), np.zeros((1,) * 8, np.int64), 2)


# ----------------------------------------------------------------------------------------
# Property: random sizes, repeats, padding and scaling, bit-exact with the device order
# ----------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 200), d=st.integers(1, 70), nw=st.integers(1, 150),
       dtype=st.sampled_from(DTYPES), pad=st.integers(-2, 150), scale=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_property_random(n, d, nw, dtype, pad, scale, seed):
    r = np.random.default_rng(seed)
    idx = r.integers(0, r.integers(1, nw + 1), n)  # skewed: many repeats when the range is small
    grad = r.standard_normal((n, d)).astype(dtype)
    out = fg.embedding_dense_backward(grad, idx, nw, pad, scale)
    np.testing.assert_array_equal(out.view(np.uint8), _emulate(grad, idx, nw, pad, scale, dtype).view(np.uint8))


# ---------------------------------------------------------------------------------------
# issue 25 point 5: the fp32 reciprocal and the cast to out's dtype
# ---------------------------------------------------------------------------------------

def test_scale_multiplies_by_the_fp32_reciprocal_not_divides(rng):
    # embedding_dense_grad_v2_scale.h:100-104: reciScale = 1.0f / count; Muls(grad, reciScale)
    n, d, nw = 600, 64, 7
    g = rng.standard_normal((n, d)).astype(np.float32)
    idx = rng.integers(0, nw, n)
    out = fg.embedding_dense_backward(g, idx, nw, scale_grad_by_freq=True)
    acc = np.zeros((nw, d), np.float32)
    np.add.at(acc, idx, g)
    cnt = np.bincount(idx, minlength=nw).astype(np.float32)
    mul = acc * (np.float32(1.0) / cnt)[:, None]
    div = acc / cnt[:, None]
    np.testing.assert_array_equal(out, mul)
    assert (mul != div).mean() > 0.05  # the two differ in a good share of the sums: the test can fail


@pytest.mark.parametrize("scale", [False, True])
def test_out_of_another_float_dtype_gets_the_casted_fp32_result(rng, scale):
    # aclnn_embedding_dense_backward.cpp:332-341 widens a 16-bit grad on A2/A3 (IsNeedCast),
    # :407 casts the fp32 result to out's dtype: a bf16 grad with an fp32 out -> unrounded sums
    n, d, nw = 300, 16, 9
    g = rng.standard_normal((n, d)).astype(BF16)
    idx = rng.integers(0, nw, n)
    acc = np.zeros((nw, d), np.float32)
    np.add.at(acc, idx, g.astype(np.float32))
    if scale:
        acc *= (np.float32(1.0) / np.maximum(np.bincount(idx, minlength=nw), 1).astype(np.float32))[:, None]
    for backend in ("cpu", "reference"):
        with fg.use_backend(backend):
            o32 = fg.embedding_dense_backward(g, idx, nw, scale_grad_by_freq=scale, out=np.empty((nw, d), np.float32))
            o16 = fg.embedding_dense_backward(g, idx, nw, scale_grad_by_freq=scale, out=np.empty((nw, d), F16))
        if backend == "cpu":
            np.testing.assert_array_equal(o32, acc)
            np.testing.assert_array_equal(o16, acc.astype(F16))  # one rounding, fp32 -> fp16
        else:
            np.testing.assert_allclose(o32, acc, rtol=1e-6, atol=1e-6)
    assert (o32 != o32.astype(BF16).astype(np.float32)).any()  # truly unrounded
    # Ascend 950 never widens (!is950): the result is in grad's dtype, then cast
    with fg.soc_version("Ascend950"):
        o950 = fg.embedding_dense_backward(g, idx, nw, scale_grad_by_freq=scale, out=np.empty((nw, d), np.float32))
    np.testing.assert_array_equal(o950, acc.astype(BF16).astype(np.float32))
