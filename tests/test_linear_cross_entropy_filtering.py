"""Gradient filtering (``filter_eps``) of the fused training loss (``fastgrad.linear_cross_entropy``
and ``fastgrad.torch.linear_cross_entropy``): the docstring's error bound against the unfiltered
result over distributions from uniform to sharply peaked, bf16/fp16/fp32, with and without the
features; exactness when nothing is skipped; the skipped set; refusals."""

import ml_dtypes
import numpy as np
import pytest
from common import sharp_problem as _problem

import fastgrad as fg

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]
FEATURES = {
    "plain": {},
    "softcap": {"softcap": 50.0},
    "smoothing": {"label_smoothing": 0.1},
    "ce_weight": {"ce_weight": True},
    "zloss_temperature": {"lse_square_scale": 1e-3, "temperature": 0.7},
}


def _kw(rng, feature, V):
    kw = dict(FEATURES[feature])
    if kw.pop("ce_weight", False):
        kw["ce_weight"] = rng.uniform(0.2, 2.0, V).astype(np.float32)
    return kw


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _row_scale(t, kw, reduction="mean", ignore_index=-100):
    """c_r of the docstring: the upstream gradient (1) times 1/Σ_valid w[t] for mean."""
    valid = t != ignore_index
    wt = valid.astype(np.float64) if kw.get("ce_weight") is None else \
        np.where(valid, _f64(kw["ce_weight"])[np.where(valid, t, 0)], 0.0)
    c = 1.0 / wt.sum() if reduction == "mean" else 1.0
    return np.where(valid, c, 0.0)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sharpness", [0.0, 1.0, 3.0, 8.0])
def test_error_bound_against_unfiltered(dtype, sharpness, feature):
    rng = np.random.default_rng(int(sharpness * 10) + 7)
    BT, H, V = 300, 48, 1337              # two filter row blocks, a ragged last column block
    x, w, t = _problem(rng, BT, H, V, dtype, sharpness, vocab_used=200)
    t[::37] = -100                        # some ignored rows
    kw = _kw(rng, feature, V)
    b = (rng.standard_normal(V) * 0.1).astype(dtype)
    dense = fg.linear_cross_entropy(x, w, t, b, return_grad=True, **kw)
    eps = 2.0 ** -12 if dtype != np.float32 else 2.0 ** -20
    filt = fg.linear_cross_entropy(x, w, t, b, return_grad=True, filter_eps=eps, **kw)
    st = filt.filter_stats
    assert st["filter_eps"] == eps and st["blocks_total"] == 2 * -(-V // 64)
    # the loss, the statistics and grad_bias are exact
    for name in ("loss", "z_loss", "lse", "predicted", "grad_bias"):
        np.testing.assert_array_equal(getattr(filt, name), getattr(dense, name))
    c = _row_scale(t, kw)
    xa, wa = np.abs(_f64(x)), np.abs(_f64(w))
    # the docstring's bound, taking every block as skipped (an upper bound on the skipped set)
    bound_gi = eps * c[:, None] * wa.sum(axis=0)[None, :]
    bound_gw = eps * (c[:, None] * xa).sum(axis=0)[None, :]
    for got, ref, bound in ((filt.grad_input, dense.grad_input, bound_gi),
                            (filt.grad_weight, dense.grad_weight, bound_gw)):
        got, ref = _f64(got), _f64(ref)
        slack = 1e-5 * np.abs(ref).max() + 1e-30          # fp32 summation order of the GEMMs
        assert np.all(np.abs(got - ref) <= bound + slack)
    if sharpness >= 8.0 and feature != "smoothing":
        assert st["blocks_skipped"] > 0            # a peaked softmax leaves negligible blocks
    if st["blocks_skipped"] == 0:
        np.testing.assert_array_equal(filt.grad_input, dense.grad_input)
        np.testing.assert_array_equal(filt.grad_weight, dense.grad_weight)


def test_skipped_set_is_the_negligible_blocks():
    """filter_eps = 1: every non-target |p - onehot| < 1, so exactly the blocks holding a target
    of their row block are kept — checked against a float64 product over those blocks."""
    rng = np.random.default_rng(5)
    BT, H, V = 300, 16, 1000
    x, w, t = _problem(rng, BT, H, V, np.float32, 1.0, vocab_used=150)
    r = fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps=1.0)
    keep = np.zeros((2, -(-V // 64)), bool)
    for k, (r0, r1) in enumerate(((0, 256), (256, BT))):
        keep[k, t[r0:r1] // 64] = True
    assert r.filter_stats["blocks_skipped"] == keep.size - keep.sum()
    z = _f64(x) @ _f64(w).T
    p = np.exp(z - _f64(r.lse)[:, None])
    p[np.arange(BT), t] -= 1
    G = p / BT
    for k, (r0, r1) in enumerate(((0, 256), (256, BT))):
        cols = np.repeat(~keep[k], 64)[:V]
        G[r0:r1, cols] = 0
    np.testing.assert_allclose(r.grad_input, G @ _f64(w), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(r.grad_weight, G.T @ _f64(x), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES + [np.dtype(np.float64)], ids=str)
def test_nothing_skipped_is_bitwise_dense(dtype):
    rng = np.random.default_rng(3)
    x, w, t = _problem(rng, 70, 16, 400, dtype, 0.5)
    dense = fg.linear_cross_entropy(x, w, t, return_grad=True, softcap=20.0)
    filt = fg.linear_cross_entropy(x, w, t, return_grad=True, softcap=20.0, filter_eps=1e-30)
    assert filt.filter_stats["blocks_skipped"] == 0
    for name in ("loss", "grad_input", "grad_weight"):
        np.testing.assert_array_equal(getattr(filt, name), getattr(dense, name))
    assert dense.filter_stats is None


def test_recompute_path_filters_the_same():
    """The backward from a saved lse (reduction='none', fused=False) filters as the fused one."""
    rng = np.random.default_rng(8)
    x, w, t = _problem(rng, 200, 48, 900, BF16, 8.0, vocab_used=100)
    go = rng.uniform(0.5, 1.5, 200)
    a = fg.linear_cross_entropy(x, w, t, return_grad=True, reduction="none", grad_output=go,
                                filter_eps="auto")
    b = fg.linear_cross_entropy(x, w, t, return_grad=True, reduction="none", grad_output=go,
                                lse=a.lse, filter_eps="auto")
    assert a.filter_stats["blocks_skipped"] > 0 and b.filter_stats == a.filter_stats
    np.testing.assert_array_equal(a.grad_input, b.grad_input)
    np.testing.assert_array_equal(a.grad_weight, b.grad_weight)


def test_ignored_rows_are_skipped_exactly():
    rng = np.random.default_rng(9)
    x, w, t = _problem(rng, 300, 16, 700, np.float32, 0.0)
    t[20:] = -100                         # the second filter row block is entirely ignored
    dense = fg.linear_cross_entropy(x, w, t, return_grad=True)
    filt = fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps=1e-30)
    assert filt.filter_stats["blocks_skipped"] == -(-700 // 64)
    # the same sums in another grouping (the kept blocks' GEMMs, not the dense grid): fp32
    # rounding of the largest gradient, not of each (cancelling) element
    np.testing.assert_allclose(filt.grad_weight, dense.grad_weight, rtol=1e-6, atol=1e-6 * np.abs(dense.grad_weight).max())
    np.testing.assert_array_equal(filt.grad_input[20:], 0)


def test_auto_and_refusals():
    rng = np.random.default_rng(1)
    for dtype, want in ((BF16, 2.0 ** -12), (np.float16, 2.0 ** -15), (np.float32, 2.0 ** -28),
                        (np.float64, 2.0 ** -57)):
        x, w, t = _problem(rng, 8, 4, 20, np.dtype(dtype), 1.0)
        r = fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps="auto")
        assert r.filter_stats["filter_eps"] == want
    x, w, t = _problem(rng, 8, 4, 130, BF16, 1.0)
    for bad in (0.0, -1.0, 2.0, "fast", True, float("nan"), [1e-3]):
        with pytest.raises(fg.AclnnError) as e:
            fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps=bad)
        assert e.value.status == 161002 and "filter_eps" in str(e.value)
    with fg.strict(), pytest.raises(fg.AclnnError) as e:
        fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps="auto")
    assert e.value.status == 161002 and "filter_eps" in str(e.value)


def test_deterministic_across_threads():
    rng = np.random.default_rng(4)
    x, w, t = _problem(rng, 300, 48, 2000, BF16, 8.0, vocab_used=300)
    with fg.num_threads(1):
        a = fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps="auto")
    with fg.num_threads(2):
        b = fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps="auto")
    assert a.filter_stats["blocks_skipped"] > 0
    np.testing.assert_array_equal(a.grad_input, b.grad_input)
    np.testing.assert_array_equal(a.grad_weight, b.grad_weight)


def test_small_workspace_many_row_blocks_and_chunks(monkeypatch):
    """Several row blocks and vocabulary chunks (gathers across chunk boundaries)."""
    from common import workspace_budget

    from fastgrad.ops import linear_cross_entropy as op

    rng = np.random.default_rng(6)
    x, w, t = _problem(rng, 130, 48, 3000, BF16, 8.0, vocab_used=400)
    dense = fg.linear_cross_entropy(x, w, t, return_grad=True)
    monkeypatch.setattr(op, "V_CHUNK", 1000)          # not a multiple of the 64-column block
    with workspace_budget(40 * 3000 * 4):              # 40-row blocks
        filt = fg.linear_cross_entropy(x, w, t, return_grad=True, filter_eps="auto")
    st = filt.filter_stats
    assert st["blocks_total"] == 4 * -(-3000 // 64) and st["blocks_skipped"] > 0
    bound = 2.0 ** -12 / 130 * np.abs(_f64(w)).sum(axis=0)
    assert np.all(np.abs(_f64(filt.grad_input) - _f64(dense.grad_input)) <= bound + 1e-9)
    bound_w = 2.0 ** -12 / 130 * np.abs(_f64(x)).sum(axis=0)
    assert np.all(np.abs(_f64(filt.grad_weight) - _f64(dense.grad_weight)) <= bound_w + 1e-9)


# ---------------------------------------------------------------------------- torch face

torch = pytest.importorskip("torch")


def _torch_grads(h, w, t, **kw):
    import fastgrad.torch as ft

    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = ft.linear_cross_entropy(hh, ww, t, **kw)
    (loss.sum() * 1.5).backward()
    return loss.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_torch_tiny_eps_equals_dense(dtype, reduction):
    rng = np.random.default_rng(11)
    x, w, t = _problem(rng, 90, 16, 500, np.float32, 0.5)
    h, W, tt = torch.from_numpy(x).to(dtype), torch.from_numpy(w).to(dtype), torch.from_numpy(t)
    ref = _torch_grads(h, W, tt, reduction=reduction)
    got = _torch_grads(h, W, tt, reduction=reduction, filter_eps=1e-30)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_filtered_matches_the_op(reduction):
    import fastgrad.torch as ft

    rng = np.random.default_rng(12)
    x, w, t = _problem(rng, 200, 48, 1500, BF16, 8.0, vocab_used=200)
    h, W, tt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16),
                torch.from_numpy(w.view(np.int16)).view(torch.bfloat16), torch.from_numpy(t))
    with fg.gemm("blas"):  # the op's engine: the bits of the two faces are compared
        _, gi, gw = _torch_grads(h, W, tt, reduction=reduction, filter_eps="auto", softcap=60.0)
    go = np.full(200, 1.5) if reduction == "none" else 1.5
    r = fg.linear_cross_entropy(x, w, t, return_grad=True, reduction=reduction, grad_output=go,
                                filter_eps="auto", softcap=60.0)
    assert r.filter_stats["blocks_skipped"] > 0
    want_gi = torch.from_numpy(np.asarray(r.grad_input)).to(torch.bfloat16)
    want_gw = torch.from_numpy(np.asarray(r.grad_weight)).to(torch.bfloat16)
    if reduction == "none":               # the recompute path: the op's own output
        assert torch.equal(gi, want_gi) and torch.equal(gw, want_gw)
    else:                                 # fused: computed with grad 1, scaled by 1.5 in fp32
        torch.testing.assert_close(gi.float(), want_gi.float(), rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(gw.float(), want_gw.float(), rtol=2 ** -7, atol=1e-6)
    dense = _torch_grads(h, W, tt, reduction=reduction, softcap=60.0)
    bound = 2.0 ** -12 * 1.5 / (200 if reduction == "mean" else 1) * torch.from_numpy(np.abs(_f64(w)).sum(0))
    assert torch.all((gi.double() - dense[1].double()).abs() <= bound + 2 ** -7 * dense[1].double().abs() + 1e-9)
    loss_fn = ft.LinearCrossEntropyLoss(reduction=reduction, softcap=60.0, filter_eps="auto")
    hh, ww = h.clone().requires_grad_(), W.clone().requires_grad_()
    with fg.gemm("blas"):
        (loss_fn(hh, ww, tt).sum() * 1.5).backward()
    assert torch.equal(hh.grad, gi) and torch.equal(ww.grad, gw)


def test_torch_refusals():
    import fastgrad.torch as ft

    h, W = torch.randn(4, 8), torch.randn(20, 8)
    t = torch.randint(0, 20, (4,))
    for kw in ({"filter_eps": 0.0}, {"filter_eps": "x"}, {"filter_eps": "auto", "precision": "device"}):
        with pytest.raises(fg.AclnnError) as e:
            ft.linear_cross_entropy(h.requires_grad_(), W, t, **kw)
        assert e.value.status == 161002 and "filter_eps" in str(e.value)
    with fg.strict():
        for kw in ({"filter_eps": "auto"}, {"filter_eps": "auto", "precision": "accurate"}):
            with pytest.raises(fg.AclnnError) as e:
                ft.linear_cross_entropy(h, W, t, **kw)
            assert e.value.status == 161002 and "filter_eps" in str(e.value)
