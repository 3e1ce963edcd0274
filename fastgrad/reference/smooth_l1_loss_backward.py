"""float64 golden of ``smooth_l1_loss_backward`` (obvious, slow, independent of the kernel).

Computes in float64 on the broadcast inputs and rounds once to the promoted dtype (then casts
to ``out``'s dtype when that differs, as the device's final Cast does).  ``beta`` is taken as
the fp32 value the device receives.
"""

from __future__ import annotations

import numpy as np

from ..backends import implements
from ..dtypes import promote

OP = "smooth_l1_loss_backward"


@implements("reference", OP)
def smooth_l1_loss_backward(*, grad_out, input, target, reduction, beta, out):
    shape = out.shape
    g = np.broadcast_to(np.asarray(grad_out, dtype=np.float64), shape)
    x = np.broadcast_to(np.asarray(input, dtype=np.float64), shape)
    t = np.broadcast_to(np.asarray(target, dtype=np.float64), shape)
    b = float(np.float32(beta))
    with np.errstate(invalid="ignore", divide="ignore"):
        d = x - t
        if b > 0:
            s = np.where(np.abs(d) < b, d / b, np.sign(d))
        else:
            s = np.sign(d)  # sign(0) = 0, NaN stays NaN
        r = s * g
        if reduction == "mean" and r.size:
            r = r / r.size
    pdt = promote(grad_out.dtype, input.dtype, target.dtype)
    out[...] = r.astype(pdt).astype(out.dtype)
    return out
