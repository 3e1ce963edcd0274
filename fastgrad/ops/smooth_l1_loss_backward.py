"""``smooth_l1_loss_backward`` — op_api layer of aclnnSmoothL1LossBackward."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import ArrayLike
from ..dtypes import FLOAT_DTYPES, promote
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "smooth_l1_loss_backward"

#: The device's rank limit (``MAX_SUPPORT_DIMS_NUMS``), enforced in strict mode.
MAX_DIMS = 8


def _relations(c: Call) -> None:
    names = ("grad_out", "input", "target")
    shapes = [c.shape_of(n) for n in names]
    try:
        shape = np.broadcast_shapes(*shapes)
    except ValueError:
        c.bad("input", "grad_out, input and target shapes that broadcast", ", ".join(map(str, shapes)))
        return
    c.outs["grad_input"] = OutSpec(shape, promote(*(c.a[n].dtype for n in names)), accept=FLOAT_DTYPES)
    c.info["kernel_args"] = {"smooth_l1_kernel": c.soc.smooth_l1_kernel}  # the SoC profile's kernel


DECL = OpDef(
    name=OP,
    aclnn="aclnnSmoothL1LossBackward",
    inputs=tuple(
        TensorDef(n, FLOAT_DTYPES, ndim=(0, MAX_DIMS), ext_ndim=(0, None)) for n in ("grad_out", "input", "target")
    ),
    attrs=(AttrDef("reduction", "reduction"), AttrDef("beta", "float", lo=0.0, finite=False, c_float=True)),
    outputs=("grad_input",),
    relations=_relations,
    source=(
        "aclnnSmoothL1LossBackward.md; ops-nn loss/smooth_l1_loss_grad_v2 (op_api aclnn_smooth_l1_loss_backward.cpp)"
    ),
)


def smooth_l1_loss_backward(
    grad_out: ArrayLike,
    input: ArrayLike,
    target: ArrayLike,
    reduction: str | int = "mean",
    beta: float = 1.0,
    *,
    out: Any = None,
) -> Any:
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
        ``+inf`` is accepted (the op_api checks only ``beta >= 0``): the gradient is 0 for every
        finite ``d``.
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
    The kernel follows the SoC profile (``fg.soc_version``; ``fastgrad/soc.py``).  With
    ``d = input - target`` in fp32:

    **"Ascend910B" / "Ascend910_93"** (the default; the TBE DSL kernel
    ``impl/dynamic/smooth_l1_loss_grad_v2.py`` of the CANN opp, ops-nn
    ``experimental/loss/smooth_l1_loss_grad_v2`` registers it for ascend910b)::

        s = -[d <= -beta] + [d >= beta] + [|d| < beta] · d / fp32(beta + 1e-6)

    — exactly ±1 at ``|d| == beta``, a true division by ``beta + 1e-6`` in the quadratic zone;
    a NaN ``d`` is read as 0 by the compares (0 at beta = 0, NaN otherwise); one formula for a
    tensor and a one-element ``grad_out``.

    **"Ascend950"** (the arch35 AscendC DAG, ``op_kernel/arch35/smooth_l1_loss_grad_v2_dag.h``)::

        s = d * fp32(1/beta)    if |d| < beta
        s = sign(d)             otherwise, with sign(0) = 0

    bit for bit: a ``grad_out`` of more than one element compares strictly, so ``|d| == beta``
    gives ``d * fp32(1/beta)`` (``1 - 2**-24`` for beta = 1.7); a one-element ``grad_out``
    takes the scalar DAG (``|d| >= beta`` -> sign).  For ``0 <= beta < fp32(1e-6)`` the
    device's ``1/beta`` is NaN (the arch35 tiling's ``fabsf(sigma) < 1e-6f ? NAN : 1/sigma``),
    so the quadratic zone (``|d| <= beta``, resp. ``|d| < beta``) gives NaN and the rest
    ``±grad_out``, as on the device; at ``beta = 0`` that is NaN at ``d = ±0`` for a tensor
    ``grad_out`` and 0 there for a one-element one (docs/device_parity.md, rows 5-5f).

    Both: ``grad_input = s * grad_out * (fp32(1/N) if reduction == "mean" else 1)``,
    rounded once (round-to-nearest-even) to the output dtype; 16-bit inputs are widened to
    fp32 exactly.  NaN in ``d`` or ``grad_out`` gives NaN.  When ``out``'s dtype differs from
    the promoted dtype, the result is rounded to the promoted dtype and then cast (the
    device's final Cast).

    Deviations from PyTorch's ``aten::smooth_l1_loss_backward`` (fastgrad follows the
    device): with ``beta = 0`` every element takes the sign branch, so ``d == 0`` gives 0
    (seed formula; 910B, and the 950 with a one-element ``grad_out``; the 950 with a tensor
    ``grad_out`` gives NaN, above), where the aten op gives ``-grad_out`` (autograd of
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

    Source: the CANN doc aclnnSmoothL1LossBackward.md; CANN ops-nn
    ``loss/smooth_l1_loss_grad_v2`` (op_api ``aclnn_smooth_l1_loss_backward.cpp``, kernel
    DAG ``SmoothL1LossGradV2OpDag``); the CANN opp TBE ``smooth_l1_loss_grad_v2_compute``.
    """
    return execute(DECL, dict(grad_out=grad_out, input=input, target=target, reduction=reduction, beta=beta), out)
