"""PyTorch's API as a front door: fastgrad.torch.nn.functional.linear_cross_entropy and
fastgrad.torch.nn.LinearCrossEntropyLoss against torch.nn.functional.linear_cross_entropy /
torch.nn.LinearCrossEntropyLoss (PyTorch's reference path, options=None: the logits
materialized) on its whole keyword grid, float64 and float32, loss and gradients."""

from __future__ import annotations

import inspect
import itertools
import warnings

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
if not hasattr(F, "linear_cross_entropy"):
    pytest.skip("torch.nn.functional.linear_cross_entropy needs PyTorch >= 2.13", allow_module_level=True)

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
import fastgrad.torch.nn as fnn  # noqa: E402
import fastgrad.torch.nn.functional as FF  # noqa: E402

N, H, C = 23, 16, 37


def _params(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_signatures_are_pytorchs():
    assert _params(inspect.signature(FF.linear_cross_entropy)) == _params(
        inspect.signature(F.linear_cross_entropy))
    assert _params(inspect.signature(fnn.LinearCrossEntropyLoss.__init__)) == _params(
        inspect.signature(torch.nn.LinearCrossEntropyLoss.__init__))
    assert _params(inspect.signature(fnn.LinearCrossEntropyLoss.forward)) == _params(
        inspect.signature(torch.nn.LinearCrossEntropyLoss.forward))


def _data(dtype, unbatched, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(C, H, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(C, generator=g, dtype=torch.float64)
    cw = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    t = torch.randint(0, C, (N,), generator=g)
    t[::5] = -100       # ignored rows (-100 is replaced by the ignore_index under test)
    if unbatched:
        x, t = x[0], t[2]
    return [a.to(dtype) for a in (x, w, b, cw)] + [t]


GRID = list(itertools.product(("mean", "sum", "none"), (None, -100, 3), (0.0, 0.1), (False, True),
                              (False, True), (False, True)))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_equals_torch_on_its_keyword_grid(dtype, tol):
    """3 reductions × 3 ignore_index × 2 label_smoothing × class weight × bias × batched/unbatched
    = 144 calls per dtype; loss and the gradients of input, weight and bias."""
    for reduction, ignore_index, ls, use_w, use_b, unbatched in GRID:
        x, w, b, cw, t = _data(dtype, unbatched)
        t = torch.where(t == -100, torch.tensor(-100 if ignore_index is None else ignore_index), t)
        kw = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=ls,
                  weight=cw if use_w else None)
        res = []
        for fn in (F.linear_cross_entropy, FF.linear_cross_entropy):
            xx, ww, bb = (a.clone().requires_grad_() for a in (x, w, b))
            loss = fn(xx, ww, t, linear_bias=bb if use_b else None, **kw)
            g = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
            loss.backward(g)
            res.append((loss.detach(), xx.grad, ww.grad, bb.grad if use_b else None))
        case = (reduction, ignore_index, ls, use_w, use_b, unbatched)
        for name, r, o in zip(("loss", "grad_input", "grad_weight", "grad_bias"), res[0], res[1]):
            if r is None:
                assert o is None
                continue
            assert o.dtype == r.dtype and o.shape == r.shape, (case, name)
            if torch.isnan(r).all():  # every row ignored with mean: NaN, as PyTorch
                assert torch.isnan(o).all(), (case, name)
                continue
            torch.testing.assert_close(o, r, rtol=tol, atol=tol, msg=f"{case} {name}")


def test_module_equals_torch_module_and_state_dict():
    torch.manual_seed(0)
    kw = dict(bias=True, dtype=torch.float64, reduction="sum", ignore_index=-1, label_smoothing=0.05,
              weight=torch.rand(C, dtype=torch.float64) + 0.5)
    ref = torch.nn.LinearCrossEntropyLoss(H, C, **kw)
    got = fnn.LinearCrossEntropyLoss(H, C, **kw, options="fused")
    assert set(ref.state_dict()) == set(got.state_dict())
    got.load_state_dict(ref.state_dict())
    x = torch.randn(N, H, dtype=torch.float64)
    t = torch.randint(0, C, (N,))
    t[::4] = -1
    lr, lg = ref(x, t), got(x, t)
    lr.backward()
    lg.backward()
    torch.testing.assert_close(lg, lr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.linear.weight.grad, ref.linear.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.linear.bias.grad, ref.linear.bias.grad, rtol=1e-12, atol=1e-12)
    assert "options=fused" in repr(got)


@pytest.mark.parametrize("options", [None, "default", "fused", "low_memory", "fast", "blas", "filtered",
                                     ft.LinearCrossEntropyOptions(schedule="recompute"),
                                     "torch"])
def test_options_presets_and_torch_options(options):
    """Every preset, fastgrad's options object and PyTorch's own options give the loss (bf16 in,
    bf16 out as PyTorch) within bf16 accuracy of float64."""
    if options == "torch":
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8)
    x, w, _, _, t = _data(torch.float32, False)
    xb, wb = x.bfloat16(), w.bfloat16()
    ref = F.cross_entropy(xb.double() @ wb.double().T, t)
    loss = FF.linear_cross_entropy(xb.requires_grad_(), wb, t, options=options)
    assert loss.dtype == torch.bfloat16  # PyTorch's output dtype: the input's
    torch.testing.assert_close(loss.double(), ref, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    loss.backward()
    assert xb.grad.dtype == torch.bfloat16 and torch.isfinite(xb.grad).all()


def test_fallback_paths_and_errors():
    x, w, _, _, t = _data(torch.float64, False)
    # class-probability targets: PyTorch's reference path, with a warning
    p = torch.softmax(torch.randn(N, C, dtype=torch.float64), 1)
    with pytest.warns(UserWarning, match="reference path"):
        got = FF.linear_cross_entropy(x, w, p)
    torch.testing.assert_close(got, F.linear_cross_entropy(x, w, p))
    with pytest.raises(fg.AclnnError, match="dimensionality 1 or 2"):
        FF.linear_cross_entropy(x[None], w, t[None])
    with pytest.raises(fg.AclnnError, match="linear_weight"):
        FF.linear_cross_entropy(x, w[:, :-1], t)
    with pytest.raises(fg.AclnnError, match="options"):
        FF.linear_cross_entropy(x, w, t, options="fastest")
    with pytest.raises(fg.AclnnError, match="reduction"):
        FF.linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(fg.AclnnError, match="schedule"):
        ft.LinearCrossEntropyOptions(schedule="sometimes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FF.linear_cross_entropy(x, w, t)   # the fastgrad path warns nothing


def test_autocast_and_int64_overflow_as_pytorch():
    """Found by fuzzing.  Under ``torch.autocast("cpu", bfloat16)`` (bf16 hidden from an autocast
    layer, fp32 weight and bias) the operands are cast as ``F.linear``'s and the loss is fp32, as
    PyTorch's; an ``ignore_index`` beyond int64 is PyTorch's ``ValueError``."""
    x, w, b, _, t = _data(torch.float32, False)
    w.requires_grad_()
    b.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x.bfloat16()
        ref = F.linear_cross_entropy(h, w, t, linear_bias=b)
        got = FF.linear_cross_entropy(h, w, t, linear_bias=b)
    assert got.dtype == ref.dtype == torch.float32
    (gw, gb) = torch.autograd.grad(got, (w, b))
    (rw, rb) = torch.autograd.grad(ref, (w, b))
    assert gw.dtype == rw.dtype == torch.float32
    # PyTorch rounds the logits to bf16 under autocast, fastgrad keeps them exact in fp32
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(gw, rw, rtol=0.1, atol=2e-3)
    torch.testing.assert_close(gb, rb, rtol=0.1, atol=2e-3)
    with pytest.raises(ValueError, match="Overflow"):
        F.linear_cross_entropy(x, w, t, ignore_index=2**70)
    with pytest.raises(fg.AclnnError, match="Overflow") as e:
        FF.linear_cross_entropy(x, w, t, ignore_index=2**70)
    assert isinstance(e.value, ValueError) and e.value.status == 161002
