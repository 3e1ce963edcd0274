"""Strict mode against the newest ops-nn source (hicann/ops-nn e5c3fa9, the newest snapshot, and
hicann/opbase aa3cd74): each disagreement found, pinned from the source line that decides it.

The oracles here are the device's answers as the cited lines give them (success, or a status
code and the phase), not fastgrad's own behaviour; docs/device_parity.md names the rows.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fastgrad as fg

F32 = np.float32
BF16 = ml_dtypes.bfloat16
A2A3 = ["Ascend910B", "Ascend910_93"]
ALL = ["Ascend910B", "Ascend910_93", "Ascend950"]


def _status(fn, soc, strict=True):
    """The status and phase fastgrad answers (0 for success) under ``soc``."""
    try:
        with fg.soc_version(soc):
            if strict:
                with fg.strict():
                    fn()
            else:
                fn()
    except fg.AclnnError as e:
        return e.status, e.phase
    return 0, None


# --- row 3h: FLCE grad, empty input/weight with an out-of-range masked_target --------------------
# aclnn_fused_linear_cross_entropy_loss_grad.cpp:289-294 returns success for an empty input or
# weight after the shape checks (:143-213) and before any kernel: masked_target is never read.


@pytest.mark.parametrize("soc", A2A3)
@pytest.mark.parametrize("bt, h", [(4, 0), (0, 8)])
def test_flce_empty_high_performance_out_of_range_target_succeeds(soc, bt, h):
    V = 128
    mt = np.full(bt, 999, np.int64)  # outside [0, V) on every (unmasked) row
    mask = np.zeros((bt + 7) // 8, np.uint8)
    softmax = np.zeros((bt, V), F32)
    gi = np.full((bt, h), 3.0, BF16)
    gw = np.full((V, h), 3.0, BF16)
    args = (np.zeros(bt, F32), np.zeros((bt, h), BF16), np.zeros((V, h), BF16), mask, mt)
    with fg.soc_version(soc), fg.strict():
        r = fg.fused_linear_cross_entropy_loss_grad(*args, softmax=softmax, out=(gi, gw))
    assert r[0] is gi and r[1] is gw
    assert (gw.astype(F32) == 3).all()  # out= untouched, as the device writes nothing
    # not empty: the high-performance data check (row 3) still refuses it
    x = np.zeros((4, 8), BF16)
    st = _status(
        lambda: fg.fused_linear_cross_entropy_loss_grad(
            np.zeros(4, F32),
            x,
            np.zeros((V, 8), BF16),
            np.zeros(1, np.uint8),
            np.full(4, 999),
            softmax=np.zeros((4, V), F32),
        ),
        soc,
    )
    assert st == (161002, "workspace")


# --- row 9d: embedding backward, an empty grad (D = 0) with indices outside [0, num_weights) -----
# aclnn_embedding_dense_backward.cpp:154-176 (CheckParams: dtypes, ranks, CheckDimension — which
# returns true for D = 0, :105-107 — and out's shape; no value check), then :312-326: an empty
# grad or indices zero-fills out (ZerosLike) and returns success; the indices are never read.


@pytest.mark.parametrize("soc", ALL)
def test_embedding_empty_grad_reads_no_index(soc):
    grad = np.zeros((3, 0), F32)
    idx = np.array([5, -7, 100], np.int64)  # num_weights = 2: every one out of range
    out = np.zeros((2, 0), F32)
    with fg.soc_version(soc), fg.strict():
        r = fg.embedding_dense_backward(grad, idx, 2, out=out)
    assert r is out and r.shape == (2, 0)
    # D = 0 also skips the row-count relation (CheckDimension :105-107): 5 rows of grad, 3 indices
    with fg.soc_version(soc), fg.strict():
        assert fg.embedding_dense_backward(np.zeros((5, 0), F32), idx, 2).shape == (2, 0)
    # D > 0: the values are read by the kernel; an out-of-range index stays refused (161002)
    st = _status(lambda: fg.embedding_dense_backward(np.zeros((3, 4), F32), idx, 2), soc)
    assert st == (161002, "workspace")


# --- row 4n: CE grad with an empty x_grad (N = 0 or C = 0) ----------------------------------------
# CrossEntropyLossGrad has no hand-written op_api: the generated aclnn API matches the dtype
# combination (161002 when none matches, opbase aa3cd74 indv_executor.cpp:958-968) and, when
# every output is empty, skips tiling and launch (indv_executor.cpp:1075-1082, :852-858,
# indv_executor.h:400-403).  So the tiling's refusals (ops-nn e5c3fa9 op_host/
# cross_entropy_loss_grad_tiling.cpp:247-267, cross_entropy_loss_grad_tiling_arch35.cpp:344-436)
# and any read of target/weight never happen: success.


def _ce_empty(n, c, **kw):
    args = dict(
        grad_loss=np.zeros((), F32),
        log_prob=np.zeros((n, c), F32),
        target=np.zeros(n, np.int64),
        reduction="mean",
    )
    args.update(kw)
    return lambda: fg.cross_entropy_loss_grad(**args)


@pytest.mark.parametrize("soc", ALL)
def test_ce_grad_empty_output_skips_the_tiling(soc):
    # target length != N (tiling :247-254 / arch35 :368-376)
    assert _status(_ce_empty(0, 5, target=np.zeros(3, np.int64)), soc) == (0, None)
    # weight length != C (tiling :256-267 / arch35 :386-393)
    assert _status(_ce_empty(0, 5, weight=np.ones(2, F32)), soc) == (0, None)
    # grad_loss of no element for mean (arch35 :359-366; the A2 kernel would read element 0)
    assert _status(_ce_empty(0, 5, grad_loss=np.zeros(0, F32)), soc) == (0, None)
    # C = 0 with a weight: targets outside [0, C) are never looked up in weight
    assert _status(_ce_empty(3, 0, target=np.array([0, 1, 2]), weight=np.zeros(0, F32)), soc) == (0, None)
    # label smoothing: the A2/A3 kernel would write nothing (row 4i) — there is nothing to write;
    # out of [0, 1] (arch35 :427-436) and a reduction spelling the arch35 strcmp refuses
    # (:404-418) are tiling refusals too
    assert _status(_ce_empty(0, 5, label_smoothing=0.5), soc) == (0, None)
    assert _status(_ce_empty(0, 5, label_smoothing=2.0), soc) == (0, None)
    assert _status(_ce_empty(0, 5, reduction="Mean"), soc) == (0, None)
    # the generated API's dtype match still runs: grad_loss of another dtype, weight not fp32
    assert _status(_ce_empty(0, 5, grad_loss=np.zeros((), np.float16)), soc) == (161002, "workspace")
    assert _status(_ce_empty(0, 5, weight=np.ones(5, np.float16)), soc) == (161002, "workspace")
    # out= untouched, nothing written
    out = np.zeros((0, 5), F32)
    with fg.soc_version(soc), fg.strict():
        assert (
            fg.cross_entropy_loss_grad(np.zeros((), F32), np.zeros((0, 5), F32), np.zeros(0, np.int64), out=out) is out
        )


def test_ce_grad_empty_output_target_dtype_is_still_matched():
    # the A2/A3 binaries take int64 targets only (cross_entropy_loss_grad_def.cpp:44-49): the
    # dtype match happens before the empty-output skip
    assert _status(_ce_empty(0, 5, target=np.zeros(0, np.int32)), "Ascend910B") == (161002, "workspace")
    assert _status(_ce_empty(0, 5, target=np.zeros(0, np.int32)), "Ascend950") == (0, None)
    # non-empty: the tiling refusals stay (561002 in strict mode)
    st = _status(
        lambda: fg.cross_entropy_loss_grad(np.zeros((), F32), np.zeros((2, 5), F32), np.zeros(3, np.int64)),
        "Ascend910B",
    )
    assert st == (561002, "workspace")


# --- row 4o: CE grad on A2/A3, a reduction string that is not exactly none/mean/sum ---------------
# op_host/cross_entropy_loss_grad_tiling.cpp:279-297 strcmp's "none"/"mean"/"sum" with no else,
# and its caller initialises reductionKey = 0 (:323) = REDUCTION_NONE (op_kernel/
# cross_entropy_loss_grad_base.h:25,163): "Mean" or " sum" runs the kernel's 'none' reduction,
# one grad_loss element per row.


@pytest.mark.parametrize("soc", A2A3)
@pytest.mark.parametrize("spelling", ["Mean", " sum", "SUM ", "None"])
def test_ce_grad_a2_other_reduction_spelling_is_none(soc, spelling):
    rng = np.random.default_rng(3)
    lp = np.log(rng.dirichlet(np.ones(5), 4)).astype(F32)
    t = np.array([0, 3, 1, 4])
    g = np.array([0.5, -2.0, 1.25, 3.0], F32)
    p = np.exp(lp)
    want = p * g[:, None]  # the 'none' reduction: row i scaled by grad_loss[i]
    want[np.arange(4), t] = (p[np.arange(4), t] * g) - g
    with fg.soc_version(soc), fg.strict():
        got = fg.cross_entropy_loss_grad(g, lp, t, reduction=spelling)
        exact = fg.cross_entropy_loss_grad(g, lp, t, reduction="none")
    np.testing.assert_array_equal(got, exact)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # a 0-d grad_loss under it: the 'none' kernel reads grad_loss[i] past its end (fastgrad's 161002)
    st = _status(lambda: fg.cross_entropy_loss_grad(F32(1.0), lp, t, reduction=spelling), soc)
    assert st == (161002, "workspace")
    # the exact spellings keep their meaning
    with fg.soc_version(soc), fg.strict():
        m = fg.cross_entropy_loss_grad(F32(1.0), lp, t, reduction="mean")
    onehot = np.eye(5, dtype=F32)[t]
    np.testing.assert_allclose(m, (p - onehot) / 4, rtol=1e-6, atol=1e-7)


# --- row 10a: attributes the device holds as a C float ----------------------------------------
# aclnnSmoothL1LossBackwardGetWorkspaceSize(..., float beta, ...) checks beta >= 0 on the float
# (op_api/aclnn_smooth_l1_loss_backward.cpp:141-145,178-181); the FLCE grad and fused CE max-sum
# APIs take float labelSmoothing and refuse != 0 (aclnn_fused_linear_cross_entropy_loss_grad.cpp
# :133-141,260-262; aclnn_fused_cross_entropy_loss_with_max_sum.cpp:114-117,122-123); the CE grad
# attribute is a GE Float (cross_entropy_loss_grad_def.cpp:77) read as float by both tilings
# (cross_entropy_loss_grad_tiling.cpp:301-303, _arch35.cpp:427-436).  A Python float reaches
# them rounded to fp32: -1e-50 is -0.0 (>= 0, == 0), 1e-50 is 0, 1 + 1e-9 is 1.


@pytest.mark.parametrize("soc", ALL)
def test_c_float_attributes_are_checked_after_rounding_to_fp32(soc):
    x = np.zeros(4, F32)
    for beta in (-1e-50, -1e-46):
        assert _status(lambda: fg.smooth_l1_loss_backward(x, x, x, "none", beta), soc) == (0, None)
    assert _status(lambda: fg.smooth_l1_loss_backward(x, x, x, "none", -1e-40), soc) == (161002, "workspace")
    stats = (np.zeros(4, F32), np.ones(4, F32), np.zeros(4, F32))
    for ls in (1e-50, -1e-50):
        assert _status(lambda: fg.fused_cross_entropy_loss_with_max_sum(*stats, label_smoothing=ls), soc) == (0, None)
    assert _status(lambda: fg.fused_cross_entropy_loss_with_max_sum(*stats, label_smoothing=1e-30), soc)[0] == 161002
    lp = np.zeros((2, 3), F32)
    t = np.array([0, 2])
    ce = [(1e-50, (0, None))]  # fp32 0: computed as 0 on every SoC (A2/A3 accept only 0, row 4i)
    ce.append((1.0 + 1e-9, (0, None) if soc == "Ascend950" else (161002, "workspace")))  # fp32 1.0
    for ls, want in ce:
        assert _status(lambda: fg.cross_entropy_loss_grad(F32(1.0), lp, t, label_smoothing=ls), soc) == want
    with fg.soc_version(soc), fg.strict():
        a = fg.cross_entropy_loss_grad(F32(1.0), lp, t, label_smoothing=1e-50)
        b = fg.cross_entropy_loss_grad(F32(1.0), lp, t)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("soc", A2A3)
def test_flce_label_smoothing_is_checked_as_a_c_float(soc):
    BT, H, V = 4, 8, 128
    args = (np.ones(BT, F32), np.ones((BT, H), BF16), np.ones((V, H), BF16), np.zeros(1, np.uint8), np.arange(BT))
    kw = dict(logits_max=np.ones(BT, F32), sum_exp_logits=np.full(BT, float(V), F32))
    for ls in (1e-50, -1e-50):
        with fg.soc_version(soc), fg.strict():
            gi, gw = fg.fused_linear_cross_entropy_loss_grad(*args, label_smoothing=ls, **kw)
            gi0, gw0 = fg.fused_linear_cross_entropy_loss_grad(*args, **kw)
        np.testing.assert_array_equal(gi.astype(F32), gi0.astype(F32))
        np.testing.assert_array_equal(gw.astype(F32), gw0.astype(F32))
    st = _status(lambda: fg.fused_linear_cross_entropy_loss_grad(*args, label_smoothing=1e-30, **kw), soc)
    assert st == (161002, "workspace")
