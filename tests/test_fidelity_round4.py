"""Issue 46 (device fidelity, round 4): each point pinned from the ops-nn / opbase source.

Sources: hicann/ops-nn e5c3fa9, hicann/opbase aa3cd74 (``src/nnopbase/...``); docs/device_parity.md
names the rows.  The oracles here are written from the kernels, not from fastgrad.
"""

from __future__ import annotations

import numpy as np
import pytest

import fastgrad as fg
from fastgrad import _config

F32 = np.float32


# --- N1: SMSB strict, empty input: success (opbase skips tiling and launch) ----------------------

@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93", "Ascend950"])
def test_smsb_strict_empty_input_succeeds(soc):
    go = np.zeros((2, 0, 4, 8), F32)
    mask = np.zeros((1, 1, 4, 8), bool)
    out = np.full((2, 0, 4, 8), 7.0, F32)
    with fg.strict(), fg.soc_version(soc):
        assert fg.scaled_masked_softmax_backward(go, go, mask, 1.0, out=out) is out


# --- N2 / N3: CrossEntropyLossGrad codes -------------------------------------------------------

def _ce(n=3, c=5, **kw):
    rng = np.random.default_rng(0)
    args = dict(grad_loss=F32(1.0), log_prob=np.log(rng.dirichlet(np.ones(c), n)).astype(F32),
                target=np.arange(n) % c, reduction="mean")
    args.update(kw)
    return args


def _status(**kw):
    with pytest.raises(fg.AclnnError) as e:
        fg.cross_entropy_loss_grad(**kw)
    return e.value.status


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend950"])
def test_ce_grad_tiling_refusals_are_561002_in_strict_mode(soc):
    with fg.soc_version(soc):
        bad_target = _ce(target=np.zeros(4, np.int64))
        bad_weight = _ce(weight=np.ones(4, F32))
        for kw in (bad_target, bad_weight):
            assert _status(**kw) == 161002           # outside strict: fastgrad's code
            with fg.strict():
                assert _status(**kw) == 561002       # the tiling's failure (indv_executor.cpp:880-885)


def test_ce_grad_950_strict_reduction_spelling_ls_range_and_grad_loss_shape():
    with fg.soc_version("Ascend950"), fg.strict():
        assert _status(**_ce(reduction="Mean")) == 561002        # strcmp, tiling_arch35.cpp:404-418
        assert _status(**_ce(reduction=1)) == 561002
        assert _status(**_ce(label_smoothing=1.5)) == 561002     # :427-436
        assert _status(**_ce(grad_loss=np.ones(3, F32))) == 561002  # :359-366
        fg.cross_entropy_loss_grad(**_ce(reduction="mean"))
    with fg.soc_version("Ascend910B"), fg.strict():              # A2/A3: no such checks
        assert _status(**_ce(label_smoothing=1.5)) == 161002


def test_ce_grad_a2_mean_sum_reads_element_0_of_any_grad_loss():
    args = _ce(reduction="sum")
    ref = fg.cross_entropy_loss_grad(**args)
    for soc in ("Ascend910B", "Ascend910_93"):
        with fg.soc_version(soc), fg.strict():
            got = fg.cross_entropy_loss_grad(**dict(args, grad_loss=np.array([1.0, 9.0, -4.0], F32)))
        np.testing.assert_array_equal(got, ref)


# --- N4: arch35 label smoothing rounding order -------------------------------------------------

def test_ce_grad_950_label_smoothing_order_is_the_arch35_kernels():
    f = np.float32
    lp = np.zeros((1, 3), F32)
    with fg.soc_version("Ascend950"):
        got = fg.cross_entropy_loss_grad(F32(1.0), lp, np.array([1]), reduction="sum", label_smoothing=0.1)
    # arch35: c = g·(1-ls), sm = g·fl(ls/C); x = fl(e·c), x[t] -= c; out = ((e·fl(sm·C)) - sm) + x
    e, c = f(1.0), f(1.0) * (f(1.0) - f(0.1))
    sm = f(1.0) * (f(0.1) / f(3.0))
    x = e * c
    xt = x - c
    want = np.array([[(e * (sm * f(3)) - sm) + x, (e * (sm * f(3)) - sm) + xt, (e * (sm * f(3)) - sm) + x]], F32)
    np.testing.assert_array_equal(got, want)
    assert got[0, 1] == F32(0.06666668)


# --- row 4m: label smoothing with a class weight and a non-finite sm: Σ_j w_j·sm term by term ----

def _arch35_ce_grad_smooth(g, lp, t, w, reduction, ignore_index, ls):
    """ops-nn loss/cross_entropy_loss_grad/op_kernel/arch35, label smoothing, statement by
    statement in fp32: base.h:191-192 (smoothFactor = fl(ls/C), 1 - ls); none: base.h:565-605
    (c = fl(g_i·(1-ls)), sm = fl(g_i·smoothFactor), ×ignoreSelect when ignore_index >= 0), mean /
    sum: weight_not_none.h:572-630 / base.h:660-712 (element 0 of grad_loss; c = fl(fl(g·(1-ls))/W),
    sm = fl(fl(g/W)·smoothFactor), W = 1 for sum, ×ignoreSelect); with a weight c ×= weight[t]
    (weight_not_none.h:490-493,623) and the row's S = Σ_j fl(w_j·sm) **term by term**
    (ComputeLogSmoothLoss*, weight_not_none.h:218-330, then ReduceSum :392,427), without one
    S = fl(sm·C) (weight_none.h:65); x = fl(e·c), x[t] = fl(x[t] - c) (base.h:487-527); out =
    fl(fl(fl(e·S) - fl(w_j·sm)) + x_j) (weight_not_none.h:173-177, weight_none.h:85-89)."""
    f = F32
    n, c = lp.shape
    smf = f(f(ls) / f(c))
    keep = f(f(1) - f(ls))
    wv = np.ones(c, f) if w is None else np.asarray(w, f)
    gv = np.asarray(g, f).reshape(-1)
    sel = np.where((ignore_index >= 0) & (t == ignore_index), f(0), f(1)).astype(f)
    out = np.empty((n, c), f)
    with np.errstate(all="ignore"):
        W = f(1)
        if reduction == "mean":  # the per-core ReduceSum; the values used here sum exactly
            W = f(np.sum((sel * wv[t]).astype(np.float64)))
        for i in range(n):
            if reduction == "none":
                ci, sm = f(gv[i] * keep), f(gv[i] * smf)
            else:
                ci, sm = f(f(gv[0] * keep) / W), f(f(gv[0] / W) * smf)
            if ignore_index >= 0:
                ci, sm = f(ci * sel[i]), f(sm * sel[i])
            if w is not None:
                ci = f(ci * wv[t[i]])
                terms = (wv * sm).astype(f)
                s_row = f(0)
                for u in terms:  # term by term
                    s_row = f(s_row + u)
            else:
                terms = np.full(c, sm, f)
                s_row = f(sm * f(c))
            e = np.exp(lp[i].astype(f)).astype(f)
            x = (e * ci).astype(f)
            x[t[i]] = f(x[t[i]] - ci)
            out[i] = (((e * s_row).astype(f) - terms).astype(f) + x).astype(f)
    return out


def _same_placement(got, want):
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    for pred in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(pred(got), pred(want))


def _nonfinite_ce_inputs(seed, dtype, weights):
    rng = np.random.default_rng(seed)
    n, c = 6, 9
    lp = np.log(rng.dirichlet(np.ones(c), n)).astype(dtype)
    lp[1, 2], lp[2, 5], lp[3, 0] = np.inf, -np.inf, np.nan
    t = np.array([0, 3, 8, 1, 0, 4])
    w = {"mixed": rng.uniform(0, 1, c) - 0.3, "zero": np.r_[0.0, rng.uniform(0.1, 1, c - 1)],
         "positive": rng.uniform(0.1, 1, c)}[weights]
    w = np.round(w * 8) / 8  # dyadic: the mean's W sums exactly
    w[w == 0] = 0.125 if weights != "zero" else 0.0
    w[0] = 0.0 if weights == "zero" else w[0]
    if weights == "mixed":
        w[[1, 4]] = [-0.5, 0.75]
    return lp, t, w.astype(F32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("weights", ["mixed", "zero", "positive", None])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("ignore_index", [0, -100])
def test_ce_grad_950_nonfinite_sm_sums_w_sm_term_by_term(dtype, weights, reduction, ignore_index):
    lp, t, w = _nonfinite_ce_inputs(11, dtype, weights or "positive")
    w = None if weights is None else w
    ls = 0.3
    if reduction == "none":
        gs = [np.array([np.inf, -np.inf, 0.5, np.nan, -np.inf, 2.0], dtype)]
    else:
        gs = [np.array(v, dtype) for v in (np.inf, -np.inf, np.nan, 1.5)]
    for g in gs:
        want = _arch35_ce_grad_smooth(g, lp, t, w, reduction, ignore_index, ls).astype(dtype)
        with fg.soc_version("Ascend950"):
            got = fg.cross_entropy_loss_grad(g, lp, t, w, reduction=reduction, ignore_index=ignore_index,
                                             label_smoothing=ls)
            with fg.use_backend("reference"):
                ref = fg.cross_entropy_loss_grad(g, lp, t, w, reduction=reduction, ignore_index=ignore_index,
                                                 label_smoothing=ls)
        assert got.dtype == dtype
        _same_placement(got, want)
        _same_placement(ref, want)
        fin = np.isfinite(want.astype(F32))
        # finite positions: the device's reduce order is not reproduced (row 4l), a few ulps
        np.testing.assert_allclose(got.astype(F32)[fin], want.astype(F32)[fin], rtol=2e-3 if dtype == np.float16
                                   else 1e-5, atol=1e-6)


def test_ce_grad_950_mixed_sign_weights_infinite_sm_is_nan_not_inf():
    """The point of row 4m: weights of both signs, sm = +inf.  S = Σ_j w_j·sm = inf - inf = NaN on
    the device; sm·Σw would be +inf and leave ±inf at the columns whose weight has the other sign."""
    lp = np.log(np.full((2, 4), 0.25, F32))
    t = np.array([1, 2])
    w = np.array([1.0, -0.5, 0.25, -2.0], F32)  # Σw = -1.25
    with fg.soc_version("Ascend950"):
        got = fg.cross_entropy_loss_grad(F32(np.inf), lp, t, w, reduction="sum", label_smoothing=0.2)
    assert np.isnan(got).all()
    want = _arch35_ce_grad_smooth(F32(np.inf), lp, t, w, "sum", -100, 0.2)
    assert np.isnan(want).all()
    # the same weights, all of one sign: S = +inf, and only inf - inf cancels: still NaN, as before
    with fg.soc_version("Ascend950"):
        pos = fg.cross_entropy_loss_grad(F32(np.inf), lp, t, np.abs(w), reduction="sum", label_smoothing=0.2)
    _same_placement(pos, _arch35_ce_grad_smooth(F32(np.inf), lp, t, np.abs(w), "sum", -100, 0.2))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_ce_grad_a2_composite_nonfinite_sm_is_pytorchs(reduction):
    """A2/A3 outside strict compute PyTorch's composite (row 4i: the A2 kernel never writes x_grad
    with ls != 0, cross_entropy_loss_grad_weight_not_none.h:133-135,145-147).  PyTorch sums the
    -sm·w_j of its grad_output term by term too (_log_softmax_backward_data): NaN rows for an
    infinite sm with weights of both signs, in the same places as fastgrad."""
    torch = pytest.importorskip("torch")
    lp, t, w = _nonfinite_ce_inputs(3, np.float32, "mixed")
    ls = 0.3
    g = (np.array([np.inf, -np.inf, 0.5, 1.0, -np.inf, 2.0], F32) if reduction == "none"
         else np.array(np.inf, F32))
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64)
    tt = torch.tensor(t)
    nll = torch.nn.functional.nll_loss(x, tt, weight=wt, reduction=reduction)
    smooth = -(x * wt).sum(-1)
    if reduction == "sum":
        smooth = smooth.sum()
    elif reduction == "mean":
        smooth = smooth.sum() / wt[tt].sum()
    loss = (1 - ls) * nll + ls / lp.shape[1] * smooth
    (grad_lp,) = torch.autograd.grad(loss, x, torch.tensor(g, dtype=torch.float64))
    want = torch._log_softmax_backward_data(grad_lp, x.detach(), 1, torch.float64).numpy()
    with fg.soc_version("Ascend910B"):
        got = fg.cross_entropy_loss_grad(g, lp, t, w, reduction=reduction, label_smoothing=ls)
        with fg.use_backend("reference"):
            ref = fg.cross_entropy_loss_grad(g, lp, t, w, reduction=reduction, label_smoothing=ls)
    assert np.isnan(got[0]).all()  # an infinite sm with mixed weights: the whole row
    _same_placement(got, want)
    _same_placement(ref, want)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)


# --- generated inputs: the 950 message for a negative ignore_index with a weight ---------------

def test_ce_grad_950_negative_ignore_index_message_says_no_row_is_ignored():
    with fg.soc_version("Ascend950"), pytest.raises(fg.AclnnError) as e:
        fg.cross_entropy_loss_grad(**_ce(target=np.array([0, -100, 1]), weight=np.ones(5, F32), ignore_index=-100))
    msg = str(e.value)
    assert "or ignore_index (-100)" not in msg and "ignores no row" in msg and "got target[1] = -100" in msg


# --- N5 / N8: FusedCE on 950, and the run phase ------------------------------------------------

def test_fused_ce_950_bt0_v0_fail_in_the_run_phase():
    z = np.zeros(0, F32)
    o = np.ones(2, F32)
    with fg.strict(), fg.soc_version("Ascend950"):
        for args, kw in (((z, z, z), {}), ((o, o, o), dict(vocab_parallel_logits=np.zeros((2, 0), F32)))):
            with pytest.raises(fg.AclnnError) as e:
                fg.fused_cross_entropy_loss_with_max_sum(*args, **kw)
            assert e.value.status == 561103 and e.value.phase == "run"
            assert "run call" in str(e.value)
    with fg.strict():  # A2: its tiling has no such check
        fg.fused_cross_entropy_loss_with_max_sum(z, z, z)


def test_floms_950_no_kernel_fails_in_the_run_phase():
    x = np.zeros((2, 4), np.float16)
    with fg.strict(), fg.soc_version("Ascend950"), pytest.raises(fg.AclnnError) as e:
        fg.fused_linear_online_max_sum(x, x, np.zeros(2, np.int64), 0, 2)
    assert e.value.status == 561103 and e.value.phase == "run"


def test_op_api_refusals_are_in_the_workspace_phase():
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.cross_entropy_loss_grad(**_ce(target=np.zeros(4, np.int64)))
    assert e.value.phase == "workspace"
    with pytest.raises(fg.AclnnError) as e:
        fg.cross_entropy_loss_grad(None, np.zeros((1, 2), F32), np.zeros(1, np.int64))
    assert e.value.status == 161001 and e.value.phase == "workspace"


# --- N6: embedding of a scalar index ----------------------------------------------------------

def test_embedding_strict_accepts_f_embedding_scalar_index_backward():
    torch = pytest.importorskip("torch")
    w = torch.randn(5, 3, requires_grad=True)
    y = torch.nn.functional.embedding(torch.tensor(2), w)
    g = torch.randn(3)
    y.backward(g)
    with fg.strict():
        got = fg.embedding_dense_backward(g, torch.tensor(2), 5)
    assert torch.equal(got, w.grad)


# --- N7: the deterministic kernel's summation order --------------------------------------------

def _determinist_kernel(grad, idx, nw, padding_idx, aiv):
    """EmbeddingDenseGradV2DeterministKernel (ops-nn embedding_dense_grad_v2_determinist.h), one
    core after the other, transcribed statement by statement (fp32, no scaling)."""
    n, d = grad.shape
    order = np.argsort(idx, kind="stable")                 # the stable sort, posIdx
    sidx = idx[order]
    cores = min(aiv, n)                                    # tiling.cpp:298-300
    tail, rep = n // cores, n % cores                      # Tiling4Deterministic :195-197
    former = tail + 1
    out = np.zeros((nw, d), F32)
    pad = padding_idx if padding_idx >= 0 else None        # uint64 compare: a negative one never matches
    for b in range(cores):                                 # InitParams :75-115
        rows = former if b < rep else tail
        off = former * min(b, rep) + tail * max(0, b - rep)
        acc = [np.zeros(d, F32), np.zeros(d, F32)]
        cnt = [0, 0]
        st = {"sw": 0, "last": -1}

        def copy_out(a, ind):                              # CopyOut :247-268 (atomic add)
            out[ind] = out[ind] + acc[a]
            acc[a] = np.zeros(d, F32)
            cnt[a] = 0

        def compute(p, limit):                             # ComputeAndCopyOut :198-221
            cur = int(sidx[off + p])
            if cur != pad:
                switch = st["last"] != -1 and cur != st["last"]
                if switch:                                 # CheckIsNeedSwitchAddQue :223-231
                    st["sw"] ^= 1
                    cnt[st["sw"]] = 0
                acc[st["sw"]] = acc[st["sw"]] + grad[order[off + p]]
                cnt[st["sw"]] += 1
                if cnt[st["sw"]] == 10 or p == limit:
                    copy_out(st["sw"], cur)
                if switch:
                    copy_out(st["sw"] ^ 1, st["last"])
                st["last"] = cur
            elif st["last"] != -1:
                copy_out(st["sw"], st["last"])
                st["last"] = -1

        stand = -1 if b == 0 else int(sidx[off - 1])       # InitStandIndice
        cont = True
        for j in range(rows - 1, -1, -1):                  # SubProcess :58-73
            if int(sidx[off + j]) == stand:
                cont = j != rows - 1
                if st["last"] != -1:
                    copy_out(st["sw"], st["last"])
                break
            compute(j, 0)
        if cont:                                           # ContinueCompute :270-284
            st["last"] = -1
            stand = int(sidx[off + rows - 1])
            for i in range(rows, n - off):
                if int(sidx[off + i]) != stand:
                    if st["last"] != -1:
                        copy_out(st["sw"], st["last"])
                    break
                compute(i, n - off - 1)
    return out


def test_deterministic_embedding_issue_example():
    g = np.array([[1.0], [2.0**-24], [2.0**-24]], F32)
    i = np.array([0, 0, 0])
    assert fg.embedding_dense_backward(g, i, 1)[0, 0] == F32(1.0)
    with _config.deterministic():
        assert fg.embedding_dense_backward(g, i, 1)[0, 0] == F32(1.0000001)


@pytest.mark.parametrize("chip,aiv", [("Ascend910B1", 48), ("Ascend910B3", 40), ("Ascend910B4", 40),
                                      ("Ascend910_9391", 48)])
@pytest.mark.parametrize("n,nw,pad", [(7, 3, -1), (97, 5, 2), (500, 11, -1), (1000, 40, 3)])
def test_deterministic_embedding_is_the_kernels_order(chip, aiv, n, nw, pad):
    rng = np.random.default_rng(n + nw)
    idx = rng.integers(0, nw, n)
    idx[rng.random(n) < 0.5] = rng.integers(0, 2)          # long runs of a few indices
    grad = (rng.standard_normal((n, 4)) * np.exp2(rng.integers(-12, 12, (n, 1)))).astype(F32)
    assert fg.soc.get_profile(chip).aiv_cores == aiv
    want = _determinist_kernel(grad, idx, nw, pad, aiv)
    with fg.soc_version(chip), _config.deterministic():
        got = fg.embedding_dense_backward(grad, idx, nw, padding_idx=pad)
        got16 = fg.embedding_dense_backward(grad, idx, nw, padding_idx=pad, out=np.empty((nw, 4), F32))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got16, want)


def test_deterministic_mode_is_off_on_950_and_by_default():
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 3, 200)
    grad = (rng.standard_normal((200, 2)) * np.exp2(rng.integers(-20, 20, (200, 1)))).astype(F32)
    base = fg.embedding_dense_backward(grad, idx, 3)
    with fg.soc_version("Ascend950"), _config.deterministic():
        np.testing.assert_array_equal(fg.embedding_dense_backward(grad, idx, 3), base)
    with _config.deterministic():
        assert not np.array_equal(fg.embedding_dense_backward(grad, idx, 3), base)


# --- row 3g: which check fires first for FLCE's out-of-range masked_target on 950 ---------------

def test_flce_950_out_of_range_target_is_the_platform_error():
    BT, H, V = 4, 8, 2048
    x = np.zeros((BT, H), np.float16)
    w = np.zeros((V, H), np.float16)
    args = (np.ones(BT, F32), x, w, np.zeros(1, np.uint8), np.full(BT, V + 5, np.int64))
    kw = dict(softmax=np.zeros((BT, V), F32))
    with fg.strict():
        with pytest.raises(fg.AclnnError) as e:
            fg.fused_linear_cross_entropy_loss_grad(*args, **kw)
        assert e.value.status == 161002 and e.value.param == "masked_target"   # A2: row 3
        with fg.soc_version("Ascend950"), pytest.raises(fg.AclnnError) as e:
            fg.fused_linear_cross_entropy_loss_grad(*args, **kw)
        assert e.value.status == 361001                                       # the op_api's :317


# --- row 5f: smooth-L1 on 950 with 0 < beta < 1e-6 -----------------------------------------------

def _arch35_smooth_l1_dag(predict, label, dout, sigma, reduction):
    """ops-nn loss/smooth_l1_loss_grad_v2, statement by statement, in fp32 (PromteT = float):
    the tiling (op_host/arch35/smooth_l1_loss_grad_v2_tiling.cpp) — doutIsScalar for a 1-element
    dout (:87-97), reduceMeanCof = float(1.0 / (double)n) for mean (:110-127), sigma, negSigma =
    -sigma, invertSigma = fabsf(sigma) < 1e-6f ? NAN : 1 / sigma (:138-145) — and the DAG
    (op_kernel/arch35/smooth_l1_loss_grad_v2_dag.h): SmoothL1LossGradV2OpDag (:61-87, strict
    compares) or SmoothL1LossGradV2OpScalarDag (:112-138, >= / <=)."""
    f = np.float32
    shape = np.broadcast_shapes(predict.shape, label.shape, dout.shape)
    p, lab, do = (np.broadcast_to(a, shape).astype(f) for a in (predict, label, dout))
    scalar = dout.size == 1
    sig = f(sigma)
    neg_sig = f(-1.0) * sig
    inv = f(np.nan) if abs(sig) < f(1e-6) else f(f(1) / sig)
    cof = f(1.0 / predict.size) if reduction == "mean" else f(1.0)
    with np.errstate(invalid="ignore"):
        x = p - lab                                                   # OpX
        xabs = np.abs(x)                                              # OpXAbs
        x_inv = x * inv                                               # OpXInvertSigma (Muls)
        if scalar:
            c_neg, c_pos, c_x = x <= neg_sig, x >= sig, xabs >= sig   # LE, GE, GE
        else:
            c_neg, c_pos, c_x = x < neg_sig, x > sig, xabs > sig      # LT, GT, GT
        sel_pos = np.where(c_pos, f(1), f(0))                         # OpSelectPos
        sel_neg = np.where(c_neg, f(-1), f(0))                        # OpSelectNeg
        sel_x = np.where(c_x, f(0), x_inv)                            # OpSelectX
        res = ((sel_pos + sel_neg) + sel_x) * do                      # OpAddPosNeg, OpAdd, OpRes
        return (res * cof).astype(f)                                  # Mul0


@pytest.mark.parametrize("beta", [0.0, 5e-7, 9.99e-7, 1e-12, 1e-39, 1e-6, 1.5e-6])
@pytest.mark.parametrize("dout_shape", [(), (1,), (7,)])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_smooth_l1_950_beta_below_1e6_is_the_arch35_nan(beta, dout_shape, reduction):
    b = F32(beta)
    d = np.array([0.0, -0.0, b / 2, -b / 2, b, -b, np.nextafter(b, F32(1)), -np.nextafter(b, F32(1)),
                  1.0, -3.0], F32)
    label = np.zeros(7, F32) + F32(0.25)
    rows = []
    for k in range(0, d.size, 7):
        chunk = np.resize(d[k:k + 7], 7)
        rows.append(chunk)
    rng = np.random.default_rng(5)
    for chunk in rows:
        predict = (chunk + label).astype(F32)
        dout = (rng.random(dout_shape) + 0.5).astype(F32)
        want = _arch35_smooth_l1_dag(predict, label, dout, beta, reduction)
        with fg.soc_version("Ascend950"):
            got = fg.smooth_l1_loss_backward(dout, predict, label, reduction, beta)
        np.testing.assert_array_equal(got, want)
    # the point of the row: below fp32(1e-6) the quadratic zone is NaN, outside it ±dout·cof
    if b < F32(1e-6):
        with fg.soc_version("Ascend950"):
            got = fg.smooth_l1_loss_backward(np.ones(2, F32), np.array([0.0, 2.0], F32), np.zeros(2, F32),
                                             "none", beta)
        assert np.isnan(got[0]) and got[1] == 1.0
        with fg.soc_version("Ascend910B"):                            # the TBE kernel: d/(β + 1e-6)
            assert np.isfinite(fg.smooth_l1_loss_backward(np.ones(2, F32), np.array([0.0, 2.0], F32),
                                                          np.zeros(2, F32), "none", beta)).all()


def test_smooth_l1_950_16bit_below_1e6_is_nan_in_the_zone():
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    predict = np.array([0.0, 1.0, -2.0], bf)
    label = np.zeros(3, bf)
    for dt in (bf, np.dtype(np.float16)):
        p, lab = predict.astype(dt), label.astype(dt)
        want = _arch35_smooth_l1_dag(p, lab, np.ones(3, dt), 5e-7, "none").astype(dt)
        with fg.soc_version("Ascend950"):
            got = fg.smooth_l1_loss_backward(np.ones(3, dt), p, lab, "none", 5e-7)
        assert got.dtype == dt
        np.testing.assert_array_equal(got.astype(F32), want.astype(F32))
        assert np.isnan(got[0].astype(F32)) and got[1] == 1 and got[2] == -1


# --- N8: AclnnError.phase is a declared attribute, kept by pickling; N7: the exports ------------

def test_aclnn_error_phase_is_declared_and_pickled():
    import pickle

    e = fg.AclnnError(561103, "no kernel", "input")
    assert e.phase == "workspace" and fg.AclnnError.phase == "workspace"
    r = fg.AclnnError(561103, "no kernel", "input", phase="run")
    back = pickle.loads(pickle.dumps(r))
    assert type(back) is type(r) and back.phase == "run" and back.status == 561103 and back.param == "input"
    p = pickle.loads(pickle.dumps(fg.AclnnError(161002, "bad", "x")))
    assert isinstance(p, fg.AclnnParamError) and p.phase == "workspace"
    with pytest.raises(ValueError, match="phase"):
        fg.AclnnError(161002, "bad", phase="launch")
    # the strict run-phase refusal of row 0a survives a round trip to a worker and back
    x = np.zeros((3, 4), np.float16)
    with fg.strict(), fg.soc_version("Ascend950"), pytest.raises(fg.AclnnError) as ei:
        fg.fused_linear_online_max_sum(x, np.zeros((5, 4), np.float16), np.zeros(3, np.int64), 0, 5)
    assert ei.value.phase == "run" and pickle.loads(pickle.dumps(ei.value)).phase == "run"


def test_deterministic_mode_is_exported():
    assert fg.deterministic is _config.deterministic
    assert fg.set_deterministic is _config.set_deterministic
    assert fg.is_deterministic is _config.is_deterministic
    assert {"deterministic", "set_deterministic", "is_deterministic"} <= set(fg.__all__)
    assert not fg.is_deterministic()
    with fg.deterministic():
        assert fg.is_deterministic()
    assert not fg.is_deterministic()
