"""``smooth_l1_loss_backward`` — op_api layer of aclnnSmoothL1LossBackward."""

from __future__ import annotations

import numpy as np

from .. import _config, arrays
from ..backends import dispatch
from ..dtypes import FLOAT_DTYPES, dtype_name, promote
from ..errors import invalid
from ._common import parse_float, parse_reduction

OP = "smooth_l1_loss_backward"

#: The device's rank limit (``MAX_SUPPORT_DIMS_NUMS``), enforced in strict mode.
MAX_DIMS = 8


def smooth_l1_loss_backward(grad_out, input, target, reduction="mean", beta=1.0, *, out=None):
    """Gradient of the smooth L1 loss with respect to ``input``.

    Parameters
    ----------
    grad_out : array_like, bfloat16 | float16 | float32
        Gradient of the loss (``gradOut``): usually a 0-d tensor for ``"mean"``/``"sum"`` and
        the input's shape for ``"none"``; any shape broadcastable with ``input`` and ``target``.
    input : array_like, bfloat16 | float16 | float32
        Predictions ``x`` (``self``); broadcastable with ``grad_out`` and ``target``.
    target : array_like, bfloat16 | float16 | float32
        Targets ``y``; broadcastable with ``grad_out`` and ``input``.
    reduction : {"none", "mean", "sum"} or {0, 1, 2}, default "mean"
        The forward's reduction (aclnn integers 0 = none, 1 = mean, 2 = sum).  ``"mean"``
        divides by the element count of the broadcast output.
    beta : float, default 1.0
        Threshold between the L2 and L1 regimes, ``>= 0``; used as fp32 (as the device).
    out : array_like, optional
        Preallocated ``grad_input`` of the broadcast shape, any of the three float dtypes
        (contiguous or not).  Written only after all validation passed.

    Returns
    -------
    grad_input : ndarray or torch.Tensor
        Broadcast shape of the three inputs, in their promoted dtype (fp16 with bf16, or any
        16-bit with fp32, gives fp32), or ``out``'s dtype.  NumPy in -> NumPy out, torch in
        -> torch out.

    Notes
    -----
    With ``d = input - target`` in fp32::

        s = d / beta            if |d| < beta    (computed as d * fp32(1/beta), as the kernel)
        s = sign(d)             otherwise, with sign(0) = 0
        grad_input = s * grad_out * (1/N if reduction == "mean" else 1)

    rounded once (round-to-nearest-even) to the output dtype; 16-bit inputs are widened to
    fp32 exactly.  NaN in ``d`` or ``grad_out`` gives NaN.  When ``out``'s dtype differs from
    the promoted dtype, the result is rounded to the promoted dtype and then cast (the
    device's final Cast).

    Deviations from PyTorch's ``aten::smooth_l1_loss_backward`` (fastgrad follows the
    device): with ``beta = 0`` every element takes the sign branch, so ``d == 0`` gives 0
    (seed formula; 910B), where the aten op gives ``-grad_out`` (autograd of
    ``F.smooth_l1_loss`` gives 0 too); ``"mean"`` divides by the broadcast output's element
    count, where the aten op divides by ``input.numel()`` (they differ only when ``input``
    itself is broadcast); and ``input`` may be broadcast to a larger shape, which the aten
    op's output (shaped like ``input``) cannot express.  Elsewhere results match PyTorch up to
    fp32 rounding (PyTorch computes ``x * grad / beta``, the device ``x * fp32(1/beta) *
    grad``).

    Extensions outside strict mode: more than 8 dimensions.

    Raises
    ------
    AclnnError
        161001 when ``grad_out``, ``input`` or ``target`` is None.
        161002 when a dtype is not bf16/fp16/fp32, the shapes do not broadcast, ``out`` has
        the wrong shape/dtype or is read-only, ``reduction`` is not one of the six accepted
        values, ``beta`` is negative or NaN, or (strict mode) a tensor has more than 8
        dimensions.

    Source: seed 003 (aclnnSmoothL1LossBackward); CANN ops-nn
    ``loss/smooth_l1_loss_grad_v2`` (op_api ``aclnn_smooth_l1_loss_backward.cpp``, kernel
    DAG ``SmoothL1LossGradV2OpDag``).
    """
    kind = arrays.kind_of(grad_out, input, target)
    g = arrays.as_numpy(grad_out, "grad_out", op=OP)
    x = arrays.as_numpy(input, "input", op=OP)
    t = arrays.as_numpy(target, "target", op=OP)
    for a, name in ((g, "grad_out"), (x, "input"), (t, "target")):
        arrays.check_dtype(a, name, FLOAT_DTYPES, OP)
    if _config.is_strict():
        for a, name in ((g, "grad_out"), (x, "input"), (t, "target")):
            if a.ndim > MAX_DIMS:
                raise invalid(name, f"at most {MAX_DIMS} dimensions", f"shape {tuple(a.shape)}", OP)
    red = parse_reduction(reduction, OP)
    b = parse_float(beta, "beta", OP)
    if not b >= 0:
        raise invalid("beta", "a non-negative number", repr(beta), OP)
    try:
        shape = np.broadcast_shapes(g.shape, x.shape, t.shape)
    except ValueError:
        raise invalid("input", "grad_out, input and target shapes that broadcast",
                      f"{tuple(g.shape)}, {tuple(x.shape)}, {tuple(t.shape)}", OP) from None
    dt = promote(g.dtype, x.dtype, t.dtype)
    out_dt = dt
    if out is not None:
        o = arrays.as_numpy(out, "out", op=OP)
        if o.dtype not in FLOAT_DTYPES:
            raise invalid("out", "dtype in (bfloat16, float16, float32)", dtype_name(o.dtype), OP)
        if _config.is_strict() and o.ndim > MAX_DIMS:
            raise invalid("out", f"at most {MAX_DIMS} dimensions", f"shape {tuple(o.shape)}", OP)
        out_dt = o.dtype
    checked = arrays.check_out(out, "out", shape, out_dt, OP)
    buf = arrays.prepare_out(out, checked, shape, out_dt)
    dispatch(OP)(grad_out=g, input=x, target=t, reduction=red, beta=b, out=buf.buffer)
    return buf.result(kind)
