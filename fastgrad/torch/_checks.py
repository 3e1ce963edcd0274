"""The training loss's argument checks (:func:`fastgrad.torch.linear_cross_entropy`): the tensors,
dtypes, shapes and scalar options, each refused with AclnnError 161002 naming the parameter;
the operands under ``torch.autocast``; the targets' values under ``torch.func``'s wrappers; CCE's
``shift``."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..errors import invalid

OP = "linear_cross_entropy"  # (the op named in the errors)
_ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TARGET_DTYPES = (torch.int64, torch.int32)
_REDUCTIONS = ("mean", "sum", "none")


def bad(param, expected, got):
    return invalid(param, expected, got, OP)


def _check_tensor(name, x, optional=False):
    if x is None and optional:
        return
    if not isinstance(x, torch.Tensor):
        raise bad(name, "a torch.Tensor", type(x).__name__)
    if x.device.type != "cpu":
        raise bad(name, "a CPU tensor (fastgrad.torch runs the CPU kernels)", f"device {x.device}")
    if x.layout != torch.strided:
        raise bad(name, "a dense (strided) tensor", f"layout {x.layout}")


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_operands(*xs: Any) -> tuple[Any, ...]:
    """Under ``torch.autocast("cpu")``: the LM head's floating operands (not float64, as autocast
    leaves it) cast to the autocast dtype, as ``F.linear`` casts its operands there — the
    gradients flow back through the casts in the parameters' own dtypes; else ``xs`` unchanged."""
    if not torch.is_autocast_enabled("cpu"):
        return xs
    dt = torch.get_autocast_dtype("cpu")
    return tuple(
        x.to(dt) if isinstance(x, torch.Tensor) and x.dtype in _AUTOCAST_ELIGIBLE and x.dtype != dt else x for x in xs
    )


def values_of(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values under ``torch.func``'s wrappers (``vmap``'s batch, ``grad``'s tracking): a
    check of the values (the targets' range) looks at every slice of a batch at once instead of
    branching on a batched tensor, which ``vmap`` refuses."""
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(x):
        x = f.get_unwrapped(x)
    return x


def real(name: str, x: Any, expected: str) -> float:
    """``x`` as a float where it is a real number (not a bool nor a string); else 161002."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise bad(name, expected, repr(x))
    return float(x)


def check_args(hidden, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing):
    for name, x, opt in (
        ("hidden", hidden, False),
        ("weight", weight, False),
        ("target", target, False),
        ("bias", bias, True),
        ("ce_weight", ce_weight, True),
    ):
        _check_tensor(name, x, opt)
    if weight.dim() != 2:
        raise bad("weight", "a 2-D [V, H] tensor", f"shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise bad(
            "hidden", f"shape [..., H] with H == weight.shape[1] == {weight.shape[1]}", f"shape {tuple(hidden.shape)}"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise bad("target", f"shape hidden.shape[:-1] == {tuple(hidden.shape[:-1])}", f"shape {tuple(target.shape)}")
    if hidden.dtype not in _ALL_DTYPES:
        raise bad("hidden", "dtype bfloat16, float16, float32 or float64", str(hidden.dtype))
    if weight.dtype != hidden.dtype:
        raise bad("weight", f"hidden's dtype ({hidden.dtype})", str(weight.dtype))
    if bias is not None and (bias.dtype != hidden.dtype or tuple(bias.shape) != (weight.shape[0],)):
        raise bad("bias", f"a [{weight.shape[0]}] tensor of hidden's dtype", f"{bias.dtype} shape {tuple(bias.shape)}")
    if target.dtype not in _TARGET_DTYPES:
        raise bad("target", "int64 or int32 class indices", str(target.dtype))
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise bad("ignore_index", "an int", repr(ignore_index))
    if not -(2**63) <= int(ignore_index) < 2**63:
        raise bad("ignore_index", "an int64 value (a class id, or -100)", repr(ignore_index))
    if reduction not in _REDUCTIONS:
        raise bad("reduction", "'mean', 'sum' or 'none'", repr(reduction))
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, numbers.Real)
        or not 0.0 <= float(label_smoothing) <= 1.0
    ):
        raise bad("label_smoothing", "a float in [0, 1]", repr(label_smoothing))


def shift_target(target, n, ignore_index):
    """Targets shifted left by n along the last dim (CCE's ``shift``), the tail ignored."""
    if n == 0:
        return target
    out = torch.full_like(target, ignore_index)
    if target.shape[-1] > n:
        out[..., :-n] = target[..., n:]
    return out
