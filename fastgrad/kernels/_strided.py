"""Strided operands for the elementwise kernels (shared by smooth-L1 and embedding)."""

from __future__ import annotations

import numpy as np

from ..dtypes import storage_view


def strided_base(a: np.ndarray, shape: tuple):
    """(1-D read-only base buffer, element offset, element strides) of ``a`` broadcast to ``shape``.

    The buffer starts at the lowest address the broadcast view touches, so negative strides
    work; nothing is copied unless a stride is not a whole number of elements.
    """
    v = np.broadcast_to(a, shape)
    isz = v.itemsize
    if any(s % isz for s in v.strides):
        v = np.broadcast_to(np.ascontiguousarray(a), shape)
    est = [s // isz for s in v.strides]
    corner = v[tuple(slice(n - 1, n) if s < 0 else slice(0, 1) for n, s in zip(shape, est))]
    lo = sum((n - 1) * s for n, s in zip(shape, est) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(shape, est) if s > 0)
    buf = np.lib.stride_tricks.as_strided(corner.reshape(-1)[:1], shape=(hi - lo + 1,), strides=(isz,), writeable=False)
    return storage_view(buf), -lo, est
