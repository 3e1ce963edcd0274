"""Gradient filtering (``filter_eps``) of the memory-saving FLCE grad: its error bound against the
unfiltered result over distributions from uniform to sharply peaked, its exactness when nothing is
negligible, and its refusals (strict mode, high-performance mode, bad values)."""

import ml_dtypes
import numpy as np
import pytest
from common import sharp_problem

import fastgrad as fg

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]
UNIT = {BF16: 2.0 ** -8, np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24}


def _problem(rng, BT, H, V, dtype, sharpness, vocab_used=None):
    """The FLCE grad's arguments for :func:`common.sharp_problem`'s inputs."""
    x, w, t = sharp_problem(rng, BT, H, V, dtype, sharpness, vocab_used)
    f = fg.fused_linear_online_max_sum(x, w, t, 0, V, logits_dtype=np.float32)
    grad = rng.uniform(0.5, 1.5, BT).astype(np.float32)
    args = (grad, x, w, f.target_mask, f.masked_target)
    kw = dict(logits_max=f.logits_max_local, sum_exp_logits=f.sum_exp_logits_local)
    return args, kw


def _f64(a):
    return np.asarray(a).astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sharpness", [0.0, 1.0, 3.0, 8.0])
def test_error_bound_against_unfiltered(dtype, sharpness):
    rng = np.random.default_rng(int(sharpness * 10) + 7)
    BT, H, V = 300, 64, 1337            # two row blocks, a ragged last column block
    args, kw = _problem(rng, BT, H, V, dtype, sharpness, vocab_used=200)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(*args, **kw)
    eps = 2.0 ** -12 if dtype != np.float32 else 2.0 ** -20
    gi_f, gw_f, plan = fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps=eps, return_plan=True)
    assert plan.filter_eps == eps and plan.blocks_total > 0
    grad, x, w = _f64(args[0]), _f64(args[1]), _f64(args[2])
    # the docstring's bound, taking every block as skipped (an upper bound on the skipped set)
    bound_gi = eps * np.abs(grad)[:, None] * np.abs(w).sum(axis=0)[None, :]
    bound_gw = eps * (np.abs(grad)[:, None] * np.abs(x)).sum(axis=0)[None, :]
    # and a tighter one from the float64 softmax: only elements below the threshold (never a
    # target) may be skipped, each dropping p·|grad|·|w| (resp. |x|) — a kept block lost fails it
    z = x @ w.T
    pr = np.exp(z - z.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    sub = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    # (g rounded to the dtype: 2⁻⁶ more, and half a subnormal step each)
    small = np.where(pr < 1.01 * eps, (1 + 2.0**-6) * pr * np.abs(grad)[:, None] + sub / 2, 0.0)
    small[np.arange(BT), args[4]] = 0.0
    # (the kept products' other summation order: 2⁻¹⁶ of the sum of |terms|; the output's
    # rounding near 0: one subnormal step)
    G = pr.copy()
    G[np.arange(BT), args[4]] -= 1.0
    G = np.abs(G) * np.abs(grad)[:, None]
    tight_gi = small @ np.abs(w) + 2.0**-16 * (G @ np.abs(w)) + sub
    tight_gw = small.T @ np.abs(x) + 2.0**-16 * (G.T @ np.abs(x)) + sub
    u = UNIT[np.dtype(dtype)]
    for got, ref, bound, tight in ((gi_f, gi, bound_gi, tight_gi), (gw_f, gw, bound_gw, tight_gw)):
        got, ref = _f64(got), _f64(ref)
        slack = 2 * u * np.abs(ref) + 1e-6 * np.abs(ref).max() + 1e-30
        assert np.all(np.abs(got - ref) <= bound + slack)
        assert np.all(np.abs(got - ref) <= tight + 2 * u * np.abs(ref) + 1e-30)
    if sharpness >= 8.0:
        assert plan.blocks_skipped > 0           # a peaked softmax leaves negligible blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nothing_negligible_is_bitwise_dense(dtype):
    rng = np.random.default_rng(3)
    args, kw = _problem(rng, 70, 16, 400, dtype, 0.0)
    dense = fg.fused_linear_cross_entropy_loss_grad(*args, **kw)
    gi, gw, plan = fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps=1e-30, return_plan=True)
    assert plan.blocks_skipped == 0
    for a, b in zip((gi, gw), dense):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_everything_negligible_keeps_the_target_column():
    rng = np.random.default_rng(5)
    args, kw = _problem(rng, 40, 8, 300, np.float32, 0.0, vocab_used=100)
    grad, x, w, tm, mt = args
    gi, gw, plan = fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps=1.0, return_plan=True)
    assert 0 < plan.blocks_skipped < plan.blocks_total
    # only the target columns remain: g = (p - 1)·grad at (r, t_r)
    p = np.exp(_f64(x) @ _f64(w).T - _f64(kw["logits_max"])[:, None]) / _f64(kw["sum_exp_logits"])[:, None]
    g = np.zeros_like(p)
    t = np.asarray(mt, np.int64)
    cols_kept = np.zeros(p.shape[1], bool)
    for r0 in range(0, 40, 256):                  # one row block here: every block holding a target
        for c in t[r0:r0 + 256]:
            cols_kept[(c // 64) * 64:(c // 64) * 64 + 64] = True
    g[:, cols_kept] = p[:, cols_kept]
    g[np.arange(40), t] -= 1
    g *= _f64(grad)[:, None]
    np.testing.assert_allclose(gi, (g.astype(np.float32).astype(np.float64) @ _f64(w)), rtol=1e-4, atol=1e-6)


def test_auto_is_ccE_eps_over_32():
    rng = np.random.default_rng(1)
    for dtype, want in ((BF16, 2.0 ** -12), (np.float16, 2.0 ** -15), (np.float32, 2.0 ** -28)):
        args, kw = _problem(rng, 8, 4, 20, np.dtype(dtype), 1.0)
        *_, plan = fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps="auto", return_plan=True)
        assert plan.filter_eps == want


def test_refusals():
    rng = np.random.default_rng(2)
    args, kw = _problem(rng, 8, 4, 130, BF16, 1.0)
    for bad in (0.0, -1.0, 2.0, "fast", True, float("nan")):
        with pytest.raises(fg.AclnnError) as e:
            fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps=bad)
        assert e.value.status == 161002 and "filter_eps" in str(e.value)
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps="auto")
    assert e.value.status == 161002 and "filter_eps" in str(e.value)
    sm = np.full((8, 130), 1 / 130, np.float32)
    with pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(*args, softmax=sm, filter_eps="auto")
    assert e.value.status == 161002 and "filter_eps" in str(e.value)


def test_the_flce_grad_and_the_training_loss_take_the_same_filter_eps_values():
    """One parser (``filter_eps_value``): the same values accepted (the threshold the plan
    carries) and refused (161002, naming ``filter_eps``) by both ops."""
    from fractions import Fraction

    rng = np.random.default_rng(3)
    args, kw = _problem(rng, 8, 4, 130, BF16, 1.0)
    x, w, t = args[1], args[2], np.zeros(8, np.int64)
    for ok, want in ((1e-3, 1e-3), (Fraction(1, 1000), 1e-3), (np.float32(0.5), 0.5), (1, 1.0), ("auto", 2.0**-12)):
        *_, plan = fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps=ok, return_plan=True)
        assert plan.filter_eps == want
        r = fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps=ok)
        assert r.filter_stats["filter_eps"] == want
    for bad in (0.0, -1.0, 2.0, "fast", True, float("nan"), [1e-3]):
        for call in (lambda: fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps=bad),
                     lambda: fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps=bad)):
            with pytest.raises(fg.AclnnError) as e:
                call()
            assert e.value.status == 161002 and "filter_eps" in str(e.value)


def test_filtered_is_deterministic_across_threads():
    rng = np.random.default_rng(4)
    args, kw = _problem(rng, 300, 16, 900, BF16, 6.0)
    with fg.num_threads(1):
        a = fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps="auto")
    with fg.num_threads(2):
        b = fg.fused_linear_cross_entropy_loss_grad(*args, **kw, filter_eps="auto")
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint16), np.asarray(v).view(np.uint16))
