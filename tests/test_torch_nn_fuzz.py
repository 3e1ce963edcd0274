"""fastgrad.torch.nn.functional.linear_cross_entropy / fastgrad.torch.nn.LinearCrossEntropyLoss
against PyTorch 2.13's own functional (the oracle: its reference path, the logits materialized)
on the inputs fuzzing found mishandled: target shapes, the class weight's dtype, and the scalar
arguments PyTorch's argument parser accepts."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
if not hasattr(F, "linear_cross_entropy"):
    pytest.skip("torch.nn.functional.linear_cross_entropy needs PyTorch >= 2.13", allow_module_level=True)

import fastgrad as fg  # noqa: E402
import fastgrad.torch.nn as fnn  # noqa: E402
import fastgrad.torch.nn.functional as FF  # noqa: E402

H, C = 5, 7


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, H, generator=g, dtype=dtype)
    w = torch.randn(C, H, generator=g, dtype=dtype)
    t = torch.tensor([1, -100, 6, 0])
    return x, w, t


def _raised(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - the oracle's exception, whatever it is
        return e
    raise AssertionError("no exception")


def test_unbatched_input_with_a_one_element_target():
    """Input ``(in_features,)`` with target ``(1,)``: PyTorch computes it (a ``()`` loss, as for a
    ``()`` target); before, fastgrad raised ValueError 'For 1D input, 1D target must have size 1,
    but got target size: 1'."""
    x, w, _ = _data()
    for red in ("mean", "sum", "none"):
        for t in (torch.tensor([3]), torch.tensor([-100])):
            ref = F.linear_cross_entropy(x[0], w, t, reduction=red)
            xx = x[0].clone().requires_grad_()
            ww = w.clone().requires_grad_()
            got = FF.linear_cross_entropy(xx, ww, t, reduction=red)
            assert got.shape == ref.shape == ()
            torch.testing.assert_close(got.detach(), ref, rtol=1e-12, atol=1e-12, equal_nan=True)
            if t.item() != -100:
                # PyTorch's own backward fails on the (1,) target ('size mismatch'): the oracle is
                # its gradient for the () target, the same loss
                xr, wr = x[0].clone().requires_grad_(), w.clone().requires_grad_()
                F.linear_cross_entropy(xr, wr, t.reshape(()), reduction=red).backward()
                got.backward()
                torch.testing.assert_close(xx.grad, xr.grad, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(ww.grad, wr.grad, rtol=1e-12, atol=1e-12)
    # a target of another size is still PyTorch's ValueError
    with pytest.raises(ValueError, match="target size: 2"):
        FF.linear_cross_entropy(x[0], w, torch.tensor([3, 4]))


@pytest.mark.parametrize("batched,shape", [(True, (4, 1)), (True, (4, 2)), (False, (1, 1)), (False, (2, 1)),
                                           (True, (3, 1)), (True, ()), (False, (1, 1, 1))])
def test_target_shapes_raise_pytorchs_error(batched, shape):
    """A multi-dimensional target: PyTorch's RuntimeError '0D or 1D target tensor expected,
    multi-target not supported' (a batch size mismatch first: ValueError).  Before, fastgrad raised
    a ValueError 'Expected input batch_size (4) to match target batch_size (4).' for (4, 1)."""
    x, w, _ = _data()
    x = x if batched else x[0]
    t = torch.zeros(shape, dtype=torch.long)
    ref = _raised(F.linear_cross_entropy, x, w, t)
    got = _raised(FF.linear_cross_entropy, x, w, t)
    assert isinstance(got, type(ref)), (got, ref)
    assert str(ref) in str(got)
    assert isinstance(got, fg.AclnnError) and got.status == 161002 and got.param == "target"


@pytest.mark.parametrize("wdtype", [torch.float32, torch.int64, torch.bfloat16])
def test_class_weight_of_another_dtype_is_pytorchs_runtime_error(wdtype):
    """A class ``weight`` whose dtype is not the logits': PyTorch raises RuntimeError 'expected
    scalar type Double but found Float'.  Before: an fp32 weight with float64 input was silently
    accepted, an int64 one raised a ValueError (fastgrad's 'ce_weight: expected dtype ...')."""
    x, w, t = _data()
    cw = torch.ones(C, dtype=wdtype)
    ref = _raised(F.linear_cross_entropy, x, w, t, weight=cw)
    got = _raised(FF.linear_cross_entropy, x, w, t, weight=cw)
    assert type(ref) is RuntimeError and isinstance(got, RuntimeError), (got, ref)
    assert str(ref) in str(got) and "weight" in str(got)
    assert isinstance(got, fg.AclnnError) and got.status == 161002 and got.param == "weight"
    # under autocast the logits are fp32 and a 16-bit weight is widened, as PyTorch's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xf, wf = x.float(), w.float()
        for d in (torch.bfloat16, torch.float32):
            cw = torch.linspace(0.5, 1.5, C).to(d)
            torch.testing.assert_close(FF.linear_cross_entropy(xf, wf, t, weight=cw),
                                       F.linear_cross_entropy(xf, wf, t, weight=cw), rtol=2e-2, atol=2e-2)
        ref = _raised(F.linear_cross_entropy, xf, wf, t, weight=cw.double())
        got = _raised(FF.linear_cross_entropy, xf, wf, t, weight=cw.double())
        assert type(ref) is RuntimeError and isinstance(got, RuntimeError) and str(ref) in str(got)


def test_scalar_arguments_pytorch_accepts():
    """What PyTorch's argument parser takes: ``ignore_index`` as a NumPy integer or a one-element
    integer tensor, ``label_smoothing`` as a NumPy float, a bool or a 0-d tensor, and the
    deprecated ``reduction='elementwise_mean'`` (``'mean'`` with its warning).  Before, each
    raised (TypeError, or ValueError for the reduction)."""
    x, w, t = _data()
    t2 = torch.where(t == -100, torch.tensor(2), t)
    cases = [
        (t2, dict(ignore_index=np.int64(2))),
        (t2, dict(ignore_index=np.int32(2))),
        (t2, dict(ignore_index=torch.tensor(2))),
        (t2, dict(ignore_index=torch.tensor([2], dtype=torch.int32))),
        (t, dict(label_smoothing=np.float32(0.25))),
        (t, dict(label_smoothing=np.float64(0.25))),
        (t, dict(label_smoothing=torch.tensor(0.25))),
        (t, dict(label_smoothing=True)),
        (t, dict(reduction="elementwise_mean")),
    ]
    for tt, kw in cases:
        with warnings.catch_warnings(record=True) as wr:
            warnings.simplefilter("always")
            ref = F.linear_cross_entropy(x, w, tt, **kw)
        with warnings.catch_warnings(record=True) as wg:
            warnings.simplefilter("always")
            got = FF.linear_cross_entropy(x, w, tt, **kw)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=str(kw))
        assert [str(a.message) for a in wg] == [str(a.message) for a in wr], kw
    # and what it refuses, with its exception types
    for kw in (dict(ignore_index=2.0), dict(ignore_index=True), dict(ignore_index=torch.tensor(2.0)),
               dict(label_smoothing="0.1"), dict(label_smoothing=torch.tensor([0.1])),
               dict(label_smoothing=torch.tensor(0.1, requires_grad=True)), dict(reduction="avg")):
        ref = _raised(F.linear_cross_entropy, x, w, t, **kw)
        got = _raised(FF.linear_cross_entropy, x, w, t, **kw)
        assert isinstance(got, type(ref)) and isinstance(got, fg.AclnnError), (kw, got, ref)
        assert got.param == next(iter(kw))
    # the module takes the deprecated reduction as PyTorch's does
    m = fnn.LinearCrossEntropyLoss(H, C, reduction="elementwise_mean").double()
    r = torch.nn.LinearCrossEntropyLoss(H, C, reduction="elementwise_mean").double()
    r.load_state_dict(m.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(m(x, t), r(x, t), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# fastgrad.torch.LinearCrossEntropyLoss (Liger's and CCE's form: loss_fn(hidden, weight, target))
# ------------------------------------------------------------------------------------------------
def test_liger_module_refuses_what_the_function_refuses():
    """``loss_fn(hidden, None, target)`` raised AttributeError ('NoneType' object has no
    attribute 'shape', read for the shard layout before any check) and ``process_group='world'``
    a bare TypeError from the layout's all-gather; the function raises 161002 naming the argument
    for both.  Now the module raises what the function raises."""
    import fastgrad.torch as ft

    x, w, t = _data(torch.float32)
    t = t.clamp(min=0)
    for bad in (None, [[1.0] * H] * C):
        ref = _raised(ft.linear_cross_entropy, x, bad, t)
        got = _raised(ft.LinearCrossEntropyLoss(), x, bad, t)
        assert type(got) is type(ref) and isinstance(got, fg.AclnnError) and got.param == "weight", got
    ref = _raised(ft.linear_cross_entropy, x, w, t, process_group="world")
    got = _raised(ft.LinearCrossEntropyLoss(process_group="world"), x, w, t)
    assert type(got) is type(ref) and isinstance(got, TypeError), got
    assert isinstance(got, fg.AclnnError) and got.param == "process_group"
