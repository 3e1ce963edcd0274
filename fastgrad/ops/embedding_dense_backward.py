"""``embedding_dense_backward`` — op_api layer of aclnnEmbeddingDenseBackward."""

from __future__ import annotations

import math

import numpy as np

from .. import _config, arrays
from ..backends import dispatch
from ..dtypes import BFLOAT16, FLOAT_DTYPES, dtype_name
from ..errors import invalid
from ._common import parse_bool, parse_int

OP = "embedding_dense_backward"

#: Index dtypes the aclnn doc lists (strict mode accepts exactly these).
DEVICE_INDEX_DTYPES = tuple(np.dtype(d) for d in (
    np.float32, np.float16, np.float64, np.int32, np.int64, np.int16, np.int8, np.uint8, np.bool_))
MAX_DIMS = 8


def _index_dtype_ok(dt: np.dtype) -> bool:
    if _config.is_strict():
        return dt in DEVICE_INDEX_DTYPES
    return dt == BFLOAT16 or dt.kind in "iubf"


def embedding_dense_backward(grad, indices, num_weights, padding_idx=-1,
                             scale_grad_by_freq=False, *, out=None):
    """Gradient of an embedding lookup with respect to the embedding table.

    Parameters
    ----------
    grad : array_like, bfloat16 | float16 | float32, shape ``(*S, D)``
        Gradient of the lookup's output; its leading axes, flattened, match ``indices``
        flattened (``prod(S) == indices.size``).  Non-contiguous accepted.
    indices : array_like, shape ``S`` (any shape with ``prod(S)`` elements)
        Row of the table each grad row was read from.  int8 | uint8 | int16 | int32 | int64 |
        bool | float16 | float32 | float64 (the aclnn list; other integer dtypes and
        bfloat16 as extensions).  Floats are truncated toward zero (the device's Cast).
        Every index must lie in ``[0, num_weights)``.
    num_weights : int
        Rows of the table (``numWeights``), ``>= 0``.
    padding_idx : int, default -1
        Row left at zero (its gradient is dropped); negative means none (the aten op's
        convention; ``F.embedding``'s negative-index normalization is the caller's job).
    scale_grad_by_freq : bool, default False
        Divide each row by the number of times its index occurs in ``indices``.
    out : array_like, optional
        Preallocated ``(num_weights, D)`` array of grad's dtype (contiguous or not).  Written
        only after all validation passed.

    Returns
    -------
    grad_weight : ndarray or torch.Tensor, shape ``(num_weights, D)``, grad's dtype
        NumPy in -> NumPy out, torch in -> torch out.

    Notes
    -----
    ``out[k] = sum_{i : indices_i == k} grad_i`` accumulated in fp32 in index order, then
    ``/= count(k)`` (fp32) when ``scale_grad_by_freq``, rounded once (round-to-nearest-even) to
    grad's dtype; rows never indexed, and row ``padding_idx``, are zero.  Deterministic
    (no atomics; bitwise identical for any thread count).

    Deviations from PyTorch: its CPU kernel accumulates fp16/bf16 in 16 bits (4096 bf16 ones
    sum to 256); fastgrad accumulates in fp32 like the device (4096).  PyTorch scales each
    term by ``1/count``; fastgrad (SPEC) divides the fp32 sum once.  An index outside
    ``[0, num_weights)`` is undefined on the device and in PyTorch; fastgrad rejects it
    (161002) and never writes out of bounds.

    Extensions outside strict mode: grad of rank 1 or above 8, indices of rank 0 or above 8,
    indices of dtypes beyond the aclnn list (uint16/32/64, bfloat16).

    Raises
    ------
    AclnnError
        161001 when ``grad`` or ``indices`` is None.
        161002 when grad's dtype is not bf16/fp16/fp32, indices' dtype is not supported,
        ``prod(grad.shape[:-1]) != indices.size`` (checked when D > 0, as the device),
        ``num_weights`` is negative, an index is outside ``[0, num_weights)`` (NaN/Inf
        included), ``out`` has the wrong shape/dtype or is read-only, an attribute has the
        wrong type, or (strict mode) grad is not 2-8-D or indices not 1-8-D.

    Source: seed 004 (aclnnEmbeddingDenseBackward); CANN ops-nn
    ``index/embedding_dense_grad_v2`` (op_api ``aclnn_embedding_dense_backward.cpp``).
    """
    kind = arrays.kind_of(grad, indices)
    g = arrays.as_numpy(grad, "grad", op=OP)
    idx = arrays.as_numpy(indices, "indices", op=OP)
    arrays.check_dtype(g, "grad", FLOAT_DTYPES, OP)
    if not _index_dtype_ok(idx.dtype):
        allowed = ", ".join(dtype_name(d) for d in DEVICE_INDEX_DTYPES)
        raise invalid("indices", f"dtype in ({allowed})", dtype_name(idx.dtype), OP)
    if _config.is_strict():
        if not 2 <= g.ndim <= MAX_DIMS:
            raise invalid("grad", f"a 2-D to {MAX_DIMS}-D tensor", f"shape {tuple(g.shape)}", OP)
        if not 1 <= idx.ndim <= MAX_DIMS:
            raise invalid("indices", f"a 1-D to {MAX_DIMS}-D tensor", f"shape {tuple(idx.shape)}", OP)
    elif g.ndim < 1:
        raise invalid("grad", "at least 1 dimension (the embedding dim)", f"shape {tuple(g.shape)}", OP)
    nw = parse_int(num_weights, "num_weights", OP)
    if nw < 0:
        raise invalid("num_weights", "a non-negative integer", nw, OP)
    pad = parse_int(padding_idx, "padding_idx", OP)
    scale = parse_bool(scale_grad_by_freq, "scale_grad_by_freq", OP)
    d = g.shape[-1]
    rows = math.prod(g.shape[:-1])
    if d != 0 and rows != idx.size:
        raise invalid("grad", f"leading axes with {idx.size} elements in all (indices.size)",
                      f"shape {tuple(g.shape)} for indices of shape {tuple(idx.shape)}", OP)
    if g.size and idx.size:
        if idx.dtype == BFLOAT16 or idx.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                v = np.trunc(idx.astype(np.float64))
        else:
            v = idx
        lo, hi = v.min(), v.max()
        if not (lo >= 0 and hi < nw):
            raise invalid("indices", f"values in [0, {nw}) (num_weights)",
                          f"values in [{lo}, {hi}]", OP)
    shape = (nw, d)
    checked = arrays.check_out(out, "out", shape, g.dtype, OP)
    buf = arrays.prepare_out(out, checked, shape, g.dtype)
    dispatch(OP)(grad=g, indices=idx, num_weights=nw, padding_idx=pad,
                 scale_grad_by_freq=scale, out=buf.buffer)
    return buf.result(kind)
