"""``torch.nn.functional.linear_cross_entropy``'s signature (PyTorch 2.13), computed by fastgrad.

Switching is one import::

    from fastgrad.torch.nn.functional import linear_cross_entropy   # was: torch.nn.functional
    loss = linear_cross_entropy(hidden, lm_head.weight, target, reduction="mean")

``options`` takes fastgrad's options (:class:`fastgrad.torch.LinearCrossEntropyOptions` or a preset
name: ``"default"``, ``"fused"``, ``"low_memory"``, ``"fast"``, ``"filtered"``, ``"device"``,
``"blas"``) or PyTorch's ``torch.nn.LinearCrossEntropyOptions`` (its chunking has no meaning
here: fastgrad never holds ``[N, C]``; a 16-bit ``acc_dtype`` is fastgrad's ``accum_dtype``).
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from typing import Any

import numpy as np
import torch

from .._checks import autocast_operands, values_of
from .._errors import torch_error
from ..functional import linear_cross_entropy as _fastgrad_lce
from ..options import resolve_options

__all__ = ["linear_cross_entropy"]

_OP = "linear_cross_entropy"


def _reference(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing):
    """PyTorch's reference path (the logits materialized): what fastgrad does not compute."""
    F = torch.nn.functional
    kw = dict(
        linear_bias=linear_bias,
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    if hasattr(F, "linear_cross_entropy"):
        return F.linear_cross_entropy(input, linear_weight, target, options=None, **kw)
    num_classes, out_features = linear_weight.shape[0], tuple(linear_weight.shape[1:-1])
    w2 = linear_weight.reshape(math.prod(out_features, start=num_classes), linear_weight.shape[-1])
    b2 = None if linear_bias is None else linear_bias.reshape(-1)
    logits = F.linear(input, w2, b2).reshape((*input.shape[:-1], num_classes, *out_features))
    return F.cross_entropy(
        logits,
        target,
        weight=weight,
        reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index,
        label_smoothing=label_smoothing,
    )


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: Any = None,
) -> torch.Tensor:
    r"""``cross_entropy(linear(input, linear_weight, linear_bias), target, ...)`` without the
    ``[N, C]`` logits: PyTorch 2.13's ``torch.nn.functional.linear_cross_entropy``, on fastgrad.

    Parameters
    ----------
    input : Tensor ``(in_features)`` or ``(N, in_features)``; bfloat16, float16, float32, float64; CPU
    linear_weight : Tensor ``(C, in_features)``, input's dtype
    target : Tensor ``()`` or ``(N)``; int64 (or int32) class ids in ``[0, C)`` or ``ignore_index``
    linear_bias : Tensor ``(C,)``, optional
    weight : Tensor ``(C,)``, optional — per-class rescaling (mean divides by ``Σ weight[target]``)
    reduction : ``"mean"`` | ``"sum"`` | ``"none"``
    ignore_index : int, optional — None means -100 (PyTorch's mapping for class indices)
    label_smoothing : float in [0, 1]
    options : None | str | fastgrad.torch.LinearCrossEntropyOptions | torch.nn.LinearCrossEntropyOptions
        fastgrad's modes (None: the ``"default"`` preset).

    Returns
    -------
    Tensor
        The loss: a scalar, or ``(N)`` / ``()`` for ``"none"``, in the input's dtype as PyTorch
        (fastgrad's statistics are fp32 for 16-bit inputs; the loss is rounded once to
        bf16/fp16 at the end, differentiably).  Gradients in the inputs' dtypes.  Autograd as
        PyTorch's op: batched gradients (``is_grads_batched``, ``gradcheck(check_batched_grad=
        True)``), forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``/``jacfwd``),
        ``torch.func.vmap``/``jacrev``; differentiable once (a second derivative raises
        AclnnError 361001, a ``RuntimeError``).

    Under ``torch.autocast("cpu")`` the operands are cast as ``F.linear`` casts them there and
    the loss is fp32, as PyTorch's (its op is ``linear`` then ``cross_entropy``; fastgrad keeps
    the logits of the autocast-dtype operands exact in fp32 where PyTorch rounds them).

    Class-probability targets and K-dimensional weights (``linear_weight`` of rank > 2) run
    PyTorch's reference path, with a warning — as PyTorch's chunked path does for what it does
    not support.  ``options`` is fastgrad's extension (keyword-only, as PyTorch's own); int32
    targets are accepted too (PyTorch takes int64 and uint8).  An unbatched ``input`` takes a
    ``()`` or ``(1,)`` target, as PyTorch's forward (whose backward then fails on ``(1,)``:
    fastgrad's gradient is that of the ``()`` target).

    Raises
    ------
    The types PyTorch 2.13 raises, each also a :class:`fastgrad.AclnnError` 161002
    (:mod:`fastgrad.torch._errors`), with PyTorch's message text:
        ``RuntimeError`` — input rank not 1 or 2, ``linear_weight`` rank < 2, unequal
        ``in_features``, a ``linear_bias`` or class ``weight`` of another shape, ``ignore_index``
        with probabilities, dtypes that differ (a class ``weight`` not in the logits' dtype
        included), a non-integer target dtype, a target of rank > 1, ``label_smoothing``
        outside [0, 1];
        ``ValueError`` — a target batch size other than the input's, a bad ``reduction``;
        ``IndexError`` — a target outside ``[0, C)`` that is not ``ignore_index``;
        ``TypeError`` — a non-int ``ignore_index``; ``NotImplementedError`` — integer inputs.
    fastgrad.AclnnError
        161002 (a ``ValueError``): bad ``options``.
    """
    opts = resolve_options(options, "options", _OP)
    if not isinstance(input, torch.Tensor) or not isinstance(linear_weight, torch.Tensor):
        raise torch_error(
            TypeError,
            f"expected input and linear_weight to be Tensors, got {type(input).__name__} and "
            f"{type(linear_weight).__name__}",
            "input",
            _OP,
        )
    # under torch.autocast("cpu"): F.linear's operands in the autocast dtype (PyTorch's op is
    # linear then cross_entropy; the loss is fp32 there, as cross_entropy's under autocast)
    autocast = torch.is_autocast_enabled("cpu")
    input, linear_weight, linear_bias = autocast_operands(input, linear_weight, linear_bias)
    # PyTorch's own checks, in its order, with its messages and exception types
    if input.dim() < 1 or input.dim() > 2:
        raise torch_error(RuntimeError, f"expected input with dimensionality 1 or 2, got {input.dim()}", "input", _OP)
    if linear_weight.dim() < 2:
        raise torch_error(
            RuntimeError,
            f"expected linear_weight with dimensionality at least 2, got {linear_weight.dim()}",
            "linear_weight",
            _OP,
        )
    if input.shape[-1] != linear_weight.shape[-1]:
        raise torch_error(
            RuntimeError,
            "expected equal input and linear_weight last dimensions (in_features), "
            f"got {input.shape[-1]} and {linear_weight.shape[-1]}, respectively",
            "linear_weight",
            _OP,
        )
    num_classes = linear_weight.shape[0]
    out_features = tuple(linear_weight.shape[1:-1])
    if linear_bias is not None and tuple(linear_bias.shape) != (num_classes, *out_features):
        raise torch_error(
            RuntimeError,
            f"expected linear_bias shape {(num_classes, *out_features)}, got {tuple(linear_bias.shape)}",
            "linear_bias",
            _OP,
        )
    logits_shape = (*input.shape[:-1], num_classes, *out_features)
    probabilities = isinstance(target, torch.Tensor) and tuple(target.shape) == logits_shape
    if probabilities and ignore_index is not None:
        raise torch_error(
            RuntimeError, "ignore_index cannot be specified when target contains probabilities", "ignore_index", _OP
        )
    if out_features or probabilities:
        warnings.warn(
            "fastgrad.torch.nn.functional.linear_cross_entropy: "
            + ("K-dimensional linear_weight" if out_features else "class-probability targets")
            + " run PyTorch's reference path (the logits are materialized)",
            stacklevel=2,
        )
        return _reference(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing)
    target, reduction, ignore_index, label_smoothing = _check_class_target(
        input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, autocast
    )
    loss = _fastgrad_lce(
        input,
        linear_weight,
        target,
        ignore_index=-100 if ignore_index is None else ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        bias=linear_bias,
        ce_weight=weight,
        options=opts,
    )
    # PyTorch's output dtype: the input's (fastgrad's statistics are fp32; the loss is rounded
    # once to bf16/fp16 here, differentiably) — fp32 under autocast, as cross_entropy's there
    if loss.dtype == input.dtype or (autocast and loss.dtype == torch.float32):
        return loss
    return loss.to(input.dtype)


_TORCH_NAMES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
}


def _tname(dtype: torch.dtype) -> str:
    return _TORCH_NAMES.get(dtype, str(dtype).replace("torch.", "").capitalize())


def _check_class_target(
    input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, autocast=False
):
    """The checks PyTorch's ``cross_entropy`` / ``linear`` make on class-index targets, with their
    messages and exception types (:mod:`fastgrad.torch._errors`); returns ``(target, reduction,
    ignore_index, label_smoothing)`` as fastgrad takes them: the target uint8 — PyTorch's
    ``Byte`` — widened to int64, an unbatched ``(1,)`` target as ``()``; what PyTorch's argument
    parser takes for the scalars (``reduction="elementwise_mean"``, its deprecated ``"mean"``,
    with its warning; an ``ignore_index`` with ``__index__`` — a NumPy integer, an integer
    tensor of one element; a ``label_smoothing`` that is a real number or a 0-d tensor without
    grad) as Python ``str`` / ``int`` / ``float``."""
    if not input.dtype.is_floating_point:
        raise torch_error(
            NotImplementedError,
            f"linear_cross_entropy is not implemented for '{_tname(input.dtype)}' input "
            "(floating point: bfloat16, float16, float32, float64)",
            "input",
            _OP,
        )
    if linear_weight.dtype != input.dtype:
        raise torch_error(
            RuntimeError,
            f"expected m1 and m2 to have the same dtype, but got: {_tname(input.dtype).lower()} != "
            f"{_tname(linear_weight.dtype).lower()} (input and linear_weight)",
            "linear_weight",
            _OP,
        )
    if linear_bias is not None and linear_bias.dtype != input.dtype:
        raise torch_error(
            RuntimeError,
            f"expected linear_bias to have input's dtype, but got {_tname(linear_bias.dtype)} "
            f"and {_tname(input.dtype)}",
            "linear_bias",
            _OP,
        )
    if not isinstance(target, torch.Tensor):
        raise torch_error(TypeError, f"expected target to be a Tensor, got {type(target).__name__}", "target", _OP)
    # PyTorch's nll_loss checks, in its order: the batch sizes, then the target's rank; an
    # unbatched input takes a () or a one-element (1,) target (PyTorch's loss is () for both)
    if input.dim() == 2 and (target.dim() == 0 or target.shape[0] != input.shape[0]):
        n = target.shape[0] if target.dim() else 0
        raise torch_error(
            ValueError, f"Expected input batch_size ({input.shape[0]}) to match target batch_size ({n}).", "target", _OP
        )
    if target.dim() > 1:
        raise torch_error(RuntimeError, "0D or 1D target tensor expected, multi-target not supported", "target", _OP)
    if input.dim() == 1 and target.dim() == 1:
        if target.shape[0] != 1:
            raise torch_error(
                ValueError,
                f"For 1D input, 1D target must have size 1, but got target size: {target.shape[0]}",
                "target",
                _OP,
            )
        target = target.reshape(())
    if target.dtype == torch.uint8:
        target = target.long()
    if target.dtype not in (torch.int64, torch.int32):
        raise torch_error(
            RuntimeError, f"expected target dtype to be Long or Byte, but got {_tname(target.dtype)}", "target", _OP
        )
    C = linear_weight.shape[0]
    if weight is not None and tuple(weight.shape) != (C,):
        raise torch_error(
            RuntimeError,
            f"weight tensor should be defined either for all {C} classes or no classes but got weight tensor "
            f"of shape: {list(weight.shape)}",
            "weight",
            _OP,
        )
    if weight is not None:
        # cross_entropy's logits dtype: the input's (fp32 under autocast, which widens a 16-bit weight)
        want, got = (torch.float32 if autocast else input.dtype), weight.dtype
        if autocast and got in (torch.float16, torch.bfloat16):
            got = torch.float32
        if got != want:
            raise torch_error(
                RuntimeError, f"expected scalar type {_tname(want)} but found {_tname(got)} (weight)", "weight", _OP
            )
    if isinstance(reduction, str) and reduction == "elementwise_mean":  # torch.nn._reduction.get_enum
        warnings.warn("reduction='elementwise_mean' is deprecated. Please use reduction='mean' instead.", stacklevel=3)
        reduction = "mean"
    if not isinstance(reduction, str) or reduction not in ("mean", "sum", "none"):
        raise torch_error(ValueError, f"{reduction} is not a valid value for reduction", "reduction", _OP)
    label_smoothing = _real(label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise torch_error(
            RuntimeError, f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}", "label_smoothing", _OP
        )
    if ignore_index is not None:
        ignore_index = _index(ignore_index)
    if ignore_index is not None and not -(2**63) <= ignore_index < 2**63:
        raise torch_error(ValueError, "Overflow when unpacking long long", "ignore_index", _OP)
    ii = -100 if ignore_index is None else ignore_index
    tv = values_of(target)  # (every slice of a vmap batch)
    bad = (tv != ii) & ((tv < 0) | (tv >= C))
    if bool(bad.any()):
        raise torch_error(IndexError, f"Target {int(tv[bad][0])} is out of bounds.", "target", _OP)
    return target, reduction, ignore_index, label_smoothing


def _real(label_smoothing: Any) -> float:
    """``label_smoothing`` as PyTorch's argument parser reads a ``float``: a real number (bool,
    int, NumPy scalars included) or a 0-d tensor that does not require grad."""
    t = label_smoothing
    if isinstance(t, torch.Tensor) and t.dim() == 0 and not t.requires_grad:
        return float(t)
    if isinstance(t, numbers.Real) or isinstance(t, np.bool_):
        return float(t)
    raise torch_error(TypeError, f"label_smoothing must be a float, not {type(t).__name__}", "label_smoothing", _OP)


def _index(ignore_index: Any) -> int:
    """``ignore_index`` as PyTorch's argument parser reads an ``int``: anything with ``__index__``
    (a NumPy integer, an integer tensor of one element) but a ``bool``."""
    t = ignore_index
    try:
        if isinstance(t, (bool, np.bool_)) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
            raise TypeError
        return operator.index(t)
    except TypeError:
        raise torch_error(TypeError, f"ignore_index must be int, not {type(t).__name__}", "ignore_index", _OP) from None
