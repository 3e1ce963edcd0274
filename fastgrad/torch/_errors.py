"""Errors of the drop-in namespace (:mod:`fastgrad.torch.nn`): fastgrad's 161002 and the type PyTorch raises.

PyTorch 2.13's ``torch.nn.functional.linear_cross_entropy`` and ``torch.nn.LinearCrossEntropyLoss``
raise ``RuntimeError`` for most bad arguments (``IndexError`` for a target out of bounds,
``TypeError`` for a non-int ``ignore_index``, ``NotImplementedError`` for integer inputs,
``ValueError`` for a batch-size mismatch or a bad ``reduction``).  Code written for PyTorch
catches those types; fastgrad's code catches :class:`fastgrad.AclnnError`.  Each class here is
both: a :class:`fastgrad.errors.AclnnParamError` (status 161002, itself a ``ValueError``) and the
type PyTorch raises, with PyTorch's message text first.
"""

from __future__ import annotations

from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnParamError

__all__ = [
    "AclnnTorchRuntimeError",
    "AclnnTorchIndexError",
    "AclnnTorchTypeError",
    "AclnnTorchNotImplementedError",
    "torch_error",
]


class _Picklable(AclnnParamError):
    def __reduce__(self):
        return (type(self), (self.status, self.message, self.param, self.reasons))


class AclnnTorchRuntimeError(_Picklable, RuntimeError):
    """161002 where PyTorch raises ``RuntimeError`` (shapes, dtypes, ranges)."""


class AclnnTorchIndexError(_Picklable, IndexError):
    """161002 where PyTorch raises ``IndexError`` (a target class outside ``[0, C)``)."""


class AclnnTorchTypeError(_Picklable, TypeError):
    """161002 where PyTorch raises ``TypeError`` (an argument of the wrong Python type)."""


class AclnnTorchNotImplementedError(_Picklable, NotImplementedError):
    """161002 where PyTorch raises ``NotImplementedError`` (an input dtype it has no kernel for)."""


_BY_TYPE: dict[type, type[AclnnParamError]] = {
    RuntimeError: AclnnTorchRuntimeError,
    IndexError: AclnnTorchIndexError,
    TypeError: AclnnTorchTypeError,
    NotImplementedError: AclnnTorchNotImplementedError,
    ValueError: AclnnParamError,
}


def torch_error(kind: type, message: str, param: str, op: str) -> AclnnParamError:
    """The 161002 error that is also PyTorch's ``kind``; ``message`` is PyTorch's text."""
    return _BY_TYPE[kind](ACLNN_ERR_PARAM_INVALID, f"{op}: {message}", param)
