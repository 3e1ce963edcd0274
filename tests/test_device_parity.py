"""Device-parity decisions (docs/device_parity.md): each test pins one row of that table.

The expectations are the CANN kernels' order of operations, emulated with NumPy fp32
arithmetic (every NumPy fp32 operation is correctly rounded, as the NPU's vector unit).
"""

import ml_dtypes
import numpy as np
import pytest

import fastgrad as fg
from fastgrad.kernels._vmath import exp_f32

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
f32 = np.float32


# ----------------------------------------------------------------------------------------
# cross_entropy_loss_grad (rows 4b, 4c)
# ----------------------------------------------------------------------------------------

def _kernel_p(lp32):
    """The kernel's own fp32 exp(log_prob), read back through the op (sum, g = 1: x = p·1)."""
    n, c = lp32.shape
    p = np.empty((n, c), np.float32)
    for tcol in (0, 1):                       # the target column holds p - 1: take it from
        o = fg.cross_entropy_loss_grad(f32(1), lp32, np.full(n, tcol), reduction="sum")
        keep = np.arange(c) != tcol           # the other call
        p[:, keep] = o[:, keep]
    return p


def _device_ce(g, p, t, w, red, ignore_index):
    """910B CrossEntropyLossGrad, ls = 0, in fp32 (weight_none.h / weight_not_none.h)."""
    n, c = p.shape
    sel = (t != ignore_index).astype(np.float32)                    # ignoreSelect
    inside = (t >= 0) & (t < c)
    wt = np.ones(n, np.float32) if w is None else \
        np.where(inside, w[np.where(inside, t, 0)], f32(0)).astype(np.float32)
    if red == "none":
        L = (np.asarray(g, np.float32) * f32(1.0)).astype(np.float32)
    else:
        L = np.full(n, f32(g) * f32(1.0), np.float32)
        if red == "mean":
            W = f32(np.sum((sel * wt).astype(np.float64)))
            L = (L / W).astype(np.float32)
    cf = ((sel * L).astype(np.float32) * wt).astype(np.float32)    # c_i
    x = (p * cf[:, None]).astype(np.float32)                        # fl(p·c)
    rows = np.nonzero(inside)[0]
    x[rows, t[rows]] = x[rows, t[rows]] - cf[rows]                  # fl(x - c)
    return x, cf


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("red", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_ce_grad_rounding_order_is_the_kernels(dtype, red, weighted):
    rng = np.random.default_rng(11)
    n, c = 40, 9
    logits = rng.standard_normal((n, c)) * 3
    lp = (logits - np.log(np.exp(logits).sum(1, keepdims=True))).astype(dtype)
    t = rng.integers(0, c, n)
    t[[3, 17]] = -100
    w = (rng.random(c) + 0.5).astype(np.float32) if weighted else None
    g = rng.standard_normal(n).astype(np.float32) if red == "none" else f32(0.37)
    out = fg.cross_entropy_loss_grad(g.astype(dtype) if red == "none" else np.asarray(g, dtype),
                                     lp, t, weight=w, reduction=red)
    g32 = np.asarray(np.asarray(g, dtype), np.float32)
    p = _kernel_p(np.asarray(lp, np.float32))
    expect, cf = _device_ce(g32 if red == "none" else f32(g32), p, t, w, red, -100)
    expect = expect.astype(dtype)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expect.view(np.uint8))
    if dtype == F32:  # the order matters: c·(p - 1) rounded once differs at some targets
        rows = np.nonzero(t >= 0)[0]
        once = ((p[rows, t[rows]].astype(np.float64) - 1) * cf[rows]).astype(np.float32)
        assert np.any(once != out[rows, t[rows]])
    with fg.use_backend("reference"):   # the golden follows the same order (exact exp)
        gold = fg.cross_entropy_loss_grad(np.asarray(g, dtype) if red != "none" else g.astype(dtype),
                                          lp, t, weight=w, reduction=red)
    exact_p = np.exp(np.asarray(lp, np.float64)).astype(np.float32) == p
    same = np.asarray(gold).view(np.uint8).reshape(n, c, -1) == expect.view(np.uint8).reshape(n, c, -1)
    assert same.all(-1)[exact_p.all(1)].all()


@pytest.mark.parametrize("ignore_index", [-100, -1, 0, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_ce_grad_ignored_rows_any_sign_of_ignore_index(ignore_index, weighted):
    rng = np.random.default_rng(5)
    n, c = 8, 6
    lp = np.log(rng.dirichlet(np.ones(c), n)).astype(np.float32)
    t = rng.integers(0, c, n)
    t[t == ignore_index] = (ignore_index + 1) % c
    t[[1, 5]] = ignore_index
    w = (rng.random(c) + 0.5).astype(np.float32) if weighted else None
    out = fg.cross_entropy_loss_grad(f32(-0.8), lp, t, weight=w, reduction="mean",
                                     ignore_index=ignore_index)
    assert np.all(out[[1, 5]] == 0)                       # ignored whatever the sign
    expect, _ = _device_ce(f32(-0.8), _kernel_p(lp), t, w, "mean", ignore_index)
    np.testing.assert_array_equal(out.view(np.uint32), expect.view(np.uint32))  # -0 included
    lp2 = lp.copy()
    lp2[5, 2] = np.nan                                    # exp(NaN)·0 on the device
    out2 = fg.cross_entropy_loss_grad(f32(-0.8), lp2, t, weight=w, reduction="mean",
                                      ignore_index=ignore_index)
    assert np.isnan(out2[5, 2]) and np.isnan(out2).sum() == 1


def test_ce_grad_grad_loss_of_shape_1_for_mean_and_sum():
    lp = np.log(np.full((3, 4), 0.25, np.float32))
    t = np.array([0, 3, 1])
    for red in ("mean", "sum"):
        a = fg.cross_entropy_loss_grad(np.array(0.5, np.float32), lp, t, reduction=red)
        b = fg.cross_entropy_loss_grad(np.array([0.5], np.float32), lp, t, reduction=red)
        np.testing.assert_array_equal(a, b)


def test_ce_grad_mean_all_ignored_is_nan():
    lp = np.log(np.full((2, 3), 1 / 3, np.float32))
    out = fg.cross_entropy_loss_grad(f32(1), lp, np.array([-100, -100]), reduction="mean")
    assert np.isnan(out).all()


# ----------------------------------------------------------------------------------------
# smooth_l1_loss_backward (rows 5-5d)
# ----------------------------------------------------------------------------------------

def test_smooth_l1_tensor_dag_compares_strictly_scalar_dag_not():
    b = 1.7
    x = np.array([1.7, -1.7, 0.85, 3.0], np.float32)
    t = np.zeros(4, np.float32)
    inv = f32(1) / f32(b)
    with fg.soc_version("Ascend950"):  # the arch35 DAGs
        # tensor grad_out (SmoothL1LossGradV2OpDag): |d| == beta is in the quadratic zone
        out = fg.smooth_l1_loss_backward(np.ones(4, np.float32), x, t, "none", b)
        np.testing.assert_array_equal(out, [x[0] * inv, x[1] * inv, x[2] * inv, 1])
        assert out[0] == np.nextafter(f32(1), f32(0))          # 1.7·fp32(1/1.7) = 1 - 2**-24
        # one-element grad_out (SmoothL1LossGradV2OpScalarDag): |d| == beta takes the sign
        out = fg.smooth_l1_loss_backward(np.float32(1), x, t, "sum", b)
        np.testing.assert_array_equal(out, [1, -1, x[2] * inv, 1])
    # A2/A3 (the TBE kernel): [d >= β] and [d <= -β], exactly ±1 at |d| == β, for both
    den = f32(f32(b) + f32(1e-6))
    for g, red in ((np.ones(4, np.float32), "none"), (np.float32(1), "sum")):
        out = fg.smooth_l1_loss_backward(g, x, t, red, b)
        np.testing.assert_array_equal(out, [1, -1, x[2] / den, 1])


def test_smooth_l1_beta_zero_d_zero_and_nan():
    x = np.array([0.0, 2.0, -3.0, np.nan], np.float32)
    t = np.zeros(4, np.float32)
    for g in (np.ones(4, np.float32), np.float32(1)):
        red = "none" if np.ndim(g) else "sum"
        # A2/A3 TBE: -[d <= 0] + [d >= 0] + 0: d = 0 gives 0; a NaN d is read as 0: 0
        np.testing.assert_array_equal(fg.smooth_l1_loss_backward(g, x, t, red, 0.0), [0, 1, -1, 0])
        with fg.soc_version("Ascend950"):
            out = fg.smooth_l1_loss_backward(g, x, t, red, 0.0)
            neg0 = fg.smooth_l1_loss_backward(g, np.full(4, -0.0, np.float32), t, red, 0.0)
        # 950: invertSigma = NaN for |beta| < 1e-6, beta = 0 included (arch35 tiling.cpp:145).
        # A tensor grad_out takes SmoothL1LossGradV2OpDag: |d| > 0 fails at d = ±0, so
        # Select gives d·NaN = NaN there (dag.h:63-64,70-71,79-83); a one-element grad_out the
        # scalar DAG: |d| >= 0, d >= 0 and d <= -0 all hold at d = ±0: (1 + -1) + 0 = 0
        # (dag.h:117-134).  NaN d stays NaN in both.
        if np.ndim(g):
            assert np.isnan(out[0]) and np.isnan(neg0).all()
        else:
            assert out[0] == 0 and (neg0 == 0).all()
        np.testing.assert_array_equal(out[1:3], [1, -1])
        assert np.isnan(out[3])
    # a one-element grad_out of shape (1,) is the scalar DAG too (doutIsScalar, tiling.cpp:87-97)
    with fg.soc_version("Ascend950"):
        one = fg.smooth_l1_loss_backward(np.ones(1, np.float32), x, t, "none", 0.0)
    np.testing.assert_array_equal(one[:3], [0, 1, -1])


def test_smooth_l1_mean_multiplies_by_fp32_reciprocal():
    n = 7
    x = np.full(n, 5.0, np.float32)
    t = np.zeros(n, np.float32)
    g = np.float32(3.0)
    out = fg.smooth_l1_loss_backward(g, x, t, "mean", 1.0)
    cof = f32(1.0 / n)                                     # reduceMeanCof (tiling.cpp:127)
    np.testing.assert_array_equal(out, np.full(n, (f32(1) * g) * cof, np.float32))
    assert (f32(3) * cof) != f32(3) / f32(n)                # multiply, not divide


def test_smooth_l1_quadratic_zone_multiplies_by_fp32_inverse():
    b = 0.3
    x = np.array([0.1, 0.2, -0.25], np.float32)
    t = np.zeros(3, np.float32)
    with fg.soc_version("Ascend950"):
        out = fg.smooth_l1_loss_backward(np.ones(3, np.float32), x, t, "none", b)
    np.testing.assert_array_equal(out, x * (f32(1) / f32(b)))   # the arch35 DAG's invβ
    out = fg.smooth_l1_loss_backward(np.ones(3, np.float32), x, t, "none", b)
    np.testing.assert_array_equal(out, x / f32(f32(b) + f32(1e-6)))   # A2/A3: d/(β + 1e-6)
    assert not np.array_equal(out, x * (f32(1) / f32(b)))


# ----------------------------------------------------------------------------------------
# fused_linear_online_max_sum (rows 6, 1)
# ----------------------------------------------------------------------------------------

def test_online_max_sum_target_compare_is_exact_above_2_24():
    start = 2 ** 24 + 1
    V = 3
    w = np.array([[1.0], [2.0], [3.0]], np.float32)
    x = np.ones((4, 1), np.float32)
    t = np.array([start, start + 1, start + 2, start - 1], np.int64)
    r = fg.fused_linear_online_max_sum(x, w, t, start, start + V)
    # fastgrad: exact integer compares
    np.testing.assert_array_equal(r.masked_target, [0, 1, 2, 0])
    assert np.unpackbits(r.target_mask, bitorder="little")[:4].tolist() == [0, 0, 0, 1]
    np.testing.assert_array_equal(r.predicted_logits_local, [1.0 - 3, 2.0 - 3, 3.0 - 3, 0.0])
    # the device compares fp32(t) with fp32(start)/fp32(end) (fused_linear_online_max_sum.h
    # :545-561): it would mask row 2 (fp32(2**24+3) = fp32(end)), keep row 3 and give row 1
    # the local index 2 -- documented, not emulated
    tf, sf, ef = t.astype(np.float32), f32(start), f32(start + V)
    dev_mask = (tf < sf) | (tf >= ef)
    dev_local = np.where(dev_mask, 0, np.rint(tf - sf)).astype(np.int64)
    assert dev_mask.tolist() == [False, False, True, False]
    assert dev_local.tolist() == [0, 2, 0, 0]


def test_online_max_sum_padding_bits_are_the_zero_targets_compare():
    x = np.ones((3, 4), np.float16)
    w = np.ones((5, 4), np.float16)
    assert fg.fused_linear_online_max_sum(x, w[:2], np.ones(3, np.int32), 0, 2).target_mask.tolist() == [0]
    # a later shard: target 0 is below start, so the padding bits are 1
    assert fg.fused_linear_online_max_sum(x, w, np.full(3, 3, np.int32), 2, 7).target_mask.tolist() == [248]


# ----------------------------------------------------------------------------------------
# fused_linear_cross_entropy_loss_grad (rows 3, 3b, 1b)
# ----------------------------------------------------------------------------------------

def _flce_case():
    V = 128
    x = np.ones((2, 1), np.float32)
    w = (np.arange(V, dtype=np.float32) / 64 - 1).reshape(V, 1)
    lmax = np.full(2, w.max(), np.float32)
    se = np.full(2, 3.0, np.float32)
    grad = np.array([0.7, -1.3], np.float32)
    return x, w, lmax, se, grad


def test_flce_memory_saving_row_is_true_division_then_minus_one_times_grad():
    x, w, lmax, se, grad = _flce_case()
    V = w.shape[0]
    mask = np.array([False, True])                  # row 0 unmasked (target 5), row 1 masked
    mt = np.array([5, 0])
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, mt,
                                                     logits_max=lmax, sum_exp_logits=se)
    # mem_friendly.h:643-702: Adds(-max), Exp, Div(sum_exp), -1 at the target, Muls(grad)
    logit = w[:, 0]                                 # x = 1, H = 1: the fp32 logit is exact
    e = np.array([exp_f32(f32(v - lmax[0])) for v in logit], np.float32)  # fastgrad's fp32 exp
    g = np.empty((2, V), np.float32)
    for r in range(2):
        p = (e / se[r]).astype(np.float32)          # true division
        if not mask[r]:
            p[mt[r]] = p[mt[r]] - f32(1)
        g[r] = (p * grad[r]).astype(np.float32)
    # fp32 input (extension): no rounding of g; grad_weight[j] = g[0,j]·1 + g[1,j]·1
    np.testing.assert_array_equal(gw[:, 0], (g[0] + g[1]).astype(np.float32))
    recip = ((e * (f32(1) / se[0])).astype(np.float32) * grad[0]).astype(np.float32)
    assert np.any(recip != g[0])                    # the test tells division from reciprocal


def test_flce_bits_past_bt_are_ignored():
    x, w, lmax, se, grad = _flce_case()
    mt = np.array([5, 7])
    a = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, np.array([0b00000000], np.uint8), mt,
                                                logits_max=lmax, sum_exp_logits=se)
    b = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, np.array([0b11111100], np.uint8), mt,
                                                logits_max=lmax, sum_exp_logits=se)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("bad_t", [-1, 128, 300])
def test_flce_high_performance_out_of_range_target_skipped_and_strict_rejects(bad_t):
    x, w, lmax, se, grad = _flce_case()
    V = w.shape[0]
    logit = w[:, 0]
    sm = np.exp(logit - lmax[0]).astype(np.float32) / se[0]
    softmax = np.stack([sm, sm]).astype(np.float32)
    mask = np.array([False, False])
    mt = np.array([bad_t, 3])
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, mt, softmax=softmax)
    # row 0: no subtraction anywhere (the device would write softmax[V*0 + t] out of range)
    g0 = (softmax[0] * grad[0]).astype(np.float32)
    g1 = softmax[1].copy()
    g1[3] -= f32(1)
    g1 = (g1 * grad[1]).astype(np.float32)
    np.testing.assert_array_equal(gw[:, 0], (g0 + g1).astype(np.float32))
    assert softmax[0].tolist() == sm.tolist()                   # input not written
    xb, wb = x.astype(BF16), w.astype(BF16)          # strict mode: bf16/fp16 only
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_cross_entropy_loss_grad(grad, xb, wb, mask, mt, softmax=softmax)
    assert e.value.status == 161002 and "masked_target" in str(e.value)
    packed = np.array([0b11111100], np.uint8)        # the packed mask too
    with fg.strict(), pytest.raises(fg.AclnnError):
        fg.fused_linear_cross_entropy_loss_grad(grad, xb, wb, packed, mt, softmax=softmax)
    # masked rows may hold anything, also in strict mode (and memory-saving mode has its check)
    with fg.strict():
        fg.fused_linear_cross_entropy_loss_grad(grad, xb, wb, np.array([True, False]), mt,
                                                softmax=softmax)
        fg.fused_linear_cross_entropy_loss_grad(grad, xb, wb, mask, mt, logits_max=lmax,
                                                sum_exp_logits=se)
    assert V == 128


def test_online_max_sum_logits_rounded_to_input_dtype_by_default():
    """Row 2: the kernel's matmul output is the input dtype; fp32 logits only on request."""
    rng = np.random.default_rng(11)
    BT, H, V = 9, 40, 77
    x = rng.standard_normal((BT, H)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((V, H)).astype(ml_dtypes.bfloat16)
    t = rng.integers(0, V, BT)
    L32 = x.astype(np.float64) @ w.astype(np.float64).T
    L16 = L32.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    for ldt, L in ((None, L16), (np.float32, L32.astype(np.float32).astype(np.float64))):
        f = fg.fused_linear_online_max_sum(x, w, t, 0, V, return_logits=True, logits_dtype=ldt)
        m = L.max(axis=1)
        np.testing.assert_allclose(f.logits_max_local, m, rtol=1e-6)   # fp32 BLAS vs float64 sums
        if ldt is None:                     # rounding to bf16 absorbs the fp32 accumulation order
            np.testing.assert_array_equal(f.logits_max_local, m.astype(np.float32))
        np.testing.assert_allclose(f.sum_exp_logits_local, np.exp(L - m[:, None]).sum(axis=1), rtol=1e-5)
        assert f.vocab_parallel_logits.dtype == (x.dtype if ldt is None else np.float32)
    assert not np.array_equal(L16, L32)          # the case distinguishes the two
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_online_max_sum(x, w, t, 0, V, logits_dtype=np.float32)
    assert e.value.status == 161002 and "logits_dtype" in str(e.value)


# ----------------------------------------------------------------------------------------
# the SoC profile setting (issue 25)
# ----------------------------------------------------------------------------------------

def test_soc_version_setting_context_env_and_default(monkeypatch):
    from fastgrad import soc

    monkeypatch.delenv("FASTGRAD_SOC_VERSION", raising=False)
    fg.set_soc_version(None)
    assert fg.get_soc_version() == "Ascend910B"                       # default: Atlas A2
    monkeypatch.setenv("FASTGRAD_SOC_VERSION", "Ascend950")
    assert fg.get_soc_version() == "Ascend950"
    fg.set_soc_version("Ascend910_93")
    try:
        assert fg.get_soc_version() == "Ascend910_93"                 # set > env
        with fg.soc_version("Ascend910B3"):                           # context > set
            assert fg.get_soc_version() == "Ascend910B3"
            assert soc.get_profile(fg.get_soc_version()).name == "Ascend910B"
        assert fg.get_soc_version() == "Ascend910_93"
    finally:
        fg.set_soc_version(None)
    assert fg.get_soc_version() == "Ascend950"
    monkeypatch.setenv("FASTGRAD_SOC_VERSION", "Ascend310P3")
    with pytest.raises(ValueError, match="FASTGRAD_SOC_VERSION"):
        fg.get_soc_version()


@pytest.mark.parametrize("name,profile", [
    ("Ascend910B", "Ascend910B"), ("ascend910b", "Ascend910B"), ("Ascend910B1", "Ascend910B"),
    ("Ascend910B4-1", "Ascend910B"), ("Ascend910_93", "Ascend910_93"), ("Ascend910_9391", "Ascend910_93"),
    ("Ascend910_9382", "Ascend910_93"), ("Ascend950", "Ascend950"), ("Ascend950PR_9599", "Ascend950"),
    ("Ascend950DT_9591", "Ascend950"),
])
def test_cann_soc_names_map_onto_the_profiles(name, profile):
    from fastgrad import soc

    assert soc.profile_name(name) == profile
    with fg.soc_version(name):
        assert fg.get_soc_version() == name


@pytest.mark.parametrize("bad", ["Ascend310P3", "Ascend910", "Ascend910A", "A2", "", "gpu", 910])
def test_unknown_soc_name_is_a_clear_value_error(bad):
    with pytest.raises(ValueError, match="Ascend910B, Ascend910_93, Ascend950"):
        fg.set_soc_version(bad)
    with pytest.raises(ValueError):
        with fg.soc_version(bad):
            pass
    assert fg.get_soc_version() == "Ascend910B"


def test_profile_table_differences():
    from fastgrad.soc import PROFILES

    a2, a3, d = PROFILES["Ascend910B"], PROFILES["Ascend910_93"], PROFILES["Ascend950"]
    assert a2.fused_linear_ops and a3.fused_linear_ops and not d.fused_linear_ops
    assert (a2.smooth_l1_kernel, d.smooth_l1_kernel) == ("tbe", "dag")
    assert (a2.softmax_grad_max_s2, a3.softmax_grad_max_s2, d.softmax_grad_max_s2) == (4096, 4096, 8192)
    assert a2.ce_grad_target_dtypes == ("int64",) and "int32" in d.ce_grad_target_dtypes
    assert a2.ce_grad_ignore_any_sign and not d.ce_grad_ignore_any_sign
