"""Shared helpers for the fused linear cross-entropy tests (an independent float64 oracle)."""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [BF16, F16, F32]
ULP = {BF16: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -24}   # unit roundoff of each dtype


def make_problem(rng, BT, H, V, dtype, scale=1.0, owned_frac=1.0):
    x = (rng.standard_normal((BT, H)) * scale).astype(np.float32).astype(dtype)
    w = (rng.standard_normal((V, H)) * (1.0 / max(H, 1)) ** 0.5).astype(np.float32).astype(dtype)
    t = rng.integers(0, V, BT).astype(np.int64)
    masked = rng.random(BT) > owned_frac
    grad = rng.uniform(0.1, 1.0, BT).astype(np.float32)
    return x, w, t, masked, grad


def stats64(x, w):
    """Exact (float64) logits_max / sum_exp of x @ w.T, returned as fp32."""
    L = x.astype(np.float64) @ w.astype(np.float64).T
    m = L.max(axis=1)
    s = np.exp(L - m[:, None]).sum(axis=1)
    return m.astype(np.float32), s.astype(np.float32)


def pack(masked):
    return np.packbits(masked, bitorder="little")


def assert_close_dtype(got, ref64, dtype, ulps=2.0, abs_frac=2e-3, what="", K=4096):
    """|got - ref| <= ulps·u·|ref| + a·max|ref|: a few roundings of the dtype, plus the absolute
    error that rounding the intermediate g leaves in a dot product (a = abs_frac scaled from
    bf16 to the dtype's unit roundoff; for fp32, the fp32 accumulation error of K terms)."""
    got = np.asarray(got).astype(np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    assert got.shape == ref64.shape, (got.shape, ref64.shape)
    if got.size == 0:
        return
    scale = np.max(np.abs(ref64)) or 1.0
    a = max(abs_frac * ULP[np.dtype(dtype)] / ULP[BF16], 2.0 ** -22 * np.sqrt(K))
    tol = ulps * ULP[np.dtype(dtype)] * np.abs(ref64) + a * scale
    err = np.abs(got - ref64)
    bad = err > tol
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off; max err {err.max():.3g}, "
                           f"max|ref| {scale:.3g}")
