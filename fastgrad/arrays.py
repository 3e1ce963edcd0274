"""NumPy / torch in -> canonical NumPy arrays -> same kind out.

Every public op passes its array arguments through :func:`as_numpy` and its results through
:func:`wrap`.  A torch CPU tensor becomes a zero-copy NumPy view (bf16 through an int16 view,
so ``ml_dtypes.bfloat16`` on the NumPy side); results go back as tensors sharing the NumPy
memory.  Kernels never see torch tensors or ml_dtypes dtypes (see ``dtypes.storage_view``).

Python data (a number, a list, a tuple) is converted as ``torch.tensor`` converts it: Python
floats to float32, ints to int64, bools to bool — so ``[0.5, 0.5]`` is a float32 array (not
NumPy's float64), and a list of the wrong kind is reported as a list.  NumPy scalars keep their
dtype.  ``out=`` must be an array or a tensor (something to write into), never a list.

A torch tensor that requires grad is read through ``.detach()``: the NumPy-level ops are not
differentiable (they are the device's backward ops; the autograd loss is
``fastgrad.torch.linear_cross_entropy``), so with grad mode on they warn (``UserWarning``)
rather than return a result that silently drops out of the autograd graph; under
``torch.no_grad()`` (and inside an autograd Function) they read it quietly.
"""

from __future__ import annotations

import numbers
import warnings
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, Union, overload

import ml_dtypes
import numpy as np
import numpy.typing as npt

from . import _outcache
from .errors import invalid, null_error

if TYPE_CHECKING:  # torch stays optional: only the type checker imports it
    import torch

#: What the public ops take for an array argument: a NumPy array (bfloat16 as
#: ``ml_dtypes.bfloat16``), a CPU torch tensor, or Python numbers / nested lists.
ArrayLike: TypeAlias = Union[npt.ArrayLike, "torch.Tensor"]
#: What the public ops return for an array: the caller's kind (a NumPy array, or a torch
#: tensor sharing its memory when the inputs were tensors).
Array: TypeAlias = Union[npt.NDArray[Any], "torch.Tensor"]


NUMPY, TORCH = "numpy", "torch"

_torch = None


def _get_torch():
    global _torch
    if _torch is None:
        import sys

        _torch = sys.modules.get("torch", False) or False
    return _torch or None


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor (without importing torch when the caller never did)."""
    t = _get_torch()
    if t is None:
        import sys

        t = sys.modules.get("torch")
        if t is None:
            return False
        globals()["_torch"] = t
    return isinstance(x, t.Tensor)


def _torch_to_numpy(x: Any, name: str) -> np.ndarray:
    torch = _get_torch()
    if x.device.type != "cpu":
        dev = _device_operand(x)
        if dev is not None:
            return dev
        raise invalid(name, "a CPU tensor (NPU tensors need the 'acl' backend and torch_npu)", f"device {x.device}")
    if x.requires_grad and torch.is_grad_enabled():  # (inside an autograd Function grad mode is off)
        warnings.warn(
            f"{name}: a tensor that requires grad was given to a NumPy-level fastgrad op; it is read "
            "detached and the result is not part of the autograd graph (use fastgrad.torch."
            "linear_cross_entropy for a differentiable loss, or pass tensor.detach())",
            UserWarning,
            stacklevel=_caller_level(),
        )
    x = x.detach()
    if x.is_conj() or x.is_neg():
        x = x.resolve_conj().resolve_neg()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _caller_level() -> int:
    """``stacklevel`` of the first frame outside the fastgrad package (the user's call)."""
    import os
    import sys
    from types import FrameType

    pkg = os.path.dirname(os.path.abspath(__file__))
    f: FrameType | None = sys._getframe(1)
    level = 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg + os.sep):
        f, level = f.f_back, level + 1
    return level


def _device_operand(x):
    """A torch_npu tensor on the 'acl' backend: described in place (no copy), else None."""
    if x.device.type != "npu":
        return None
    from .backends import get_backend

    if get_backend() != "acl":
        return None
    from .backends import acl

    if not acl.torch_npu_available():
        return None
    return acl.device_array_from_torch(x.detach())


@overload
def as_numpy(x: Any, name: str, *, required: Literal[True] = True, op: str | None = None) -> np.ndarray: ...


@overload
def as_numpy(x: Any, name: str, *, required: bool, op: str | None = None) -> np.ndarray | None: ...


def as_numpy(x: Any, name: str, *, required: bool = True, op: str | None = None) -> np.ndarray | None:
    """Canonical NumPy view of an array argument (no copy where the input allows it).

    Raises 161001 when ``x`` is None and required, 161002 when it is not array-like.
    """
    if x is None:
        if required:
            raise null_error(name, op)
        return None
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        return _torch_to_numpy(x, name)
    if name == "out" or name.startswith("out["):
        raise invalid(name, "a NumPy array or torch.Tensor to write into", type(x).__name__, op)
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, (list, tuple, numbers.Number)):
        return _from_python(x, name, op)
    raise invalid(name, "a NumPy array or torch.Tensor", type(x).__name__, op)


def _from_python(x: Any, name: str, op: str | None) -> np.ndarray:
    """Python data as ``torch.tensor`` reads it: floats -> float32, ints -> int64, bools -> bool."""
    what = type(x).__name__
    try:
        a = np.asarray(x)
    except ValueError as e:  # ragged nesting
        expected = "a NumPy array, torch.Tensor or a rectangular list of numbers"
        raise invalid(name, expected, f"{what} ({e})", op) from None
    if a.dtype.kind == "f":
        a = a.astype(np.float32)
    elif a.dtype.kind in "iu":
        a = a.astype(np.int64)
    elif a.dtype.kind != "b":
        raise invalid(name, "a NumPy array, torch.Tensor or a list of numbers", f"a {what} of {a.dtype} values", op)
    return a


def kind_of(*xs: Any) -> str:
    """Output kind: torch when the first non-None argument is a tensor, else numpy."""
    for x in xs:
        if x is not None:
            return TORCH if is_torch(x) else NUMPY
    return NUMPY


def wrap(a: np.ndarray | None, kind: str) -> Array | None:
    """Return ``a`` as the caller's kind (a torch tensor sharing memory, or the array)."""
    if a is None or kind == NUMPY:
        return a
    torch = _get_torch()
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == np.dtype(np.uint16):  # not a torch dtype before 2.3; keep the bits
        return torch.from_numpy(a.view(np.int16))
    return torch.from_numpy(a)


def check_dtype(a: np.ndarray, name: str, allowed: Any, op: str | None = None) -> None:
    """161002 unless ``a.dtype`` is one of ``allowed``."""
    allowed = tuple(np.dtype(d) for d in allowed)
    if a.dtype not in allowed:
        from .dtypes import dtype_name

        raise invalid(name, "dtype in (" + ", ".join(dtype_name(d) for d in allowed) + ")", dtype_name(a.dtype), op)


def check_ndim(a: np.ndarray, name: str, ndim: int, op: str | None = None) -> None:
    if a.ndim != ndim:
        raise invalid(name, f"a {ndim}-D tensor", f"shape {tuple(a.shape)}", op)


def check_shape(a: np.ndarray, name: str, shape: tuple[int, ...], op: str | None = None) -> None:
    if tuple(a.shape) != tuple(shape):
        raise invalid(name, f"shape {tuple(shape)}", f"shape {tuple(a.shape)}", op)


class Out:
    """A validated ``out=`` target.

    ``buffer`` is a C-contiguous NumPy array the backend writes into: the caller's own memory
    when it is contiguous, else a scratch array copied into the caller's on :meth:`commit`.
    Nothing touches the caller's memory before ``commit`` except writes into ``buffer`` when
    it *is* the caller's memory, which only happens after all validation (call
    :func:`prepare_out` after validating).
    """

    __slots__ = ("user", "target", "buffer")

    def __init__(self, user: Array | None, target: np.ndarray, buffer: np.ndarray) -> None:
        self.user, self.target, self.buffer = user, target, buffer

    def commit(self) -> Any:
        """Copy the scratch buffer into the caller's array (when they differ)."""
        if self.buffer is not self.target:
            self.target[...] = self.buffer
        return self.user

    def result(self, kind: str) -> Any:
        """What the op returns: the caller's own ``out`` object, or the new array as ``kind``."""
        if self.user is not None:
            return self.commit()
        return wrap(self.buffer, kind)


def check_out(out: Any, name: str, shape: tuple[int, ...], dtype: Any, op: str | None = None) -> np.ndarray | None:
    """Validate one ``out=`` array (shape, dtype, writable); returns its NumPy view. Writes nothing."""
    if out is None:
        return None
    a = as_numpy(out, name, op=op)
    dt = np.dtype(dtype)
    if a.dtype != dt:
        from .dtypes import dtype_name

        raise invalid(name, f"dtype {dtype_name(dt)}", dtype_name(a.dtype), op)
    if tuple(a.shape) != tuple(shape):
        raise invalid(name, f"shape {tuple(shape)}", f"shape {tuple(a.shape)}", op)
    if not a.flags.writeable:
        raise invalid(name, "a writable array", "a read-only array", op)
    return a


def prepare_out(user: Any, checked: np.ndarray | None, shape: tuple[int, ...], dtype: Any) -> Out:
    """Make the buffer the backend writes (the user's array when contiguous, else scratch)."""
    if checked is None:
        buf = _outcache.empty(shape, dtype)  # large outputs on recycled memory
        return Out(None, buf, buf)
    if checked.flags.c_contiguous:
        return Out(user, checked, checked)
    return Out(user, checked, np.empty(shape, dtype))


def contiguous(a: np.ndarray | None) -> np.ndarray | None:
    """C-contiguous version of ``a`` (a copy only when it is not already)."""
    if a is None:
        return None
    return np.ascontiguousarray(a)
