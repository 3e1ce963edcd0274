"""Every bad input of issue 10 answered: AclnnError 161001/161002 naming the parameter, or a
correct result — never a crash, NaN, an internal error or a silently wrong value.

The oracles here are written from the contract (docs/spec.md), not from fastgrad's reference.
"""

import ml_dtypes
import numpy as np
import pytest

import fastgrad as fg

BF16 = np.dtype(ml_dtypes.bfloat16)


def _raises(status, param, fn, *args, **kw):
    with pytest.raises(fg.AclnnError) as e:
        fn(*args, **kw)
    assert e.value.status == status, str(e.value)
    assert param in str(e.value), str(e.value)
    assert e.value.param is not None
    return e.value


# ---------------------------------------------------------------------------------------------
# smooth L1 with an fp32-subnormal beta: the 910B's finite formula, the 950's NaN zone (row 5f)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_smooth_l1_subnormal_beta_follows_each_soc(dtype, reduction):
    """910B (the TBE kernel: ``d/fp32(β + 1e-6)``): finite, the formula's values.  950 (the arch35
    tiling: ``1/β`` is NaN below 1e-6, ``smooth_l1_loss_grad_v2_tiling.cpp:145``): NaN in the
    quadratic zone (``|d| <= β`` for a tensor grad_out, ``|d| < β`` for a one-element one: the
    DAGs' compares, docs/device_parity.md row 5f), ``sign(d)·grad`` outside it."""
    beta = 1e-39                                    # fp32 subnormal
    b32 = float(np.float32(beta))
    t = np.zeros(6, np.float32)
    x = np.array([0.0, 5e-40, -5e-40, 1.0, -2.0, 0.0], np.float32)   # d = x - t
    if dtype != np.float32:                         # 16-bit: no subnormal d of that size
        x = np.array([0.0, 0.0, 0.5, 1.0, -2.0, 0.0], np.float32)
    g = np.float32(0.5) if reduction != "none" else np.linspace(1, 2, 6).astype(np.float32)
    scale = (1 / 6 if reduction == "mean" else 1)
    d = x.astype(dtype).astype(np.float64)
    g64 = np.asarray(g, np.float64)
    args = (np.asarray(g).astype(dtype), x.astype(dtype), t.astype(dtype), reduction, beta)
    with fg.soc_version("Ascend950"):
        got950 = np.asarray(fg.smooth_l1_loss_backward(*args), np.float64)
    zone = np.abs(d) <= b32 if reduction == "none" else np.abs(d) < b32
    assert np.array_equal(np.isnan(got950), zone)
    np.testing.assert_allclose(got950[~zone], (np.sign(d) * g64 * scale)[~zone], rtol=2 ** -7, atol=0)
    got910 = np.asarray(fg.smooth_l1_loss_backward(*args), np.float64)
    assert np.all(np.isfinite(got910))
    den = float(np.float32(b32 + 1e-6))
    want = np.where(np.abs(d) < b32, d / den, np.sign(d)) * g64 * scale
    np.testing.assert_allclose(got910, want, rtol=2 ** -7 if dtype != np.float32 else 1e-6, atol=1e-45)


def test_smooth_l1_subnormal_beta_reference_agrees():
    x = np.array([0.0, 5e-40, -7e-40, 3.0], np.float32)
    t = np.zeros(4, np.float32)
    g = np.ones(4, np.float32)
    a = fg.smooth_l1_loss_backward(g, x, t, "none", 1e-39)
    with fg.use_backend("reference"):
        b = fg.smooth_l1_loss_backward(g, x, t, "none", 1e-39)
    np.testing.assert_allclose(a, b, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# out= overlapping an input: one rule for every op (161002, out untouched)
# ---------------------------------------------------------------------------------------------

def _ce_args():
    lp = np.log(np.full((3, 4), 0.25, np.float32))
    return dict(grad_loss=np.float32(1.0), log_prob=lp, target=np.array([0, 1, 2]))


def test_cross_entropy_out_is_log_prob_refused():
    kw = _ce_args()
    before = kw["log_prob"].copy()
    _raises(161002, "out", fg.cross_entropy_loss_grad, **kw, out=kw["log_prob"])
    np.testing.assert_array_equal(kw["log_prob"], before)


def test_cross_entropy_out_overlapping_a_view_refused():
    big = np.log(np.full((4, 4), 0.25, np.float32))
    kw = dict(grad_loss=np.float32(1.0), log_prob=big[:3], target=np.array([0, 1, 2]))
    before = big.copy()
    _raises(161002, "out", fg.cross_entropy_loss_grad, **kw, out=big[1:])
    np.testing.assert_array_equal(big, before)


def test_embedding_out_is_grad_refused():
    grad = np.arange(12, dtype=np.float32).reshape(4, 3)
    before = grad.copy()
    _raises(161002, "out", fg.embedding_dense_backward, grad, np.array([0, 1, 2, 3]), 4, out=grad)
    np.testing.assert_array_equal(grad, before)


def test_every_op_refuses_aliased_out():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 4)).astype(np.float32)
    _raises(161002, "out", fg.smooth_l1_loss_backward, np.float32(1), x, x.copy(), "sum", out=x)
    y = rng.random((1, 1, 4, 4)).astype(np.float32)
    _raises(161002, "out", fg.scaled_masked_softmax_backward, y.copy(), y, np.zeros((1, 1, 4, 4), bool), out=y)
    xi = rng.standard_normal((4, 4)).astype(np.float32)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    m, s = np.zeros(4, np.float32), np.ones(4, np.float32)
    grad = np.ones(4, np.float32)
    _raises(161002, "out", fg.fused_linear_cross_entropy_loss_grad, grad, xi, w, np.zeros(4, bool),
            np.zeros(4, np.int64), logits_max=m, sum_exp_logits=s, out=(xi, np.empty_like(w)))
    o = np.empty((4, 4), np.float32)
    _raises(161002, "out", fg.fused_linear_cross_entropy_loss_grad, grad, xi, w, np.zeros(4, bool),
            np.zeros(4, np.int64), logits_max=m, sum_exp_logits=s, out=(o, o))   # outputs overlapping


def test_disjoint_views_of_one_buffer_are_fine():
    buf = np.zeros((8, 4), np.float32)
    buf[:4] = np.log(0.25)
    out = buf[4:]
    fg.cross_entropy_loss_grad(np.float32(1.0), buf[:4], np.array([0, 1, 2, 3]), out=out)
    assert np.all(np.isfinite(out)) and np.any(out != 0)


# ---------------------------------------------------------------------------------------------
# integers beyond what the op can hold
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nw", [2 ** 62, 2 ** 64, 2 ** 70])
def test_embedding_huge_num_weights(nw):
    _raises(161002, "num_weights", fg.embedding_dense_backward, np.ones((2, 3), np.float32),
            np.array([0, 1]), nw)


def test_integers_beyond_int64():
    kw = _ce_args()
    _raises(161002, "ignore_index", fg.cross_entropy_loss_grad, **kw, ignore_index=2 ** 70)
    _raises(161002, "indices", fg.embedding_dense_backward, np.ones((2, 3), np.float32),
            [0, 2 ** 70], 4)
    x = np.ones((2, 4), np.float16)
    w = np.ones((3, 4), np.float16)
    t = np.zeros(2, np.int64)
    _raises(161002, "vocab_start_index", fg.fused_linear_online_max_sum, x, w, t, 2 ** 70, 2 ** 70 + 3)
    _raises(161002, "vocab_end_index", fg.fused_linear_online_max_sum, x, w, t, 0, 2 ** 70)


# ---------------------------------------------------------------------------------------------
# attributes out of range, shard bounds, mixed kinds
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ls", [-0.1, 1.5, float("nan"), float("inf")])
def test_label_smoothing_outside_unit_interval(ls):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 4)).astype(BF16)
    w = rng.standard_normal((8, 4)).astype(BF16)
    f = fg.fused_linear_online_max_sum(x, w, np.arange(4), 0, 8, return_logits=True)
    _raises(161002, "label_smoothing", fg.fused_linear_cross_entropy_loss_grad, np.ones(4, np.float32),
            x, w, f.target_mask, f.masked_target, ls, logits_max=f.logits_max_local,
            sum_exp_logits=f.sum_exp_logits_local)
    _raises(161002, "label_smoothing", fg.fused_cross_entropy_loss_with_max_sum, f.logits_max_local,
            f.sum_exp_logits_local, f.predicted_logits_local, ls, f.vocab_parallel_logits)
    _raises(161002, "label_smoothing", fg.cross_entropy_loss_grad, **_ce_args(), label_smoothing=ls)


def test_embedding_zero_width_still_checks_indices():
    _raises(161002, "indices", fg.embedding_dense_backward, np.zeros((3, 0), np.float32), np.array([0, 9, 1]), 5)


@pytest.mark.parametrize("strict", [False, True])
def test_shard_range_is_checked_only_as_the_device_checks_it(strict):
    # aclnn_fused_linear_online_max_sum.cpp:154-171: start >= 0 and end >= start, nothing
    # more; end - start need not be V (the CANN example runs V = 5 with [0, 2))
    x = np.ones((3, 4), np.float16)
    w = np.ones((5, 4), np.float16)
    t = np.array([1, 6, 7], np.int32)
    with fg.strict(strict):
        _raises(161002, "vocab_end_index", fg.fused_linear_online_max_sum, x, w, t, 3, 2)
        _raises(161002, "vocab_start_index", fg.fused_linear_online_max_sum, x, w, t, -1, 2)
        for start, end in ((0, 8), (2, 3), (3, 8), (0, 2), (4, 4), (0, 100)):
            r = fg.fused_linear_online_max_sum(x, w, t, start, end)
            owned = (t >= start) & (t < end)
            np.testing.assert_array_equal(np.unpackbits(r.target_mask, bitorder="little")[:3], ~owned)


def test_numpy_and_torch_mixed_refused():
    torch = pytest.importorskip("torch")
    x = np.ones((2, 3), np.float32)
    _raises(161002, "NumPy arrays and torch tensors mixed", fg.smooth_l1_loss_backward,
            np.float32(1.0), torch.ones(2, 3), x)


# ---------------------------------------------------------------------------------------------
# errors: every reason listed, Python habits
# ---------------------------------------------------------------------------------------------

def test_one_error_lists_every_reason():
    e = _raises(161002, "target", fg.cross_entropy_loss_grad, np.float32(1.0),
                np.zeros((3, 4), np.float32), np.zeros(3, np.float64), reduction="avg", ignore_index=1.5)
    assert "reduction" in str(e) and "ignore_index" in str(e)
    assert len(e.reasons) == 3
    e = _raises(161002, "weight", fg.fused_linear_online_max_sum, np.ones((3, 4), np.float16),
                np.ones((5, 6), BF16), np.zeros(4, np.int64), 0, 5)
    assert "weight" in str(e) and "target" in str(e) and len(e.reasons) >= 3


def test_errors_are_python_exceptions_too():
    with pytest.raises(ValueError):
        fg.smooth_l1_loss_backward(np.ones(2, np.float32), np.ones(2, np.float32), np.ones(3, np.float32))
    with pytest.raises(TypeError):
        fg.smooth_l1_loss_backward(None, np.ones(2, np.float32), np.ones(2, np.float32))
    with pytest.raises(RuntimeError):
        fg.set_backend("no-such-backend")
    e = fg.AclnnError(fg.ACLNN_ERR_PARAM_INVALID, "x: bad", "x")
    assert isinstance(e, fg.AclnnParamError) and isinstance(e, ValueError)
    import pickle

    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is type(e) and e2.status == 161002 and e2.param == "x" and str(e2) == str(e)


def test_nullptr_lists_every_missing_input():
    with pytest.raises(fg.AclnnError) as e:
        fg.smooth_l1_loss_backward(None, None, np.ones(2, np.float32))
    assert e.value.status == 161001 and "grad_out" in str(e.value) and "input" in str(e.value)
