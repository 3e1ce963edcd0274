"""PyTorch 2.13's own tests of ``F.linear_cross_entropy`` / ``nn.LinearCrossEntropyLoss``, run on fastgrad's drop-in.

The samples, error inputs and gradient helpers are PyTorch's, from the installed wheel (2.13.0):

* ``torch/testing/_internal/common_methods_invocations.py``: the three OpInfos
  ``"nn.functional.linear_cross_entropy"`` (``""``, ``"chunked"``, ``"chunked_none"``), their
  ``sample_inputs_linear_cross_entropy*`` and ``error_inputs_linear_cross_entropy``;
* ``torch/testing/_internal/common_modules.py``: ``module_inputs_torch_nn_LinearCrossEntropyLoss``
  (with its ``reference_fn``, ``common_nn.linear_cross_entropy_loss_reference``) and
  ``module_error_inputs_torch_nn_LinearCrossEntropyLoss``;
* ``torch/testing/_internal/common_utils.py``: ``TestGradients._grad_test_helper`` /
  ``_check_helper`` (gradcheck with ``check_batched_grad``, ``check_forward_ad``,
  ``check_batched_forward_grad``, ``check_undefined_grad``, ``check_grad_dtypes``).

The test bodies are those of pytorch/pytorch (each ported below with the op swapped for fastgrad's):
``test/test_ops.py::TestCommon.test_errors``, ``test/test_ops_gradients.py::TestBwdGradients.
test_fn_grad`` and ``test_fn_fail_gradgrad`` (commit 008ec6b1840c94ff6d0f685bc10fbf585167c673),
``test/test_ops_fwd_gradients.py::TestFwdGradients.test_forward_mode_AD`` (commit
04e900e463ef8254494112f42140f947bfba5068), ``test/test_modules.py::TestModule.test_forward``,
``test_errors`` and ``_test_gradients_helper`` (gradcheck of parameters and input).

Where fastgrad does more than an OpInfo declares (forward AD and batched gradients on the
chunked variants, whose PyTorch implementation has none), the stronger check is run.  Where it
does less — second derivatives — the refusal is PyTorch's ``test_fn_fail_gradgrad`` contract:
a ``RuntimeError`` matching ``derivative for .* is not implemented``.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal imports it

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402
from torch.testing._internal.common_utils import TestGradients  # noqa: E402

import fastgrad as fg  # noqa: E402
import fastgrad.torch.nn as fnn  # noqa: E402
import fastgrad.torch.nn.functional as FF  # noqa: E402

_OPS = {o.variant_test_name: o for o in op_db if o.name == "nn.functional.linear_cross_entropy"}
_MODULE = next(m for m in module_db if m.module_cls is torch.nn.LinearCrossEntropyLoss)


def _ours(variant: str):
    """PyTorch's OpInfo with the op replaced by fastgrad's drop-in (samples, flags, tolerances kept)."""
    op = copy.copy(_OPS[variant])
    op.op = FF.linear_cross_entropy
    return op


class _Runner(TestGradients):
    """PyTorch's gradient-test base class, driven from pytest (its helpers need a TestCase)."""

    def runTest(self):  # pragma: no cover - unittest needs a method name
        pass


@pytest.fixture
def tc():
    r = _Runner()
    r.setUp()
    yield r
    r.tearDown()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference-path warning of probability targets
        yield


def test_the_three_opinfos_are_pytorchs():
    assert set(_OPS) == {"", "chunked", "chunked_none"}
    base = _OPS[""]
    assert base.supports_forward_ad and base.check_batched_grad and base.check_batched_forward_grad
    assert not base.supports_out


@pytest.mark.parametrize("variant", ["", "chunked", "chunked_none"])
def test_errors(variant):
    """test_ops.py::TestCommon.test_errors: every error input raises PyTorch's type and message."""
    op = _ours(variant)
    n = 0
    for ei in op.error_inputs("cpu"):
        si = ei.sample_input
        with pytest.raises(ei.error_type, match=ei.error_regex) as info:
            op(si.input, *si.args, **si.kwargs)
        # fastgrad's own errors are also AclnnError 161002 (the K-dimensional one is PyTorch's own
        # reference path raising)
        if "K-dimensional" not in ei.error_regex:
            assert isinstance(info.value, fg.AclnnError) and info.value.status == 161002
        n += 1
    assert n == 6


@pytest.mark.parametrize("variant", ["", "chunked", "chunked_none"])
def test_fn_grad(tc, variant):
    """test_ops_gradients.py::TestBwdGradients.test_fn_grad in float64: gradcheck of every sample,
    batched gradients included (fastgrad also on "chunked_none", which PyTorch's op cannot)."""
    op = _ours(variant)
    tc._grad_test_helper("cpu", torch.float64, op, op.get_op(), check_batched_grad=True)


@pytest.mark.parametrize("variant", ["", "chunked", "chunked_none"])
def test_forward_mode_AD(tc, variant):
    """test_ops_fwd_gradients.py::TestFwdGradients.test_forward_mode_AD (its
    ``_forward_grad_helper``): forward AD and batched forward AD against finite differences
    (PyTorch's chunked variants declare no forward AD; fastgrad's drop-in has it there too)."""
    op = _ours(variant)
    tc._grad_test_helper(
        "cpu",
        torch.float64,
        op,
        op.get_op(),
        check_forward_ad=True,
        check_backward_ad=False,
        check_batched_grad=False,
        check_batched_forward_grad=True,
    )


def test_fn_fail_gradgrad(tc):
    """test_ops_gradients.py::TestBwdGradients.test_fn_fail_gradgrad: differentiable once, and
    the second derivative refused with PyTorch's wording (not a silent zero)."""
    op = _ours("")
    with pytest.raises(RuntimeError, match=r"derivative for .* is not implemented"):
        tc._check_helper("cpu", torch.float64, op, op.get_op(), "bwgrad_bwgrad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_dtype_is_pytorchs(dtype):
    """The loss comes back in PyTorch's dtype (``assert_close(..., exact_dtype=True)`` holds)."""
    for sample in _ours("").sample_inputs("cpu", dtype, requires_grad=False):
        got = FF.linear_cross_entropy(sample.input, *sample.args, **sample.kwargs)
        ref = torch.nn.functional.linear_cross_entropy(sample.input, *sample.args, **sample.kwargs)
        assert got.dtype == ref.dtype == dtype
        tol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}[dtype]
        torch.testing.assert_close(got, ref, rtol=tol[0], atol=tol[1])


# ----------------------------------------------------------------------------------------------
# ModuleInfo: test_modules.py
# ----------------------------------------------------------------------------------------------


def _module_inputs(dtype, requires_grad=False):
    return _MODULE.module_inputs_func(_MODULE, device="cpu", dtype=dtype, requires_grad=requires_grad, training=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_module_forward(dtype):
    """test_modules.py::TestModule.test_forward: each sample's output equals its reference_fn
    (PyTorch's default tolerances of the dtype, exact dtype)."""
    tc = _Runner()
    n = 0
    for mi in _module_inputs(dtype):
        args, kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
        torch.manual_seed(0)
        m = fnn.LinearCrossEntropyLoss(*args, **kwargs)
        out = m(*mi.forward_input.args, **mi.forward_input.kwargs)
        ref = mi.reference_fn(m, *mi.forward_input.args, **mi.forward_input.kwargs)  # it passes the parameters
        tc.assertEqual(out, ref, exact_dtype=True)
        n += 1
    assert n > 100


def test_module_errors():
    """test_modules.py::TestModule.test_errors: PyTorch's five error inputs, construction and forward."""
    from torch.testing._internal.common_modules import ModuleErrorEnum

    for ei in _MODULE.module_error_inputs_func(_MODULE, "cpu", torch.float32, False, True):
        mi = ei.module_error_input
        c, f = mi.constructor_input, mi.forward_input
        if ei.error_on == ModuleErrorEnum.CONSTRUCTION_ERROR:
            with pytest.raises(ei.error_type, match=ei.error_regex):
                fnn.LinearCrossEntropyLoss(*c.args, **c.kwargs)
        else:
            m = fnn.LinearCrossEntropyLoss(*c.args, **c.kwargs)
            with pytest.raises(ei.error_type, match=ei.error_regex):
                m(*f.args, **f.kwargs)


def _module_gradcheck(stride: int, offset: int = 0):
    """test_modules.py::TestModule._test_gradients_helper ("gradcheck"): parameters and input,
    float64, batched gradients and forward AD on (every ``stride``-th sample)."""
    from torch.autograd import gradcheck

    n = 0
    for i, mi in enumerate(_module_inputs(torch.float64, requires_grad=True)):
        if i % stride != offset:
            continue
        c = mi.constructor_input
        if c.kwargs.get("out_features"):
            continue  # K-dimensional: PyTorch's own reference path
        m = fnn.LinearCrossEntropyLoss(*c.args, **c.kwargs).to(torch.float64)
        params = tuple(m.parameters())
        inp, target = mi.forward_input.args

        def fn(x, *ps, m=m, target=target):
            with torch.nn.utils.stateless._reparametrize_module(m, dict(zip((k for k, _ in m.named_parameters()), ps))):
                return m(x, target)

        assert gradcheck(
            fn,
            (inp, *params),
            check_batched_grad=True,
            check_forward_ad=True,
            check_batched_forward_grad=True,
            fast_mode=True,
        )
        n += 1
    assert n > 0


def test_module_gradients_sampled():
    """A tenth of the module samples (every reduction, ignore_index, smoothing, weight, bias and
    option kind occurs in it); the whole set is the extended test below."""
    _module_gradcheck(25)


@pytest.mark.extended  # every ModuleInfo sample (minutes): `pytest -m extended`; every 25th runs in CI
def test_module_gradients_all():
    _module_gradcheck(1)
