"""PyTorch 2.13's linear cross-entropy API, computed by fastgrad: switching is one import.

* :func:`fastgrad.torch.nn.functional.linear_cross_entropy` — the signature of
  ``torch.nn.functional.linear_cross_entropy``;
* :class:`LinearCrossEntropyLoss` — ``torch.nn.LinearCrossEntropyLoss``'s constructor, parameters
  (``linear.weight``, ``linear.bias``, the ``weight`` buffer: the same ``state_dict``) and forward;
* :class:`LinearCrossEntropyOptions` — fastgrad's options (the same name as PyTorch's; PyTorch's
  own options object is accepted too).
"""

from __future__ import annotations

from ..options import LinearCrossEntropyOptions
from . import functional
from ._loss import LinearCrossEntropyLoss

__all__ = ["functional", "LinearCrossEntropyLoss", "LinearCrossEntropyOptions"]
