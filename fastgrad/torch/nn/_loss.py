"""``torch.nn.LinearCrossEntropyLoss`` (PyTorch 2.13) on fastgrad."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import invalid
from .._errors import torch_error
from ..options import resolve_options
from . import functional as _F

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(torch.nn.Module):
    r"""A linear layer and the cross-entropy of its output, without the ``[N, C]`` logits.

    The constructor, attributes, parameters (``linear.weight`` of ``(C·prod(out_features),
    in_features)``, ``linear.bias``, the ``weight`` buffer) and ``forward(input, target)`` of
    ``torch.nn.LinearCrossEntropyLoss``; the computation is
    :func:`fastgrad.torch.nn.functional.linear_cross_entropy` (``options``: fastgrad's options or a
    preset name; PyTorch's options object is accepted).

    Parameters
    ----------
    in_features : int
    num_classes : int — ``C``
    out_features : tuple of int — K-dimensional loss (PyTorch's reference path, with a warning)
    bias : bool — a learnable bias of the linear layer
    device, dtype : of the linear layer
    reduction : ``"mean"`` | ``"sum"`` | ``"none"``
    weight : Tensor ``(C,)``, optional — per-class rescaling
    ignore_index : int, optional (None: -100)
    label_smoothing : float in [0, 1]
    options : None | str | fastgrad.torch.LinearCrossEntropyOptions | torch.nn.LinearCrossEntropyOptions

    Raises
    ------
    fastgrad.torch._errors.AclnnTorchRuntimeError
        161002 and a ``RuntimeError``, as PyTorch: a ``weight`` not of shape ``(C,)``
        (``expected weight shape to be (C,), got ...``), ``label_smoothing`` outside [0, 1]
        (``expected label_smoothing to be in range [0, 1], got ...``).
    fastgrad.AclnnError
        161002 (a ``ValueError``): a bad ``reduction`` or ``options``.  The forward raises what
        :func:`fastgrad.torch.nn.functional.linear_cross_entropy` raises.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        out_features: tuple[int, ...] = (),
        bias: bool = False,
        device: Any = None,
        dtype: Any = None,
        reduction: str = "mean",
        weight: torch.Tensor | None = None,
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        options: Any = None,
    ) -> None:
        if weight is not None and tuple(weight.shape) != (num_classes,):
            raise torch_error(
                RuntimeError,
                f"expected weight shape to be {(num_classes,)}, got {tuple(weight.shape)}",
                "weight",
                "LinearCrossEntropyLoss",
            )
        if not 0.0 <= label_smoothing <= 1.0:
            raise torch_error(
                RuntimeError,
                f"expected label_smoothing to be in range [0, 1], got {label_smoothing}",
                "label_smoothing",
                "LinearCrossEntropyLoss",
            )
        if not isinstance(reduction, str) or reduction not in ("mean", "sum", "none", "elementwise_mean"):
            raise invalid("reduction", "'mean', 'sum' or 'none'", repr(reduction), "LinearCrossEntropyLoss")
        resolve_options(options, "options", "LinearCrossEntropyLoss")
        super().__init__()
        self.register_buffer("weight", weight)
        self.weight: torch.Tensor | None
        self.reduction = reduction
        self.num_classes = num_classes
        self.out_features = tuple(out_features)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.linear = torch.nn.Linear(
            in_features, math.prod(self.out_features, start=num_classes), bias=bias, device=device, dtype=dtype
        )
        self.options = options

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        linear_weight = self.linear.weight.reshape((self.num_classes, *self.out_features, self.linear.in_features))
        linear_bias = (
            self.linear.bias.reshape((self.num_classes, *self.out_features)) if self.linear.bias is not None else None
        )
        return _F.linear_cross_entropy(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            weight=self.weight,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            options=self.options,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.linear.in_features}, num_classes={self.num_classes}, "
            f"out_features={self.out_features}, bias={self.linear.bias is not None}, "
            f"reduction={self.reduction}, ignore_index={self.ignore_index}, "
            f"label_smoothing={self.label_smoothing}, options={self.options}"
        )
