"""float64 golden of ``smooth_l1_loss_backward`` (obvious, slow, independent of the kernel).

Computes ``d = input - target`` in fp32 (as the device), the rest in float64 on the broadcast
inputs, and rounds once to the promoted dtype (then casts
to ``out``'s dtype when that differs, as the device's final Cast does).  ``beta`` is taken as
the fp32 value the device receives, and the quadratic zone multiplies by the device's fp32
constant ``1/beta`` (ops-nn ``arch35/smooth_l1_loss_grad_v2_tiling.cpp:145``; NaN for
``0 <= beta < fp32(1e-6)``, so the zone is NaN there, rows 5f and 5a); the zone is
``|d| <= beta`` for a tensor ``grad_out`` and ``|d| < beta`` for a one-element one (the two
DAGs of ``op_kernel/arch35/smooth_l1_loss_grad_v2_dag.h``).  ``smooth_l1_kernel="tbe"`` (the
A2/A3 profiles) takes the 910B TBE formula instead (``_tbe``).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import promote

OP = "smooth_l1_loss_backward"


def _tbe(d, b):
    """The 910B TBE kernel: ``-[d <= -β] + [d >= β] + [|d| < β]·d/fp32(β + 1e-6)``, a NaN d read
    as 0 by the compares (so 0 at β = 0, NaN otherwise)."""
    den = float(np.float32(np.float32(b) + np.float32(1e-6)))
    x = np.where(np.isnan(d), 0.0, d)
    with np.errstate(invalid="ignore", divide="ignore"):
        temp = d / den
        return (-(x <= -b).astype(np.float64) + (x >= b)) + np.where(np.abs(x) < b, temp, 0.0)


def smooth_l1_loss_backward(
    *,
    grad_out: np.ndarray,
    input: np.ndarray,
    target: np.ndarray,
    reduction: str,
    beta: float,
    out: np.ndarray,
    smooth_l1_kernel: str = "dag",
) -> np.ndarray:
    shape = out.shape
    g = np.broadcast_to(np.asarray(grad_out, dtype=np.float64), shape)
    x = np.broadcast_to(np.asarray(input, dtype=np.float64), shape)
    t = np.broadcast_to(np.asarray(target, dtype=np.float64), shape)
    b32 = np.float32(beta)
    b = float(b32)
    # the device's tiling constant 1/beta, an fp32 value; NaN below fp32(1e-6), beta = 0
    # included (arch35 smooth_l1_loss_grad_v2_tiling.cpp:145, docs/device_parity.md rows 5f, 5a:
    # at beta = 0 the tensor DAG's zone |d| <= 0 is NaN, the scalar DAG's |d| < 0 is empty)
    if b < float(np.float32(1e-6)):
        inv = float("nan")
    else:
        inv = float(np.float32(np.float32(1.0) / b32))
    # the tensor DAG (grad_out of more than one element) compares strictly, the scalar DAG not
    strict = np.asarray(grad_out).size != 1
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # d = input - target in fp32, as the device (docs/spec.md): a difference beyond FLT_MAX is
        # ±inf there (±1 at beta = inf on the TBE, NaN on the tensor DAG), finite in float64
        d = (x.astype(np.float32) - t.astype(np.float32)).astype(np.float64)
        lin = (np.abs(d) <= b) if strict else (np.abs(d) < b)
        s = np.where(lin, d * inv + 0.0, np.sign(d))  # sign(0) = 0; NaN stays NaN
        if smooth_l1_kernel == "tbe":
            s = _tbe(d, b)
        r = s * g
        if reduction == "mean" and r.size:
            r = r / r.size
    pdt = promote(grad_out.dtype, input.dtype, target.dtype)
    out[...] = r.astype(pdt).astype(out.dtype)
    return out
