"""float64 golden of ``scaled_masked_softmax_backward`` (the oracle; obvious, slow, clear).

The device's two forms, each step rounded to fp32 as the kernel rounds it (float64 arithmetic
on fp32 operands, rounded: the IEEE fp32 result), with ``Σ dy·y`` summed exactly (float64 over
the fp32 products) and rounded once — the kernel's summation order is not reproduced here:

* padded S2 <= 1024 (AscendC ``SoftmaxGrad``, ``scaled_masked_softmax_grad_v2_norm_headdim.h:152``):
  ``out = fl(fl(fl(dy - Σ)·y)·scale)``;
* padded S2 > 1024 (``..._large_headdim.h:169-184``): ``out = fl(fl(fl(dy·y) - fl(y·Σ))·scale)``;

0 where the (broadcast) mask or the causal ``j > i`` mask is set, rounded to
``grad_output``'s dtype.
"""

from __future__ import annotations

import numpy as np

OP = "scaled_masked_softmax_backward"


def _fl(a):
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


def scaled_masked_softmax_backward_reference(
    *,
    grad_output: np.ndarray,
    y: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
    fix_triu_mask: bool,
    out: np.ndarray,
) -> np.ndarray:
    go = np.asarray(grad_output).astype(np.float64)
    yy = np.asarray(y).astype(np.float64)
    sc = float(np.float32(scale))
    s2 = go.shape[-1] if go.ndim else 1
    with np.errstate(invalid="ignore", over="ignore"):
        prod = _fl(go * yy)
        acc = _fl(prod.sum(axis=-1, keepdims=True))
        if (s2 + 63) // 64 * 64 <= 1024:
            res = _fl(_fl(_fl(go - acc) * yy) * sc)
        else:
            res = _fl(_fl(prod - _fl(yy * acc)) * sc)
    masked = np.zeros(go.shape, dtype=bool)
    if mask is not None:
        masked |= np.broadcast_to(np.asarray(mask) != 0, go.shape)
    if fix_triu_mask:
        s1 = go.shape[-2] if go.ndim >= 2 else 1
        tri = np.triu(np.ones((s1, s2), dtype=bool), k=1)
        masked |= tri if go.ndim >= 2 else tri[0]  # a 1-D row is row i = 0 of its causal mask
    res[masked] = 0.0
    out[...] = res.astype(np.float32).astype(out.dtype)
    return out
