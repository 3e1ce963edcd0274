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


def assert_close_dtype(got, ref64, dtype, ulps=2.0, what="", K=4096, mag=None, abs_u=0.25):
    """|got - ref| <= ulps·u·|ref| + (absolute term), u the dtype's unit roundoff.

    Relative term: ulps = 2 covers the output's own RNE rounding (<= u·|ref|) plus that of a
    reference which is itself a rounded output (the reference backend): one ulp in all.

    Absolute term, the two error sources the fused grad has beyond the final rounding:
    * the rounding of g to the input dtype before the GEMMs: each term of
      grad_input[r, h] = Σ_v g[r, v]·w[v, h] is off by a factor (1 + δ), |δ| <= u (RNE), so
      |Δ| <= u·Σ_v |g[r, v]|·|w[v, h]|  (0 for fp32 input: g is not rounded there);
    * the fp32 accumulation of K terms: |Δ| <= K·u32·Σ|g|·|w| (Higham's γ_K bound).
    With ``mag`` = Σ|g|·|w| (the absolute-value product, same shape as ``ref64``) this bound is
    applied as is: rigorous.  Without it only ``max|ref|`` is known; the δ are independent and
    of mean 0, so both sums grow like √V (resp. √K) times a typical term (Higham's probabilistic
    bound), and for the softmax gradient (one dominant target term per row) that is a fraction
    of max|ref|: ``abs_u``·u·max|ref| for 16-bit dtypes and ``abs_u``·2·√K·u32·max|ref| for fp32.
    Measured over tests/test_fused_linear_cross_entropy_loss_grad.py the largest error needs
    0.11·u (bf16), 0.08·u (fp16) and 9.2·u32 (fp32, √K·u32·0.5 = 32·u32 at K = 4096): the
    default abs_u = 0.25 leaves a 2-3.5x margin (it was 0.51·u and 256·u32 before)."""
    got = np.asarray(got).astype(np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    assert got.shape == ref64.shape, (got.shape, ref64.shape)
    if got.size == 0:
        return
    dt = np.dtype(dtype)
    u, u32 = ULP[dt], ULP[F32]
    if mag is not None:
        g_round = 0.0 if dt == F32 else u
        tol = ulps * u * np.abs(ref64) + (g_round + (K + 2) * u32) * np.asarray(mag, np.float64)
    else:
        scale = np.max(np.abs(ref64)) or 1.0
        a = abs_u * (2.0 * np.sqrt(K) * u32 if dt == F32 else u)
        tol = ulps * u * np.abs(ref64) + a * scale
    err = np.abs(got - ref64)
    bad = ~(err <= tol)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off; max err {err.max():.3g}, "
                           f"max tol {np.max(tol):.3g}")
