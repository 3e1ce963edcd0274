"""float64 golden of ``scaled_masked_softmax_backward`` (the oracle; obvious, slow, clear).

``out = (go·y - Σ_last(go·y)·y)·scale`` in float64, 0 where the (broadcast) mask or the
causal ``j > i`` mask is set, rounded once to ``grad_output``'s dtype.
"""

from __future__ import annotations

import numpy as np

OP = "scaled_masked_softmax_backward"


def scaled_masked_softmax_backward_reference(*, grad_output, y, mask, scale, fix_triu_mask, out):
    go = np.asarray(grad_output).astype(np.float64)
    yy = np.asarray(y).astype(np.float64)
    prod = go * yy
    res = (prod - prod.sum(axis=-1, keepdims=True) * yy) * float(scale)
    masked = np.zeros(go.shape, dtype=bool)
    if mask is not None:
        masked |= np.broadcast_to(np.asarray(mask) != 0, go.shape)
    if fix_triu_mask:
        s1 = go.shape[-2] if go.ndim >= 2 else 1
        s2 = go.shape[-1]
        masked |= np.triu(np.ones((s1, s2), dtype=bool), k=1)
    res[masked] = 0.0
    out[...] = res.astype(out.dtype)
    return out
