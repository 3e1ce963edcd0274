"""float64 golden of ``embedding_dense_backward`` (obvious, slow, independent of the kernel).

Sums the grad rows of each index in float64 (``np.add.at``), divides by the occurrence count
when ``scale_grad_by_freq``, zeroes the ``padding_idx`` row and rounds once to grad's dtype.
Float indices are truncated toward zero, as the device's Cast to an integer type.
"""

from __future__ import annotations

import numpy as np

OP = "embedding_dense_backward"


def embedding_dense_backward(*, grad, indices, num_weights, padding_idx, scale_grad_by_freq, out):
    nw, d = out.shape
    acc = np.zeros((nw, d), np.float64)
    idx = np.asarray(indices).reshape(-1)
    if idx.dtype.kind in "iub":
        idx = idx.astype(np.int64)
    else:  # float16/32/64, bfloat16
        idx = np.trunc(idx.astype(np.float64)).astype(np.int64)
    if grad.size and d:
        g = np.asarray(grad, dtype=np.float64).reshape(idx.size, d)
        np.add.at(acc, idx, g)
        if scale_grad_by_freq:
            counts = np.bincount(idx, minlength=nw).astype(np.float64)
            seen = counts > 0
            acc[seen] /= counts[seen][:, None]
    if 0 <= padding_idx < nw:
        acc[padding_idx] = 0.0
    out[...] = acc.astype(out.dtype)
    return out
