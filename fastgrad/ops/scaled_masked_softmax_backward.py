"""op_api layer of ``scaled_masked_softmax_backward`` (aclnnScaledMaskedSoftmaxBackward)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import FLOAT_DTYPES, dtype_name
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, broadcasts, execute

OP = "scaled_masked_softmax_backward"

#: The device's range for the last dimension S2 (seed 002: "最后一维范围是[1, 4096]").
MAX_S2_DEVICE = 4096

_MASK_DTYPES_EXT = tuple(np.dtype(d) for d in (np.uint8, np.int8, np.int16, np.int32, np.int64))


def _mask_optional(raw: dict, strict: bool) -> bool:
    """The mask may be None outside strict mode when fix_triu_mask supplies the masking."""
    return (not strict) and raw.get("fix_triu_mask") is True


def _relations(c: Call) -> None:
    go, y, m = c.a["grad_output"], c.a["y"], c.a["mask"]
    shape = c.shape_of("grad_output")
    if y.dtype != go.dtype:
        c.bad("y", f"the dtype of grad_output ({dtype_name(go.dtype)})", dtype_name(y.dtype))
    c.expect_shape("y", shape)
    if m is not None and not broadcasts(m.shape, shape):
        c.bad("mask", f"a shape broadcastable to {shape}", f"shape {tuple(m.shape)}")
    c.outs["out"] = OutSpec(shape, go.dtype)


def _device_limits(c: Call) -> None:
    shape = c.shape_of("grad_output")
    m = c.a["mask"]
    if m is not None and tuple(m.shape[-2:]) != shape[-2:]:
        c.bad(
            "mask", f"last two dimensions {shape[-2:]} (those of grad_output; strict mode)", f"shape {tuple(m.shape)}"
        )
    if not (1 <= shape[-1] <= MAX_S2_DEVICE):
        c.bad("grad_output", f"last dimension in [1, {MAX_S2_DEVICE}] (device limit)", f"shape {shape}")


DECL = OpDef(
    name=OP,
    aclnn="aclnnScaledMaskedSoftmaxBackward",
    inputs=(
        TensorDef("grad_output", FLOAT_DTYPES, ndim=(4, 4), ext_ndim=(1, None)),
        TensorDef("y", FLOAT_DTYPES, ndim=(4, 4), ext_ndim=(1, None)),
        TensorDef(
            "mask", (np.bool_,), ext_dtypes=_MASK_DTYPES_EXT, ndim=(4, 4), ext_ndim=(0, None), optional=_mask_optional
        ),
    ),
    attrs=(
        AttrDef("scale", "float", finite=False),
        AttrDef(
            "fix_triu_mask",
            "bool",
            device=(False,),
            device_why="False (device limit; True is computed outside strict mode)",
        ),
    ),
    outputs=("out",),
    relations=_relations,
    device_limits=_device_limits,
    source="seed 002; ops-nn vfusion/scaled_masked_softmax_grad_v2",
)


def scaled_masked_softmax_backward(
    grad_output: Any, y: Any, mask: Any, scale: float = 1.0, fix_triu_mask: bool = False, *, out: Any = None
) -> Any:
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

    Source: seed 002 (CANN aclnnScaledMaskedSoftmaxBackward doc) and docs/spec.md; CANN kernel
    ``ScaledMaskedSoftmaxGradV2`` (ops-nn ``vfusion/scaled_masked_softmax_grad_v2``).
    """
    return execute(DECL, dict(grad_output=grad_output, y=y, mask=mask, scale=scale, fix_triu_mask=fix_triu_mask), out)
