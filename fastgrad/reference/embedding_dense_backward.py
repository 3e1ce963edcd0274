"""float64 golden of ``embedding_dense_backward`` (obvious, slow, independent of the kernel).

Sums the grad rows of each index in float64 (``np.add.at``), multiplies by the device's fp32
reciprocal of the occurrence count (``fp32(1.0f / count)``, ``embedding_dense_grad_v2_scale.h:100-104``)
when ``scale_grad_by_freq``, zeroes the ``padding_idx`` row and rounds once to ``result_dtype``
(the device's result dtype, grad's by default), then casts to ``out``'s dtype.
Float indices are truncated toward zero, as the device's Cast to an integer type.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

OP = "embedding_dense_backward"


def embedding_dense_backward(
    *,
    grad: np.ndarray,
    indices: np.ndarray,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
    out: np.ndarray,
    result_dtype: npt.DTypeLike | None = None,
    deterministic_cores: int = 0,
) -> np.ndarray:
    # deterministic_cores: the device's summation order; the float64 golden has none (exact sums)
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
            rc = (np.float32(1.0) / counts[seen].astype(np.float32)).astype(np.float64)
            acc[seen] *= rc[:, None]
    if 0 <= padding_idx < nw:
        acc[padding_idx] = 0.0
    rdt = out.dtype if result_dtype is None else np.dtype(result_dtype)
    out[...] = acc.astype(rdt).astype(out.dtype)
    return out
