"""fused_linear_cross_entropy_loss_grad: against PyTorch autograd (float64), the float64 golden,
the companion forward, sharding, masks, modes, errors, threads, memory."""

import tracemalloc

import numpy as np
import pytest
from flce_helpers import BF16, DTYPES, F16, F32, assert_close_dtype, make_problem, pack, stats64

import fastgrad as fg
from fastgrad import tiling

torch = pytest.importorskip("torch")
F = torch.nn.functional

SHAPES = [(1, 1, 1), (7, 13, 300), (37, 19, 257), (130, 5, 1031)]


def torch_grads(x, w, t, grad, label_smoothing=0.0):
    """Autograd of cross_entropy(x @ w.T, t, reduction='none') weighted by grad, in float64."""
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    wt = torch.tensor(w.astype(np.float64), requires_grad=True)
    loss = F.cross_entropy(xt @ wt.T, torch.tensor(t), reduction="none",
                           label_smoothing=label_smoothing)
    (loss * torch.tensor(grad.astype(np.float64))).sum().backward()
    return xt.grad.numpy(), wt.grad.numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_torch_autograd_world_size_1(rng, dtype, shape):
    BT, H, V = shape
    x, w, t, _, grad = make_problem(rng, BT, H, V, dtype)
    m, s = stats64(x, w)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(np.zeros(BT, bool)), t,
                                                     logits_max=m, sum_exp_logits=s)
    assert gi.dtype == dtype and gw.dtype == dtype
    assert gi.shape == (BT, H) and gw.shape == (V, H)
    ti, tw = torch_grads(x, w, t, grad)
    assert_close_dtype(gi, ti, dtype, what="grad_input")
    assert_close_dtype(gw, tw, dtype, what="grad_weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_golden_over_many_tiles(rng, dtype):
    """A tiny budget forces many (bt, v) tiles, incl. ragged edge tiles; equals the golden."""
    BT, H, V = 300, 24, 1100
    x, w, t, masked, grad = make_problem(rng, BT, H, V, dtype, owned_frac=0.7)
    m, s = stats64(x, w)
    plan = tiling.plan_linear_cross_entropy(BT, V, H, budget_bytes=200_000)
    assert plan.n_bt_tiles > 1 and plan.n_v_tiles > 1
    assert V % plan.v_tile != 0 and BT % plan.bt_tile != 0
    args = (grad, x, w, pack(masked), t)
    kw = dict(logits_max=m, sum_exp_logits=s)
    tiling.set_workspace_budget(200_000)
    try:
        gi, gw = fg.fused_linear_cross_entropy_loss_grad(*args, **kw)
    finally:
        tiling.set_workspace_budget(None)
    with fg.use_backend("reference"):
        ri, rw = fg.fused_linear_cross_entropy_loss_grad(*args, **kw)
    assert_close_dtype(gi, ri.astype(np.float64), dtype, what="grad_input")
    assert_close_dtype(gw, rw.astype(np.float64), dtype, what="grad_weight")
    gi2, gw2 = fg.fused_linear_cross_entropy_loss_grad(*args, **kw)   # one big tile
    assert_close_dtype(gi2, gi.astype(np.float64), dtype, what="tiling-independent grad_input")


def test_g_is_rounded_to_input_dtype_before_the_gemms(rng):
    """With one row and one vocab entry per output element the only error left is the device's
    rounding of g to bf16: grad_weight must equal round_bf16(round_bf16(g)·x) exactly."""
    H, V = 4, 3
    x = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32).astype(BF16)
    w = (rng.standard_normal((V, H)) * 0.3).astype(np.float32).astype(BF16)
    t = np.array([1])
    grad = np.array([0.3331], np.float32)
    m, s = stats64(x, w)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(np.zeros(1, bool)), t,
                                                     logits_max=m, sum_exp_logits=s)
    L = x.astype(np.float32) @ w.astype(np.float32).T
    p = np.exp(L - m[:, None]) / s[:, None]
    p[0, 1] -= 1
    g = (p * grad[:, None]).astype(np.float32).astype(BF16).astype(np.float32)
    expect = (g.T @ x.astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(gw.view(np.uint16), expect.view(np.uint16))


def test_shards_combined_give_unsharded_result(rng):
    """Two shards through the companion forward, combined as docs/spec.md says: loss and both
    gradients equal the unsharded computation (and PyTorch autograd)."""
    BT, H, V = 45, 16, 203
    bounds = [0, 97, V]
    x, w, t, _, grad = make_problem(rng, BT, H, V, F32)
    outs = [fg.fused_linear_online_max_sum(x, w[a:b], t, a, b) for a, b in zip(bounds, bounds[1:])]
    gmax = np.max([o.logits_max_local for o in outs], axis=0)
    gsum = sum(o.sum_exp_logits_local * np.exp(o.logits_max_local - gmax) for o in outs)
    owned = [~np.unpackbits(o.target_mask, bitorder="little")[:BT].astype(bool) for o in outs]
    gpred = sum(o.predicted_logits_local + (o.logits_max_local - gmax) * ow for o, ow in zip(outs, owned))
    assert np.all(sum(ow.astype(int) for ow in owned) == 1)
    loss, _ = fg.fused_cross_entropy_loss_with_max_sum(gmax, gsum.astype(np.float32), gpred.astype(np.float32))
    full = fg.fused_linear_online_max_sum(x, w, t, 0, V)
    loss_full, _ = fg.fused_cross_entropy_loss_with_max_sum(full.logits_max_local, full.sum_exp_logits_local,
                                                            full.predicted_logits_local)
    ref = F.cross_entropy(torch.tensor(x, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64).T,
                          torch.tensor(t), reduction="none").numpy()
    np.testing.assert_allclose(loss, loss_full, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-5)
    gi = np.zeros((BT, H), np.float64)
    gws = []
    for (a, b), o in zip(zip(bounds, bounds[1:]), outs):
        gi_k, gw_k = fg.fused_linear_cross_entropy_loss_grad(
            grad, x, w[a:b], o.target_mask, o.masked_target,
            logits_max=gmax.astype(np.float32), sum_exp_logits=gsum.astype(np.float32))
        gi += gi_k
        gws.append(gw_k)
    ti, tw = torch_grads(x, w, t, grad)
    np.testing.assert_allclose(gi, ti, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate(gws), tw, rtol=1e-5, atol=1e-6)


def test_bool_and_packed_masks_agree_and_masked_rows_subtract_nothing(rng):
    BT, H, V = 29, 8, 140
    x, w, t, masked, grad = make_problem(rng, BT, H, V, BF16, owned_frac=0.5)
    assert masked.any() and (~masked).any()
    m, s = stats64(x, w)
    mt = np.where(masked, rng.integers(-5, 2 * V, BT), t)     # garbage where masked
    kw = dict(logits_max=m, sum_exp_logits=s)
    a = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), mt, **kw)
    b = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, mt.astype(np.int32), **kw)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u.view(np.uint16), v.view(np.uint16))
    # masked rows: g = softmax · grad only, as if the target were in another shard
    with fg.use_backend("reference"):
        r = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, np.where(masked, -1, t), **kw)
    for u, v in zip(a, r):
        assert_close_dtype(u, v.astype(np.float64), BF16)
    # an unmasked row whose masked_target is outside [0, V) subtracts nothing either
    mt2 = t.copy()
    mt2[0], mt2[1] = V, -3
    nm = np.zeros(BT, bool)
    c = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, nm, mt2, **kw)
    nm2 = nm.copy()
    nm2[:2] = True
    d = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, nm2, mt2, **kw)
    for u, v in zip(c, d):
        np.testing.assert_array_equal(u.view(np.uint16), v.view(np.uint16))


def test_packed_mask_longer_than_needed(rng):
    BT, H, V = 9, 4, 20
    x, w, t, masked, grad = make_problem(rng, BT, H, V, F16, owned_frac=0.5)
    m, s = stats64(x, w)
    p = np.concatenate([pack(masked), [0xFF, 0x00]]).astype(np.uint8)
    a = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, p, t, logits_max=m, sum_exp_logits=s)
    b = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, t, logits_max=m, sum_exp_logits=s)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u.view(np.uint16), v.view(np.uint16))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_high_performance_mode_matches_memory_saving_and_keeps_softmax(rng, dtype):
    BT, H, V = 33, 12, 300
    x, w, t, masked, grad = make_problem(rng, BT, H, V, dtype, owned_frac=0.8)
    m, s = stats64(x, w)
    L = x.astype(np.float64) @ w.astype(np.float64).T
    softmax = (np.exp(L - m[:, None].astype(np.float64)) / s[:, None]).astype(np.float32)
    before = softmax.copy()
    hp = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, softmax=softmax)
    np.testing.assert_array_equal(softmax, before)
    ms = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, logits_max=m, sum_exp_logits=s)
    with fg.use_backend("reference"):
        ref = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, softmax=softmax)
    for a, b, r in zip(hp, ms, ref):
        assert_close_dtype(a, r.astype(np.float64), dtype)
        assert_close_dtype(a, b.astype(np.float64), dtype)
    # logits_max / sum_exp_logits are ignored when softmax is given
    hp2 = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, softmax=softmax,
                                                  logits_max=m * 0 + 5, sum_exp_logits=s * 9)
    for a, b in zip(hp, hp2):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_label_smoothing_extension_is_megatrons(rng):
    """Megatron's α with K = V equals PyTorch's label_smoothing s = α·K/(K-1) at world size 1."""
    BT, H, V = 21, 10, 50
    alpha = 0.1
    x, w, t, _, grad = make_problem(rng, BT, H, V, F32)
    m, s = stats64(x, w)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, np.zeros(BT, bool), t, alpha,
                                                     logits_max=m, sum_exp_logits=s)
    ti, tw = torch_grads(x, w, t, grad, label_smoothing=alpha * V / (V - 1))
    np.testing.assert_allclose(gi, ti, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, tw, rtol=1e-5, atol=1e-6)
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(grad, x.astype(BF16), w.astype(BF16), np.zeros(BT, bool),
                                                t, alpha, logits_max=m, sum_exp_logits=s)
    assert e.value.status == 161002 and "label_smoothing" in str(e.value)


def test_torch_tensors_in_and_out_bf16(rng):
    BT, H, V = 17, 8, 64
    x, w, t, masked, grad = make_problem(rng, BT, H, V, BF16)
    m, s = stats64(x, w)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    wt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(torch.from_numpy(grad), xt, wt,
                                                     torch.from_numpy(pack(masked)), torch.from_numpy(t),
                                                     logits_max=torch.from_numpy(m),
                                                     sum_exp_logits=torch.from_numpy(s))
    assert isinstance(gi, torch.Tensor) and gi.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    ni, nw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, logits_max=m, sum_exp_logits=s)
    np.testing.assert_array_equal(gi.view(torch.int16).numpy(), ni.view(np.int16))
    np.testing.assert_array_equal(gw.view(torch.int16).numpy(), nw.view(np.int16))
    # out= with torch tensors is filled in place and returned
    oi = torch.empty((BT, H), dtype=torch.bfloat16)
    ow = torch.empty((V, H), dtype=torch.bfloat16)
    ri, rw = fg.fused_linear_cross_entropy_loss_grad(torch.from_numpy(grad), xt, wt, torch.from_numpy(masked),
                                                     torch.from_numpy(t), logits_max=torch.from_numpy(m),
                                                     sum_exp_logits=torch.from_numpy(s), out=(oi, ow))
    assert ri is oi and rw is ow
    np.testing.assert_array_equal(oi.view(torch.int16).numpy(), ni.view(np.int16))


def test_non_contiguous_inputs_and_out(rng):
    BT, H, V = 19, 6, 90
    x, w, t, masked, grad = make_problem(rng, BT, H, V, F16)
    m, s = stats64(x, w)
    xs = np.asfortranarray(x)
    ws = np.repeat(w, 2, axis=0)[::2]
    gs = np.repeat(grad, 3)[::3]
    ts = np.repeat(t, 2)[::2]
    assert not xs.flags.c_contiguous and not ws.flags.c_contiguous and not gs.flags.c_contiguous
    a = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, t, logits_max=m, sum_exp_logits=s)
    oi = np.zeros((H, BT), F16).T
    ow = np.zeros((V, 2 * H), F16)[:, ::2]
    b = fg.fused_linear_cross_entropy_loss_grad(gs, xs, ws, masked, ts, logits_max=np.repeat(m, 2)[::2],
                                                sum_exp_logits=s, out=(oi, ow))
    assert b[0] is oi and b[1] is ow
    np.testing.assert_array_equal(a[0].view(np.uint16), oi.view(np.uint16))
    np.testing.assert_array_equal(a[1].view(np.uint16), ow.view(np.uint16))


def test_inputs_are_not_modified(rng):
    BT, H, V = 11, 5, 40
    x, w, t, masked, grad = make_problem(rng, BT, H, V, BF16)
    m, s = stats64(x, w)
    sm = np.full((BT, V), 1.0 / V, np.float32)
    args = [grad, x, w, pack(masked), t, m, s, sm]
    copies = [a.copy() for a in args]
    fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, logits_max=m, sum_exp_logits=s)
    fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, softmax=sm)
    for a, c in zip(args, copies):
        np.testing.assert_array_equal(a.view(np.uint8), c.view(np.uint8))


def test_empty_inputs(rng):
    H, V = 4, 10
    x = np.zeros((0, H), BF16)
    w = np.ones((V, H), BF16)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(np.zeros(0, np.float32), x, w, np.zeros(0, np.uint8),
                                                     np.zeros(0, np.int64), logits_max=np.zeros(0, np.float32),
                                                     sum_exp_logits=np.zeros(0, np.float32))
    assert gi.shape == (0, H) and gw.shape == (V, H)
    assert not np.any(gw.astype(np.float32))
    # strict mode: the device returns success and leaves out= untouched
    ow = np.full((V, H), 7, BF16)
    with fg.strict():
        fg.fused_linear_cross_entropy_loss_grad(np.zeros(0, np.float32), x, w, np.zeros(0, np.uint8),
                                                np.zeros(0, np.int64), logits_max=np.zeros(0, np.float32),
                                                sum_exp_logits=np.zeros(0, np.float32),
                                                out=(np.zeros((0, H), BF16), ow))
    assert np.all(ow.astype(np.float32) == 7)


def test_bitwise_identical_for_1_and_2_threads(rng):
    BT, H, V = 260, 64, 3000
    x, w, t, masked, grad = make_problem(rng, BT, H, V, BF16, owned_frac=0.9)
    m, s = stats64(x, w)
    res = []
    for n in (1, 2, 1):
        with fg.num_threads(n):
            res.append(fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t,
                                                               logits_max=m, sum_exp_logits=s))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_memory_does_not_grow_with_bt_times_v(rng):
    """Peak NumPy allocation beyond inputs/outputs stays at the plan's workspace, far below the
    [BT, V] fp32 matrix it avoids (tracemalloc sees NumPy's allocations)."""
    BT, H, V = 512, 32, 20000
    x, w, t, masked, grad = make_problem(rng, BT, H, V, BF16)
    m, s = stats64(x, w)
    oi = np.empty((BT, H), BF16)
    ow = np.empty((V, H), BF16)
    budget = 2 * 2**20
    plan = tiling.plan_linear_cross_entropy(BT, V, H, budget_bytes=budget)
    tiling.set_workspace_budget(budget)
    try:
        fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, logits_max=m, sum_exp_logits=s,
                                                out=(oi, ow))  # warm-up (compilation)
        tracemalloc.start()
        fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(masked), t, logits_max=m, sum_exp_logits=s,
                                                out=(oi, ow))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        tiling.set_workspace_budget(None)
    logits_bytes = 4 * BT * V
    assert plan.workspace_bytes < logits_bytes / 4
    assert peak < plan.workspace_bytes + 1.5 * 2**20, (peak, plan.workspace_bytes)
    assert peak < logits_bytes / 4


def test_plan_is_shape_driven_and_bounded():
    p1 = tiling.plan_linear_cross_entropy(2048, 151936, 896)
    p2 = tiling.plan_linear_cross_entropy(2048, 10 * 151936, 896)
    assert p1.workspace_bytes == p2.workspace_bytes          # independent of V
    assert p1.workspace_bytes <= tiling.workspace_budget() + 2 * 4 * 2048 * 896
    assert p1.v_tile % tiling.BASE_V == 0 and p1.n_v_tiles * p1.v_tile >= 151936
    assert list(p1.tiles())[0] == (0, 2048, 0, p1.v_tile)
    assert p1.logits_bytes_avoided == 4 * 2048 * 151936


def test_seed_sample_high_performance_bf16_zeros():
    """Seed 000's C++ sample: BT = V = H = 1024, bf16 zeros, fp32 zero softmax and grad, int32
    masked_target, uint8 target_mask of length BT -> inputGradOut zeros."""
    n = 1024
    z16 = np.zeros((n, n), BF16)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(np.zeros(n, np.float32), z16, z16, np.zeros(n, np.uint8),
                                                     np.zeros(n, np.int32), 0.0, None, None,
                                                     np.zeros((n, n), np.float32))
    assert gi.shape == (n, n) and gw.shape == (n, n)
    assert not np.any(gi.view(np.uint16)) and not np.any(gw.view(np.uint16))


# ---------------------------------------------------------------- errors (aclnnFusedLinearCrossEntropyLossGrad.md's table)

def _good(rng, dtype=BF16):
    BT, H, V = 10, 4, 130
    x, w, t, masked, grad = make_problem(rng, BT, H, V, dtype)
    m, s = stats64(x, w)
    return dict(grad=grad, input=x, weight=w, target_mask=pack(masked), masked_target=t,
                logits_max=m, sum_exp_logits=s)


BAD = [
    # (mutation, status, parameter named in the message)
    (lambda k: k.update(grad=None), 161001, "grad"),
    (lambda k: k.update(input=None), 161001, "input"),
    (lambda k: k.update(weight=None), 161001, "weight"),
    (lambda k: k.update(target_mask=None), 161001, "target_mask"),
    (lambda k: k.update(masked_target=None), 161001, "masked_target"),
    (lambda k: k.update(logits_max=None), 161001, "logits_max"),
    (lambda k: k.update(sum_exp_logits=None), 161001, "sum_exp_logits"),
    (lambda k: k.update(grad=k["grad"].astype(np.float16)), 161002, "grad"),
    (lambda k: k.update(input=k["input"].astype(np.float64)), 161002, "input"),
    (lambda k: k.update(weight=k["weight"].astype(np.float16)), 161002, "weight"),
    (lambda k: k.update(target_mask=k["target_mask"].astype(np.int32)), 161002, "target_mask"),
    (lambda k: k.update(masked_target=k["masked_target"].astype(np.float32)), 161002, "masked_target"),
    (lambda k: k.update(logits_max=k["logits_max"].astype(np.float64)), 161002, "logits_max"),
    (lambda k: k.update(sum_exp_logits=k["sum_exp_logits"].astype(np.float16)), 161002, "sum_exp_logits"),
    (lambda k: k.update(grad=k["grad"][None]), 161002, "grad"),
    (lambda k: k.update(input=k["input"][None]), 161002, "input"),
    (lambda k: k.update(weight=k["weight"][0]), 161002, "weight"),
    (lambda k: k.update(input=k["input"][:-1]), 161002, "input"),
    (lambda k: k.update(weight=k["weight"][:, :-1]), 161002, "weight"),
    (lambda k: k.update(target_mask=k["target_mask"][:1]), 161002, "target_mask"),
    (lambda k: k.update(target_mask=np.zeros(9, bool)), 161002, "target_mask"),
    (lambda k: k.update(masked_target=k["masked_target"][:-1]), 161002, "masked_target"),
    (lambda k: k.update(logits_max=k["logits_max"][:-1]), 161002, "logits_max"),
    (lambda k: k.update(sum_exp_logits=k["sum_exp_logits"][:, None]), 161002, "sum_exp_logits"),
    (lambda k: k.update(softmax=np.zeros((10, 129), np.float32)), 161002, "softmax"),
    (lambda k: k.update(softmax=np.zeros((10, 130), np.float16)), 161002, "softmax"),
    (lambda k: k.update(label_smoothing=float("nan")), 161002, "label_smoothing"),
    (lambda k: k.update(label_smoothing="0.1"), 161002, "label_smoothing"),
]


@pytest.mark.parametrize("mutate,status,param", BAD)
def test_bad_input_raises_status_and_leaves_out_untouched(rng, mutate, status, param):
    kw = _good(rng)
    mutate(kw)
    oi = np.full((10, 4), 3, BF16)
    ow = np.full((130, 4), 3, BF16)
    with pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(**kw, out=(oi, ow))
    assert e.value.status == status
    assert param in str(e.value)
    assert np.all(oi.astype(np.float32) == 3) and np.all(ow.astype(np.float32) == 3)


@pytest.mark.parametrize("which,bad", [(0, np.zeros((10, 4), np.float16)), (1, np.zeros((130, 5), BF16)),
                                       (0, np.zeros((10, 4), BF16)[:, :0])])
def test_bad_out_raises_161002(rng, which, bad):
    kw = _good(rng)
    good = [np.full((10, 4), 3, BF16), np.full((130, 4), 3, BF16)]
    good[which] = bad
    with pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(**kw, out=tuple(good))
    assert e.value.status == 161002 and "out" in str(e.value)
    assert np.all(good[1 - which].astype(np.float32) == 3)


def test_strict_mode_rejects_what_the_device_rejects(rng):
    kw = _good(rng)
    with fg.strict():
        with pytest.raises(fg.AclnnError) as e:    # fp32 input is an extension
            k = dict(kw, input=kw["input"].astype(np.float32), weight=kw["weight"].astype(np.float32))
            fg.fused_linear_cross_entropy_loss_grad(**k)
        assert e.value.status == 161002
        small = dict(kw, weight=kw["weight"][:100], softmax=np.zeros((10, 100), np.float32))
        with pytest.raises(fg.AclnnError) as e:    # V < 128 in high-performance mode
            fg.fused_linear_cross_entropy_loss_grad(**small)
        assert e.value.status == 161002 and "weight" in str(e.value)
        fg.fused_linear_cross_entropy_loss_grad(**kw)   # the device's own case passes
    fg.fused_linear_cross_entropy_loss_grad(**small)    # outside strict mode: computed


def test_unknown_or_unavailable_backend_raises_361001(rng):
    with pytest.raises(fg.AclnnError) as e:
        fg.set_backend("no-such-backend")
    assert e.value.status == 361001
    if "acl" not in fg.available_backends():
        with pytest.raises(fg.AclnnError) as e:
            with fg.use_backend("acl"):
                pass
        assert e.value.status == 361001
        assert fg.available_backends(with_reasons=True)["acl"]


def test_fp32_grad_input_out_is_the_unrounded_accumulator(rng):
    BT, H, V = 15, 9, 77
    x, w, t, masked, grad = make_problem(rng, BT, H, V, BF16)
    m, s = stats64(x, w)
    oi = np.empty((BT, H), np.float32)
    ow = np.empty((V, H), BF16)
    fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, t, logits_max=m, sum_exp_logits=s, out=(oi, ow))
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, t, logits_max=m, sum_exp_logits=s)
    np.testing.assert_array_equal(oi.astype(BF16).view(np.uint16), gi.view(np.uint16))
    assert np.any(oi != oi.astype(BF16).astype(np.float32))      # really unrounded
    np.testing.assert_array_equal(ow.view(np.uint16), gw.view(np.uint16))
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(grad, x, w, masked, t, logits_max=m, sum_exp_logits=s,
                                                out=(oi, ow))
    assert e.value.status == 161002


# ---------------------------------------------------------------- issue 25 point 7: as the device takes them

def _hp_case(rng, BT=6, H=4, V=130, dtype=BF16):
    x, w, t, masked, grad = make_problem(rng, BT, H, V, dtype)
    m, s = stats64(x, w)
    L = x.astype(np.float64) @ w.astype(np.float64).T
    sm = (np.exp(L - m[:, None]) / s[:, None]).astype(np.float32)
    return dict(grad=grad, input=x, weight=w, target_mask=pack(masked), masked_target=t, softmax=sm)


@pytest.mark.parametrize("strict", [False, True])
def test_softmax_given_ignores_logits_max_and_sum_exp_logits(rng, strict):
    # op_api :101-106, :152-157, :204-209 check them only when softmax is None
    kw = _hp_case(rng)
    with fg.strict(strict):
        ref = fg.fused_linear_cross_entropy_loss_grad(**kw)
        for lm, se in ((np.float32(0.0), np.float32(0.0)), (np.zeros((), np.float32), np.zeros(3, np.int8)),
                       (np.zeros((2, 2), np.float64), None), (None, np.ones(99, np.float16))):
            gi, gw = fg.fused_linear_cross_entropy_loss_grad(**kw, logits_max=lm, sum_exp_logits=se)
            np.testing.assert_array_equal(gi.view(np.uint16), ref[0].view(np.uint16))
            np.testing.assert_array_equal(gw.view(np.uint16), ref[1].view(np.uint16))


def _tiling_case(BT, H, V, hp):
    z = lambda *s: np.zeros(s, BF16)  # noqa: E731
    kw = dict(grad=np.zeros(BT, np.float32), input=z(BT, H), weight=z(V, H), target_mask=np.zeros(BT, bool),
              masked_target=np.zeros(BT, np.int32))
    if hp:
        kw["softmax"] = np.zeros((BT, V), np.float32)
    else:
        kw.update(logits_max=np.zeros(BT, np.float32), sum_exp_logits=np.ones(BT, np.float32))
    return kw


@pytest.mark.parametrize("BT,H,V,hp,param", [
    (1, 65536, 1, False, "input"),          # H > 65535, memory-saving (tiling :527-530)
    (1, 65536, 128, True, "input"),         # H > 65535, high-performance (:237-240)
    (65601, 1, 128, True, "grad"),          # ceil16(BT) - (BT % 64) = 65615 > 65535 (:220-223)
    (65537, 1, 128, True, "grad"),          # 65552 - 1 = 65551
    (65600, 1, 128, True, "grad"),          # 65600 - 64 = 65536
    (1, 1, 65281, True, "weight"),          # V > 65280 (:231-235)
    (1, 1, 24561, True, "weight"),          # a softmax row over half the 192 KiB UB (:181-182, :242-246)
])
def test_strict_rejects_what_the_tiling_rejects_with_inner_nullptr(BT, H, V, hp, param):
    kw = _tiling_case(BT, H, V, hp)
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(**kw)
    assert e.value.status == 561103 and param in str(e.value)


@pytest.mark.parametrize("BT,H,V,hp", [(1, 65535, 1, False), (65536, 1, 128, True), (1, 1, 24560, True)])
def test_strict_accepts_the_tiling_bounds(BT, H, V, hp):
    with fg.strict():
        gi, gw = fg.fused_linear_cross_entropy_loss_grad(**_tiling_case(BT, H, V, hp))
    assert gi.shape == (BT, H) and gw.shape == (V, H)


def test_ascend950_strict_refuses_with_the_op_apis_runtime_error(rng):
    kw = _good(rng)
    with fg.soc_version("Ascend950"):
        fg.fused_linear_cross_entropy_loss_grad(**kw)  # outside strict mode: computed
        with fg.strict():
            with pytest.raises(fg.AclnnError) as e:     # aclnn_..._loss_grad.cpp:215-223, 317
                fg.fused_linear_cross_entropy_loss_grad(**kw)
            assert e.value.status == 361001 and "Ascend950" in str(e.value)
            # the empty-tensor return comes first (:289-294)
            fg.fused_linear_cross_entropy_loss_grad(**dict(kw, input=kw["input"][:, :0], weight=kw["weight"][:, :0]))


def test_high_performance_over_several_row_tiles_matches_memory_saving(rng):
    # the high-performance epilogue ran over softmax.shape[0] rows of each row tile (out of
    # bounds past the first tile: a crash at BT = 20000); it runs over the tile's rows
    BT, H, V = 0, 3, 130
    bt_tile = tiling.plan_linear_cross_entropy(4096, V, H, mode="high_performance", widen=True).bt_tile
    BT = 2 * bt_tile + 5
    kw = _hp_case(rng, BT=BT, H=H, V=V)
    assert tiling.plan_linear_cross_entropy(BT, V, H, mode="high_performance", widen=True).n_tiles > 1
    hp = fg.fused_linear_cross_entropy_loss_grad(**kw)
    x, w = kw["input"], kw["weight"]
    m, s = stats64(x, w)
    ms = fg.fused_linear_cross_entropy_loss_grad(**{k: v for k, v in kw.items() if k != "softmax"},
                                                 logits_max=m, sum_exp_logits=s)
    assert_close_dtype(hp[0], ms[0].astype(np.float64), BF16, what="grad_input")
    assert_close_dtype(hp[1], ms[1].astype(np.float64), BF16, what="grad_weight")


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # (NumPy's, on inf)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("filter_eps", [None, "auto"])
def test_a_zero_sum_exp_is_ieee_division(rng, dtype, filter_eps):
    """Found by fuzzing: ``sum_exp_logits`` 0 (or -0) in a row raised a plain ZeroDivisionError
    (Numba's Python error model).  The device divides (``docs/spec.md``: ``p = exp(logits -
    logits_max) / sum_exp_logits``): such a row's ``g`` is ±inf / NaN and spreads through the
    GEMMs, as in the float64 golden (the reference backend); the other rows are untouched."""
    BT, H, V = 9, 5, 70
    x, w, t, _, grad = make_problem(rng, BT, H, V, dtype)
    m, s = stats64(x, w)
    s[2], s[6] = 0.0, -0.0
    kw = dict(logits_max=m, sum_exp_logits=s, filter_eps=filter_eps)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(np.zeros(BT, bool)), t, **kw)
    with fg.use_backend("reference"), np.errstate(divide="ignore", invalid="ignore"):
        ri, rw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, pack(np.zeros(BT, bool)), t, **kw)
    gi, gw, ri, rw = (np.asarray(a, np.float64) for a in (gi, gw, ri, rw))
    for got, ref in ((gi, ri), (gw, rw)):
        assert not np.isfinite(got).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    ok = np.ones(BT, bool)
    ok[[2, 6]] = False
    assert np.isfinite(gi[ok]).all()
    np.testing.assert_allclose(gi[ok], ri[ok], rtol=2e-2 if dtype != F32 else 1e-5, atol=1e-6)
