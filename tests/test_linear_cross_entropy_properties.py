"""Property-based test of the training loss's declaration (hypothesis; issue 26: the op now runs the
generic path): dtypes, shapes (empty, 1, primes), memory layouts, attributes in and out of their
documented ranges, targets out of range, class weights, a masked (-inf) bias column.

The property: when the contract says the call is valid the loss and the three gradients match
PyTorch's float64 autograd of ``F.cross_entropy(softcap(x·wᵀ + b)/T, t, weight, ignore_index,
reduction, label_smoothing) + z-loss`` (an oracle independent of fastgrad) within the forward
error of the compute dtype's logits, NaN where PyTorch's is; when it is invalid the op raises
``fastgrad.AclnnError`` 161002 naming one of the bad parameters.  Never another exception.
"""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
import naive as N  # noqa: E402
from common import training_logits  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastgrad as fg  # noqa: E402

F64 = np.dtype(np.float64)
BAD = {
    "label_smoothing": (-0.1, 1.5, float("nan")),
    "softcap": (0.0, -1.0, float("inf")),
    "temperature": (0.0, float("nan"), -2.0),
    "lse_square_scale": (-1.0,),
    "reduction": ("avg", 3),
}


def _layout(a, kind):
    if kind == 0 or a.ndim == 0:
        return a
    if kind == 1:
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        big[..., 1::2] = a
        return big[..., 1::2]
    if kind == 2 and a.ndim == 2:
        return np.ascontiguousarray(a.T).T
    return np.ascontiguousarray(a[::-1])[::-1]


def _oracle(x, w, b, t, cw, ign, red, eps, cap, T, zsc):
    """PyTorch float64 autograd: (loss, grad_input, grad_weight, grad_bias, z, lse)."""
    xt = torch.tensor(x.astype(F64), requires_grad=True)
    wt = torch.tensor(w.astype(F64), requires_grad=True)
    bt = None if b is None else torch.tensor(b.astype(F64), requires_grad=True)
    z = training_logits(xt, wt, bt, cap, T)
    tt = torch.tensor(t)
    cwt = None if cw is None else torch.tensor(cw.astype(F64))
    red_s = {1: "mean", 2: "sum", 0: "none"}.get(red, red)
    loss = torch.nn.functional.cross_entropy(z, tt, weight=cwt, ignore_index=ign, reduction=red_s,
                                             label_smoothing=eps)
    lse = torch.logsumexp(z, dim=1) if z.shape[1] else torch.full((z.shape[0],), -torch.inf, dtype=torch.float64)
    valid = tt != ign
    zl = torch.where(valid, zsc * lse * lse, torch.zeros_like(lse))
    if red_s == "mean":
        n = int(valid.sum())
        loss = loss + (zl.sum() / n if n else (torch.tensor(float("nan"), dtype=torch.float64) if zsc else 0.0))
    elif red_s == "sum":
        loss = loss + zl.sum()
    else:
        loss = loss + zl
    if loss.requires_grad:
        g = torch.ones_like(loss) if red_s == "none" else None
        loss.backward(g)
    grads = [None if a is None or a.grad is None else a.grad.numpy() for a in (xt, wt, bt)]
    grads = [np.zeros(a.shape) if (gr is None and a is not None) else gr for gr, a in zip(grads, (xt, wt, bt))]
    return loss.detach().numpy(), *grads, z.detach().numpy(), lse.detach().numpy()


@given(dt=st.sampled_from([N.F32, N.BF16, N.F16, F64]), bt=st.sampled_from([0, 1, 2, 3, 7]),
       h=st.sampled_from([1, 2, 3, 5]), v=st.sampled_from([1, 2, 3, 5, 13]),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), with_bias=st.booleans(), masked=st.booleans(),
       with_cw=st.booleans(), ign=st.sampled_from([-100, 0]), red=st.sampled_from(["mean", "sum", "none", 1]),
       eps=st.sampled_from([0.0, 0.1, 1.0]), cap=st.sampled_from([None, 5.0]), T=st.sampled_from([1.0, 0.5]),
       zsc=st.sampled_from([0.0, 1e-2]), bad=st.sampled_from([None] * 8 + [*BAD]),
       bad_target=st.sampled_from([False] * 5 + [True]),
       layout=st.integers(0, 3), seed=st.integers(0, 2**16))
@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_the_training_loss_matches_torch_float64_or_refuses(dt, bt, h, v, scale, with_bias, masked, with_cw, ign,
                                                            red, eps, cap, T, zsc, bad, bad_target, layout, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((bt, h)) * scale).astype(dt)
    w = rng.standard_normal((v, h)).astype(dt)
    b = rng.standard_normal(v).astype(dt) if with_bias else None
    if b is not None and masked and v > 1:
        b[rng.integers(0, v)] = -np.inf
    cw = rng.uniform(0.5, 2.0, v).astype(np.float32) if with_cw else None
    t = rng.integers(0, v, bt)
    if bt > 1:
        t[rng.integers(0, bt)] = ign if ign < 0 else t[0]  # an ignored row (ign = 0: class 0 is ignored)
    kw = dict(ignore_index=ign, reduction=red, label_smoothing=eps, softcap=cap, temperature=T,
              lse_square_scale=zsc)
    if bad is not None:
        kw[bad] = BAD[bad][seed % len(BAD[bad])]
    invalid = bad is not None
    if bad_target and bt:
        t[0] = v if t[0] != ign else v + 1
        invalid = invalid or t[0] != ign
    xs, ws = _layout(x, layout), _layout(w, (layout + 1) % 4)
    x0, w0 = xs.copy(), ws.copy()
    try:
        r = fg.linear_cross_entropy(xs, ws, t, b, cw, return_grad=True, **kw)
    except fg.AclnnError as e:
        assert invalid, f"valid input refused: {e}"
        assert e.status == 161002, e.status
        assert e.param in ({bad} if bad else set()) | ({"target"} if bad_target else set()), (e.param, bad)
        return
    assert not invalid, f"invalid input accepted: {bad}={kw.get(bad)!r}, bad_target={bad_target}"
    np.testing.assert_array_equal(xs, x0)  # inputs never modified
    np.testing.assert_array_equal(ws, w0)
    want, gi64, gw64, gb64, z64, lse64 = _oracle(x, w, b, t, cw, ign, red, eps, cap, T, zsc)
    # the forward error of the compute dtype's logits (exact 16-bit products, sums in fp32; fp64
    # for fp64 inputs), per row: dz; then the loss's error per row (lse and z_t each off by dz,
    # plus the row's own roundings)
    u = 2.0**-53 if dt == F64 else 2.0**-24
    with np.errstate(all="ignore"):
        mag = np.abs(x.astype(F64)) @ np.abs(w.astype(F64)).T + (0 if b is None else np.abs(np.nan_to_num(
            b.astype(F64), neginf=0)))
        dz = (h + 8) * u * mag.max(axis=1, initial=0) / T
        zfin = np.where(np.isfinite(z64), np.abs(z64), 0)
        e_row = 4 * dz + 64 * u * (1 + np.abs(np.nan_to_num(lse64)) + zfin.max(axis=1, initial=0))
        valid = t != ign
        wt = np.where(valid, 1.0 if cw is None else cw.astype(F64)[np.where(valid, t, 0)], 0.0)
        wsum = float(v) if cw is None else float(cw.astype(F64).sum())
        per_row = np.where(valid, ((1 - eps) * wt + eps * wsum / v) * e_row
                           + zsc * 2 * np.abs(np.nan_to_num(lse64)) * e_row, 0.0)
        red_s = {1: "mean"}.get(red, red)
        if red_s == "mean":
            tol = per_row.sum() / max(wt.sum(), 1e-300) + per_row.sum() / max(valid.sum(), 1)
        elif red_s == "sum":
            tol = per_row.sum()
        else:
            tol = per_row
    got = np.asarray(r.loss, F64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    with np.errstate(invalid="ignore"):
        close = (got == want) | (np.abs(got - want) <= 4 * np.broadcast_to(tol, np.shape(want)) + 1e-12)
    assert np.all(close[ok]), (got, want, tol)  # (== : the same ±inf, a row whose target is masked)
    if not np.isfinite(want).all() or not bt or not v:
        return
    # gradients: dloss/dz's elements are each off by at most c_r·(p_v + [v=t] + ε)·(3 e_r) (p's
    # relative error from lse and z_v), chained through T and the softcap (|dz/dl| ≤ 1/T); the
    # GEMMs add their own sums' rounding (fp32: K·u of the absolute products)
    p = np.exp(z64 - lse64[:, None])
    onehot = np.zeros_like(p)
    rows = np.flatnonzero(valid)
    onehot[rows, t[rows]] = 1.0
    if red_s == "mean":
        c = np.where(valid, 1.0, 0.0) / max(wt.sum(), 1e-300) + (zsc > 0) * np.where(valid, 1.0, 0.0) / max(
            valid.sum(), 1)
    else:
        c = np.where(valid, 1.0, 0.0) * (1 + zsc * 2 * np.abs(lse64))
    cmax = c * max(1.0, 0 if cw is None else float(cw.max())) * (1 + zsc * 2 * np.abs(lse64))
    A = cmax[:, None] * (p + onehot + eps)  # |dloss/dz| elementwise, bounded
    dG = A * (3 * e_row[:, None] + 16 * u + (0 if cap is None else dz[:, None] / cap)) / T
    aW, aX = np.abs(w.astype(F64)), np.abs(x.astype(F64))
    G_abs = A / T
    gi_tol = dG @ aW + (v + 4) * u * (G_abs @ aW)
    gw_tol = dG.T @ aX + (bt + 4) * u * (G_abs.T @ aX)
    for name, g, ref, tl in (("grad_input", r.grad_input, gi64, gi_tol), ("grad_weight", r.grad_weight, gw64, gw_tol)):
        err = np.abs(np.asarray(g, F64) - ref)
        assert np.all(err <= 4 * tl + 1e-12), (name, float(err.max()), float((err - 4 * tl).max()))
    if b is not None:
        gb_tol = dG.sum(0) + (bt + 4) * u * G_abs.sum(0)
        err = np.abs(np.asarray(r.grad_bias, F64) - gb64)
        fin = np.isfinite(gb64)
        assert np.all(err[fin] <= 4 * gb_tol[fin] + 1e-12), ("grad_bias", float(err[fin].max()))
