"""float64 golden of ``cross_entropy_loss_grad`` (the oracle; obvious, slow, clear).

The device's path (``label_smoothing = 0``, no z-loss) follows the 910B kernel's order of
operations, each step rounded to fp32 as the device rounds it (float64 arithmetic on fp32
operands, rounded to fp32: exactly the IEEE fp32 result), with a correctly rounded ``exp``::

    c_i = fl(fl(fl(g·(1-ls)) / W)·ignore_i)·w_i      (sum: fl(g·(1-ls)), none: fl(g_i·(1-ls)))
    x   = fl(fl(exp(log_prob))·c_i);   at the target column x = fl(x - c_i)
    out = x rounded to log_prob's dtype

(ops-nn ``loss/cross_entropy_loss_grad/op_kernel``: ``cross_entropy_loss_grad_base.h:198-252``,
``cross_entropy_loss_grad_weight_none.h:90-101,164-181``, ``..._weight_not_none.h:80-150,
183-207``).  Ignored rows are ``p·c_i`` with ``c_i = ±0``: 0, NaN where ``p`` is NaN or inf.
The extension (label smoothing), which the 910B device does not compute, uses the float64
formula (docs/spec.md) rounded once to the dtype; rows with a non-finite operand (scale,
``exp(log_prob)`` or a weight) follow the kernel's operations instead, so that inf/NaN fall where
the kernel puts them — in particular the row's ``Σ_j w_j·sm`` is summed term by term (NaN for
an infinite ``sm`` with a zero weight or weights of both signs; docs/device_parity.md row 4m).
"""

from __future__ import annotations

import numpy as np

OP = "cross_entropy_loss_grad"


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _fl(a):
    """Round float64 values to fp32 (and back): the device's fp32 rounding of one operation."""
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


def _ignored(t, ignore_index, any_sign):
    """The SoC's ignore rule: 910B any sign, arch35 only a non-negative ignore_index."""
    return (t == ignore_index) & (any_sign or ignore_index >= 0)


def _device_path(grad_loss, log_prob, target, weight, reduction, ignore_index, out, any_sign=True):
    """ls = 0: the 910B kernel's fp32 order of operations (module docstring)."""
    n, c = log_prob.shape
    lp = _f64(log_prob)
    t = np.asarray(target).astype(np.int64)
    m = (~_ignored(t, ignore_index, any_sign)).astype(np.float64)  # ignoreSelect
    inside = (t >= 0) & (t < c)
    if weight is None:
        w_t = np.ones(n)
    else:  # TargetWeight: 0 outside [0, C)
        wc = _f64(weight)
        w_t = np.where(inside, wc[np.where(inside, t, 0)] if c else 0.0, 0.0)
    g = _f64(grad_loss)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if reduction == "none":
            L = g.reshape(n) * 1.0  # fl(g_i·(1-ls)), ls = 0: exact
        else:
            L = np.full(n, g.reshape(()) * 1.0)
            if reduction == "mean":
                W = _fl((w_t * m).sum())  # Σ ignore_i·w_i, one fp32 value
                L = _fl(L / W)
        cf = _fl(_fl(m * L) * w_t)  # c_i (ignored rows: ±0, or NaN)
        p = _fl(np.exp(lp))
        x = _fl(p * cf[:, None])
        rows = np.nonzero(inside)[0]  # subtract at t (ignored rows: ±0)
        x[rows, t[rows]] = _fl(x[rows, t[rows]] - cf[rows])
    out[...] = x.astype(np.float32).astype(out.dtype)
    return out


def cross_entropy_loss_grad_reference(
    *,
    grad_loss: np.ndarray,
    log_prob: np.ndarray,
    target: np.ndarray,
    weight: np.ndarray | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    grad_zloss: np.ndarray | None,
    lse_for_zloss: np.ndarray | None,
    lse_square_scale_for_zloss: float,
    out: np.ndarray,
    ignore_any_sign: bool = True,
    smooth_arch35: bool = False,
) -> np.ndarray:
    """The z-loss inputs are not read (the device ignores them)."""
    n, c = log_prob.shape
    if n == 0 or c == 0:  # nothing to write (a C = 0 row has no column to index weight with)
        return out
    if float(label_smoothing) == 0.0:
        return _device_path(grad_loss, log_prob, target, weight, reduction, ignore_index, out, ignore_any_sign)
    lp = _f64(log_prob)
    t = np.asarray(target).astype(np.int64)
    wc = np.ones(c) if weight is None else _f64(weight)
    keep = ~_ignored(t, ignore_index, ignore_any_sign)  # ignoreMask
    m = keep.astype(np.float64)
    inside = keep & (t >= 0) & (t < c)
    t_safe = np.where(inside, t, 0)
    w_t = np.where(keep, wc[t_safe] if c else 0.0, 0.0)  # weight of each row's target (1 outside [0, C): no weight)
    g = _f64(grad_loss)
    if reduction == "mean":
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.full(n, g / w_t.sum())  # W = 0 -> inf/nan, as the device
    elif reduction == "sum":
        s = np.full(n, g)
    else:
        s = g.reshape(n)
    ls = float(label_smoothing)
    p = np.exp(lp)
    with np.errstate(over="ignore"):
        # the device's fp32 exp: +inf above log(FLT_MAX) ~ 88.72 where float64's stays finite
        p32 = _fl(p)
    onehot = np.zeros((n, c))
    onehot[np.nonzero(inside)[0], t[inside]] = 1.0  # a target outside [0, C) matches no column
    with np.errstate(invalid="ignore"):
        # sm = s·m and the ignored-row zero through multiplication, as the device (NaN stays NaN)
        sm = (s * m)[:, None]
        res = sm * ((1.0 - ls) * w_t[:, None] * (p - onehot) + (ls / c if c else 0.0) * (p * wc.sum() - wc[None, :]))
    # ignored rows: exactly 0 when the scale is finite (p·0 would be NaN for p = inf)
    fin = np.isfinite(s) | keep
    res[~keep & fin] = 0.0
    # Rows with a non-finite operand: the kernels' own operations, so that inf/NaN land where
    # they do on the device (finite rows keep the formula above, unchanged).
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(s * m) | ~np.isfinite(p32).all(axis=1) | (not np.isfinite(wc).all())
    if bad.any():
        # p32: a row whose fp32 exp overflows is inf there on the device (an ignored row's p·0 is
        # NaN, docs/device_parity.md row 4e), not the float64 exp's finite value
        res[bad] = _smooth_nonfinite_rows(s, m, p32, t, wc, weight is not None, ls, smooth_arch35)[bad]
    out[...] = res.astype(out.dtype)
    return out


def _smooth_nonfinite_rows(s, m, p, t, wc, has_weight, ls, arch35):
    """ls != 0, float64, in the kernel's structure (what decides where inf and NaN fall):

    ``c_i = s_i·(1-ls)·m_i·w_i`` (the device's TargetWeight: ``weight[t]`` also on ignored
    rows, 0 outside [0, C) with a weight), ``sm_i = s_i·(ls/C)·m_i``, the terms
    ``u_ij = w_j·sm_i`` and the row's ``S_i = Σ_j u_ij`` **term by term** — with ``sm_i = ±inf``
    a zero weight or weights of both signs make it NaN (arch35 ``weight_not_none.h:218-330``;
    PyTorch's composite sums its ``-sm·w_j`` the same way).  Then arch35 (``base.h:487-527``,
    ``weight_not_none.h:146-182``, ``weight_none.h:57-93``): ``x = p·c_i``, ``x[t] -= c_i``,
    ``out = (p·S_i − u_ij) + x``; the composite (A2/A3 outside strict):
    ``out = p·(c_i + S_i) − u_ij``, ``− c_i`` at the target.
    """
    n, c = p.shape
    inside = (t >= 0) & (t < c)
    t_in = np.where(inside, t, 0)
    w_t = np.where(inside, wc[t_in], 0.0 if has_weight else 1.0)
    rows = np.nonzero(inside)[0]
    with np.errstate(invalid="ignore", over="ignore"):
        sm_row = s * m
        ci = sm_row * (1.0 - ls) * w_t
        smi = sm_row * (ls / c)
        u = smi[:, None] * wc[None, :]
        S = np.zeros(n)
        for j in range(c):  # term by term (an infinite sm: the order does not matter)
            S = S + u[:, j]
        if arch35:
            x = p * ci[:, None]
            x[rows, t[rows]] = x[rows, t[rows]] - ci[rows]
            return (p * S[:, None] - u) + x
        r = p * (ci + S)[:, None] - u
        r[rows, t[rows]] = r[rows, t[rows]] - ci[rows]
        return r
