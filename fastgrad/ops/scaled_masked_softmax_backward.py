"""op_api layer of ``scaled_masked_softmax_backward`` (aclnnScaledMaskedSoftmaxBackward)."""

from __future__ import annotations

import numpy as np

from .. import arrays
from .._config import is_strict
from ..backends import dispatch
from ..dtypes import FLOAT_DTYPES, dtype_name
from ..errors import invalid
from ._common import parse_bool, parse_float

OP = "scaled_masked_softmax_backward"

#: The device's range for the last dimension S2 (seed 002: "最后一维范围是[1, 4096]").
MAX_S2_DEVICE = 4096

_MASK_DTYPES_EXT = (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64)


def scaled_masked_softmax_backward(grad_output, y, mask, scale=1.0, fix_triu_mask=False, *, out=None):
    r"""Backward of ``y = softmax(mask_fill(x·scale))`` w.r.t. ``x`` (aclnnScaledMaskedSoftmaxBackward).

    Parameters
    ----------
    grad_output : array (B, N, S1, S2), float32 | float16 | bfloat16
        Gradient w.r.t. the softmax output ``y``.  Any strides.  Outside strict mode any
        shape with at least one dimension is accepted (rows of the last dimension).
    y : array, same shape and dtype as ``grad_output``
        The forward's softmax output.
    mask : array of bool, broadcastable to ``grad_output``, or None
        True = masked (the output is an explicit 0 there).  The device takes a 4-D mask
        ``[B|1, N|1, S1, S2]`` (broadcast over batch and heads, last two dimensions equal to
        ``grad_output``'s).  Outside strict mode: any mask NumPy-broadcastable to
        ``grad_output`` (fewer dimensions, broadcast rows or columns), integer masks
        (nonzero = masked), and None when ``fix_triu_mask`` is True.
    scale : float
        The forward's input scale.
    fix_triu_mask : bool
        Extension (the device accepts only False): also mask the upper triangle ``j > i``
        (column j of the last dimension, row i of the second-to-last), Megatron's causal
        variant.
    out : array, shape and dtype of ``grad_output``, optional
        Preallocated output (any strides); returned.

    Returns
    -------
    array, shape and dtype of ``grad_output``
        NumPy in -> NumPy out; torch tensor in -> torch tensor out.

    Notes
    -----
    Per row of the last dimension, in fp32 (16-bit inputs widened exactly):

    .. math::

        out_j = \Big(go_j\,y_j - \big(\textstyle\sum_k go_k\,y_k\big)\, y_j\Big)\cdot scale,
        \qquad out_j = 0 \text{ where mask}_j

    rounded once to the dtype (RNE).  The row sum is accumulated in fp32 in a fixed order
    (same bits for any thread count).  Masked elements are exactly 0 even when the inputs
    hold NaN/Inf there.

    Raises
    ------
    AclnnError
        161001 (ACLNN_ERR_PARAM_NULLPTR): ``grad_output`` or ``y`` is None, or ``mask`` is
        None (allowed outside strict mode when ``fix_triu_mask`` is True).
        161002 (ACLNN_ERR_PARAM_INVALID): unsupported dtypes; ``y``'s shape or dtype not
        ``grad_output``'s; a mask that does not broadcast; a bad ``out``.  In strict mode
        (``fg.strict()``) also, as the device: tensors not 4-D; S2 outside [1, 4096]; a mask
        that is not bool, not 4-D, or whose last two dimensions differ from
        ``grad_output``'s; ``fix_triu_mask=True``.

    Source: seed 002 (CANN aclnnScaledMaskedSoftmaxBackward doc) and SPEC.md; CANN kernel
    ``ScaledMaskedSoftmaxGradV2`` (ops-nn ``vfusion/scaled_masked_softmax_grad_v2``).
    """
    strict = is_strict()
    kind = arrays.kind_of(grad_output, y, mask)
    go = arrays.as_numpy(grad_output, "grad_output", op=OP)
    yy = arrays.as_numpy(y, "y", op=OP)
    triu = parse_bool(fix_triu_mask, "fix_triu_mask", OP)
    m = arrays.as_numpy(mask, "mask", required=strict or not triu, op=OP)
    sc = parse_float(scale, "scale", OP)

    arrays.check_dtype(go, "grad_output", FLOAT_DTYPES, OP)
    arrays.check_dtype(yy, "y", FLOAT_DTYPES, OP)
    if yy.dtype != go.dtype:
        raise invalid("y", f"the dtype of grad_output ({dtype_name(go.dtype)})", dtype_name(yy.dtype), OP)
    if m is not None:
        arrays.check_dtype(m, "mask", (np.bool_,) if strict else _MASK_DTYPES_EXT, OP)

    shape = tuple(int(d) for d in go.shape)
    if strict:
        arrays.check_ndim(go, "grad_output", 4, OP)
    elif go.ndim < 1:
        raise invalid("grad_output", "at least 1 dimension", "a 0-d array", OP)
    arrays.check_shape(yy, "y", shape, OP)
    if m is not None:
        if strict:
            arrays.check_ndim(m, "mask", 4, OP)
            if tuple(m.shape[-2:]) != shape[-2:]:
                raise invalid("mask", f"last two dimensions {shape[-2:]} (those of grad_output)",
                              f"shape {tuple(m.shape)}", OP)
        if not _broadcasts(m.shape, shape):
            raise invalid("mask", f"a shape broadcastable to {shape}", f"shape {tuple(m.shape)}", OP)
    if strict:
        if not (1 <= shape[-1] <= MAX_S2_DEVICE):
            raise invalid("grad_output", f"last dimension in [1, {MAX_S2_DEVICE}] (device limit)",
                          f"shape {shape}", OP)
        if triu:
            raise invalid("fix_triu_mask", "False (device limit; True is computed outside strict mode)",
                          True, OP)

    chk = arrays.check_out(out, "out", shape, go.dtype, OP)
    buf = arrays.prepare_out(out, chk, shape, go.dtype)
    dispatch(OP)(grad_output=go, y=yy, mask=m, scale=sc, fix_triu_mask=triu, out=buf.buffer)
    return buf.result(kind)


def _broadcasts(mshape, shape) -> bool:
    """True when ``mshape`` broadcasts to ``shape`` without changing it (NumPy rules)."""
    if len(mshape) > len(shape):
        return False
    for a, b in zip(reversed(tuple(mshape)), reversed(shape)):
        if a != b and a != 1:
            return False
    return True
