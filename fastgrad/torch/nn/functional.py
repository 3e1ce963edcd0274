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
import warnings
from typing import Any

import torch

from ...errors import invalid
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
        The loss: a scalar, or ``(N)`` / ``()`` for ``"none"``.  fp32 for 16-bit inputs (PyTorch
        returns the input dtype; fastgrad's statistics are fp32 and the loss keeps them), the
        input's dtype otherwise.  Gradients in the inputs' dtypes.

    Class-probability targets and K-dimensional weights (``linear_weight`` of rank > 2) run
    PyTorch's reference path, with a warning — as PyTorch's chunked path does for what it does
    not support.

    Raises
    ------
    fastgrad.AclnnError
        161002 (a ``ValueError``): ranks and shapes PyTorch rejects, dtypes, a target outside
        ``[0, C)``, bad ``reduction`` / ``label_smoothing`` / ``options``.
    """
    opts = resolve_options(options, "options", _OP)
    if not isinstance(input, torch.Tensor) or not isinstance(linear_weight, torch.Tensor):
        raise invalid("input", "torch.Tensor input and linear_weight", (type(input), type(linear_weight)), _OP)
    if input.dim() < 1 or input.dim() > 2:
        raise invalid("input", "dimensionality 1 or 2 (as torch.nn.functional.linear_cross_entropy)", input.dim(), _OP)
    if linear_weight.dim() < 2:
        raise invalid("linear_weight", "dimensionality at least 2", linear_weight.dim(), _OP)
    if input.shape[-1] != linear_weight.shape[-1]:
        raise invalid(
            "linear_weight",
            f"last dimension equal to input's (in_features = {input.shape[-1]})",
            tuple(linear_weight.shape),
            _OP,
        )
    num_classes = linear_weight.shape[0]
    out_features = tuple(linear_weight.shape[1:-1])
    if linear_bias is not None and tuple(linear_bias.shape) != (num_classes, *out_features):
        raise invalid("linear_bias", f"shape {(num_classes, *out_features)}", tuple(linear_bias.shape), _OP)
    logits_shape = (*input.shape[:-1], num_classes, *out_features)
    probabilities = isinstance(target, torch.Tensor) and tuple(target.shape) == logits_shape
    if probabilities and ignore_index is not None:
        raise invalid("ignore_index", "None when target contains probabilities", ignore_index, _OP)
    if out_features or probabilities:
        warnings.warn(
            "fastgrad.torch.nn.functional.linear_cross_entropy: "
            + ("K-dimensional linear_weight" if out_features else "class-probability targets")
            + " run PyTorch's reference path (the logits are materialized)",
            stacklevel=2,
        )
        return _reference(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing)
    return _fastgrad_lce(
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
