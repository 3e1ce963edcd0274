"""float64 golden of ``cross_entropy_loss_grad`` (the oracle; obvious, slow, clear).

Follows the device's formula (SPEC.md / ops-nn ``CrossEntropyLossGrad`` golden) in float64 and
rounds the result once to ``log_prob``'s dtype.
"""

from __future__ import annotations

import numpy as np

from ..backends import implements

OP = "cross_entropy_loss_grad"


def _f64(a):
    return np.asarray(a).astype(np.float64)


@implements("reference", OP)
def cross_entropy_loss_grad_reference(*, grad_loss, log_prob, target, weight, reduction,
                                      ignore_index, label_smoothing, grad_zloss, lse_for_zloss,
                                      lse_square_scale_for_zloss, out):
    n, c = log_prob.shape
    lp = _f64(log_prob)
    t = np.asarray(target).astype(np.int64)
    wc = np.ones(c) if weight is None else _f64(weight)
    keep = t != ignore_index                           # ignoreMask
    m = keep.astype(np.float64)
    t_safe = np.where(keep, t, 0)
    w_t = np.where(keep, wc[t_safe] if c else 0.0, 0.0)  # weight of each row's target
    g = _f64(grad_loss)
    if reduction == "mean":
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.full(n, g / w_t.sum())              # W = 0 -> inf/nan, as the device
    elif reduction == "sum":
        s = np.full(n, g)
    else:
        s = g.reshape(n)
    ls = float(label_smoothing)
    p = np.exp(lp)
    onehot = np.zeros((n, c))
    onehot[np.nonzero(keep)[0], t[keep]] = 1.0
    with np.errstate(invalid="ignore"):
        # sm = s·m and the ignored-row zero through multiplication, as the device (NaN stays NaN)
        sm = (s * m)[:, None]
        res = sm * ((1.0 - ls) * w_t[:, None] * (p - onehot)
                    + (ls / c if c else 0.0) * (p * wc.sum() - wc[None, :]))
        zs = float(lse_square_scale_for_zloss)
        if zs != 0.0:
            gz = g if grad_zloss is None else g + _f64(grad_zloss)
            gz = np.broadcast_to(gz, (n,)).astype(np.float64)
            if reduction == "mean":
                gz = gz / m.sum()
            lse = _f64(lse_for_zloss).reshape(n)
            res = res + p * (2.0 * zs * lse * m * gz)[:, None]
    # ignored rows: exactly 0 when the scale is finite (p·0 would be NaN for p = inf)
    fin = np.isfinite(s) | keep
    res[~keep & fin] = 0.0
    out[...] = res.astype(out.dtype)
    return out
