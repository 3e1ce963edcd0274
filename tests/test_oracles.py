"""Every op, on the "cpu" and the "reference" backend, against the independent float64 oracles of
tests/naive.py (written from docs/spec.md and the aclnn docs, importing nothing from fastgrad), over float32 / float16 /
bfloat16 and awkward shapes (1, primes, tile non-multiples, empty).  Where PyTorch is installed,
the oracles themselves (and fastgrad's fp32 results) are checked against PyTorch float64 autograd.

Tolerances are the forward-error bounds of each op's fp32 pipeline (see ``naive.check_*``): one
ulp of the output dtype plus k·u32 times the magnitude of the terms combined, never a fixed rtol.
"""

import naive as N
import numpy as np
import pytest

import fastgrad as fg

BF16, F16, F32 = N.BF16, N.F16, N.F32
DTYPES = [F32, F16, BF16]
BACKENDS = ["cpu", "reference"]


def _run(backend, fn, *a, **k):
    with fg.use_backend(backend):
        return fn(*a, **k)


def _dt_id(d):
    return np.dtype(d).name


def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


# ---------------------------------------------------------------------------------------------
# the oracle itself: seed samples of the documents
# ---------------------------------------------------------------------------------------------

def test_naive_seed_samples():
    ce = N.cross_entropy_loss_grad(np.float32(0.1), np.full((2, 3), -0.2, np.float32),
                                   np.array([0, 0]), np.ones(3, np.float32), "mean")
    np.testing.assert_allclose(ce, [[-0.0090635, 0.0409365, 0.0409365]] * 2, atol=5e-8)
    sl = N.smooth_l1_loss_backward(np.float32(1), np.arange(8, dtype=np.float32), np.float32(1),
                                   "none", 1.0)
    assert sl.tolist() == [-1, 0, 1, 1, 1, 1, 1, 1]
    emb = N.embedding_dense_backward(np.array([[1, 2, 3], [4, 5, 6]], np.float32), np.array([1, 2]), 4, 0)
    assert emb.tolist() == [[0, 0, 0], [1, 2, 3], [4, 5, 6], [0, 0, 0]]
    v = np.arange(1, 17, dtype=np.float32).reshape(2, 2, 2, 2)
    mask = np.array([1, 1, 0, 0] * 4, bool).reshape(2, 2, 2, 2)
    sm = N.scaled_masked_softmax_backward(v, v, mask, 1.0)
    assert (sm[mask] == 0).all()
    row = v.reshape(-1, 2)[1]
    assert sm.reshape(-1, 2)[1].tolist() == list(row * row - (row * row).sum() * row)
    # packing: LSB-first, padding bits from target 0
    assert N.pack_mask([1, 0, 1]).tolist() == [0b101]
    assert N.pack_mask([1, 0, 1], padding_bit=True).tolist() == [0b11111101]
    assert N.unpack_mask(np.array([0b101], np.uint8), 3).tolist() == [True, False, True]


def test_assert_matches_rejects_a_one_ulp_plus_error():
    ref = np.array([1.0, 3.0, -2.5])
    got = N.round_like_device(ref, BF16)
    N.assert_matches(got, ref, BF16)
    bad = (ref * (1 + 2 * 2.0 ** -8)).astype(np.float32).astype(BF16)     # two bf16 ulps off
    with pytest.raises(AssertionError):
        N.assert_matches(bad, ref, BF16)
    with pytest.raises(AssertionError):
        N.assert_matches(np.array([np.nan, 3, -2.5], np.float32), ref, F32)
    with pytest.raises(AssertionError):
        N.assert_matches(np.array([1, 3, -2.5], np.float32), np.array([np.nan, 3, -2.5]), F32)


# ---------------------------------------------------------------------------------------------
# smooth_l1_loss_backward
# ---------------------------------------------------------------------------------------------

SL1_SHAPES = [((), (1,), (1,)), ((), (7,), (7,)), ((3, 13), (3, 13), (3, 13)), ((), (0,), (0,)),
              ((5,), (2, 1, 5), (3, 1)), ((1, 1), (17,), ())]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("shapes", SL1_SHAPES, ids=str)
@pytest.mark.parametrize("reduction,beta", [("none", 1.0), ("mean", 0.5), ("sum", 0.0), (1, 1.7)])
def test_smooth_l1_loss_backward(rng, backend, dtype, shapes, reduction, beta):
    g = _randn(rng, shapes[0], dtype)
    x = _randn(rng, shapes[1], dtype, 2.0)
    t = _randn(rng, shapes[2], dtype)
    if x.size > 2:
        x.reshape(-1)[0] = t.reshape(-1)[0] if t.size == x.size else x.reshape(-1)[0]  # d = 0
    got = _run(backend, fg.smooth_l1_loss_backward, g, x, t, reduction, beta)
    assert got.dtype == dtype and got.shape == np.broadcast_shapes(*shapes)
    N.check_smooth_l1_loss_backward(got, g, x, t, reduction, beta)  # A2/A3 (the default profile)
    with fg.soc_version("Ascend950"):
        got = _run(backend, fg.smooth_l1_loss_backward, g, x, t, reduction, beta)
    N.check_smooth_l1_loss_backward(got, g, x, t, reduction, beta, tbe=False)


# ---------------------------------------------------------------------------------------------
# embedding_dense_backward
# ---------------------------------------------------------------------------------------------

EMB_SHAPES = [((1,), 1, 1), ((13,), 7, 5), ((0,), 3, 4), ((37,), 17, 11), ((3, 5), 2, 257), ((4,), 0, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("ishape,d,nw", EMB_SHAPES, ids=str)
@pytest.mark.parametrize("padding_idx,scale", [(-1, False), (0, True), (3, False), (2, True)])
def test_embedding_dense_backward(rng, backend, dtype, ishape, d, nw, padding_idx, scale):
    idx = rng.integers(0, nw, ishape).astype(np.int64)
    grad = _randn(rng, ishape + (d,), dtype)
    got = _run(backend, fg.embedding_dense_backward, grad, idx, nw, padding_idx, scale)
    assert got.dtype == dtype and got.shape == (nw, d)
    N.check_embedding_dense_backward(got, grad, idx, nw, padding_idx, scale)


# ---------------------------------------------------------------------------------------------
# scaled_masked_softmax_backward
# ---------------------------------------------------------------------------------------------

SMSB_SHAPES = [((1, 1, 1, 1), (1, 1, 1, 1)), ((2, 3, 5, 7), (2, 1, 5, 7)), ((1, 2, 3, 17), (1, 1, 3, 17)),
               ((2, 2, 4, 131), (2, 2, 4, 131)), ((2, 1, 0, 3), (1, 1, 0, 3)), ((3, 2, 2, 1), (1, 2, 2, 1))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("shape,mshape", SMSB_SHAPES, ids=str)
@pytest.mark.parametrize("scale,triu", [(1.0, False), (0.125, False), (-3.0, True)])
def test_scaled_masked_softmax_backward(rng, backend, dtype, shape, mshape, scale, triu):
    z = np.exp(rng.standard_normal(shape))
    y = (z / np.maximum(z.sum(-1, keepdims=True), 1e-30)).astype(np.float32).astype(dtype)
    go = _randn(rng, shape, dtype)
    mask = rng.random(mshape) < 0.3
    got = _run(backend, fg.scaled_masked_softmax_backward, go, y, mask, scale, triu)
    assert got.dtype == dtype and got.shape == shape
    N.check_scaled_masked_softmax_backward(got, go, y, mask, scale, triu)


# ---------------------------------------------------------------------------------------------
# cross_entropy_loss_grad
# ---------------------------------------------------------------------------------------------

def _log_softmax(rng, n, c, dtype):
    z = rng.standard_normal((n, c)) * 2
    lp = z - np.log(np.exp(z).sum(1, keepdims=True)) if c else z
    return lp.astype(np.float32).astype(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("n,c", [(1, 1), (7, 13), (3, 129), (0, 5), (11, 2)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted,ls,zs", [(False, 0.0, 0.0), (True, 0.0, 0.0), (True, 0.3, 0.0),
                                            (False, 0.1, 1e-2)])
def test_cross_entropy_loss_grad(rng, backend, dtype, n, c, reduction, weighted, ls, zs):
    lp = _log_softmax(rng, n, c, dtype)
    t = rng.integers(0, c, n).astype(np.int64)
    if n > 2:
        t[1] = -100
    g = (rng.uniform(0.1, 2, n) if reduction == "none" else np.array(rng.uniform(0.1, 2))).astype(dtype)
    w = rng.uniform(0.2, 2, c).astype(np.float32) if weighted else None
    kw = dict(weight=w, reduction=reduction, label_smoothing=ls)
    if zs:
        kw.update(grad_zloss=(np.ones_like(g) * 0.5).astype(dtype),
                  lse_for_zloss=rng.uniform(-1, 3, n).astype(np.float32), lse_square_scale_for_zloss=zs)
    got = _run(backend, fg.cross_entropy_loss_grad, g, lp, t, **kw)
    assert got.dtype == dtype and got.shape == (n, c)
    N.check_cross_entropy_loss_grad(got, g, lp, t, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_cross_entropy_all_ignored_mean_is_nan(backend, dtype):
    lp = np.full((3, 4), -np.log(4), np.float32).astype(dtype)
    t = np.full(3, -100)
    got = _run(backend, fg.cross_entropy_loss_grad, np.array(1.0, dtype), lp, t, reduction="mean")
    assert np.isnan(N.cross_entropy_loss_grad(np.array(1.0, dtype), lp, t)).all()
    N.check_cross_entropy_loss_grad(got, np.array(1.0, dtype), lp, t)
    ok = _run(backend, fg.cross_entropy_loss_grad, np.array(1.0, dtype), lp, t, reduction="sum")
    assert (N.f64(ok) == 0).all()


# ---------------------------------------------------------------------------------------------
# fused_cross_entropy_loss_with_max_sum
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("bt,v,ls,with_logits",
                         [(bt, v, ls, wl) for bt, v in [(1, 1), (7, 13), (13, 257), (0, 5)]
                          for ls, wl in [(0.0, False), (0.0, True), (0.2, True)]
                          if not (ls and v < 2)],      # s = α·K/(K-1) is undefined for K = 1
                         ids=str)
def test_fused_cross_entropy_loss_with_max_sum(rng, backend, dtype, bt, v, ls, with_logits):
    lg = _randn(rng, (bt, v), dtype, 3.0)
    lf = N.f64(lg)
    m = lf.max(1).astype(np.float32) if v else np.zeros(bt, np.float32)
    s = np.exp(lf - m[:, None]).sum(1).astype(np.float32)
    t = rng.integers(0, v, bt)
    pr = (lf[np.arange(bt), t] - m).astype(np.float32)
    args = (m, s, pr, ls, lg if with_logits else None)
    loss, sm = _run(backend, fg.fused_cross_entropy_loss_with_max_sum, *args)
    assert loss.dtype == np.float32 and loss.shape == (bt,)
    if with_logits:
        assert sm.dtype == np.float32 and sm.shape == (bt, v)
    N.check_fused_cross_entropy_loss_with_max_sum(loss, sm, *args)


# ---------------------------------------------------------------------------------------------
# fused_linear_online_max_sum
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("bt,h,v", [(1, 1, 1), (7, 13, 37), (13, 5, 130), (0, 4, 3), (9, 3, 300)], ids=str)
@pytest.mark.parametrize("shard", [(0, None), (5, None), (3, 2)], ids=str)
@pytest.mark.parametrize("return_logits", [False, True])
def test_fused_linear_online_max_sum(rng, backend, dtype, bt, h, v, shard, return_logits):
    start = shard[0]
    end = start + v                                      # the shard owns [start, start + V)
    x = _randn(rng, (bt, h), dtype)
    w = _randn(rng, (v, h), dtype, 1 / np.sqrt(h))
    t = rng.integers(0, start + v + 4, bt).astype(np.int64 if shard[1] is None else np.int32)
    got = _run(backend, fg.fused_linear_online_max_sum, x, w, t, start, end, return_logits)
    N.check_fused_linear_online_max_sum(got, x, w, t, start, end, return_logits=return_logits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=_dt_id)
def test_fused_linear_online_max_sum_fp32_logits(rng, backend, dtype):
    x, w = _randn(rng, (11, 7), dtype), _randn(rng, (29, 7), dtype)
    t = rng.integers(0, 29, 11)
    got = _run(backend, fg.fused_linear_online_max_sum, x, w, t, 0, 29, True, logits_dtype=np.float32)
    N.check_fused_linear_online_max_sum(got, x, w, t, 0, 29, logits_dtype=F32, return_logits=True)


# ---------------------------------------------------------------------------------------------
# fused_linear_cross_entropy_loss_grad
# ---------------------------------------------------------------------------------------------

def _flce_problem(rng, bt, h, v, dtype, owned=0.7):
    x = _randn(rng, (bt, h), dtype)
    w = _randn(rng, (v, h), dtype, 1 / np.sqrt(max(h, 1)))
    lg = N.f64(x) @ N.f64(w).T
    m = lg.max(1) if v else np.zeros(bt)
    s = np.exp(lg - m[:, None]).sum(1)
    masked = rng.random(bt) > owned
    mt = np.where(masked, rng.integers(-3, v + 3, bt), rng.integers(0, max(v, 1), bt)).astype(np.int64)
    grad = rng.uniform(0.1, 1, bt).astype(np.float32)
    sm = (np.exp(lg - m[:, None]) / s[:, None]).astype(np.float32)
    return x, w, masked, mt, grad, m.astype(np.float32), s.astype(np.float32), sm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
@pytest.mark.parametrize("mode", ["memory-saving", "high-performance"])
@pytest.mark.parametrize("bt,h,v,ls,packed",
                         [(*shape, ls, packed)
                          for shape in [(1, 1, 1), (7, 13, 37), (13, 5, 131), (17, 3, 257), (0, 4, 5)]
                          for ls, packed in [(0.0, True), (0.0, False), (0.15, True)]
                          if not (ls and shape[2] < 2)],   # s = α·K/(K-1) undefined for K = 1
                         ids=str)
def test_fused_linear_cross_entropy_loss_grad(rng, backend, dtype, bt, h, v, mode, ls, packed):
    x, w, masked, mt, grad, m, s, sm = _flce_problem(rng, bt, h, v, dtype)
    mask = N.pack_mask(masked, padding_bit=True) if packed else masked
    kw = dict(label_smoothing=ls)
    if mode == "memory-saving":
        kw.update(logits_max=m, sum_exp_logits=s)
    else:
        kw.update(softmax=sm)
    got = _run(backend, fg.fused_linear_cross_entropy_loss_grad, grad, x, w, mask, mt, **kw)
    N.check_fused_linear_cross_entropy_loss_grad(got, grad, x, w, mask, mt, **kw)


# ---------------------------------------------------------------------------------------------
# PyTorch float64 autograd: checks the oracles themselves, and fastgrad's fp32 path
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted,ls", [(False, 0.0), (True, 0.0), (True, 0.25), (False, 0.1)])
def test_torch_cross_entropy(rng, reduction, weighted, ls):
    torch = pytest.importorskip("torch")
    n, c = 9, 23
    z = rng.standard_normal((n, c))
    t = rng.integers(0, c, n)
    t[2] = -100
    w = rng.uniform(0.2, 2, c) if weighted else None
    g = rng.uniform(0.1, 2, n) if reduction == "none" else np.array(0.7)
    zt = torch.tensor(z, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(zt, torch.tensor(t), weight=None if w is None else torch.tensor(w),
                                             reduction=reduction, label_smoothing=ls)
    (gz,) = torch.autograd.grad(loss, zt, torch.tensor(g))
    lp = torch.log_softmax(torch.tensor(z), -1).numpy()
    ref = N.cross_entropy_loss_grad(g, lp, t, w, reduction, label_smoothing=ls)
    np.testing.assert_allclose(ref, gz.numpy(), rtol=1e-12, atol=1e-14)          # the oracle
    got = fg.cross_entropy_loss_grad(g.astype(np.float32), lp.astype(np.float32), t,
                                     None if w is None else w.astype(np.float32), reduction,
                                     label_smoothing=ls)
    N.check_cross_entropy_loss_grad(got, g.astype(np.float32), lp.astype(np.float32), t,
                                    None if w is None else w.astype(np.float32), reduction,
                                    label_smoothing=ls)


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_torch_scaled_masked_softmax(rng, scale):
    torch = pytest.importorskip("torch")
    shape = (2, 3, 5, 19)
    x = torch.tensor(rng.standard_normal(shape), requires_grad=True)
    mask = rng.random((2, 1, 5, 19)) < 0.3
    mask[..., 0] = False                                         # no fully masked row
    y = torch.softmax((x * scale).masked_fill(torch.tensor(mask), float("-inf")), -1)
    go = rng.standard_normal(shape)
    (gx,) = torch.autograd.grad(y, x, torch.tensor(go))
    ref = N.scaled_masked_softmax_backward(go, y.detach().numpy(), mask, scale)
    np.testing.assert_allclose(ref, gx.numpy(), rtol=1e-12, atol=1e-15)
    got = fg.scaled_masked_softmax_backward(go.astype(np.float32), y.detach().numpy().astype(np.float32),
                                            mask, scale)
    N.check_scaled_masked_softmax_backward(got, go.astype(np.float32), y.detach().numpy().astype(np.float32),
                                           mask, scale)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("beta", [1.0, 0.3, 0.0])
def test_torch_smooth_l1(rng, reduction, beta):
    torch = pytest.importorskip("torch")
    x = (rng.standard_normal((4, 9)) * 2).astype(np.float32)
    t = rng.standard_normal((4, 9)).astype(np.float32)
    x[0, 0] = t[0, 0]                                           # d = 0: autograd gives 0 at beta 0
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    loss = torch.nn.functional.smooth_l1_loss(xt, torch.tensor(t.astype(np.float64)), reduction=reduction,
                                              beta=beta)
    g = rng.uniform(0.5, 2, (4, 9)) if reduction == "none" else np.array(1.3)
    (gx,) = torch.autograd.grad(loss, xt, torch.tensor(g))
    ref = N.smooth_l1_loss_backward(g, x, t, reduction, beta, tbe=False)  # the 950 DAG: PyTorch's d/β
    # ... but for beta < 1e-6 the 950's 1/beta is NaN: at beta = 0 the tensor DAG's zone |d| <= 0
    # (d = 0, a per-element grad) is NaN where PyTorch gives 0 (row 5a); everywhere else PyTorch's
    zone = np.zeros(ref.shape, bool)
    if beta == 0.0 and reduction == "none":
        zone[0, 0] = True
    assert np.array_equal(np.isnan(ref), zone)
    np.testing.assert_allclose(ref[~zone], gx.numpy()[~zone], rtol=1e-6, atol=0)   # the oracle's d is fp32
    got = fg.smooth_l1_loss_backward(g.astype(np.float32), x, t, reduction, beta)  # A2/A3: the TBE kernel
    N.check_smooth_l1_loss_backward(got, g.astype(np.float32), x, t, reduction, beta)
    with fg.soc_version("Ascend950"):
        got = fg.smooth_l1_loss_backward(g.astype(np.float32), x, t, reduction, beta)
    N.check_smooth_l1_loss_backward(got, g.astype(np.float32), x, t, reduction, beta, tbe=False)


@pytest.mark.parametrize("padding_idx,scale", [(-1, False), (2, False), (-1, True), (4, True)])
def test_torch_embedding(rng, padding_idx, scale):
    torch = pytest.importorskip("torch")
    nw, d = 11, 6
    idx = rng.integers(0, nw, (5, 7))
    wt = torch.zeros(nw, d, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.embedding(torch.tensor(idx), wt, padding_idx=None if padding_idx < 0 else padding_idx,
                                        scale_grad_by_freq=scale)
    go = rng.standard_normal((5, 7, d))
    (gw,) = torch.autograd.grad(out, wt, torch.tensor(go))
    ref = N.embedding_dense_backward(go, idx, nw, padding_idx, scale)
    np.testing.assert_allclose(ref, gw.numpy(), rtol=1e-12, atol=1e-14)
    got = fg.embedding_dense_backward(go.astype(np.float32), idx, nw, padding_idx, scale)
    N.check_embedding_dense_backward(got, go.astype(np.float32), idx, nw, padding_idx, scale)


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_torch_linear_cross_entropy(rng, ls):
    """World size 1: the FLCE oracle (g unrounded, fp32 input) equals autograd of
    cross_entropy(x @ wᵀ) weighted by grad; fastgrad's fp32 path is within the oracle's bound."""
    torch = pytest.importorskip("torch")
    bt, h, v = 9, 7, 41
    x, w, _, t, grad, m, s, sm = _flce_problem(rng, bt, h, v, F32, owned=1.0)
    masked = np.zeros(bt, bool)
    # Megatron's g[t] -= 1-s, g[:] -= s/K is torch's uniform smoothing with ε = s = α·K/(K-1)
    eps = N.megatron_smoothing(ls, v) if ls else 0.0
    xt = torch.tensor(N.f64(x), requires_grad=True)
    wt = torch.tensor(N.f64(w), requires_grad=True)
    loss = torch.nn.functional.cross_entropy(xt @ wt.T, torch.tensor(t), reduction="none", label_smoothing=eps)
    (loss * torch.tensor(N.f64(grad))).sum().backward()
    lg = N.f64(x) @ N.f64(w).T
    m64 = lg.max(1)
    s64 = np.exp(lg - m64[:, None]).sum(1)
    g = N.flce_g(grad, x, w, masked, t, ls, m64, s64)
    np.testing.assert_allclose(g @ N.f64(w), xt.grad.numpy(), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(g.T @ N.f64(x), wt.grad.numpy(), rtol=1e-10, atol=1e-13)
    got = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, t, ls, logits_max=m, sum_exp_logits=s)
    N.check_fused_linear_cross_entropy_loss_grad(got, grad, x, w, masked, t, ls, logits_max=m, sum_exp_logits=s)


def test_torch_online_max_sum_and_loss(rng):
    """fp32 logits: the forward + loss oracles give torch's cross_entropy in float64."""
    torch = pytest.importorskip("torch")
    bt, h, v = 8, 5, 23
    x, w = _randn(rng, (bt, h), F32), _randn(rng, (v, h), F32)
    t = rng.integers(0, v, bt)
    r = N.fused_linear_online_max_sum(x, w, t, 0, v, logits_dtype=np.float64)
    loss, _ = N.fused_cross_entropy_loss_with_max_sum(r["logits_max_local"], r["sum_exp_logits_local"],
                                                      r["predicted_logits_local"])
    ref = torch.nn.functional.cross_entropy(torch.tensor(N.f64(x) @ N.f64(w).T), torch.tensor(t),
                                            reduction="none").numpy()
    np.testing.assert_allclose(loss, ref, rtol=1e-12, atol=1e-13)
    got = fg.fused_linear_online_max_sum(x, w, t, 0, v)
    gl, _ = fg.fused_cross_entropy_loss_with_max_sum(got.logits_max_local, got.sum_exp_logits_local,
                                                     got.predicted_logits_local)
    N.assert_matches(gl, ref, F32, mag=np.abs(ref) + np.abs(N.f64(got.logits_max_local)) + 1, k32=v + 4 * h)
