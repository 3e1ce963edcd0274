"""op_api layer of ``scaled_masked_softmax_backward`` (aclnnScaledMaskedSoftmaxBackward)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import ArrayLike
from ..dtypes import FLOAT_DTYPES, dtype_name
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, broadcasts, execute

OP = "scaled_masked_softmax_backward"

#: The device's largest last dimension S2 on A2/A3 (aclnnScaledMaskedSoftmaxBackward.md:
#: "最后一维范围是[1, 4096]"); 8192 on Ascend 950 — the SoC profile's ``softmax_grad_max_s2`` (fastgrad/soc.py).
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
    lim = c.soc.softmax_grad_max_s2  # op_api :32-33,104-113: 4096, 8192 on regbase (Ascend 950)
    if shape[-1] > lim:
        c.bad("grad_output", f"last dimension <= {lim} on {c.soc.name} (device limit)", f"shape {shape}")
    elif any(d == 0 for d in shape):
        # the op_api accepts dimensions >= 0 (aclnn_scaled_masked_softmax_backward.cpp:109);
        # an empty grad_output makes the output empty, and the generated aclnnInner API skips
        # tiling and launch when every output is empty (opbase indv_executor.cpp:1075-1082,
        # indv_executor.h:400-403): success, nothing written — the tiling's "dimension <= 0"
        # refusal (scaled_masked_softmax_grad_v2_tiling.cpp:130-132) is never reached
        c.skip_compute = True


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
    source="aclnnScaledMaskedSoftmaxBackward.md; ops-nn vfusion/scaled_masked_softmax_grad_v2",
)


def scaled_masked_softmax_backward(
    grad_output: ArrayLike,
    y: ArrayLike,
    mask: ArrayLike | None,
    scale: float = 1.0,
    fix_triu_mask: bool = False,
    *,
    out: Any = None,
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
    Per row of the last dimension, in fp32 (16-bit inputs widened exactly), as the device's
    kernel (the same on every SoC; the tiling picks it from S2 padded to 64,
    ``scaled_masked_softmax_grad_v2_tiling.cpp:267-272,314``), without fastmath:

    .. math::

        S = \textstyle\sum_k \mathrm{fl}(go_k\,y_k), \qquad
        out_j = \begin{cases} \big((go_j - S)\, y_j\big)\cdot scale & \lceil S2/64\rceil\cdot 64 \le 1024
                              \text{ (AscendC SoftmaxGrad, norm\_headdim.h:152)}\\
                              \big(go_j\,y_j - y_j\, S\big)\cdot scale & \text{otherwise (large\_headdim.h:169-184)}
                \end{cases}

    each step rounded to fp32, ``out_j = 0`` where masked, then rounded once to the dtype
    (RNE).  ``S`` is summed in the order of CANN's own golden (the vector unit's reduce: 8-element
    blocks pairwise, 64-element repeats lane by lane, resp. 64-element blocks then the block
    sums pairwise), so near cancellation the bits are the device's: fp32 ``go = [.1, .1]``,
    ``y = [.1, .9]``, scale 1 gives ``[7.45e-10, 6.71e-9]``, not 0.  Same bits for any thread
    count.  Masked elements are exactly 0 even when the inputs hold NaN/Inf there.

    Raises
    ------
    AclnnError
        161001 (ACLNN_ERR_PARAM_NULLPTR): ``grad_output`` or ``y`` is None, or ``mask`` is
        None (allowed outside strict mode when ``fix_triu_mask`` is True).
        161002 (ACLNN_ERR_PARAM_INVALID): unsupported dtypes; ``y``'s shape or dtype not
        ``grad_output``'s; a mask that does not broadcast; a bad ``out``.  In strict mode
        (``fg.strict()``) also, as the device's op_api: tensors not 4-D; S2 above the SoC
        profile's limit (4096 on ``"Ascend910B"``/``"Ascend910_93"``, 8192 on ``"Ascend950"``,
        ``aclnn_scaled_masked_softmax_backward.cpp:32-33,104-113``); a mask that is not bool,
        not 4-D, or whose last two dimensions differ from ``grad_output``'s;
        ``fix_triu_mask=True``.
        A bad ``out`` includes one of another dtype than ``grad_output``, in every mode: the
        device's op_api accepts it but rewrites out's dtype to grad_output's
        (``aclnn_scaled_masked_softmax_backward.cpp:181-182``), so it writes grad_output-dtype
        bits into the buffer (docs/device_parity.md row 7c).

    An empty ``grad_output`` (a dimension 0) succeeds in every mode, with nothing to write: the
    op_api accepts dimensions >= 0 (:109) and the generated aclnnInner API skips tiling and
    launch when every output is empty (opbase ``indv_executor.cpp:1075-1082``,
    ``indv_executor.h:400-403``).

    Source: the CANN doc aclnnScaledMaskedSoftmaxBackward.md and docs/spec.md; CANN kernel
    ``ScaledMaskedSoftmaxGradV2`` (ops-nn ``vfusion/scaled_masked_softmax_grad_v2``).
    """
    return execute(DECL, dict(grad_output=grad_output, y=y, mask=mask, scale=scale, fix_triu_mask=fix_triu_mask), out)
