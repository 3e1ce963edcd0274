"""fastgrad.torch.linear_cross_entropy under torch.func and forward-mode AD, against PyTorch's
autograd of ``cross_entropy(softcap(h @ w.T + b) / T, ...)`` on the materialized logits (issue 44)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402

F = torch.nn.functional
N, H, V = 6, 5, 11


def _data():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (N,), generator=g)
    t[1] = -100
    return h, w, b, t


def _torch(h, w, b, t, reduction, cap=None, T=1.0):
    z = h @ w.T + b
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return F.cross_entropy(z / T, t, reduction=reduction, label_smoothing=0.1)


def _ours(h, w, b, t, reduction, cap=None, T=1.0, **kw):
    return ft.linear_cross_entropy(
        h, w, t, reduction=reduction, bias=b, softcap=cap, temperature=T, label_smoothing=0.1, **kw
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fused", [True, False])
def test_jvp_jacrev_jacfwd_vmap_equal_pytorch(reduction, fused):
    h, w, b, t = _data()
    tan = tuple(torch.randn_like(x) for x in (h, w, b))
    args = dict(cap=3.0, T=0.8)
    ref = torch.func.jvp(lambda h, w, b: _torch(h, w, b, t, reduction, **args), (h, w, b), tan)
    got = torch.func.jvp(lambda h, w, b: _ours(h, w, b, t, reduction, fused=fused, **args), (h, w, b), tan)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for jac in (torch.func.jacrev, torch.func.jacfwd):
        jr = jac(lambda h, w: _torch(h, w, b, t, reduction, **args), argnums=(0, 1))(h, w)
        jg = jac(lambda h, w: _ours(h, w, b, t, reduction, fused=fused, **args), argnums=(0, 1))(h, w)
        torch.testing.assert_close(jg, jr, rtol=1e-10, atol=1e-12)
    hs = torch.randn(3, N, H, dtype=torch.float64)
    torch.testing.assert_close(
        torch.func.vmap(lambda h: _ours(h, w, b, t, reduction, fused=fused, **args))(hs),
        torch.func.vmap(lambda h: _torch(h, w, b, t, reduction, **args))(hs),
        rtol=1e-10,
        atol=1e-12,
    )


def test_is_grads_batched_equals_rows_of_the_jacobian():
    h, w, b, t = _data()
    hh = h.clone().requires_grad_()
    loss = ft.linear_cross_entropy(hh, w, t, reduction="none", bias=b)
    eye = torch.eye(N, dtype=torch.float64)
    (g,) = torch.autograd.grad(loss, hh, eye, is_grads_batched=True)
    ref = torch.func.jacrev(lambda h: F.cross_entropy(h @ w.T + b, t, reduction="none"))(h)
    torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)


def test_forward_ad_of_the_entropy():
    h, w, _, t = _data()
    th = torch.randn_like(h)

    def ent_ref(h):
        p = torch.softmax(h @ w.T, -1)
        e = -(p * torch.log_softmax(h @ w.T, -1)).sum(-1)
        return torch.where(t != -100, e, torch.zeros_like(e))

    _, ref = torch.func.jvp(ent_ref, (h,), (th,))
    _, got = torch.func.jvp(
        lambda h: ft.linear_cross_entropy(h, w, t, reduction="none", return_entropy=True).entropy, (h,), (th,)
    )
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_second_derivatives_refused_under_torch_func():
    h, w, b, t = _data()
    f = lambda h: _ours(h, w, b, t, "mean")  # noqa: E731
    torch.func.grad(f)(h)  # once: fine
    gg = torch.func.grad(lambda h: torch.func.grad(f)(h).sum())  # a gradient penalty's shape
    for second in (gg, torch.func.hessian(f)):
        with pytest.raises(RuntimeError, match=r"derivative for .* is not implemented") as info:
            second(h)
        assert isinstance(info.value, fg.AclnnError) and info.value.status == 361001


def test_vmap_over_batched_targets_and_per_sample_gradients():
    """``vmap`` with the targets batched too (found by fuzzing: the range check branched on a
    batched tensor, which ``vmap`` refuses) — a batch of losses and per-sample gradients
    (``vmap(grad)``, the weight shared), fastgrad's loss and the drop-in against PyTorch's."""
    import fastgrad.torch.nn.functional as FF

    h, w, b, t = _data()
    hs = torch.randn(3, N, H, dtype=torch.float64)
    ts = torch.randint(0, V, (3, N))
    ts[1, 2] = -100
    ref = torch.func.vmap(lambda h, t: _torch(h, w, b, t, "mean"))(hs, ts)
    got = torch.func.vmap(lambda h, t: _ours(h, w, b, t, "mean"))(hs, ts)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)

    def per_sample(loss):
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(w, h, t)

    ref = per_sample(lambda w, x, y: F.cross_entropy(x @ w.T + b, y, label_smoothing=0.1))
    for fn in (
        lambda w, x, y: _ours(x, w, b, y, "mean"),
        lambda w, x, y: FF.linear_cross_entropy(x, w, y, linear_bias=b, label_smoothing=0.1),
    ):
        got = per_sample(fn)
        assert got.shape == (N, V, H)
        torch.testing.assert_close(got[t != -100], ref[t != -100], rtol=1e-10, atol=1e-12)
    # a target out of range in one slice of the batch is still refused, naming it
    ts[2, 4] = V
    for fn in (lambda h, t: _ours(h, w, b, t, "mean"), lambda h, t: FF.linear_cross_entropy(h, w, t)):
        with pytest.raises(fg.AclnnError, match=f"Target {V} is out of bounds") as e:
            torch.func.vmap(fn)(hs, ts)
        assert e.value.status == 161002
