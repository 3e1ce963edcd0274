"""Liger-Kernel's own tests of its fused linear cross-entropy and cross-entropy, run on fastgrad.

Ported from linkedin/Liger-Kernel at commit ead96b618e5c67bddc6a6e9bcb99bfe6b5ab661c:

* ``test/transformers/test_fused_linear_cross_entropy.py`` — ``TorchLMHeadCE`` (the reference:
  ``nn.Linear`` → fp32 logits → softcap → ``CrossEntropyWithZLoss``), ``test_correctness``,
  ``test_correctness_with_forward_only``, ``test_correctness_functional``,
  ``test_correctness_with_token_accuracy``, ``test_amp``, the token-scaling tests,
  ``test_liger_fused_linear_cross_entropy_structured_output``,
  ``test_correctness_with_predicted_tokens``,
  ``test_correctness_reduction_none_per_token_grad_output``;
* ``test/transformers/test_cross_entropy.py`` — ``CrossEntropyWithZLoss`` and the bodies of every
  ``_test_correctness_*_once`` helper with their parametrizations, ``test_float32_internal``,
  ``test_correctness_with_out_of_bounds_target_once``, ``test_liger_cross_entropy_structured_output``,
  ``test_correctness_with_predicted_tokens``,
  ``test_correctness_true_class_grad_confident_predictions``;
* ``test/utils.py`` — ``assert_verbose_allclose`` (``|a - b| <= atol + rtol·|b|``, NaN/inf positions
  equal) and ``set_seed``.

The references, the data (``torch.rand`` LM heads, ``randn`` inputs, a random share of targets set
to ``ignore_index``) and the tolerances are Liger's (atol/rtol per dtype and reduction as in the
files).  What changed in the port:

* fastgrad runs on the CPU: the bodies run on CPU torch.  Shapes: Liger's FLCE shape
  ``(B, T, H, V) = (8, 128, 1024, 4096)`` runs as-is under ``@pytest.mark.extended``; the default run
  uses ``(4, 64, 256, 1024)`` in its place, plus Liger's own "random shape" ``(4, 47, 31, 123)``.
* Liger's cross-entropy tests take logits ``[BT, V]``.  fastgrad's loss takes hidden states and an
  LM head, so the logits are passed as ``hidden`` with an identity head ``weight = I_V``:
  ``hidden @ I`` is the logits exactly in every dtype (one exact product per output, the others
  zero), and ``grad_hidden = grad_logits · I`` is the logits' gradient exactly — so Liger's tight
  fp32 tolerances (rtol 1e-6, atol 1e-8) apply to fastgrad's statistics and gradient unchanged.
  The identity head is ``V × V``, so Liger's ``(2, 4096, 32000)`` / ``(3, 423, 32000)`` run as
  ``(2, 128, 1024)`` / ``(3, 423, 500)`` (the "weird" ``T = 423`` kept); the ``V = 32000`` rows
  are under ``@pytest.mark.extended`` at ``(2, 16, 32000)`` (a 4 GiB fp32 identity would not fit,
  so the batch is small and the head is the identity in bf16/fp32 as the dtype asks).
* Where the signature fits (no softcap, z-loss, predicted tokens), the cross-entropy body runs on
  the drop-in ``fastgrad.torch.nn.functional.linear_cross_entropy`` (PyTorch's signature, the loss
  in the input's dtype, as ``torch.nn.CrossEntropyLoss`` returns it); otherwise on
  ``fastgrad.torch.linear_cross_entropy`` (fp32 loss, documented; compared in the reference's
  dtype: ``.to(output.dtype)``, as Liger's reference itself casts).
* Token scaling (``use_token_scaling``, Liger's ``loss·p_target.detach()``): fastgrad has no flag;
  the recipe is one line on its per-token loss, ``loss * exp(-loss).detach()`` (``exp(-ce) =
  p_target``), and Liger's token-scaling tests check exactly that against Liger's references.
* Liger raises ``AssertionError("... out of bounds ...")`` for a target outside ``[0, V)``;
  fastgrad's documented error is ``AclnnError`` 161002 (a ``ValueError``; the drop-in: PyTorch's
  ``IndexError`` type) whose text names ``out of bounds`` — asserted explicitly below.
* ``test_correctness_with_forward_only``: Liger accepts either outcome of the backward of a
  ``no_grad`` loss; here the ``RuntimeError`` ("does not require grad") is required.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
import fastgrad.torch.nn.functional as FF  # noqa: E402

# the peers' own full-size shapes: `pytest -m extended` (minutes; not in CI — the same test
# bodies run in the default suite at the scaled shapes above)
extended = pytest.mark.extended


def set_seed(seed=42):
    random.seed(seed)
    np.random.seed(0)
    torch.manual_seed(seed)


def assert_verbose_allclose(tensor1, tensor2, rtol=1e-05, atol=1e-08, extra_info=""):
    """Liger's ``test/utils.py::assert_verbose_allclose`` (the tolerance against ``tensor2``)."""
    if tensor1.shape != tensor2.shape:
        raise AssertionError("Input tensors must have the same shape.")
    diff = torch.abs(tensor1 - tensor2)
    tolerance = atol + rtol * torch.abs(tensor2)
    mismatched = (
        (diff > tolerance)
        | torch.logical_xor(torch.isnan(tensor1), torch.isnan(tensor2))
        | torch.logical_xor(torch.isposinf(tensor1), torch.isposinf(tensor2))
        | torch.logical_xor(torch.isneginf(tensor1), torch.isneginf(tensor2))
    )
    n = int(mismatched.sum())
    if n:
        idx = mismatched.nonzero()[:5].tolist()
        raise AssertionError(
            f"{extra_info}{n} of {mismatched.numel()} mismatched (atol {atol}, rtol {rtol}); max diff "
            f"{float(diff[mismatched].max())}; first at {idx}: {tensor1[mismatched][:5].tolist()} vs "
            f"{tensor2[mismatched][:5].tolist()}"
        )


@pytest.fixture(autouse=True)
def _seed():
    set_seed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


# ---------------------------------------------------------------------------------------------
# the references (Liger's, verbatim up to the device)
# ---------------------------------------------------------------------------------------------


class CrossEntropyWithZLoss(torch.nn.Module):
    def __init__(
        self,
        weight=None,
        lse_square_scale=0.0,
        reduction="mean",
        ignore_index=-100,
        label_smoothing=0.0,
        return_z_loss=False,
        dtype=torch.float32,
    ):
        super().__init__()
        self.weight = weight
        self.lse_square_scale = lse_square_scale
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.return_z_loss = return_z_loss
        self.label_smoothing = label_smoothing
        self.dtype = dtype
        self.compute_dtype = torch.float32  # float64 for the arbiter of _agree (the port's only change)

    def forward(self, logits, targets):
        logits = logits.to(self.compute_dtype)
        target_mask = targets != self.ignore_index
        ce_loss = F.cross_entropy(
            logits,
            targets,
            weight=self.weight,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
        )
        lse = torch.logsumexp(logits, dim=-1)
        z_loss = torch.where(targets != self.ignore_index, self.lse_square_scale * (lse**2), 0.0)
        if self.reduction == "mean":
            z_loss = z_loss.sum() / target_mask.sum()
        elif self.reduction == "sum":
            z_loss = z_loss.sum()
        ce_loss = ce_loss.to(self.dtype)
        z_loss = z_loss.to(self.dtype)
        total_loss = ce_loss + z_loss
        if self.return_z_loss:
            return total_loss, z_loss
        return total_loss


class TorchLMHeadCE(torch.nn.Module):
    def __init__(
        self,
        H: int,
        V: int,
        dtype: torch.dtype,
        bias: bool = False,
        ce_weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
    ):
        super().__init__()
        self.lin = torch.nn.Linear(in_features=H, out_features=V, bias=bias, dtype=dtype)
        self.ce_loss = CrossEntropyWithZLoss(
            weight=ce_weight,
            ignore_index=ignore_index,
            lse_square_scale=lse_square_scale,
            label_smoothing=label_smoothing,
            reduction=reduction,
            return_z_loss=return_z_loss,
        )
        self.softcap = softcap

    def forward(self, x, y):
        logits = self.lin(x).to(torch.float32)
        if self.softcap is not None and self.softcap != 0.0:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return self.ce_loss(logits, y)


class FastgradLMHeadCE(torch.nn.Module):
    """Liger's ``LigerLMHeadCE`` with fastgrad's loss in place of ``LigerFusedLinearCrossEntropyLoss``."""

    def __init__(
        self,
        H: int,
        V: int,
        dtype: torch.dtype,
        ce_weight=None,
        bias: bool = False,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap=None,
        return_z_loss: bool = False,
        accum_dtype=None,
    ):
        super().__init__()
        self.lin = torch.nn.Linear(in_features=H, out_features=V, bias=bias, dtype=dtype)
        self.kw = dict(
            ce_weight=ce_weight,
            ignore_index=ignore_index,
            lse_square_scale=lse_square_scale,
            label_smoothing=label_smoothing,
            reduction=reduction,
            softcap=softcap,
            return_z_loss=return_z_loss,
            accum_dtype=accum_dtype,
        )

    def forward(self, x, y):
        return ft.linear_cross_entropy(x, self.lin.weight, y, bias=self.lin.bias, **self.kw)


def _ignore_some(target, ignore_index):
    BT = target.numel()
    n = torch.randint(1, BT // 2, (1,)).item()
    target[torch.randperm(BT)[:n]] = ignore_index
    return target


# ---------------------------------------------------------------------------------------------
# test_fused_linear_cross_entropy.py
# ---------------------------------------------------------------------------------------------

FLCE_SHAPES = [
    pytest.param(8, 128, 1024, 4096, marks=extended, id="liger-8x128x1024x4096"),
    pytest.param(4, 64, 256, 1024, id="scaled-4x64x256x1024"),
    pytest.param(4, 47, 31, 123, id="random-4x47x31x123"),
]
FLCE_TOLS = [
    ("mean", 1.0, torch.bfloat16, 5e-3, 5e-2),
    ("mean", 1.0, torch.float32, 1e-5, 5e-4),
    ("sum", 1.0, torch.bfloat16, 5e-0, 5e1),
    ("sum", 1.0, torch.float32, 1e-3, 5e-2),
]
FLCE_FEATURES = [
    (False, 0, -100, 0, None, False, None),
    # Pass non-default values once to ensure all params work along
    (True, 0.1, 42, 1e-4, 30.0, True, torch.float32),
]


def _flce_pair(H, V, dtype, bias, ce_weight, lse_square_scale, label_smoothing, ignore_index, reduction,
               softcap, return_z_loss, accum_dtype):
    ref = TorchLMHeadCE(H=H, V=V, bias=bias, ce_weight=ce_weight, lse_square_scale=lse_square_scale,
                        label_smoothing=label_smoothing, ignore_index=ignore_index, reduction=reduction,
                        softcap=softcap, return_z_loss=return_z_loss, dtype=dtype)
    ours = FastgradLMHeadCE(H=H, V=V, bias=bias, ce_weight=ce_weight, lse_square_scale=lse_square_scale,
                            label_smoothing=label_smoothing, ignore_index=ignore_index, reduction=reduction,
                            softcap=softcap, return_z_loss=return_z_loss, dtype=dtype, accum_dtype=accum_dtype)
    ref.lin.weight.data = ours.lin.weight.data = torch.rand(V, H, dtype=dtype)
    if bias:
        ref.lin.bias.data = ours.lin.bias.data = torch.rand(V, dtype=dtype)
    return ref, ours


@pytest.mark.parametrize("B, T, H, V", FLCE_SHAPES)
@pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", FLCE_TOLS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "has_ce_weight, label_smoothing, ignore_index, lse_square_scale, softcap, return_z_loss, accum_dtype",
    FLCE_FEATURES,
)
def test_flce_correctness(B, T, H, V, scalar, dtype, bias, has_ce_weight, lse_square_scale, label_smoothing,
                          ignore_index, reduction, softcap, return_z_loss, accum_dtype, atol, rtol):
    ce_weight = torch.rand(V, dtype=torch.float32) if has_ce_weight else None
    ref, ours = _flce_pair(H, V, dtype, bias, ce_weight, lse_square_scale, label_smoothing, ignore_index,
                           reduction, softcap, return_z_loss, accum_dtype)
    _tensor = torch.randn(B * T, H, dtype=dtype) * scalar
    _input1 = _tensor.detach().clone().requires_grad_(True)
    _input2 = _tensor.detach().clone().requires_grad_(True)
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)

    if return_z_loss:
        output1, z_output1 = ref(_input1, target)
        result2 = ours(_input2, target)
        assert isinstance(result2, ft.LinearCrossEntropyOutput)
        output2, z_output2 = result2.loss, result2.z_loss
    else:
        output1 = ref(_input1, target)
        output2 = ours(_input2, target)

    assert_verbose_allclose(output1, output2, atol=atol, rtol=rtol)
    if return_z_loss:
        assert_verbose_allclose(z_output1, z_output2, atol=atol, rtol=rtol)

    grad_output = torch.ones_like(output1)
    output1.backward(gradient=grad_output)
    output2.backward(gradient=grad_output)
    assert_verbose_allclose(_input1.grad, _input2.grad, atol=atol, rtol=rtol)
    assert_verbose_allclose(ref.lin.weight.grad, ours.lin.weight.grad, atol=atol, rtol=rtol)
    if bias:
        assert_verbose_allclose(ref.lin.bias.grad, ours.lin.bias.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("B, T, H, V", FLCE_SHAPES)
@pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", FLCE_TOLS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "has_ce_weight, label_smoothing, ignore_index, lse_square_scale, softcap, return_z_loss, accum_dtype",
    FLCE_FEATURES,
)
def test_flce_correctness_with_forward_only(B, T, H, V, scalar, dtype, bias, has_ce_weight, lse_square_scale,
                                            label_smoothing, ignore_index, reduction, softcap, return_z_loss,
                                            accum_dtype, atol, rtol):
    ce_weight = torch.rand(V, dtype=torch.float32) if has_ce_weight else None
    ref, ours = _flce_pair(H, V, dtype, bias, ce_weight, lse_square_scale, label_smoothing, ignore_index,
                           reduction, softcap, return_z_loss, accum_dtype)
    _tensor = torch.randn(B * T, H, dtype=dtype) * scalar
    _input1 = _tensor.detach().clone().requires_grad_(True)
    _input2 = _tensor.detach().clone().requires_grad_(True)
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)

    with torch.no_grad():
        if return_z_loss:
            output1, z_output1 = ref(_input1, target)
            result2 = ours(_input2, target)
            assert isinstance(result2, ft.LinearCrossEntropyOutput)
            output2, z_output2 = result2.loss, result2.z_loss
        else:
            output1 = ref(_input1, target)
            output2 = ours(_input2, target)
        assert_verbose_allclose(output1, output2, atol=atol, rtol=rtol)
        if return_z_loss:
            assert_verbose_allclose(z_output1, z_output2, atol=atol, rtol=rtol)

    with pytest.raises(RuntimeError, match="does not require grad"):
        output2.backward(gradient=torch.rand_like(output1))


@pytest.mark.parametrize("B, T, H, V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", [(1.0, torch.bfloat16, 5e-3, 5e-2),
                                                        (1.0, torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("ce_weight", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_flce_correctness_functional(B, T, H, V, scalar, dtype, bias, ce_weight, atol, rtol):
    """Liger compares its functional face with its autograd Function; here the functional face
    (``ft.linear_cross_entropy``) with the module face (``ft.LinearCrossEntropyLoss``) and with
    Liger's torch reference of the same keywords (``TorchLMHeadCE``'s body)."""
    _input = torch.randn(B * T, H, dtype=dtype) * scalar
    x1 = _input.detach().clone().requires_grad_(True)
    x2 = _input.detach().clone().requires_grad_(True)
    x3 = _input.detach().clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    weight = torch.randn(V, H, dtype=dtype)
    bias = torch.randn(V, dtype=dtype) if bias else None
    ce_weight = torch.randn(V) if ce_weight else None
    kw = dict(ignore_index=-100, lse_square_scale=1e-4, label_smoothing=0.1, reduction="mean", softcap=30.0,
              return_z_loss=True, accum_dtype=torch.float32)
    result = ft.linear_cross_entropy(x1, weight, target, bias=bias, ce_weight=ce_weight, **kw)
    y1, z1 = result.loss, result.z_loss
    module = ft.LinearCrossEntropyLoss(ignore_index=-100, reduction="mean", label_smoothing=0.1, ce_weight=ce_weight,
                                       lse_square_scale=1e-4, softcap=30.0, return_z_loss=True,
                                       accum_dtype=torch.float32)
    r2 = module(x2, weight, target, bias)
    y2, z2 = r2.loss, r2.z_loss
    assert torch.allclose(y1, y2, atol=atol, rtol=rtol)
    assert torch.allclose(z1, z2, atol=atol, rtol=rtol)

    logits = F.linear(x3, weight, bias).float()
    logits = 30.0 * torch.tanh(logits / 30.0)
    y3, z3 = CrossEntropyWithZLoss(weight=ce_weight, lse_square_scale=1e-4, label_smoothing=0.1,
                                   return_z_loss=True)(logits, target)
    assert torch.allclose(y1, y3, atol=atol, rtol=rtol)
    assert torch.allclose(z1, z3, atol=atol, rtol=rtol)

    grad_output = torch.randn_like(y1)
    y1.backward(grad_output)
    y2.backward(grad_output)
    y3.backward(grad_output)
    assert torch.allclose(x1.grad, x2.grad, atol=atol, rtol=rtol)
    assert torch.allclose(x1.grad.float(), x3.grad.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("B, T, H, V", FLCE_SHAPES)
@pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", FLCE_TOLS[:2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_token_accuracy", [True, False])
def test_flce_correctness_with_token_accuracy(B, T, H, V, scalar, dtype, bias, return_token_accuracy,
                                              reduction, atol, rtol):
    ref, ours = _flce_pair(H, V, dtype, bias, None, 0.0, 0.0, -100, reduction, None, False, None)
    _tensor = torch.randn(B * T, H, dtype=dtype) * scalar
    _input1 = _tensor.detach().clone().requires_grad_(True)
    _input2 = _tensor.detach().clone().requires_grad_(True)
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), -100)

    output1 = ref(_input1, target)
    result = ft.linear_cross_entropy(_input2, ours.lin.weight, target, bias=ours.lin.bias if bias else None,
                                     ignore_index=-100, reduction=reduction,
                                     return_token_accuracy=return_token_accuracy)
    if return_token_accuracy:
        assert isinstance(result, ft.LinearCrossEntropyOutput)
        output2, token_accuracy = result.loss, result.token_accuracy
        assert token_accuracy is not None
        with torch.no_grad():
            logits = _input2 @ ours.lin.weight.t()
            if bias:
                logits = logits + ours.lin.bias
            predictions = torch.argmax(logits, dim=-1)
            mask = target != -100
            expected_accuracy = ((predictions == target) & mask).sum().float() / mask.sum().float()
            if dtype == torch.float32:
                assert_verbose_allclose(token_accuracy, expected_accuracy, atol=atol, rtol=rtol)
            else:
                # Documented divergence (docs/torch.md, return_token_accuracy): fastgrad's argmax is
                # of the fp32 logits (bf16 products are exact in fp32), Liger's reference's of the
                # logits rounded to bf16 (ulp 0.125 at these |logits| ~ 20, so near-ties reorder).
                # fastgrad's accuracy is the exact one: that of the float64 logits ...
                exact = _input2.double() @ ours.lin.weight.double().t()
                if bias:
                    exact = exact + ours.lin.bias.double()
                exact_pred = exact.argmax(dim=-1)
                exact_acc = ((exact_pred == target) & mask).sum().float() / mask.sum().float()
                assert float(token_accuracy) == float(exact_acc)
                # ... and it differs from Liger's reference only by the rows whose bf16 rounding
                # moves the argmax
                moved = int(((exact_pred != predictions) & mask).sum())
                assert abs(float(token_accuracy) - float(expected_accuracy)) <= moved / float(mask.sum()) + 1e-7
    else:
        output2 = result
        assert not isinstance(result, ft.LinearCrossEntropyOutput)
    assert_verbose_allclose(output1, output2, atol=atol, rtol=rtol)

    output1.backward(gradient=torch.ones_like(output1))
    output2.backward(gradient=torch.ones_like(output1))
    assert_verbose_allclose(_input1.grad, _input2.grad, atol=atol, rtol=rtol)
    assert_verbose_allclose(ref.lin.weight.grad, ours.lin.weight.grad, atol=atol, rtol=rtol)
    if bias:
        assert_verbose_allclose(ref.lin.bias.grad, ours.lin.bias.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("B, T, H, V", FLCE_SHAPES)
@pytest.mark.parametrize(
    "bias, cast_dtype, atol, rtol",
    [
        (True, torch.bfloat16, 5e-3, 5e-2),
        (True, torch.float16, 5e-3, 5e-2),
        (False, torch.bfloat16, 5e-3, 5e-2),
        (False, torch.float16, 5e-3, 5e-2),
    ],
)
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_flce_amp(B, T, H, V, bias, cast_dtype, accum_dtype, atol, rtol):
    dtype = torch.float32
    ref, ours = _flce_pair(H, V, dtype, bias, None, 0.0, 0.0, -100, "mean", None, False, accum_dtype)
    # Liger initializes the weight only (the biases keep nn.Linear's own, different init)
    ours.lin.weight.data = ref.lin.weight.data = torch.rand(V, H, dtype=dtype)
    if bias:
        ours.lin.bias.data = ref.lin.bias.data.clone()
    _tensor = torch.randn(B * T, H, dtype=dtype)
    _input1 = _tensor.detach().clone().requires_grad_(True)
    _input2 = _tensor.detach().clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)

    with torch.autocast(device_type="cpu", dtype=cast_dtype):
        output1 = ref(_input1, target)
        output2 = ours(_input2, target)
    assert_verbose_allclose(output1, output2, atol=atol, rtol=rtol)
    with torch.autocast(device_type="cpu", dtype=cast_dtype):
        output1.backward()
        output2.backward()
    assert_verbose_allclose(_input1.grad, _input2.grad, atol=atol, rtol=rtol)
    assert_verbose_allclose(ref.lin.weight.grad, ours.lin.weight.grad, atol=atol, rtol=rtol)


def _token_scaled(loss):
    """Liger's ``use_token_scaling``: each token's loss times its detached target probability."""
    return loss * torch.exp(-loss).detach()


def test_flce_correctness_token_scaling():
    B, T, H, V = 2, 4, 8, 16
    _input = torch.randn(B * T, H, requires_grad=True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    weight = torch.randn(V, H)
    bias = torch.randn(V)
    loss_scaled = _token_scaled(ft.linear_cross_entropy(_input, weight, target, bias=bias, reduction="none"))

    logits = _input @ weight.t() + bias
    ce_loss = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    pred_probs = torch.softmax(logits, dim=-1).gather(1, target.unsqueeze(-1)).squeeze(-1).detach()
    expected_loss = ce_loss * pred_probs
    assert torch.allclose(loss_scaled, expected_loss, atol=1e-4, rtol=1e-4)

    loss_scaled.sum().backward(retain_graph=True)
    grad_scaled = _input.grad.clone()
    _input.grad.zero_()
    expected_loss.sum().backward(retain_graph=True)
    grad_expected = _input.grad.clone()
    assert torch.allclose(grad_scaled, grad_expected, atol=1e-4, rtol=1e-4)


def test_flce_correctness_token_scaling_consistency():
    B, T, H, V = 2, 4, 8, 16
    _input = torch.randn(B * T, H, requires_grad=True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    weight = torch.randn(V, H)
    bias = torch.randn(V)
    loss_functional = _token_scaled(
        ft.linear_cross_entropy(_input, weight, target, bias=bias, reduction="none")).sum()
    loss_module = _token_scaled(ft.LinearCrossEntropyLoss(reduction="none")(_input, weight, target, bias)).sum()
    assert torch.allclose(loss_functional, loss_module, atol=1e-6, rtol=1e-6)
    loss_functional.backward(retain_graph=True)
    grad_functional = _input.grad.clone()
    _input.grad.zero_()
    loss_module.backward(retain_graph=True)
    assert torch.allclose(grad_functional, _input.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("face", ["functional", "module"])
def test_flce_correctness_token_scaling_sum(face):
    B, T, H, V = 2, 4, 8, 16
    _input = torch.randn(B * T, H)
    x1 = _input.detach().clone().requires_grad_(True)
    x2 = _input.detach().clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    weight = torch.randn(V, H)
    bias = torch.randn(V)
    if face == "functional":
        per_token = ft.linear_cross_entropy(x1, weight, target, bias=bias, reduction="none")
    else:
        per_token = ft.LinearCrossEntropyLoss(reduction="none")(x1, weight, target, bias)
    y1 = _token_scaled(per_token).sum()

    logits = x2 @ weight.t() + bias
    probs = torch.softmax(logits.detach(), dim=-1)
    pred_probs = torch.gather(probs, -1, target.unsqueeze(-1)).squeeze(-1)
    y2 = (F.cross_entropy(logits, target, ignore_index=-100, reduction="none") * pred_probs).sum()
    assert torch.allclose(y1, y2, atol=1e-5, rtol=1e-5)
    y1.backward()
    y2.backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)


def test_flce_token_scaling_with_ignore_index():
    H, V = 8, 1000
    target = torch.tensor([0, 100, -100, 500, -100, 999], dtype=torch.long)
    _input = torch.randn(6, H, requires_grad=True)
    weight = torch.randn(V, H)
    bias = torch.randn(V)
    loss_scaled = _token_scaled(ft.linear_cross_entropy(_input, weight, target, bias=bias, reduction="none")).sum()
    assert loss_scaled.numel() == 1
    assert not torch.isnan(loss_scaled)
    assert not torch.isinf(loss_scaled)
    loss_scaled.backward()
    assert _input.grad is not None
    assert not torch.isnan(_input.grad).any()


@pytest.mark.parametrize("return_z_loss, return_token_accuracy",
                         [(False, False), (True, False), (False, True), (True, True)])
def test_flce_structured_output(return_z_loss, return_token_accuracy):
    hidden_states = torch.tensor([[0.2, -0.1], [1.0, 0.5], [-0.3, 0.7]], requires_grad=True)
    weight = torch.tensor([[0.5, -0.4], [-0.2, 0.3], [0.1, 0.6]])
    bias = torch.tensor([0.1, -0.2, 0.05])
    targets = torch.tensor([0, 1, 2])
    result = ft.linear_cross_entropy(hidden_states, weight, targets, bias=bias, return_z_loss=return_z_loss,
                                     return_token_accuracy=return_token_accuracy)
    logits = hidden_states @ weight.t() + bias
    expected_loss = F.cross_entropy(logits, targets)

    if not return_z_loss and not return_token_accuracy:
        assert isinstance(result, torch.Tensor)
        assert torch.allclose(result, expected_loss, atol=1e-6)
        result.backward()
    else:
        assert isinstance(result, ft.LinearCrossEntropyOutput)
        assert torch.allclose(result.loss, expected_loss, atol=1e-6)
        assert (result.z_loss is not None) == return_z_loss
        if return_token_accuracy:
            with torch.no_grad():
                expected_accuracy = (logits.argmax(dim=-1) == targets).float().mean()
            assert torch.allclose(result.token_accuracy, expected_accuracy, atol=1e-6)
        else:
            assert result.token_accuracy is None
        result.loss.backward()
    assert hidden_states.grad is not None
    hidden_states.grad.zero_()

    module = ft.LinearCrossEntropyLoss(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
    module_result = module(hidden_states, weight, targets, bias)
    if not return_z_loss and not return_token_accuracy:
        assert isinstance(module_result, torch.Tensor)
        assert torch.allclose(module_result, expected_loss, atol=1e-6)
    else:
        assert isinstance(module_result, ft.LinearCrossEntropyOutput)
        assert torch.allclose(module_result.loss, expected_loss, atol=1e-6)
        assert (module_result.z_loss is not None) == return_z_loss
        assert (module_result.token_accuracy is not None) == return_token_accuracy


@pytest.mark.parametrize("B, T, H, V", FLCE_SHAPES)
@pytest.mark.parametrize("reduction, dtype, atol, rtol",
                         [("mean", torch.bfloat16, 5e-3, 5e-2), ("mean", torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_flce_correctness_with_predicted_tokens(B, T, H, V, reduction, dtype, bias, ignore_index, atol, rtol):
    torch.manual_seed(42)
    weight = torch.randn(V, H, dtype=dtype)
    bias_tensor = torch.randn(V, dtype=dtype) if bias else None
    _input = torch.randn(B * T, H, dtype=dtype, requires_grad=True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    target[torch.randperm(B * T)[: B * T // 4]] = ignore_index

    result = ft.linear_cross_entropy(_input, weight, target, bias=bias_tensor, ignore_index=ignore_index,
                                     reduction=reduction, return_predicted_tokens=True)
    assert isinstance(result, ft.LinearCrossEntropyOutput)
    assert result.predicted_tokens is not None
    assert result.predicted_tokens.shape == (B * T,)
    assert result.predicted_tokens.dtype == torch.int64

    keep = target != ignore_index
    with torch.no_grad():
        logits = _input.float() @ weight.float().t()
        if bias_tensor is not None:
            logits = logits + bias_tensor.float()
        max_logits = logits[keep].max(dim=-1).values
        predicted_logits = logits[keep].gather(1, result.predicted_tokens[keep].unsqueeze(1)).squeeze(1)
    assert torch.allclose(predicted_logits, max_logits, atol=atol, rtol=rtol)
    assert torch.all(result.predicted_tokens[~keep] == -1)
    result.loss.backward()
    assert _input.grad is not None


@pytest.mark.parametrize("B, T, H, V", [(2, 16, 32, 64), (1, 32, 64, 128)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-4)])
def test_flce_reduction_none_per_token_grad_output(B, T, H, V, bias, dtype, atol, rtol):
    set_seed(42)
    BT = B * T
    _input = torch.randn(BT, H, dtype=dtype) * 0.1
    weight = torch.randn(V, H, dtype=dtype) * 0.1
    bias_t = torch.randn(V, dtype=dtype) * 0.1 if bias else None
    target = torch.randint(0, V, (BT,), dtype=torch.long)
    grad_output = torch.rand(BT, dtype=dtype) + 0.5

    def run(fn):
        x = _input.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        b = bias_t.clone().requires_grad_(True) if bias else None
        loss = fn(x, w, b)
        loss.backward(grad_output)
        return loss, x.grad, w.grad, (b.grad if bias else None)

    ref = run(lambda x, w, b: F.cross_entropy(F.linear(x, w, b), target, reduction="none"))
    ours = run(lambda x, w, b: ft.linear_cross_entropy(x, w, target, bias=b, reduction="none"))
    for a, r in zip(ours, ref):
        if r is not None:
            assert_verbose_allclose(a, r, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# test_cross_entropy.py — the logits as hidden states through an identity head
# ---------------------------------------------------------------------------------------------

_EYE: dict = {}


def _eye(V, dtype):
    key = (V, dtype)
    if key not in _EYE:
        _EYE.clear()
        _EYE[key] = torch.eye(V, dtype=dtype)
    return _EYE[key]


class FastgradCE:
    """Liger's ``LigerCrossEntropyLoss(...)`` on fastgrad: ``loss(logits, target)`` with the logits
    passed as hidden states through ``weight = I``.  The drop-in (PyTorch's signature and output
    dtype) where the keywords fit it, the extended API otherwise."""

    def __init__(self, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
                 return_predicted_tokens=False):
        self.kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        self.weight = weight
        self.extra = dict(lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                          return_token_accuracy=return_token_accuracy,
                          return_predicted_tokens=return_predicted_tokens)
        self.dropin = lse_square_scale == 0.0 and softcap is None and not (
            return_z_loss or return_token_accuracy or return_predicted_tokens)

    def __call__(self, logits, target):
        eye = _eye(logits.shape[-1], logits.dtype)
        if self.dropin:
            return FF.linear_cross_entropy(logits, eye, target, weight=self.weight, **self.kw)
        return ft.linear_cross_entropy(logits, eye, target, ce_weight=self.weight, **self.kw, **self.extra)


CE_SHAPES = [
    pytest.param(2, 128, 1024, id="scaled-2x128x1024"),
    pytest.param(3, 423, 500, id="weird-3x423x500"),
    pytest.param(2, 16, 32000, marks=extended, id="V32000-2x16x32000"),
]
CE_TOLS = [(1.0, torch.bfloat16, 1e-8, 5e-2), (1.0, torch.float32, 1e-8, 1e-6)]


def _same(out, ref):
    return out.to(ref.dtype) if isinstance(out, torch.Tensor) else out


def _agree(ours, ref, exact, atol, rtol, what):
    """Liger's ``torch.allclose(ref, ours, atol, rtol)``, element by element, with one documented
    allowance: an element outside the tolerance passes when fastgrad's value is at least as close
    to the float64 evaluation of the same reference as the reference itself is — the mismatch is
    then the reference's own rounding.  Liger's references run on CUDA, whose bf16/fp32 softmax
    kernels accumulate in fp32 and round once; PyTorch's CPU kernels do not (its bf16
    ``log_softmax`` backward takes ``exp`` of the bf16-rounded log-probabilities: up to 5 % off at
    ``p ≈ 1/V``; its fp32 label-smoothing and z-loss gradients carry ~4e-6 relative error, above
    Liger's fp32 ``rtol`` 1e-6 — fastgrad's error there is 4-5x smaller).  Returns how many
    elements needed the allowance."""
    o, r = ours.detach().double(), ref.detach().double()
    within = (r - o).abs() <= atol + rtol * o.abs()
    closer = (o - exact).abs() <= (r - exact).abs()
    bad = ~(within | closer)
    if bad.any():
        i = bad.nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside Liger's tolerance (atol {atol}, "
            f"rtol {rtol}) and farther from float64 than the reference; first at {i}: fastgrad "
            f"{o[bad][:5].tolist()}, reference {r[bad][:5].tolist()}, float64 {exact[bad][:5].tolist()}"
        )
    return int((~within).sum())


def _run_ce(ref, target_ce, _tensor, target, atol, rtol, upstream="ones", return_z_loss=False):
    """One Liger ``_test_correctness_*_once`` body: ``ref(x, exact)`` is Liger's reference (``exact``:
    evaluated in float64 on the same values, the arbiter of :func:`_agree`)."""
    _input = _tensor.detach().clone().requires_grad_(True)
    _input2 = _tensor.detach().clone().requires_grad_(True)
    _input3 = _tensor.detach().double().requires_grad_(True)
    out, out64 = ref(_input, False), ref(_input3, True)
    res = target_ce(_input2, target)
    if return_z_loss:
        (output, z_output), (output64, z64) = out, out64
        output2, z_output2 = _same(res.loss, output), _same(res.z_loss, z_output)
        _agree(z_output2, z_output, z64, atol, rtol, "z_loss")
    else:
        output, output64 = out, out64
        output2 = _same(res, output)
    assert output2.dtype == output.dtype
    _agree(output2, output, output64, atol, rtol, "loss")
    if upstream == "ones":
        g = torch.ones_like(output)
    elif upstream == "rand":  # the not-last-layer bodies: (loss * 3).backward(rand)
        g = torch.rand_like(output) * 3
    else:
        g = None
    for o in (output, output2, output64):
        o.backward(gradient=None if g is None else g.to(o.dtype))
    _agree(_input2.grad, _input.grad, _input3.grad, atol, rtol, "grad")


def _plain_ref(target, dtype, **kw):
    def ref(x, exact):
        return F.cross_entropy(x, target, **kw)
    return ref


def _softcap_ref(target, dtype, softcap, **kw):
    def ref(x, exact):
        z = x.to(torch.float64 if exact else torch.float32)
        out = F.cross_entropy(softcap * torch.tanh(z / softcap), target, **kw)
        return out if exact else out.to(dtype)
    return ref


def _zloss_ref(target, dtype, softcap=None, inner_dtype=None, **kw):
    def ref(x, exact):
        m = CrossEntropyWithZLoss(dtype=torch.float64 if exact else (inner_dtype or dtype), **kw)
        if exact:
            m.compute_dtype = torch.float64
        z = x.to(torch.float64 if exact else torch.float32)
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
            if not exact:
                # Liger: CrossEntropyWithZLoss(... softcap'd fp32 logits).to(dtype)
                out = m(z, target)
                return tuple(o.to(dtype) for o in out) if isinstance(out, tuple) else out.to(dtype)
        return m(z, target)
    return ref


@pytest.mark.parametrize("B, T, V", CE_SHAPES)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness(B, T, V, scalar, dtype, reduction, atol, rtol):
    torch.manual_seed(0)
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    _run_ce(_plain_ref(target, dtype, reduction=reduction), FastgradCE(reduction=reduction), _tensor, target,
            atol, rtol)


@pytest.mark.parametrize("B, T, V", [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_functional(B, T, V, scalar, dtype, atol, rtol):
    """Liger's functional-vs-Function check; here the extended API against the module face and
    against Liger's reference (``CrossEntropyWithZLoss`` on the softcapped logits)."""
    _input = torch.randn(B * T, V, dtype=dtype) * scalar
    x1 = _input.clone().requires_grad_(True)
    x2 = _input.clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    eye = _eye(V, dtype)
    kw = dict(ignore_index=0, lse_square_scale=1e-4, label_smoothing=0.1, reduction="mean", softcap=30.0,
              return_z_loss=True)
    r1 = ft.linear_cross_entropy(x1, eye, target, **kw)
    r2 = ft.LinearCrossEntropyLoss(ignore_index=0, label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0,
                                   return_z_loss=True)(x2, eye, target)
    assert torch.allclose(r1.loss, r2.loss, atol=atol, rtol=rtol)
    assert torch.allclose(r1.z_loss, r2.z_loss, atol=atol, rtol=rtol)
    grad = torch.randn_like(r1.loss)
    r1.loss.backward(grad)
    r2.loss.backward(grad)
    assert torch.allclose(x1.grad, x2.grad, atol=atol, rtol=rtol)
    # and against Liger's reference of the same keywords
    ref = _zloss_ref(target, dtype, softcap=30.0, ignore_index=0, lse_square_scale=1e-4, label_smoothing=0.1,
                     return_z_loss=True)
    _run_ce(ref, FastgradCE(ignore_index=0, lse_square_scale=1e-4, label_smoothing=0.1, softcap=30.0,
                            return_z_loss=True), _input, target, atol, rtol, return_z_loss=True)


def _ce_ignore_shapes():
    return [
        pytest.param(2, 128, 1024, 2, id="scaled-2x128x1024-ii2"),
        pytest.param(3, 423, 500, -123, id="weird-3x423x500-ii-123"),
        pytest.param(2, 16, 32000, 2, marks=extended, id="V32000"),
    ]


@pytest.mark.parametrize("B, T, V, ignore_index", _ce_ignore_shapes())
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_with_ignore_index(B, T, V, ignore_index, reduction, scalar, dtype, atol, rtol):
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)
    _run_ce(_plain_ref(target, dtype, ignore_index=ignore_index, reduction=reduction),
            FastgradCE(ignore_index=ignore_index, reduction=reduction), _tensor, target, atol, rtol)


@pytest.mark.parametrize("B, T, V, label_smoothing", [
    pytest.param(2, 128, 1024, 0.1, id="scaled"),
    pytest.param(3, 423, 500, 0.1, id="weird"),
    pytest.param(2, 16, 32000, 0.1, marks=extended, id="V32000"),
])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_with_label_smoothing(B, T, V, label_smoothing, scalar, dtype, atol, rtol):
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    _run_ce(_plain_ref(target, dtype, label_smoothing=label_smoothing), FastgradCE(label_smoothing=label_smoothing),
            _tensor, target, atol, rtol, upstream=None)


@pytest.mark.parametrize("B, T, V, ignore_index, label_smoothing", [
    pytest.param(2, 128, 1024, 1, 0.1, id="scaled"),
    pytest.param(3, 423, 500, -300, 0.2, id="weird"),
    pytest.param(2, 16, 32000, 1, 0.1, marks=extended, id="V32000"),
])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_with_label_smoothing_with_ignore_index(B, T, V, ignore_index, label_smoothing, scalar,
                                                               dtype, atol, rtol):
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)
    _run_ce(_plain_ref(target, dtype, ignore_index=ignore_index, label_smoothing=label_smoothing),
            FastgradCE(ignore_index=ignore_index, label_smoothing=label_smoothing), _tensor, target, atol, rtol,
            upstream=None)


@pytest.mark.parametrize("B, T, V, softcap", [
    pytest.param(2, 128, 1024, 30.0, id="scaled"),
    pytest.param(3, 423, 500, 30.0, id="weird"),
    pytest.param(2, 16, 32000, 30.0, marks=extended, id="V32000"),
])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_with_softcap(B, T, V, softcap, reduction, scalar, dtype, atol, rtol):
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    _run_ce(_softcap_ref(target, dtype, softcap, reduction=reduction),
            FastgradCE(softcap=softcap, reduction=reduction), _tensor, target, atol, rtol)


@pytest.mark.parametrize("B, T, V", CE_SHAPES)
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
@pytest.mark.parametrize("return_z_loss", [True, False])
@pytest.mark.parametrize("lse_square_scale", [1e-4, 1e-5])
def test_ce_correctness_with_z_loss(B, T, V, scalar, dtype, atol, rtol, lse_square_scale, return_z_loss):
    torch.manual_seed(0)
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    _run_ce(_zloss_ref(target, dtype, lse_square_scale=lse_square_scale, return_z_loss=return_z_loss),
            FastgradCE(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss), _tensor, target, atol, rtol,
            upstream=None, return_z_loss=return_z_loss)


@pytest.mark.parametrize("B, T, V", CE_SHAPES)
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
@pytest.mark.parametrize("return_z_loss, lse_square_scale", [(True, 1e-4), (False, 1e-5)])
@pytest.mark.parametrize("label_smoothing, ignore_index, reduction", [(0.1, 42, "mean"), (0.2, -42, "sum")])
def test_ce_correctness_with_z_loss_with_other_params(B, T, V, scalar, dtype, atol, rtol, lse_square_scale,
                                                      return_z_loss, label_smoothing, ignore_index, reduction):
    torch.manual_seed(0)
    kw = dict(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss, label_smoothing=label_smoothing,
              ignore_index=ignore_index, reduction=reduction)
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)
    _run_ce(_zloss_ref(target, dtype, **kw), FastgradCE(**kw), _tensor, target, atol, rtol, upstream=None,
            return_z_loss=return_z_loss)


@pytest.mark.parametrize("B, T, V", CE_SHAPES)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_with_weight(B, T, V, reduction, scalar, dtype, atol, rtol):
    weight = torch.rand(V, dtype=dtype)
    torch.manual_seed(0)
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), dtype=torch.long)

    def ref(x, exact):
        return F.cross_entropy(x, target, weight=weight.to(x.dtype), reduction=reduction)

    _run_ce(ref, FastgradCE(weight=weight, reduction=reduction), _tensor, target, atol, rtol)


@pytest.mark.parametrize("B, T, V", CE_SHAPES)
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("ignore_index, lse_square_scale, label_smoothing, softcap",
                         [(-100, 1e-4, 0.1, 30.0), (42, 1e-5, 0.2, 40.0)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_with_weight_with_other_params(B, T, V, reduction, lse_square_scale, ignore_index,
                                                      label_smoothing, softcap, scalar, dtype, atol, rtol):
    weight = torch.rand(V, dtype=torch.float32)
    torch.manual_seed(0)
    kw = dict(lse_square_scale=lse_square_scale, ignore_index=ignore_index, reduction=reduction,
              label_smoothing=label_smoothing)
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)

    def ref(x, exact):
        return _zloss_ref(target, dtype, softcap=softcap, weight=weight.to(torch.float64) if exact else weight,
                          **kw)(x, exact)

    _run_ce(ref, FastgradCE(weight=weight, softcap=softcap, **kw), _tensor, target, atol, rtol)


@pytest.mark.parametrize("B, T, V", CE_SHAPES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol", CE_TOLS)
def test_ce_correctness_not_last_layer(B, T, V, reduction, scalar, dtype, atol, rtol):
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    _run_ce(_plain_ref(target, dtype, reduction=reduction), FastgradCE(reduction=reduction), _tensor, target,
            atol, rtol, upstream="rand")


@pytest.mark.parametrize("B, T, V", [
    pytest.param(2, 128, 1024, id="scaled"),
    pytest.param(3, 423, 500, id="weird"),
    pytest.param(2, 16, 32000, marks=extended, id="V32000"),
])
@pytest.mark.parametrize("ignore_index, lse_square_scale, label_smoothing, softcap",
                         [(-100, 1e-4, 0.1, 30.0), (42, 1e-5, 0.2, 40.0)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("scalar, dtype, atol, rtol",
                         [(1.0, torch.bfloat16, 1e-8, 5e-2), (1.0, torch.float32, 1e-8, 1e-5)])
def test_ce_correctness_not_last_layer_with_other_params(B, T, V, reduction, ignore_index, lse_square_scale,
                                                         label_smoothing, softcap, scalar, dtype, atol, rtol):
    kw = dict(reduction=reduction, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
              label_smoothing=label_smoothing)
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)
    # Liger's reference here is CrossEntropyWithZLoss with its default dtype (fp32), cast to dtype
    _run_ce(_zloss_ref(target, dtype, softcap=softcap, inner_dtype=torch.float32, **kw),
            FastgradCE(softcap=softcap, **kw), _tensor, target, atol, rtol, upstream="rand")


@pytest.mark.parametrize("B, T, V, ignore_index", [
    pytest.param(2, 128, 1024, -100, id="scaled"),
    pytest.param(3, 423, 500, 2, id="weird"),
    pytest.param(2, 16, 32000, -100, marks=extended, id="V32000"),
])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype, scalar, atol, rtol", [(torch.float32, 1.0, 1e-4, 1e-4),
                                                       (torch.float16, 1.0, 1e-2, 1e-2),
                                                       (torch.bfloat16, 1.0, 1e-2, 1e-2)])
def test_ce_correctness_with_forward_only(B, T, V, ignore_index, reduction, dtype, scalar, atol, rtol):
    """Liger's reference here is ``CrossEntropyLoss(reduction=reduction)`` without its
    ``ignore_index`` (at ``V = 32000`` a random target rarely equals 2); at the port's ``V = 500``
    about 2.5 targets of the 1269 do, so the reference is given the same ``ignore_index``."""
    target_ce = FastgradCE(ignore_index=ignore_index, reduction=reduction)
    torch.manual_seed(0)
    torch_ce = torch.nn.CrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)
    _tensor = torch.randn(B * T, V, dtype=dtype) * scalar
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    with torch.no_grad():
        output = torch_ce(_tensor.clone(), target)
        output2 = target_ce(_tensor.clone(), target)
        assert torch.allclose(output, output2, atol=atol, rtol=rtol)
    with pytest.raises(RuntimeError, match="does not require grad"):
        output2.backward(gradient=torch.ones_like(output))


def test_ce_float32_internal():
    """Liger's check that a bf16 input is computed in fp32 (its kernel at ``n_cols = 128256``).
    The logits here come from a bf16 head of Llama-3's vocabulary (128256), so the bf16 call and the
    call on the same values widened to fp32 see the same fp32 logits (products of bf16 are exact):
    the losses agree to fp32 rounding.  (Liger's own test computes ``torch.allclose`` without
    asserting it; it is asserted here.)"""
    batch_size, n_cols, H = 4, 128256, 64
    X = torch.randn(batch_size, H, dtype=torch.bfloat16)
    W = torch.randn(n_cols, H, dtype=torch.bfloat16)
    Y = torch.randint(0, n_cols, (batch_size,))
    loss_bf16 = ft.linear_cross_entropy(X, W, Y, reduction="none")
    loss_fp32 = ft.linear_cross_entropy(X.float(), W.float(), Y, reduction="none")
    assert loss_bf16.dtype == torch.float32
    assert torch.allclose(loss_bf16, loss_fp32)


@pytest.mark.parametrize("B, T, V, ignore_index", [
    pytest.param(2, 128, 1024, 2, id="scaled"),
    pytest.param(3, 423, 500, -123, id="weird"),
])
def test_ce_correctness_with_out_of_bounds_target(B, T, V, ignore_index):
    """Documented divergence: Liger raises ``AssertionError`` ("out of bounds"); fastgrad raises
    its argument error — ``AclnnError`` 161002, a ``ValueError``, from the extended API, and
    PyTorch's ``IndexError`` type (also an ``AclnnError``) from the drop-in — naming the target
    that is out of bounds, before any computation."""
    torch.manual_seed(0)
    _input = torch.randn(B * T, V, dtype=torch.bfloat16).requires_grad_(True)
    target = _ignore_some(torch.randint(0, V, (B * T,), dtype=torch.long), ignore_index)
    n = torch.randint(1, B * T // 2, (1,)).item()
    target[torch.randperm(B * T)[:n]] = torch.randint(V, 2 * V, (n,))
    eye = _eye(V, torch.bfloat16)
    with pytest.raises(fg.AclnnError, match="out of bounds") as e:
        ft.linear_cross_entropy(_input, eye, target, ignore_index=ignore_index)
    assert isinstance(e.value, ValueError) and e.value.status == 161002
    with pytest.raises(IndexError, match="out of bounds") as e2:
        FF.linear_cross_entropy(_input, eye, target, ignore_index=ignore_index)
    assert isinstance(e2.value, fg.AclnnError)
    assert _input.grad is None


@pytest.mark.parametrize("return_z_loss, return_token_accuracy, return_predicted_tokens",
                         [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)])
def test_ce_structured_output(return_z_loss, return_token_accuracy, return_predicted_tokens):
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 1.5, 0.3], [0.7, -0.2, 0.9]], requires_grad=True)
    targets = torch.tensor([0, 1, 2])
    original_logits = logits.detach().clone()
    result = ft.linear_cross_entropy(logits, _eye(3, torch.float32), targets, reduction="mean",
                                     return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                                     return_predicted_tokens=return_predicted_tokens)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        assert isinstance(result, torch.Tensor)
        assert result.shape == ()
        result.backward()
        assert logits.grad is not None
        return
    assert isinstance(result, ft.LinearCrossEntropyOutput)
    assert result.loss.shape == ()
    assert (result.z_loss is not None) == return_z_loss
    if return_token_accuracy:
        expected_accuracy = (original_logits.argmax(dim=-1) == targets).float().mean()
        assert torch.allclose(result.token_accuracy, expected_accuracy, atol=1e-6)
    else:
        assert result.token_accuracy is None
    if return_predicted_tokens:
        assert result.predicted_tokens.dtype == torch.int64
        assert result.predicted_tokens.shape == (3,)
        assert torch.equal(result.predicted_tokens, original_logits.argmax(dim=-1))
        if return_token_accuracy:
            assert torch.allclose(result.token_accuracy, (result.predicted_tokens == targets).float().mean(),
                                  atol=1e-6)
    else:
        assert result.predicted_tokens is None
    result.loss.backward()
    assert logits.grad is not None


@pytest.mark.parametrize("B, T, V", [(2, 128, 512), (3, 47, 31)])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_correctness_with_predicted_tokens(B, T, V, ignore_index, dtype):
    torch.manual_seed(42)
    _tensor = torch.randn(B * T, V, dtype=dtype)
    _input = _tensor.detach().clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    target[torch.randperm(B * T)[: B * T // 4]] = ignore_index
    expected_predictions = _tensor.float().argmax(dim=-1)
    result = FastgradCE(ignore_index=ignore_index, return_predicted_tokens=True)(_input, target)
    assert isinstance(result, ft.LinearCrossEntropyOutput)
    assert result.predicted_tokens.shape == (B * T,)
    assert result.predicted_tokens.dtype == torch.int64
    keep = target != ignore_index
    assert torch.equal(result.predicted_tokens[keep], expected_predictions[keep])
    assert torch.all(result.predicted_tokens[~keep] == -1)
    result.loss.backward()
    assert _input.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ce_true_class_grad_confident_predictions(dtype, label_smoothing, reduction):
    torch.manual_seed(0)
    B, T, V = 2, 64, 4096
    logits = torch.randn(B * T, V, dtype=torch.float32)
    target = torch.randint(0, V, (B * T,), dtype=torch.long)
    logits[torch.arange(B * T), target] = logits.max(dim=-1).values + 10.0
    _tensor = logits.to(dtype)
    _input = _tensor.detach().clone().requires_grad_(True)
    _input2 = _tensor.detach().clone().requires_grad_(True)
    _input_ref = _tensor.detach().clone().float().requires_grad_(True)
    torch_ce = torch.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=label_smoothing)
    torch_ce(_input, target).backward()
    FastgradCE(reduction=reduction, label_smoothing=label_smoothing)(_input2, target).backward()
    torch_ce(_input_ref, target).backward()
    rows = torch.arange(B * T)
    ref = _input_ref.grad[rows, target].double()
    torch_err = (_input.grad[rows, target].double() - ref).abs().max().item()
    ours_err = (_input2.grad[rows, target].double() - ref).abs().max().item()
    assert ours_err <= max(4 * torch_err, torch.finfo(dtype).tiny), (ours_err, torch_err)
