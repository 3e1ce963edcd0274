"""fastgrad.linear_cross_entropy (the training op) and fastgrad.torch.linear_cross_entropy's
Liger/CCE keywords, against PyTorch float64 autograd of the materialized formula (an oracle
written here from the contract), gradcheck in float64, and the bf16 accuracy target."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from common import bf16_grad_errors, bf16_lm_inputs  # noqa: E402

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402

IGN = -100


def _oracle_logits(h, w, t, bias, softcap, temperature, shift):
    """(z [BT, V], the shifted targets) of the materialized computation (autograd)."""
    if shift:
        tt = torch.full_like(t, IGN)
        tt[..., :-shift] = t[..., shift:]
        t = tt
    H = h.shape[-1]
    z = h.reshape(-1, H) @ w.T
    if bias is not None:
        z = z + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature, t


def _oracle(h, w, t, *, bias=None, ce_weight=None, label_smoothing=0.0, softcap=None,
            temperature=1.0, lse_square_scale=0.0, reduction="mean", shift=0, dtype=torch.float64):
    """(loss, z_loss, accuracy) of the materialized computation in ``dtype`` (autograd)."""
    z, t = _oracle_logits(h, w, t, bias, softcap, temperature, shift)
    tf = t.reshape(-1)
    valid = tf != IGN
    cw = None if ce_weight is None else ce_weight.to(dtype)
    ce = F.cross_entropy(z, tf, weight=cw, ignore_index=IGN, reduction=reduction,
                         label_smoothing=label_smoothing)
    lse = torch.logsumexp(z, 1)
    zl = torch.where(valid, lse_square_scale * lse * lse, torch.zeros_like(lse))
    acc_rows = ((z.argmax(1) == tf) & valid).to(dtype)
    if reduction == "mean":
        zr = zl.sum() / valid.sum()
        acc = acc_rows.sum() / valid.sum()
    elif reduction == "sum":
        zr = zl.sum()
        acc = acc_rows.sum() / valid.sum()
    else:
        zr, acc = zl, acc_rows
    loss = ce + zr
    if reduction == "none":
        shp = tuple(t.shape)
        loss, zr, acc = loss.reshape(shp), zr.reshape(shp), acc.reshape(shp)
        if shift:
            loss, zr, acc = (x[..., :-shift] for x in (loss, zr, acc))
    return loss, zr, acc


def _data(B, T, H, V, dtype, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / H ** 0.5)
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    t = torch.randint(0, V, (B, T), generator=g)
    t[0, ::3] = IGN
    return h.to(dtype), w.to(dtype), b.to(dtype), cw, t


FEATURES = [
    {},
    {"bias": True},
    {"ce_weight": True},
    {"softcap": 2.5},
    {"temperature": 0.7},
    {"lse_square_scale": 1e-2},
    {"label_smoothing": 0.1},
    {"label_smoothing": 0.2, "ce_weight": True, "bias": True},
    {"shift": 1},
    {"softcap": 3.0, "temperature": 1.3, "lse_square_scale": 1e-3, "bias": True},
]


def _kw(feat, b, cw):
    kw = dict(feat)
    kw["bias"] = b if feat.get("bias") else None
    kw["ce_weight"] = cw if feat.get("ce_weight") else None
    return kw


def _run_fg(h, w, t, kw, reduction, go, fused):
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    bb = kw["bias"].detach().clone().requires_grad_() if kw["bias"] is not None else None
    out = ft.linear_cross_entropy(hh, ww, t, reduction=reduction, return_z_loss=True,
                                  return_token_accuracy=True, fused=fused,
                                  **{**kw, "bias": bb})
    out.loss.backward(go)
    return out, hh.grad, ww.grad, (bb.grad if bb is not None else None)


@pytest.mark.parametrize("feat", FEATURES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp32_features_match_float64_autograd(feat, reduction):
    fused = reduction != "none" and (hash(str(feat)) % 2 == 0 or "bias" in feat)
    h, w, b, cw, t = _data(2, 9, 24, 67, torch.float32, seed=len(str(feat)))
    kw = _kw(feat, b, cw)
    shp = t.shape if reduction == "none" else ()
    if reduction == "none" and feat.get("shift"):
        shp = (t.shape[0], t.shape[1] - feat["shift"])
    go = torch.rand(shp, dtype=torch.float64) + 0.5
    out, gh, gw, gb = _run_fg(h, w, t, kw, reduction, go.float(), fused)
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = kw["bias"].double().requires_grad_() if kw["bias"] is not None else None
    loss, zr, acc = _oracle(h64, w64, t, reduction=reduction, **{**kw, "bias": b64})
    loss.backward(go)
    assert out.loss.dtype == torch.float32 and out.loss.shape == loss.shape
    np.testing.assert_allclose(out.loss.detach().double(), loss.detach(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(out.z_loss.double(), zr.detach(), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(out.token_accuracy.double(), acc, rtol=1e-6, atol=1e-7)
    for a, r in ((gh, h64.grad), (gw, w64.grad)) + (((gb, b64.grad),) if gb is not None else ()):
        scale = r.abs().max().item()
        assert (a.double() - r).abs().max().item() <= 2e-5 * scale + 1e-9


@pytest.mark.parametrize("feat", [FEATURES[0], FEATURES[7], FEATURES[9], FEATURES[8]],
                         ids=["plain", "ls-cw-bias", "cap-temp-z-bias", "shift"])
@pytest.mark.parametrize("reduction,fused", [("mean", True), ("sum", False), ("none", None)])
def test_gradcheck_float64(feat, reduction, fused):
    h, w, b, cw, t = _data(2, 3, 4, 7, torch.float64, seed=3)
    kw = _kw(feat, b, cw)
    h.requires_grad_()
    w.requires_grad_()
    args = [h, w]
    if kw["bias"] is not None:
        args.append(kw["bias"].requires_grad_())

    def fn(*a):
        k = dict(kw)
        if len(a) == 3:
            k["bias"] = a[2]
        return ft.linear_cross_entropy(a[0], a[1], t, reduction=reduction, fused=fused, **k)

    assert torch.autograd.gradcheck(fn, tuple(args), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_numpy_op_matches_and_recompute_equals_fused():
    h, w, b, cw, t = _data(1, 40, 16, 300, torch.float32, seed=9)
    x, W, bb, tt = h[0].numpy(), w.numpy(), b.numpy(), t[0].numpy()
    kw = dict(ce_weight=cw.numpy(), label_smoothing=0.1, softcap=4.0, lse_square_scale=1e-3)
    r = fg.linear_cross_entropy(x, W, tt, bb, return_grad=True, **kw)
    r2 = fg.linear_cross_entropy(x, W, tt, bb, return_grad=True, lse=r.lse, **kw)
    assert isinstance(r.loss, np.ndarray) and r2.loss is None
    for a, c in ((r.grad_input, r2.grad_input), (r.grad_weight, r2.grad_weight),
                 (r.grad_bias, r2.grad_bias)):
        np.testing.assert_array_equal(a, c)


def test_row_blocks_do_not_change_results():
    """A tiny budget (many row blocks, one vocabulary chunk per GEMM) gives the same numbers."""
    from fastgrad import tiling

    h, w, b, cw, t = _data(3, 50, 32, 1000, torch.bfloat16, seed=4)
    x, W, tt = h.reshape(-1, 32), w, t.reshape(-1)
    full = fg.linear_cross_entropy(x, W, tt, return_grad=True)
    tiling.set_workspace_budget(40 * 1000 * 4)
    try:
        small = fg.linear_cross_entropy(x, W, tt, return_grad=True)
    finally:
        tiling.set_workspace_budget(None)
    np.testing.assert_allclose(small.loss, full.loss, rtol=1e-6)
    np.testing.assert_allclose(small.grad_input, full.grad_input, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(small.grad_weight, full.grad_weight, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("bad,param", [
    (dict(temperature=0.0), "temperature"), (dict(softcap=-1.0), "softcap"),
    (dict(lse_square_scale=-1.0), "lse_square_scale"), (dict(shift=-1), "shift"),
    (dict(precision="fastest"), "precision"), (dict(bias=torch.zeros(3)), "bias"),
    (dict(softcap=2.0, precision="device"), "softcap"),
])
def test_bad_keywords_raise_161002(bad, param):
    h, w, b, cw, t = _data(1, 4, 8, 5, torch.float32)
    with pytest.raises(fg.AclnnError) as e:
        ft.linear_cross_entropy(h, w, t, **bad)
    assert e.value.status == 161002 and e.value.param == param


def test_module_face_with_features():
    h, w, b, cw, t = _data(2, 5, 8, 11, torch.float32, seed=2)
    m = ft.LinearCrossEntropyLoss(ce_weight=cw.float(), softcap=3.0, lse_square_scale=1e-3,
                                  return_z_loss=True, shift=1)
    out = m(h, w, t, b)
    ref = ft.linear_cross_entropy(h, w, t, bias=b, ce_weight=cw.float(), softcap=3.0,
                                  lse_square_scale=1e-3, return_z_loss=True, shift=1)
    assert torch.equal(out.loss, ref.loss) and torch.equal(out.z_loss, ref.z_loss)


# ---------------------------------------------------------------------------------------------
# bf16 accuracy (issue 13): Liger's test shape, torch.rand inputs (|logits| up to ~150)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["auto", "blas", "onednn"])
@pytest.mark.parametrize("shape,gen", [((2, 4, 512, 512), "rand"), ((2, 64, 256, 3000), "randn"),
                                       ((1, 96, 128, 2000), "rand-small")])
def test_bf16_accuracy_target(shape, gen, engine):
    B, T, H, V = shape
    h, w, t = bf16_lm_inputs(B * T, H, V, gen)
    with fg.gemm(engine):
        e = bf16_grad_errors(h, w, t, {"fastgrad": lambda a, b: ft.linear_cross_entropy(a, b, t)})
    for i, name in enumerate(("grad_input", "grad_weight")):
        fgm, f32, b16 = e["fastgrad"][i], e["torch-fp32"][i], e["torch-bf16"][i]
        assert fgm <= 2 * f32 + 1e-12, (name, e)
        assert fgm <= b16, (name, e)


# ---------------------------------------------------------------------------------------------
# accum_dtype (Liger's name): grad_weight accumulated in the 16-bit dtype itself
# ---------------------------------------------------------------------------------------------


def _plain_grad_weight_f64(x, W, t):
    """float64 oracle from the contract: G = (softmax - onehot)/n, dW = Gᵀ·X; also |G|ᵀ·|X|."""
    X = np.asarray(x, np.float64)
    Wd = np.asarray(W, np.float64)
    z = X @ Wd.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    valid = t != IGN
    rows = np.flatnonzero(valid)
    p[rows, t[rows]] -= 1.0
    G = np.where(valid[:, None], p, 0.0) / valid.sum()
    return G.T @ X, np.abs(G).T @ np.abs(X)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("budget_rows", [None, 7])
def test_accum_dtype_16bit(dtype, budget_rows):
    """One row block: the fp32 accumulation rounded once, bitwise.  Many row blocks (a budget of
    7 rows): within one rounding per block of the float64 gradient, ``n·u·|G|ᵀ|X|``."""
    import ml_dtypes

    from fastgrad import tiling

    V, H = 301, 24
    h, w, b, cw, t = _data(2, 53, H, V, dtype, seed=11)
    x, W, tt = h.reshape(-1, H), w, t.reshape(-1)
    BT = x.shape[0]
    np16 = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float16
    if budget_rows:
        tiling.set_workspace_budget(budget_rows * V * 4)
    try:
        ref = fg.linear_cross_entropy(x, W, tt, return_grad=True)
        acc = fg.linear_cross_entropy(x, W, tt, return_grad=True, accum_dtype=dtype)
        # filtering: the gathered products of the kept blocks, rounded per block
        ref_f = fg.linear_cross_entropy(x, W, tt, return_grad=True, filter_eps=0.3)
        filt = fg.linear_cross_entropy(x, W, tt, return_grad=True, accum_dtype=dtype, filter_eps=0.3)
    finally:
        tiling.set_workspace_budget(None)
    gw = acc.grad_weight.float().numpy()
    assert acc.grad_weight.dtype == dtype and acc.grad_input.dtype == torch.float32
    np.testing.assert_array_equal(acc.grad_input.numpy(), ref.grad_input.numpy())
    np.testing.assert_array_equal(acc.loss.numpy(), ref.loss.numpy())
    if budget_rows is None:
        once = ref.grad_weight.numpy().astype(np16).astype(np.float32)
        np.testing.assert_array_equal(gw, once)
    else:
        n_blocks = -(-BT // budget_rows)
        u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        exact, absprod = _plain_grad_weight_f64(x.float().numpy(), W.float().numpy(), tt.numpy())
        for got, want in ((gw, exact), (filt.grad_weight.float().numpy(), ref_f.grad_weight.numpy())):
            err = np.abs(got - want)
            assert np.all(err <= n_blocks * u * absprod + 1e-6 * absprod + 1e-30)
        assert filt.filter_stats["blocks_skipped"] > 0
        assert filt.filter_stats == ref_f.filter_stats
        # and it is a real change from the fp32 accumulation (the rounding per block happened)
        assert not np.array_equal(gw, ref.grad_weight.numpy().astype(np16).astype(np.float32))


def test_accum_dtype_torch_and_refusals():
    h, w, b, cw, t = _data(2, 9, 16, 40, torch.bfloat16, seed=3)
    grads = {}
    for acc in (None, torch.bfloat16, torch.float32):
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        ft.linear_cross_entropy(hh, ww, t, accum_dtype=acc).backward()
        assert ww.grad.dtype == torch.bfloat16
        grads[acc] = (hh.grad, ww.grad)
    assert torch.equal(grads[None][1], grads[torch.float32][1])
    # one row block at this size: the bf16 accumulation is the fp32 one rounded once
    assert torch.equal(grads[None][1], grads[torch.bfloat16][1])
    m = ft.LinearCrossEntropyLoss(accum_dtype=torch.bfloat16)
    assert m.accum_dtype == torch.bfloat16
    for bad in (torch.float16, "int32", "nonsense"):
        with pytest.raises(fg.AclnnError) as e:
            fg.linear_cross_entropy(h.reshape(-1, 16), w, t.reshape(-1), return_grad=True, accum_dtype=bad)
        assert e.value.status == 161002 and e.value.param == "accum_dtype"
    with pytest.raises(fg.AclnnError) as e:
        ft.linear_cross_entropy(h, w, t, accum_dtype=torch.bfloat16, precision="device")
    assert e.value.param == "accum_dtype"


# ---------------------------------------------------------------------------------------------
# entropy (verl's RL output) and predicted tokens (Liger's), against float64 autograd
# ---------------------------------------------------------------------------------------------


def _entropy_oracle(h, w, t, *, bias=None, softcap=None, temperature=1.0, reduction="mean", shift=0,
                    keep_cols=None):
    """(entropy reduced like the z-loss, predicted tokens) of the materialized float64 logits,
    written from the contract: ``H = -Σ p log p`` per token, 0 / excluded where the target is
    ignored; prediction = first argmax, -1 where ignored.  ``keep_cols``: the columns whose
    probability can be non-zero (a bias of -inf masks the others: they are left out here, where
    autograd would turn ``0·log 0`` into NaN)."""
    z, t = _oracle_logits(h, w, t, bias, softcap, temperature, shift)
    cols = torch.arange(z.shape[1]) if keep_cols is None else keep_cols
    zk = z[:, cols]
    logp = torch.log_softmax(zk, 1)
    ent = -(logp.exp() * logp).sum(1)
    tf = t.reshape(-1)
    valid = tf != IGN
    ent = torch.where(valid, ent, torch.zeros_like(ent))
    pred = torch.where(valid, cols[zk.argmax(1)], torch.full_like(tf, -1))
    if reduction == "mean":
        ent = ent.sum() / valid.sum()
    elif reduction == "sum":
        ent = ent.sum()
    shp = tuple(t.shape)
    pred = pred.reshape(shp)
    if reduction == "none":
        ent = ent.reshape(shp)
    if shift:
        pred = pred[..., :-shift]
        if reduction == "none":
            ent = ent[..., :-shift]
    return ent, pred


ENTROPY_FEATURES = [
    {},
    {"softcap": 3.0, "temperature": 0.6, "bias": True},
    {"label_smoothing": 0.1, "ce_weight": True, "lse_square_scale": 1e-2, "temperature": 1.7},
    {"shift": 2},
]


@pytest.mark.parametrize("feat", ENTROPY_FEATURES,
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_and_predicted_tokens_match_float64_autograd(feat, reduction, dtype):
    """``loss·g + entropy·g_h`` backpropagated (both upstream gradients non-trivial): values and
    gradients against float64 autograd on the same (rounded) inputs."""
    h, w, b, cw, t = _data(2, 11, 24, 83, dtype, seed=5 + len(str(feat)))
    kw = _kw(feat, b, cw)
    n = t.shape[1] - feat.get("shift", 0)
    shp = (t.shape[0], n) if reduction == "none" else ()
    g = torch.Generator().manual_seed(1)
    go = torch.rand(shp, generator=g, dtype=torch.float64) + 0.5
    gh = torch.randn(shp, generator=g, dtype=torch.float64)
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    bb = kw["bias"].detach().clone().requires_grad_() if kw["bias"] is not None else None
    out = ft.linear_cross_entropy(hh, ww, t, reduction=reduction, return_entropy=True,
                                  return_predicted_tokens=True, **{**kw, "bias": bb})
    assert out.entropy.dtype == torch.float32 and out.predicted_tokens.dtype == torch.int64
    (out.loss * go.float()).sum().add((out.entropy * gh.float()).sum()).backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    b64 = kw["bias"].double().requires_grad_() if kw["bias"] is not None else None
    k64 = {**kw, "bias": b64}
    loss, _, _ = _oracle(h64, w64, t, reduction=reduction, **k64)
    ent, pred = _entropy_oracle(h64, w64, t, reduction=reduction,
                                **{k: v for k, v in k64.items() if k in ("bias", "softcap", "temperature", "shift")})
    ((loss * go).sum() + (ent * gh).sum()).backward()
    assert out.entropy.shape == ent.shape and torch.equal(out.predicted_tokens, pred)
    np.testing.assert_allclose(out.entropy.detach().double(), ent.detach(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(out.loss.detach().double(), loss.detach(), rtol=2e-5, atol=2e-6)
    # fp32 arithmetic on the same inputs, the gradient rounded once to the input dtype
    rel = 2e-5 if dtype == torch.float32 else 2.0 ** -8
    for a, r in ((hh.grad, h64.grad), (ww.grad, w64.grad)) + (((bb.grad, b64.grad),) if bb is not None else ()):
        assert a.dtype == dtype
        bound = rel * r.abs() + 2e-5 * r.abs().max().item()
        assert ((a.double() - r).abs() <= bound).all(), (a.double() - r).abs().max().item()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_entropy_gradcheck_float64(reduction):
    h, w, b, cw, t = _data(2, 3, 4, 7, torch.float64, seed=8)
    args = (h.requires_grad_(), w.requires_grad_(), b.requires_grad_())

    def fn(a, c, d):
        out = ft.linear_cross_entropy(a, c, t, reduction=reduction, bias=d, softcap=2.0, temperature=0.8,
                                      return_entropy=True)
        return out.loss, out.entropy

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_with_a_masked_vocabulary_is_finite(dtype):
    """A bias of -inf on some columns (a masked vocabulary): p = 0 there and ``0·(-inf)`` must
    not turn the entropy or its gradient into NaN; equal to the oracle on the other columns."""
    h, w, b, cw, t = _data(1, 13, 16, 40, dtype, seed=2)
    masked = torch.tensor([0, 5, 6, 39])
    keep = torch.tensor([v for v in range(40) if v not in set(masked.tolist())])
    b = b.clone()
    b[masked] = -float("inf")
    t = torch.where(torch.isin(t, masked), keep[0], t)
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = ft.linear_cross_entropy(hh, ww, t, bias=b, return_entropy=True, reduction="sum")
    (out.loss + 0.5 * out.entropy).backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    wk = w64[keep]
    loss = F.cross_entropy(h64.reshape(-1, 16) @ wk.T + b.double()[keep],
                           torch.searchsorted(keep, t.reshape(-1).clamp(min=0)).where(t.reshape(-1) != IGN, IGN),
                           ignore_index=IGN, reduction="sum")
    ent, _ = _entropy_oracle(h64, w64, t, bias=b.double(), reduction="sum", keep_cols=keep)
    (loss + 0.5 * ent).backward()
    assert torch.isfinite(out.entropy) and torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(out.entropy.item(), ent.item(), rtol=tol)
    assert (ww.grad[masked] == 0).all()
    for a, r in ((hh.grad, h64.grad), (ww.grad, w64.grad)):
        assert (a.double() - r).abs().max().item() <= tol * r.abs().max().item()


def test_entropy_numpy_op_recompute_and_refusals():
    h, w, b, cw, t = _data(1, 30, 16, 200, torch.float32, seed=6)
    x, W, bb, tt = h[0].numpy(), w.numpy(), b.numpy(), t[0].numpy()
    gh = np.random.default_rng(0).standard_normal(30)
    kw = dict(reduction="none", softcap=4.0, temperature=0.9)
    r = fg.linear_cross_entropy(x, W, tt, bb, return_grad=True, return_entropy=True, grad_entropy=gh, **kw)
    r2 = fg.linear_cross_entropy(x, W, tt, bb, return_grad=True, grad_entropy=gh, lse=r.lse, z_mean=r.z_mean, **kw)
    for a, c in ((r.grad_input, r2.grad_input), (r.grad_weight, r2.grad_weight), (r.grad_bias, r2.grad_bias)):
        np.testing.assert_array_equal(a, c)
    # the entropy's gradient is really in there
    r0 = fg.linear_cross_entropy(x, W, tt, bb, return_grad=True, **kw)
    assert not np.allclose(r0.grad_input, r.grad_input)
    bad = [
        (dict(return_grad=True, grad_entropy=gh, lse=r.lse), "z_mean"),
        (dict(return_grad=True, grad_entropy=gh[:5]), "grad_entropy"),
        (dict(return_grad=True, grad_entropy=gh, filter_eps=0.1), "filter_eps"),
        (dict(return_entropy=1), "return_entropy"),
    ]
    for extra, param in bad:
        with pytest.raises(fg.AclnnError) as e:
            fg.linear_cross_entropy(x, W, tt, bb, **{**kw, **extra})
        assert e.value.status == 161002 and e.value.param == param
    for extra, param in ((dict(filter_eps="auto"), "filter_eps"), (dict(precision="device"), "return_entropy"),
                         (dict(return_predicted_tokens="yes"), "return_predicted_tokens")):
        with pytest.raises(fg.AclnnError) as e:
            ft.linear_cross_entropy(h, w, t, return_entropy=extra.get("return_predicted_tokens") is None,
                                    **extra)
        assert e.value.status == 161002 and e.value.param == param


def test_entropy_module_face_and_no_fusion():
    """The module passes the new keywords; with the entropy the step is the recompute path
    (its upstream gradient is unknown in the forward), equal to fused=False."""
    h, w, b, cw, t = _data(2, 5, 8, 11, torch.float32, seed=2)
    m = ft.LinearCrossEntropyLoss(return_entropy=True, return_predicted_tokens=True, temperature=0.5)
    out = m(h, w, t)
    ref = ft.linear_cross_entropy(h, w, t, temperature=0.5, return_entropy=True, return_predicted_tokens=True,
                                  fused=False)
    assert torch.equal(out.entropy, ref.entropy) and torch.equal(out.predicted_tokens, ref.predicted_tokens)
    assert out.z_loss is None and out.token_accuracy is None


@pytest.mark.parametrize("v_chunk", [3, 7, 13])
def test_entropy_online_across_vocabulary_chunks(monkeypatch, v_chunk):
    """Many vocabulary chunks per row block, logits rising along the vocabulary (the running max
    grows in almost every chunk: the rescaling of ``Σ e·(z - m)`` is exercised), against the
    float64 oracle; and the same numbers as with one chunk."""
    import fastgrad.ops.linear_cross_entropy as op_mod

    h, w, b, cw, t = _data(1, 17, 8, 61, torch.float32, seed=12)
    b = torch.linspace(-20.0, 20.0, 61)  # rising bias: each chunk beats the last
    x, W, tt = h[0], w, t[0]
    ent64, _ = _entropy_oracle(x.double(), W.double(), tt, bias=b.double(), reduction="none")
    one = fg.linear_cross_entropy(x.numpy(), W.numpy(), tt.numpy(), b.numpy(), reduction="none",
                                  return_entropy=True)
    monkeypatch.setattr(op_mod, "V_CHUNK", v_chunk)
    many = fg.linear_cross_entropy(x.numpy(), W.numpy(), tt.numpy(), b.numpy(), reduction="none",
                                   return_entropy=True)
    ok = tt.numpy() != IGN
    np.testing.assert_allclose(many.entropy[ok], ent64.numpy()[ok], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(many.entropy, one.entropy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(many.z_mean, one.z_mean, rtol=1e-5, atol=1e-5)
