"""Adversarial numerics of the LM-head family through the public API, against float64 oracles
written here from docs/spec.md (and PyTorch float64 autograd where the contract is PyTorch's),
importing nothing from fastgrad's kernels or goldens.

* ``fused_linear_online_max_sum``: inputs of small multiples of 1/4, so every logit is exact in
  fp32 (whatever the GEMM's order) and its rounding to the input dtype is the oracle's; the max,
  the target logit, the mask bytes (padding bits included), ``masked_target`` and the logits are
  then compared **bitwise**, the sum of exponentials within the exp's and the summation's error,
  NaN/±inf exactly.  Hostile values: NaN/±inf in input and weight, fp16 logits that overflow to
  ±inf, targets at 0, V-1, outside the shard and inside it beyond V, empty shards, one-row shards.
* ``fused_linear_cross_entropy_loss_grad``: the float64 ``g`` rounded once to the input dtype,
  then its two products, within the rounding of ``g`` and the fp32 accumulation (a forward-error
  bound on ``|p|+onehot`` so that cancellation at the target is covered), NaN/±inf exactly; both
  modes, label smoothing (Megatron's), NaN/±inf/0 in ``grad``, bool and packed masks with
  garbage past BT, out-of-range ``masked_target``; and PyTorch's autograd (world size 1).
* ``linear_cross_entropy`` (the training op): PyTorch float64 autograd with ``-inf`` biases,
  ignored rows, every row ignored, label smoothing, each reduction.

Each op is also held to its promises of equal bits: 1 vs 2 threads, the SoC profiles outside
strict mode, the native ISA settings (avx512 vs avx2 variants), ``out=`` buffers, and
many-tile vs one-tile plans where the result is not a sum over tiles (the online max, the target
logit, the logits; the sums agree within their rounding, with the same NaN/±inf).
"""

import ml_dtypes
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastgrad as fg  # noqa: E402
from fastgrad import _cpu  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [F32, F16, BF16]
U = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}  # unit roundoff
U32 = 2.0**-24
# the smallest positive subnormal (a g that underflows is off by up to half of it)
TINY = {F32: 2.0**-149, F16: 2.0**-24, BF16: 2.0**-133}

FUZZ = settings(max_examples=20, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SHAPES_BT = [1, 2, 7, 9, 33, 130]
SHAPES_H = [1, 2, 3, 16, 17]
SHAPES_V = [1, 2, 15, 16, 17, 31, 33, 127, 129, 1000, 4097]
LAYOUTS = ["C", "F", "neg", "strided"]
TINY_BUDGET = fg.Options(workspace_bytes=1)  # one 128 x 256 base block per tile, or less
ONE_TILE = fg.Options(workspace_bytes=1 << 30)


def relayout(a, kind):
    """The same values in another memory layout (a view where it can be one)."""
    a = np.asarray(a)
    if kind == "F" and a.ndim == 2:
        return np.asfortranarray(a)
    if kind == "neg":
        return np.flip(np.flip(a, 0).copy(), 0)
    if kind == "strided":
        big = np.zeros((2 * a.shape[0],) + a.shape[1:], a.dtype)
        big[::2] = a
        return big[::2]
    return a


def rnd(a64, dtype):
    """float64 values rounded to fp32, then to ``dtype`` (RNE, as ml_dtypes), back as float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(a64, np.float64).astype(np.float32).astype(dtype).astype(np.float64)


def f64(a):
    return np.asarray(a).astype(np.float32).astype(np.float64)


def quarters(rng, shape, dtype, lim=3):
    """Multiples of 1/4 in [-lim/4·4, lim]: every product and sum of a few is exact in fp32."""
    return (rng.integers(-4 * lim, 4 * lim + 1, shape) / 4.0).astype(np.float32).astype(dtype)


def inject(rng, a, p, values):
    """``a`` with a fraction ``p`` of its elements replaced by ``values`` (same dtype)."""
    a = np.array(a)
    hit = rng.random(a.shape) < p
    a[hit] = rng.choice(np.asarray(values, np.float32), hit.sum()).astype(a.dtype)
    return a


def same_bits(a, b, what=""):
    """Bitwise equal (any NaN equals any NaN), same dtype and shape."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.kind in "iub":
        np.testing.assert_array_equal(a, b, err_msg=what)
        return
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    nan = np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64))
    bad = (np.ascontiguousarray(a).view(u) != np.ascontiguousarray(b).view(u)) & ~nan
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} differ, e.g. {a[bad][:3]} vs {b[bad][:3]}"


def same_specials(got, ref, what=""):
    """NaN where the oracle has NaN, the oracle's ±inf where it has ±inf, finite elsewhere."""
    g, r = f64(got), np.asarray(ref, np.float64)
    assert g.shape == r.shape, (what, g.shape, r.shape)
    for f in (np.isnan, np.isposinf, np.isneginf):
        bad = f(g) != f(r)
        assert not bad.any(), f"{what}: {f.__name__} differs at {np.argwhere(bad)[:4].tolist()}: got {g[bad][:4]}, oracle {r[bad][:4]}"


def within(got, ref, tol, what=""):
    """Non-finite values as the oracle's; finite ones within ``tol`` (float64, elementwise)."""
    same_specials(got, ref, what)
    g, r = f64(got), np.asarray(ref, np.float64)
    fin = np.isfinite(r)
    with np.errstate(invalid="ignore"):
        err = np.abs(g - r)[fin]
    tl = np.broadcast_to(tol, r.shape)[fin]
    bad = ~(err <= tl)
    assert not bad.any(), (f"{what}: {bad.sum()} off, e.g. got {g[fin][bad][:3]}, oracle {r[fin][bad][:3]}, "
                           f"tol {tl[bad][:3]}")


# ---------------------------------------------------------------------------------------------
# fused_linear_online_max_sum
# ---------------------------------------------------------------------------------------------


def floms_oracle(x, w, t, start, end, ldt):
    """docs/spec.md, fused_linear_online_max_sum, in float64 (``x``, ``w`` of exact products)."""
    BT, V = x.shape[0], w.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        L = rnd(f64(x) @ f64(w).T, ldt)  # fp32 accumulation of exact products, rounded to ldt
    t = np.asarray(t, np.int64)
    masked = (t < start) | (t >= end)
    mt = np.where(masked, 0, t - start)
    nbytes = -(-BT // 8)
    bits = np.concatenate([masked, np.full(8 * nbytes - BT, (0 < start) | (0 >= end))])
    mask = np.packbits(bits, bitorder="little")
    if V == 0:
        return np.full(BT, -np.inf), np.zeros(BT), np.zeros(BT), mask, mt, L
    with np.errstate(invalid="ignore", over="ignore"):
        m = L.max(axis=1)  # NaN-propagating
        s = np.exp(L - m[:, None]).sum(axis=1)
        picked = np.where(mt < V, L[np.arange(BT), np.minimum(mt, V - 1)], 0.0)
        pred = np.where(masked, 0.0, picked - m)
    return m, s, pred, mask, mt, L


def check_floms(r, x, w, t, start, end, ldt, what=""):
    m, s, pred, mask, mt, L = floms_oracle(x, w, t, start, end, ldt)
    BT, V = x.shape[0], w.shape[0]
    same_bits(r.logits_max_local, m.astype(np.float32), what + " max")
    same_bits(r.predicted_logits_local, pred.astype(np.float32), what + " predicted")
    same_bits(r.target_mask, mask, what + " target_mask")
    same_bits(r.masked_target, mt.astype(np.asarray(t).dtype), what + " masked_target")
    # Σ of V positive terms each within ~2 ulps (exp) plus fp32 accumulation: γ_{V+2}
    within(r.sum_exp_logits_local, s, (V + 4) * U32 * np.abs(s) + 1e-44, what + " sum_exp")
    if r.vocab_parallel_logits is not None:
        assert r.vocab_parallel_logits.shape == (BT, V)
        same_bits(r.vocab_parallel_logits, L.astype(ldt), what + " logits")


@settings(FUZZ, max_examples=12)
@given(
    BT=st.sampled_from(SHAPES_BT), H=st.sampled_from(SHAPES_H), V=st.sampled_from(SHAPES_V),
    dt=st.sampled_from(DTYPES), f32_logits=st.booleans(), shard=st.sampled_from(["all", "inner", "one", "empty", "wide"]),
    specials=st.sampled_from([0.0, 0.05, 0.3]), layout=st.sampled_from(LAYOUTS), t64=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_online_max_sum_fuzz_against_the_contract(BT, H, V, dt, f32_logits, shard, specials, layout, t64, seed):
    rng = np.random.default_rng(seed)
    x = quarters(rng, (BT, H), dt)
    w = quarters(rng, (V, H), dt)
    if specials:
        x = inject(rng, x, specials / 4, [np.nan, np.inf, -np.inf])
        w = inject(rng, w, specials, [np.nan, np.inf, -np.inf, 0.0])
    if dt == F16 and rng.random() < 0.5:  # logits past 65504: ±inf in the kernel's fp16 logits
        w = (f64(w) * 512).astype(dt)
    start, end = {"all": (0, V), "inner": (V // 3, V // 3 + max(1, V // 2)), "one": (V - 1, V),
                  "empty": (V // 2, V // 2), "wide": (2, V + 5)}[shard]
    t = rng.choice(np.array([0, V - 1, start, end - 1, end, end + 3, start + V, max(start - 1, 0)]), BT)
    t = np.where(rng.random(BT) < 0.5, rng.integers(0, V + 6, BT), t).astype(np.int64 if t64 else np.int32)
    ldt = F32 if f32_logits else dt
    kw = dict(return_logits=True, logits_dtype=np.float32 if f32_logits else None)
    with np.errstate(invalid="ignore", over="ignore"):
        r = fg.fused_linear_online_max_sum(relayout(x, layout), relayout(w, layout), relayout(t, layout), start, end, **kw)
    check_floms(r, x, w, t, start, end, ldt, "one call")
    # many tiles (a vocabulary tile of 256 columns at most) and two threads: the order-free
    # outputs bitwise, the sum within its rounding (it is summed per tile), the same specials
    with fg.num_threads(1):
        tiny = fg.fused_linear_online_max_sum(x, w, t, start, end, options=TINY_BUDGET, **kw)
        one = fg.fused_linear_online_max_sum(x, w, t, start, end, options=ONE_TILE, **kw)
    for name in ("logits_max_local", "predicted_logits_local", "target_mask", "masked_target", "vocab_parallel_logits"):
        same_bits(getattr(tiny, name), getattr(r, name), "tiny budget " + name)
    same_bits(one.sum_exp_logits_local, r.sum_exp_logits_local, "one thread, one tile sum_exp")
    check_floms(tiny, x, w, t, start, end, ldt, "tiny budget")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("dt", [F16, F32])
def test_online_max_sum_a_vocabulary_tile_of_minus_inf_logits_adds_nothing(dt, where):
    """Found here: a vocabulary tile whose logits were all -inf (fp16 logits past -65504 round to
    -inf, as the device's fp16 matmul output; or a -inf in the operands) gave sum_exp NaN — the
    tile's own sum ``Σ exp(-inf - (-inf))`` is NaN and was scaled by ``exp(-inf - max) = 0`` —
    where the contract's ``Σ_v exp(l - max)`` and one big tile give the finite sum.  The result
    hung on the workspace budget.  A row of -inf only stays NaN (``exp(-inf + inf)``) either way."""
    V, H = 1000, 2
    rng = np.random.default_rng(0)
    x = np.array([[1.0, 300.0], [0.5, 300.0], [0.0, 1.0]], np.float32).astype(dt)
    w = quarters(rng, (V, H), dt, lim=2)
    w[:, 1] = 0
    cols = {"first": slice(0, 300), "middle": slice(256, 768), "last": slice(700, V)}[where]
    w[cols, 1] = -300.0 if dt == F16 else -np.inf  # fp16: -90000 -> -inf; fp32: -inf (0·-inf = NaN in row 2)
    w[cols, 0] = 0
    x[2, 1] = 0 if dt == F16 else 1  # row 2: logits of the tile NaN (fp32) or finite (fp16)
    t = np.array([5, 800, 100])
    for opts in (TINY_BUDGET, ONE_TILE):
        with np.errstate(invalid="ignore"):
            r = fg.fused_linear_online_max_sum(x, w, t, 0, V, options=opts)
        check_floms(r, x, w, t, 0, V, dt, f"budget {opts.workspace_bytes}")
        assert np.isfinite(r.sum_exp_logits_local[:2]).all()
    allinf = np.full((V, H), -300.0 if dt == F16 else -np.inf, np.float32).astype(dt)
    allinf[:, 0] = 1
    for opts in (TINY_BUDGET, ONE_TILE):
        r = fg.fused_linear_online_max_sum(x[:2], allinf, t[:2], 0, V, options=opts)
        assert np.isneginf(r.logits_max_local).all() and np.isnan(r.sum_exp_logits_local).all()


def test_online_max_sum_out_buffers_and_profiles_give_the_same_bits():
    rng = np.random.default_rng(1)
    BT, H, V = 9, 17, 129
    for dt in DTYPES:
        x, w = quarters(rng, (BT, H), dt), quarters(rng, (V, H), dt)
        t = rng.integers(-2, V + 3, BT)
        ref = fg.fused_linear_online_max_sum(x, w, t, 1, V - 2, return_logits=True)
        out = (np.empty(BT, np.float32), np.empty(BT, np.float32), np.empty(BT, np.float32),
               np.empty(2, np.uint8), np.empty(BT, np.int64), np.empty((BT, V), dt))
        got = fg.fused_linear_online_max_sum(x, w, t, 1, V - 2, return_logits=True, out=out)
        for a, b, o in zip(got, ref, out):
            same_bits(a, b, "out=")
            assert a is o or np.shares_memory(a, o)
        for soc in ("Ascend910_93", "Ascend950"):
            with fg.soc_version(soc):
                for a, b in zip(fg.fused_linear_online_max_sum(x, w, t, 1, V - 2, return_logits=True), ref):
                    same_bits(a, b, soc)
        check_floms(ref, x, w, t, 1, V - 2, dt)


# ---------------------------------------------------------------------------------------------
# fused_linear_cross_entropy_loss_grad
# ---------------------------------------------------------------------------------------------


def megatron(alpha, K):
    """docs/spec.md: ``s = α·K/(K-1)`` on K local columns (no smoothing for α = 0 or K = 1)."""
    if alpha == 0 or K <= 1:
        return 0.0, 0.0
    s = alpha * K / (K - 1)
    return s, s / K


def flce_oracle(grad, x, w, masked, mt, alpha, lmax=None, sexp=None, softmax=None, filter_eps=None):
    """docs/spec.md, fused_linear_cross_entropy_loss_grad, float64: ``(gi, gw, tol_i, tol_w)``,
    the tolerance the rounding of ``g`` to the dtype and the fp32 accumulation allow (forward
    error on ``(|p| + onehot + s/K)·|grad|``, so the cancellation ``p - 1`` is covered)."""
    dt = np.asarray(x).dtype
    X, W = f64(x), f64(w)
    BT, V = X.shape[0], W.shape[0]
    with np.errstate(all="ignore"):
        if softmax is None:
            p = np.exp(X @ W.T - f64(lmax)[:, None]) / f64(sexp)[:, None]
        else:
            p = f64(softmax)
        s, s_k = megatron(alpha, V)
        mt = np.asarray(mt, np.int64)
        own = ~np.asarray(masked, bool) & (mt >= 0) & (mt < V)
        hot = np.zeros((BT, V))
        hot[np.flatnonzero(own), mt[own]] = 1.0
        gr = f64(grad)[:, None]
        g = rnd((p - hot * (1 - s) - s_k) * gr, dt)
        mag = (np.abs(p) + hot + s_k) * np.abs(gr) * (1 + 2 * U[dt])
        gi, gw = g @ W, g.T @ X
        k_i, k_w = V + 4, BT + 4
        u_g = 0.0 if dt == F32 else U[dt]
        # each g within u_g relative or half a subnormal of its rounding; the fp32 sums γ_K; the
        # output's own rounding (one ulp of the oracle's value, or a subnormal's spacing)
        ti = 2 * U[dt] * np.abs(gi) + (u_g + (k_i + 4) * U32) * (mag @ np.abs(W)) + TINY[dt] * (1 + np.abs(W).sum(0))
        tw = 2 * U[dt] * np.abs(gw) + (u_g + (k_w + 4) * U32) * (mag.T @ np.abs(X)) + TINY[dt] * (1 + np.abs(X).sum(0))
        if filter_eps:  # docs/spec.md: each skipped |g| < eps·|grad[r]| (before the rounding)
            ti += filter_eps * np.abs(gr).sum() * np.abs(W).sum(0) * (1 + u_g)
            tw += filter_eps * (np.abs(gr) * np.abs(X)).sum(0) * (1 + u_g)
    return gi, gw, ti, tw


def stats_of(x, w):
    """The float64 row max and Σ exp(l - max) of the fp32 logits, rounded to fp32."""
    L = f64(x) @ f64(w).T
    m = L.max(1)
    return m.astype(np.float32), np.exp(L - m[:, None]).sum(1).astype(np.float32)


def mask_arg(rng, masked, kind):
    """The mask as the op takes it: bool [BT], packed LSB-first, or packed with garbage past BT
    and extra bytes (docs/device_parity.md row 1c: never read)."""
    if kind == "bool":
        return np.asarray(masked, bool)
    bits = np.concatenate([masked, rng.random(8 * (-(-len(masked) // 8)) - len(masked)) < 0.5])
    packed = np.packbits(bits, bitorder="little")
    return packed if kind == "packed" else np.concatenate([packed, rng.integers(0, 256, 2).astype(np.uint8)])


def flce_inputs(rng, BT, H, V, dt, hostile_grad, owned):
    x = quarters(rng, (BT, H), dt, lim=2)
    w = (quarters(rng, (V, H), dt, lim=2).astype(np.float32) / 4).astype(dt)  # |logit| <= 4·H/4
    masked = rng.random(BT) > owned
    mt = rng.choice(np.array([0, V - 1, -1, V, V + 7, -5]), BT)
    mt = np.where(rng.random(BT) < 0.6, rng.integers(0, V, BT), mt)
    grad = rng.uniform(-2, 2, BT).astype(np.float32)
    if hostile_grad:
        grad = inject(rng, grad, 0.3, [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, 1e-30])
    return x, w, masked, mt, grad


@FUZZ
@given(
    BT=st.sampled_from(SHAPES_BT), H=st.sampled_from(SHAPES_H), V=st.sampled_from(SHAPES_V),
    dt=st.sampled_from(DTYPES), alpha=st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0]),
    hostile_grad=st.booleans(), owned=st.sampled_from([0.0, 0.6, 1.0]),
    mask_kind=st.sampled_from(["bool", "packed", "garbage"]), layout=st.sampled_from(LAYOUTS),
    hp=st.booleans(), hostile_stats=st.booleans(), filter_eps=st.sampled_from([None, None, 1e-3, 0.05]),
    seed=st.integers(0, 2**31 - 1),
)
def test_flce_grad_fuzz_against_the_contract(
    BT, H, V, dt, alpha, hostile_grad, owned, mask_kind, layout, hp, hostile_stats, filter_eps, seed
):
    rng = np.random.default_rng(seed)
    # gradient filtering (memory-saving mode, an extension) is bounded for a finite grad only:
    # a skipped block of a NaN/inf grad row is 0, where the dense g is NaN/inf (CCE's semantics)
    filter_eps = None if hp or hostile_grad else filter_eps
    x, w, masked, mt, grad = flce_inputs(rng, BT, H, V, dt, hostile_grad, owned)
    mask = mask_arg(rng, masked, mask_kind)
    m, s = stats_of(x, w)
    if hostile_stats and not hp:  # the all-reduced statistics as given: NaN, ±inf, ±0, a negative sum
        m = inject(rng, m, 0.3, [np.nan, np.inf, -np.inf, 1e30])
        s = inject(rng, s, 0.3, [np.nan, np.inf, 0.0, -0.0, -1.0, 1e-30])
    if hp:
        L = f64(x) @ f64(w).T
        sm = (np.exp(L - f64(m)[:, None]) / f64(s)[:, None]).astype(np.float32)
        if rng.random() < 0.3:
            sm = inject(rng, sm, 0.05, [np.nan, np.inf, 0.0])
        stat = dict(softmax=relayout(sm, layout), logits_max=np.zeros(()), sum_exp_logits=None)
        keep = sm.copy()
        oracle = flce_oracle(grad, x, w, masked, mt, alpha, softmax=sm)
    else:
        stat = dict(logits_max=relayout(m, layout), sum_exp_logits=relayout(s, layout), filter_eps=filter_eps)
        oracle = flce_oracle(grad, x, w, masked, mt, alpha, m, s, filter_eps=filter_eps)
    args = (relayout(grad, layout), relayout(x, layout), relayout(w, layout), mask, relayout(mt, layout), alpha)
    with np.errstate(all="ignore"):
        gi, gw = fg.fused_linear_cross_entropy_loss_grad(*args, **stat)
    assert gi.dtype == dt and gw.dtype == dt and gi.shape == (BT, H) and gw.shape == (V, H)
    ri, rw, ti, tw = oracle
    within(gi, ri, ti, "grad_input")
    within(gw, rw, tw, "grad_weight")
    if hp:
        same_bits(stat["softmax"], keep, "softmax not written")
    # one thread and a tiny budget (many tiles, accumulated tile by tile: within the same bound)
    with fg.num_threads(1), np.errstate(all="ignore"):
        one = fg.fused_linear_cross_entropy_loss_grad(*args, **stat)
        tiny = fg.fused_linear_cross_entropy_loss_grad(*args, **stat, options=TINY_BUDGET)
    same_bits(one[0], gi, "1 thread grad_input")
    same_bits(one[1], gw, "1 thread grad_weight")
    within(tiny[0], ri, ti, "tiny budget grad_input")
    within(tiny[1], rw, tw, "tiny budget grad_weight")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("V", [1, 17, 129])
def test_flce_grad_is_pytorchs_cross_entropy_gradient(dt, V):
    """World size 1, every row owned: ``grad_input``/``grad_weight`` are the float64 autograd
    gradients of ``Σ_r grad[r]·CE_r`` with PyTorch's label smoothing ``ε = s = α·V/(V-1)``
    (Megatron's, docs/spec.md), within the op's two roundings."""
    rng = np.random.default_rng(V)
    BT, H = 33, 16
    x = (rng.standard_normal((BT, H))).astype(dt)
    w = (rng.standard_normal((V, H)) / 4).astype(dt)
    t = rng.integers(0, V, BT)
    grad = rng.uniform(-1, 1, BT).astype(np.float32)
    alpha = 0.0 if V == 1 else 0.2
    s, _ = megatron(alpha, V)
    m, se = stats_of(x, w)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, np.zeros(BT, bool), t, alpha, m, se)
    X = torch.tensor(f64(x), requires_grad=True)
    W = torch.tensor(f64(w), requires_grad=True)
    ce = torch.nn.functional.cross_entropy(X @ W.T, torch.tensor(t), reduction="none", label_smoothing=s)
    (ce * torch.tensor(f64(grad))).sum().backward()
    _, _, ti, tw = flce_oracle(grad, x, w, np.zeros(BT, bool), t, alpha, m, se)
    within(gi, X.grad.numpy(), ti * 1.5, "grad_input")
    within(gw, W.grad.numpy(), tw * 1.5, "grad_weight")


@pytest.mark.parametrize("dt", [BF16, F16])
def test_native_isa_settings_give_the_same_bits(dt):
    """docs/architecture.md: every bf16 variant of the native kernel gives the same bits as every
    other, every fp32 (fp16 operands) variant the same as the other: avx512 vs avx2 settings, for
    the forward and both modes of the gradient, with H and V off the vector widths."""
    if not (_cpu.has("avx512f") and _cpu.has("avx2", "fma")):
        pytest.skip("needs a CPU that runs both the AVX-512 and the AVX2 variants")
    rng = np.random.default_rng(3)
    BT, H, V = 37, 33, 300
    x = (rng.standard_normal((BT, H))).astype(dt)
    w = (rng.standard_normal((V, H)) / 4).astype(dt)
    t = rng.integers(0, V, BT)
    grad = rng.uniform(0.1, 1, BT).astype(np.float32)
    res = {}
    for isa in ("avx512", "avx2"):
        o = fg.Options(gemm="auto", native_isa=isa)
        f = fg.fused_linear_online_max_sum(x, w, t, 0, V, return_logits=True, options=o)
        sm = np.exp(f.vocab_parallel_logits.astype(np.float32) - f.logits_max_local[:, None]) / f.sum_exp_logits_local[:, None]
        ms = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, f.target_mask, f.masked_target, 0.0,
                                                     f.logits_max_local, f.sum_exp_logits_local, return_plan=True, options=o)
        hp = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, f.target_mask, f.masked_target, softmax=sm, options=o)
        assert ms[2].gemm.variant is not None and isa in ms[2].gemm.variant, ms[2].gemm.describe()
        res[isa] = (*f[:3], f.vocab_parallel_logits, *ms[:2], *hp)
    for a, b in zip(res["avx512"], res["avx2"]):
        same_bits(a, b, "avx512 vs avx2")


def test_flce_grad_out_buffers_empty_shapes_and_profiles():
    rng = np.random.default_rng(4)
    BT, H, V = 9, 17, 31
    for dt in DTYPES:
        x, w, masked, mt, grad = flce_inputs(rng, BT, H, V, dt, False, 0.7)
        m, s = stats_of(x, w)
        args = (grad, x, w, np.packbits(masked, bitorder="little"), mt, 0.0, m, s)
        ref = fg.fused_linear_cross_entropy_loss_grad(*args)
        out = (np.full((BT, H), np.nan, dt), np.full((V, H), np.nan, dt))
        got = fg.fused_linear_cross_entropy_loss_grad(*args, out=out)
        for a, b, o in zip(got, ref, out):
            same_bits(a, b, "out=")
            assert np.shares_memory(a, o)
        for soc in ("Ascend910_93", "Ascend950"):
            with fg.soc_version(soc):
                for a, b in zip(fg.fused_linear_cross_entropy_loss_grad(*args), ref):
                    same_bits(a, b, soc)
        within(ref[0], *flce_oracle(grad, x, w, masked, mt, 0.0, m, s)[0::2], "grad_input")
    # every row masked, targets anywhere: g = p·grad, nothing subtracted
    x, w, _, mt, grad = flce_inputs(rng, BT, H, V, BF16, False, 1.0)
    m, s = stats_of(x, w)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, np.full(2, 255, np.uint8), mt, 0.0, m, s)
    ri, rw, ti, tw = flce_oracle(grad, x, w, np.ones(BT, bool), mt, 0.0, m, s)
    within(gi, ri, ti, "all masked grad_input")
    within(gw, rw, tw, "all masked grad_weight")
    # H = 0 / BT = 0: empty results
    for BT0, H0 in ((0, 3), (4, 0)):
        xe = np.zeros((BT0, H0), BF16)
        we = np.zeros((V, H0), BF16)
        gi, gw = fg.fused_linear_cross_entropy_loss_grad(
            np.ones(BT0, np.float32), xe, we, np.zeros(BT0, bool), np.zeros(BT0, np.int64), 0.0,
            np.zeros(BT0, np.float32), np.ones(BT0, np.float32))
        assert gi.shape == (BT0, H0) and gw.shape == (V, H0) and not np.any(f64(gw))


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy (the training op): PyTorch float64 autograd
# ---------------------------------------------------------------------------------------------


def torch_ce(x, w, b, t, reduction, ls, ignore_index, grad_output, softcap, temperature, zscale):
    """PyTorch float64 from the training op's contract (docs/spec.md, its docstring):
    ``z = softcap·tanh((x·wᵀ + b)/softcap)/T``; F.cross_entropy plus the z-loss ``scale·lse²`` of
    the valid rows reduced like the loss (mean: over the valid rows); the entropy of each valid
    row's softmax reduced the same way.  ``(loss, entropy, lse, grad_input, grad_weight,
    grad_bias)``, the gradients of ``Σ grad_output·loss``."""
    X = torch.tensor(f64(x), requires_grad=True)
    W = torch.tensor(f64(w), requires_grad=True)
    B = None if b is None else torch.tensor(f64(b), requires_grad=True)
    z = X @ W.T + (0 if B is None else B)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    T = torch.tensor(t)
    valid = (T != ignore_index).double()
    lse = torch.logsumexp(z, 1)
    zl = zscale * lse**2 * valid
    ent = torch.special.entr(torch.softmax(z, 1)).sum(1) * valid
    red = {"sum": torch.sum, "none": lambda a: a, "mean": lambda a: a.sum() / valid.sum()}[reduction]
    # PyTorch's own mean for the cross-entropy (every row ignored: loss NaN, gradient 0); the
    # z-loss's gradient is 0 on ignored rows (its mean's 1/n_valid is not differentiated at 0)
    ce_red = torch.nn.functional.cross_entropy(z, T, reduction=reduction, label_smoothing=ls, ignore_index=ignore_index)
    n = max(1.0, float(valid.sum())) if reduction == "mean" else 1.0
    zl_g = zl.sum() / n if reduction != "none" else zl
    ((ce_red + zl_g) * torch.tensor(grad_output)).sum().backward()
    loss = (ce_red + red(zl)).detach().numpy()
    grads = (X.grad.numpy(), W.grad.numpy(), None if B is None else B.grad.numpy())
    return (loss, red(ent).detach().numpy(), lse.detach().numpy(), *grads)


@FUZZ
@given(
    BT=st.sampled_from([1, 2, 9, 33]), H=st.sampled_from([1, 3, 16, 17]), V=st.sampled_from([1, 2, 16, 33, 129, 1000]),
    dt=st.sampled_from(DTYPES), reduction=st.sampled_from(["mean", "sum", "none"]),
    ls=st.sampled_from([0.0, 0.0, 0.3]), ignored=st.sampled_from([0.0, 0.3, 1.0]), ignore_index=st.sampled_from([-100, 0]),
    bias=st.sampled_from([None, "finite", "-inf"]), softcap=st.sampled_from([None, None, 3.0]),
    temperature=st.sampled_from([1.0, 0.7]), zscale=st.sampled_from([0.0, 0.0, 1e-2]),
    tiny=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_training_loss_fuzz_against_torch_autograd(
    BT, H, V, dt, reduction, ls, ignored, ignore_index, bias, softcap, temperature, zscale, tiny, seed
):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(dt)
    w = (rng.standard_normal((V, H)) / 2).astype(dt)
    b = None
    t = rng.choice(np.array([0, V - 1]), BT)
    t = np.where(rng.random(BT) < 0.5, rng.integers(0, V, BT), t)
    if bias is not None:
        b = (rng.standard_normal(V)).astype(dt)
        if bias == "-inf" and V > 1:  # columns masked out by a -inf bias (never a target's)
            dead = rng.random(V) < 0.4
            dead[t] = False
            b[dead] = -np.inf
    t = np.where(rng.random(BT) < ignored, ignore_index, t)
    go = rng.uniform(0.5, 2, BT) if reduction == "none" else 1.5
    kw = dict(reduction=reduction, label_smoothing=ls, ignore_index=ignore_index, softcap=softcap,
              temperature=temperature, lse_square_scale=zscale, return_grad=True, grad_output=go,
              options=TINY_BUDGET if tiny else None)
    with np.errstate(all="ignore"):
        r = fg.linear_cross_entropy(x, w, t, b, return_entropy=True, **kw)
        rc = fg.linear_cross_entropy(x, w, t, b, lse=r.lse, **kw)  # the recompute from the saved lse
        loss, ent, lse, gi, gw, gb = torch_ce(x, w, b, t, reduction, ls, ignore_index, go, softcap, temperature, zscale)
    # fp32 logits and gradient, rounded once to the output dtype: a few fp32 ulps of the terms'
    # magnitude (|p| + onehot ≤ 2 per element, times 1/T, the upstream gradient, Σ over V / BT)
    n_valid = (t != ignore_index).sum()
    scale = np.abs(go).max() / (max(1, n_valid) if reduction == "mean" else 1) / temperature * (1 + 4 * zscale * 30)
    K = V + BT + H + 16
    u_out, tiny_out = U[np.asarray(r.grad_input).dtype], TINY[np.asarray(r.grad_input).dtype]
    tol_i = tiny_out + 2 * u_out * np.abs(gi) + 4 * K * U32 * scale * (np.ones((BT, V)) @ np.abs(f64(w)))
    tol_w = tiny_out + 2 * u_out * np.abs(gw) + 4 * K * U32 * scale * (np.ones((V, BT)) @ np.abs(f64(x)))
    for res, what in ((r, "fused"), (rc, "recompute")):
        within(res.grad_input, gi, tol_i, what + " grad_input")
        within(res.grad_weight, gw, tol_w, what + " grad_weight")
        if b is not None:
            within(res.grad_bias, gb, tiny_out + 2 * u_out * np.abs(gb) + 4 * K * U32 * scale * BT, what + " grad_bias")
            # a -inf bias column: p = 0 there, so no gradient — but label smoothing's -ε/V
            # reaches every column, and the softcap maps -inf to -softcap
            dead = np.isneginf(f64(b)) & (softcap is None) & (ls == 0)
            assert not np.any(f64(res.grad_bias)[dead]) and not np.any(f64(res.grad_weight)[dead])
    lmag = (np.abs(loss) + (np.log(V + 1) + 8 / temperature) * (1 + 30 * zscale) * np.abs(go).max() * BT + 1)
    within(np.asarray(r.loss, np.float32), loss, 8 * K * U32 * lmag, "loss")
    within(np.asarray(r.entropy, np.float32), ent, 8 * K * U32 * lmag, "entropy")
    within(r.lse, lse, 8 * K * U32 * (np.abs(lse) + 8 / temperature), "lse")


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("dt", [F32, BF16])
def test_training_loss_nan_logits_make_the_row_nan_whatever_the_chunk(dt, grad):
    """Found here: logits NaN over a whole vocabulary chunk before the row's first other logit
    (a NaN in the weight's rows 0..2047, the first chunk of 2048 columns) were dropped from the
    row's statistics — the chunk's max is -inf (a NaN never becomes the max) and its sums were
    skipped — so ``lse``, the loss and the entropy came out finite without ``return_grad`` (NaN
    with it), and a row of NaN logits only gave ``lse`` -inf; PyTorch (float64) gives NaN, as
    the contract's "NaN propagates through the sums".  Now such a chunk makes the row's sums NaN."""
    rng = np.random.default_rng(5)
    BT, H, V = 3, 2, 2100
    x = rng.standard_normal((BT, H)).astype(dt)
    w = rng.standard_normal((V, H)).astype(dt)
    w[:2048, 0] = np.nan
    x[2] = [0, 1]  # row 2: 0·NaN = NaN too (every logit of the chunk NaN, the rest finite)
    t = np.array([2050, 2090, 2099])
    xr = x.copy()
    xr[1] = np.nan  # a row of NaN logits only
    for xx in (x, xr):
        with np.errstate(all="ignore"):
            r = fg.linear_cross_entropy(xx, w, t, reduction="none", return_grad=grad, return_entropy=True)
            loss, ent, lse, gi, gw, _ = torch_ce(xx, w, None, t, "none", 0.0, -100, np.ones(BT), None, 1.0, 0.0)
        for got, ref, what in ((r.lse, lse, "lse"), (r.loss, loss, "loss"), (r.entropy, ent, "entropy")):
            same_specials(got, ref, what)
        assert np.isnan(f64(r.lse)).all()
        if grad:
            same_specials(r.grad_input, gi, "grad_input")
            same_specials(r.grad_weight, gw, "grad_weight")
