"""op_api layer of ``cross_entropy_loss_grad`` (aclnnCrossEntropyLossGrad)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from ..dtypes import FLOAT32, FLOAT_DTYPES, dtype_name
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "cross_entropy_loss_grad"

#: The device's limit on N (seed 001: "logProb第零维N需满足N<200000").
MAX_N_DEVICE = 200000


def _lse_optional(raw: dict, strict: bool) -> bool:
    """lse_for_zloss is required (161001) when the z-loss scale is a non-zero number."""
    z = raw.get("lse_square_scale_for_zloss", 0.0)
    real = isinstance(z, numbers.Real) and not isinstance(z, bool)
    return not (real and z != 0 and math.isfinite(z))  # a bad scale is reported as 161002


def _relations(c: Call) -> None:
    lp, tg = c.a["log_prob"], c.a["target"]
    n, cc = c.shape_of("log_prob")
    red, ign = c.attrs["reduction"], c.attrs["ignore_index"]
    c.expect_shape("target", (n,))
    red_shapes = [(n,)] if red == "none" else [(), (1,)]  # mean/sum: 0-d or (1,), as the kernel
    for name in ("grad_loss", "grad_zloss"):
        a = c.a[name]
        if a is not None and tuple(a.shape) not in red_shapes:
            c.bad(name, " or ".join(map(str, red_shapes)) + f" for reduction={red!r}", f"shape {tuple(a.shape)}")
        elif a is not None and red != "none":
            c.a[name] = a.reshape(())
    if c.a["weight"] is not None:
        c.expect_shape("weight", (cc,))
    if c.a["lse_for_zloss"] is not None:
        c.expect_shape("lse_for_zloss", (n,))
    if n and tg.shape == (n,):  # never read out of bounds (the device would)
        bad = (tg != ign) & ((tg < 0) | (tg >= cc))
        if bad.any():
            k = int(np.argmax(bad))
            c.bad("target", f"values in [0, {cc}) or ignore_index ({ign})", f"target[{k}] = {int(tg[k])}")
    c.outs["out"] = OutSpec((n, cc), lp.dtype)


def _device_limits(c: Call) -> None:
    gl, lp = c.a["grad_loss"], c.a["log_prob"]
    n, cc = c.shape_of("log_prob")
    if not isinstance(c.raw["grad_loss"], (int, float)) and gl.dtype != lp.dtype:
        c.bad("grad_loss", f"the dtype of log_prob ({dtype_name(lp.dtype)})", dtype_name(gl.dtype))
    for name in ("grad_zloss", "lse_for_zloss"):
        if c.a[name] is not None:
            c.bad(name, "None (device: z-loss unsupported)", "an array")
    if n >= MAX_N_DEVICE:
        c.bad("log_prob", f"N < {MAX_N_DEVICE} (device limit)", f"N = {n}")
    if c.attrs["ignore_index"] >= cc:
        c.bad("ignore_index", f"a value < C = {cc} (device limit)", c.attrs["ignore_index"])


DECL = OpDef(
    name=OP,
    aclnn="aclnnCrossEntropyLossGrad",
    inputs=(
        TensorDef("grad_loss", FLOAT_DTYPES, ndim=(0, 1), scalar_ok=True),
        TensorDef("log_prob", FLOAT_DTYPES, ndim=(2, 2)),
        TensorDef("target", (np.int64,), ext_dtypes=(np.int32,), ndim=(1, 1)),
        TensorDef("weight", (FLOAT32,), ext_dtypes=FLOAT_DTYPES[:2], ndim=(1, 1), optional=True),
        TensorDef("grad_zloss", FLOAT_DTYPES, ndim=(0, 1), optional=True),
        TensorDef("lse_for_zloss", FLOAT_DTYPES, ndim=(1, 1), optional=_lse_optional),
    ),
    attrs=(
        AttrDef("reduction", "reduction"),
        AttrDef("ignore_index", "int"),
        AttrDef(
            "label_smoothing",
            "float",
            lo=0.0,
            hi=1.0,
            device=(0.0,),
            device_why="0.0 (device limit; fastgrad computes other values outside strict mode)",
        ),
        AttrDef("lse_square_scale_for_zloss", "float", device=(0.0,), device_why="0.0 (device: z-loss unsupported)"),
    ),
    outputs=("out",),
    relations=_relations,
    device_limits=_device_limits,
    source="seed 001; ops-nn loss/cross_entropy_loss_grad; ATen LossNLL.cpp",
)


def cross_entropy_loss_grad(
    grad_loss: Any,
    log_prob: Any,
    target: Any,
    weight: Any = None,
    reduction: str | int = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    grad_zloss: Any = None,
    lse_for_zloss: Any = None,
    lse_square_scale_for_zloss: float = 0.0,
    *,
    out: Any = None,
) -> Any:
    r"""Gradient of the cross-entropy loss w.r.t. the logits (aclnnCrossEntropyLossGrad).

    The backward of ``loss = cross_entropy(logits, target, weight, ignore_index, reduction,
    label_smoothing)`` given ``log_prob = log_softmax(logits)``: NLL backward fused with the
    log-softmax backward, in one pass over ``log_prob``.

    Parameters
    ----------
    grad_loss : array, float32 | float16 | bfloat16
        Gradient of the loss: 0-d for ``reduction`` ``"mean"``/``"sum"``, shape ``(N,)`` for
        ``"none"``.  (A Python number is accepted as a 0-d float32 of any precision.)
    log_prob : array (N, C), float32 | float16 | bfloat16
        The forward's ``log_softmax(logits)``.  ``p = exp(log_prob)`` is used as is (not
        renormalised).  N may be 0; C classes.
    target : array (N,), int64 (int32 accepted outside strict mode)
        Class indices in ``[0, C)``, or ``ignore_index``.
    weight : array (C,), float32, optional
        Class weights (default all ones).  float16/bfloat16 are accepted outside strict mode
        (widened exactly to fp32).
    reduction : {"mean", "sum", "none"} or {1, 2, 0}
        The forward's reduction.
    ignore_index : int
        Rows whose target equals it contribute nothing (their gradient row is 0).
    label_smoothing : float in [0, 1]
        Label smoothing ``ls`` with PyTorch's composite semantics (extension: the device
        accepts only 0).
    grad_zloss : array, optional
        Gradient of the z-loss output, shaped like ``grad_loss`` (extension; the device
        accepts only None).
    lse_for_zloss : array (N,), float, optional
        The forward's ``logsumexp(logits)`` per row; required when
        ``lse_square_scale_for_zloss != 0`` (extension).
    lse_square_scale_for_zloss : float
        z-loss scale ``zs`` (extension; the device accepts only 0.0).
    out : array (N, C), dtype of ``log_prob``, optional
        Preallocated output (any strides); returned.

    Returns
    -------
    x_grad : array (N, C), dtype of ``log_prob``
        NumPy in -> NumPy out; torch tensor in -> torch tensor out.

    Notes
    -----
    With ``w_i = weight[t_i]`` (1 without weight) and ``m_i = 0`` for ignored rows (1
    otherwise), ``W = Σ_i m_i·w_i`` and the row scale ``s_i = g/W`` (mean), ``g`` (sum),
    ``g_i`` (none), ``p = exp(log_prob)``:

    .. math::

        x\_grad_{ij} = m_i s_i\left[(1-ls)\,w_i\,(p_{ij} - \delta_{j,t_i})
                      + \frac{ls}{C}\Big(p_{ij}\sum_c weight_c - weight_j\Big)\right]
                      + p_{ij}\cdot 2\,zs\cdot lse_i\, m_i\, gz_i

    where ``gz = grad_loss + grad_zloss`` (``grad_zloss`` defaults to 0), divided by the
    number of non-ignored rows for ``mean``; the z-loss term is present only when
    ``zs != 0``.  Arithmetic is fp32 (16-bit inputs widened exactly, ``W`` summed serially in
    fp64), the output is rounded once to the dtype (RNE).  With ``ls = 0`` the rounding order
    is the 910B kernel's, bit for bit: ``c_i = fl(fl(fl(g·(1-ls))/W)·m_i)·w_i``,
    ``x = fl(p·c_i)``, at the target ``fl(x - c_i)``, then the cast (ops-nn
    ``cross_entropy_loss_grad_weight_none.h:90-101,164-170``,
    ``cross_entropy_loss_grad_weight_not_none.h:110-150,183-194``).  Ignored rows are
    computed as ``p·c_i`` with ``c_i = ±0``, as on the device: 0, but NaN where ``log_prob``
    is NaN (or ``exp`` overflows), and NaN when their scale is not finite.

    Deviations, as the device: with ``mean`` and ``W = 0`` (e.g. every row ignored) the
    result is **NaN everywhere** (PyTorch returns 0).  A row is ignored when
    ``target == ignore_index`` whatever the sign of ``ignore_index``, as the 910B kernel
    (``cross_entropy_loss_grad_base.h:198-220``; it compares in fp32, which equals the int64
    compare below 2**24) and PyTorch; the CANN golden and the Ascend 950 kernel ignore rows only
    when ``ignore_index >= 0`` (docs/device_parity.md, rows 4b-4e).

    Raises
    ------
    AclnnError
        161001 (ACLNN_ERR_PARAM_NULLPTR): ``grad_loss``, ``log_prob`` or ``target`` is None,
        or ``lse_for_zloss`` is None while ``lse_square_scale_for_zloss != 0``.
        161002 (ACLNN_ERR_PARAM_INVALID): a dtype or shape not listed above; ``reduction``
        not one of the three; ``label_smoothing`` outside [0, 1]; a target outside [0, C)
        that is not ``ignore_index`` (the device reads out of bounds; fastgrad always
        rejects it); a bad ``out``.  In strict mode (``fg.strict()``) also, as the device:
        ``label_smoothing != 0``; ``grad_zloss`` or ``lse_for_zloss`` given or
        ``lse_square_scale_for_zloss != 0``; ``N >= 200000``; target not int64; weight
        not float32; ``grad_loss`` dtype different from ``log_prob``'s; ``ignore_index >= C``
        (seed: "must be less than C").

    Source: seed 001 (CANN aclnnCrossEntropyLossGrad doc) and docs/spec.md; CANN kernel
    ``CrossEntropyLossGrad`` (ops-nn ``loss/cross_entropy_loss_grad``) and its golden.
    """
    return execute(
        DECL,
        dict(
            grad_loss=grad_loss,
            log_prob=log_prob,
            target=target,
            weight=weight,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            grad_zloss=grad_zloss,
            lse_for_zloss=lse_for_zloss,
            lse_square_scale_for_zloss=lse_square_scale_for_zloss,
        ),
        out,
    )
