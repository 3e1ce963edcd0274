"""The fp32 kernel (fastgrad/kernels/_bf16dot.py, kind "f32") that runs the GEMMs of the
NumPy-level fused linear ops on fp16 operands, against float64 oracles and the BLAS path.

Every test runs once per native ISA this machine has (``common.native_isas``: the AVX-512F
variant and the AVX2 + FMA one); the kernel needs AVX2 + FMA at least.
"""

import numpy as np
import pytest
from common import kspec, native_isa  # noqa: F401  (the fixture)

import fastgrad as fg
from fastgrad.kernels import _bf16dot as B
from fastgrad.kernels import _native

F16 = np.float16
needs_kernel = pytest.mark.skipif(not B.available("f32"), reason="the CPU has neither AVX2 + FMA nor AVX-512F")

#: every test of this module once per native ISA of this machine (the fixture's params)
pytestmark = pytest.mark.usefixtures("native_isa")


def _b(Bm: np.ndarray) -> np.ndarray:
    """``Bm`` [K, N] as the kernel's B: rows padded to 64 columns with garbage past N (never
    read into a kept output)."""
    k, n = Bm.shape
    bp = np.full((k, B.npad(n)), np.nan, np.float32)
    bp[:, :n] = Bm
    return bp


def _f16_valued(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F16).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize(
    "M,K,N", [(1, 1, 1), (7, 5, 3), (6, 2, 64), (13, 131, 70), (517, 263, 1031), (3, 600, 65), (12, 257, 128)]
)
@pytest.mark.parametrize("transposed", [False, True])
def test_matches_float64(M, K, N, transposed):
    """``A`` along its rows or as the transpose of a C-contiguous array (``gᵀ`` of the grad),
    fresh or summed onto ``out``: products of fp16 values exact, K fp32 additions."""
    rng = np.random.default_rng(M + 7 * K + 13 * N + transposed)
    A = _f16_valued(rng, (M, K), 3.0)
    Bm = _f16_valued(rng, (K, N))
    a_op = np.ascontiguousarray(A.T).T if transposed else A
    a64, b64 = A.astype(np.float64), Bm.astype(np.float64)
    fresh = np.full((M, N), np.nan, np.float32)
    B.matmul(a_op, _b(Bm), N, fresh, spec=kspec("f32"))
    den = np.abs(a64) @ np.abs(b64)
    assert np.all(np.abs(fresh - a64 @ b64) <= K * 2.0**-24 * den + 1e-30)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    got = C0.copy()
    B.matmul(a_op, _b(Bm), N, got, acc=True, spec=kspec("f32"))
    assert np.all(np.abs(got - (C0 + a64 @ b64)) <= (K + 1) * 2.0**-24 * (np.abs(C0) + den) + 1e-30)
    # and as close to float64 as sgemm, within its factor
    sg = A @ Bm
    assert np.abs(fresh - a64 @ b64).mean() <= 4 * np.abs(sg - a64 @ b64).mean() + 1e-12


@needs_kernel
def test_strided_operands_and_output():
    """The transposed ``A`` and the strided ``A`` give the same bits; nothing is written outside
    the output's columns."""
    rng = np.random.default_rng(3)
    A = _f16_valued(rng, (40, 130))[::3, :129]
    Bm = _f16_valued(rng, (129, 70))
    outbig = np.zeros((A.shape[0], 100), np.float32)
    out = outbig[:, 10:80]
    B.matmul(A, _b(Bm), 70, out, spec=kspec("f32"))
    ref = A.astype(np.float64) @ Bm
    assert np.all(np.abs(out - ref) <= 129 * 2.0**-24 * (np.abs(A) @ np.abs(Bm)) + 1e-30)
    assert np.all(outbig[:, :10] == 0) and np.all(outbig[:, 80:] == 0)
    out_t = np.empty((A.shape[0], 70), np.float32)
    B.matmul(np.ascontiguousarray(A.T).T, _b(Bm), 70, out_t, spec=kspec("f32"))
    assert np.array_equal(out_t.view(np.uint32), np.ascontiguousarray(out).view(np.uint32))


@needs_kernel
def test_bitwise_independent_of_tiling_k_blocking_and_threads(monkeypatch):
    from common import assert_gemm_kernel_invariant

    rng = np.random.default_rng(5)
    A = _f16_valued(rng, (700, 1001))
    bp = _b(_f16_valued(rng, (1001, 1100)))

    def run():
        out = np.empty((700, 1100), np.float32)
        B.matmul(A, bp, 1100, out, spec=kspec("f32"))
        return out

    full = assert_gemm_kernel_invariant(run, A, bp)
    # passes over k store and reload the fp32 sums: the same additions in the same order
    for kc in (10**6, 7):
        monkeypatch.setattr(B, "_KC", kc)
        other = np.empty_like(full)
        B.matmul(A, bp, 1100, other, spec=kspec("f32"))
        assert np.array_equal(full.view(np.uint32), other.view(np.uint32))


@needs_kernel
def test_special_values_and_fp16_subnormals():
    """Inf and NaN propagate as in sgemm; fp16 subnormals (2⁻²⁴) and their products (2⁻⁴⁸, a
    normal fp32) are exact: no flush, unlike the bf16 instruction."""
    A = np.array([[np.inf, 1.0], [np.nan, 0.0], [2.0**-24, 2.0**-24], [65504.0, -65504.0]], np.float32)
    Bm = np.array([[1.0, 0.0, 2.0**-24], [0.0, 1.0, 2.0**-24]], np.float32)
    got = np.empty((4, 3), np.float32)
    B.matmul(A, _b(Bm), 3, got, spec=kspec("f32"))
    with np.errstate(invalid="ignore"):
        ref = A @ Bm
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(got[ok], ref[ok])
    assert got[2, 2] == 2.0**-47


def test_unavailable_without_avx2_and_fma():
    flags = frozenset({"avx2", "fma"})
    assert _native.compiled(_native.SPECS["avx512_f32"], flags=flags) is None
    assert _native.runnable(_native.SPECS["avx2_f32"], flags)
    assert not any(_native.runnable(_native.SPECS[n], frozenset({"sse4_2", "avx"})) for n in _native.PREFERENCE["f32"])


def _problem(rng, BT, H, V):
    x = rng.standard_normal((BT, H)).astype(F16)
    w = (rng.standard_normal((V, H)) / max(H, 1) ** 0.5 * 2).astype(F16)
    t = rng.integers(0, V, BT)
    masked = rng.random(BT) < 0.2
    grad = rng.uniform(0.1, 1.0, BT).astype(np.float32)
    return x, w, t, masked, grad


def _flce(x, w, t, masked, grad, m, s, **kw):
    return fg.fused_linear_cross_entropy_loss_grad(
        grad, x, w, np.packbits(masked, bitorder="little"), t, logits_max=m, sum_exp_logits=s, **kw
    )


@needs_kernel
@pytest.mark.parametrize(
    "BT,H,V,budget", [(37, 33, 1031, 60_000), (260, 64, 3000, None), (1, 1, 1, None), (13, 130, 517, 40_000)]
)
def test_flce_grad_fp16_on_the_kernel_matches_float64_and_blas(monkeypatch, BT, H, V, budget):
    """The NumPy-level FLCE grad of fp16 operands runs its three GEMMs on the kernel (on "auto";
    H not a multiple of 64: padded operands), within the contract's bound of float64 (the
    oracle in tests/naive.py), equal to the BLAS path but for last-bit flips, bitwise the same
    at any thread count."""
    from common import flce_grad_on_and_off_kernel

    rng = np.random.default_rng(BT + H + V)
    x, w, t, masked, grad = _problem(rng, BT, H, V)
    got, ref = flce_grad_on_and_off_kernel(monkeypatch, x, w, t, masked, grad, budget)
    for a, c in zip(got, ref):
        a64, c64 = a.astype(np.float64), c.astype(np.float64)
        assert np.all(np.abs(a64 - c64) <= 2.0**-10 * np.abs(c64) + 2.0**-10 * np.abs(c64).max())


@needs_kernel
def test_flce_grad_fp16_label_smoothing_and_filtering():
    """Label smoothing through the kernel path against the oracle; the filtered grad (kept
    blocks on BLAS over the padded operands' views) within its bound of the unfiltered one."""
    from flce_helpers import stats64
    from naive import check_fused_linear_cross_entropy_loss_grad

    rng = np.random.default_rng(17)
    x, w, t, masked, grad = _problem(rng, 40, 70, 5000)
    x = (x.astype(np.float32) * 0.05).astype(F16)  # near-uniform p ≈ 1/V < eps: blocks negligible
    m, s = stats64(x, w)
    got = _flce(x, w, t, masked, grad, m, s, label_smoothing=0.1)
    check_fused_linear_cross_entropy_loss_grad(
        got, grad, x, w, np.packbits(masked, bitorder="little"), t, label_smoothing=0.1, logits_max=m, sum_exp_logits=s
    )
    dense = _flce(x, w, t, masked, grad, m, s)
    *filt, plan = _flce(x, w, t, masked, grad, m, s, filter_eps=1e-3, return_plan=True)
    assert 0 < plan.blocks_skipped < plan.blocks_total
    # each skipped |g| < eps·grad, at most V of them per grad_input element (times |w|) and BT
    # per grad_weight element (times |x|), plus the fp16 rounding of the result
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    tol_i = 1e-3 * grad.max() * np.abs(w64).sum(0)[None, :] + 2.0**-10 * np.abs(dense[0].astype(np.float64))
    tol_w = 1e-3 * grad.max() * np.abs(x64).sum(0)[None, :] + 2.0**-10 * np.abs(dense[1].astype(np.float64))
    assert np.all(np.abs(filt[0].astype(np.float64) - dense[0]) <= tol_i + 1e-7)
    assert np.all(np.abs(filt[1].astype(np.float64) - dense[1]) <= tol_w + 1e-7)


@needs_kernel
@pytest.mark.parametrize("BT,H,V", [(37, 33, 1031), (5, 64, 200), (1, 1, 1)])
def test_online_max_sum_fp16_on_the_kernel(monkeypatch, BT, H, V):
    from common import count_kernel_calls
    from naive import check_fused_linear_online_max_sum

    rng = np.random.default_rng(BT * H + V)
    x, w, t, _, _ = _problem(rng, BT, H, V)
    calls = count_kernel_calls(monkeypatch)
    got = fg.fused_linear_online_max_sum(x, w, t, 0, V, True)
    assert calls, "the fp32 kernel did not run"
    check_fused_linear_online_max_sum(got, x, w, t, 0, V, return_logits=True)
    with fg.num_threads(1):
        one = fg.fused_linear_online_max_sum(x, w, t, 0, V, True)
    for a, b in zip(got, one):
        assert np.array_equal(np.asarray(a), np.asarray(b))
