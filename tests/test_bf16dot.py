"""The exact-product bf16 logits kernel (fastgrad/kernels/_bf16dot.py) against float64 oracles.

Every test runs once per native ISA this machine has (``common.native_isas``: the AVX-512 BF16
variant and the AVX2 + FMA one, forced with ``fastgrad._config.set_native_isa``); the kernel
needs AVX2 + FMA at least, so nothing here skips on an x86-64 CPU since Haswell / Zen 1."""

import ml_dtypes
import numpy as np
import pytest
import torch
from common import kform, kspec, native_isa  # noqa: F401  (the fixture)

import fastgrad as fg
import fastgrad.torch  # noqa: F401  (fg.torch)
from fastgrad.errors import InternalError
from fastgrad.kernels import _bf16dot as B
from fastgrad.kernels import _native

BF = ml_dtypes.bfloat16
needs_kernel = pytest.mark.skipif(not B.available(), reason="the CPU has neither AVX2 + FMA nor AVX-512")

#: every test of this module once per native ISA of this machine (the fixture's params)
pytestmark = pytest.mark.usefixtures("native_isa")


def _run(X, W):
    out = np.full((X.shape[0], W.shape[0]), np.nan, np.float32)
    B.matmul_nt(B.pairs(X), B.pack(B.pairs(W)), W.shape[0], out, spec=kspec("bf16"))
    return out


def _oracle(X, W):
    x, w = X.astype(np.float64), W.astype(np.float64)
    return x @ w.T, np.abs(x) @ np.abs(w).T


@needs_kernel
@pytest.mark.parametrize(
    "M,N,H",
    [(1, 1, 1), (1, 64, 2), (5, 63, 3), (6, 64, 2), (7, 65, 7), (13, 200, 896), (517, 1031, 895), (64, 2048, 64)],
)
def test_matches_float64(M, N, H):
    rng = np.random.default_rng(M * 1000 + N + H)
    X = (rng.standard_normal((M, H)) * 3).astype(BF)
    W = rng.standard_normal((N, H)).astype(BF)
    got = _run(X, W)
    ref, den = _oracle(X, W)
    # products exact, H fp32 additions: |error| <= H·2⁻²⁴·Σ|x||w| (the fp32 GEMM's own bound)
    assert np.all(np.abs(got - ref) <= H * 2.0**-24 * den + 1e-30)
    # and as close to float64 as sgemm on the widened operands, within its factor
    sg = X.astype(np.float32) @ W.astype(np.float32).T
    assert np.abs(got - ref).mean() <= 4 * np.abs(sg - ref).mean() + 1e-12


@needs_kernel
def test_non_contiguous_rows_and_strided_output():
    rng = np.random.default_rng(3)
    Xbig = rng.standard_normal((40, 130)).astype(BF)
    X = Xbig[::3, :129]  # non-contiguous, odd H: a padded copy
    W = rng.standard_normal((70, 129)).astype(BF)
    outbig = np.zeros((X.shape[0], 100), np.float32)
    out = outbig[:, 10:80]
    B.matmul_nt(B.pairs(X), B.pack(B.pairs(W)), 70, out, spec=kspec("bf16"))
    ref, den = _oracle(X, W)
    assert np.all(np.abs(out - ref) <= 129 * 2.0**-24 * den + 1e-30)
    assert np.all(outbig[:, :10] == 0) and np.all(outbig[:, 80:] == 0)  # nothing written outside


@needs_kernel
def test_bitwise_independent_of_tiling_and_threads():
    from common import assert_gemm_kernel_invariant

    rng = np.random.default_rng(5)
    X = rng.standard_normal((700, 96)).astype(BF)
    W = rng.standard_normal((1100, 96)).astype(BF)
    assert_gemm_kernel_invariant(lambda: _run(X, W), B.pairs(X), B.pack(B.pairs(W)))


@needs_kernel
def test_special_values_and_the_documented_flush():
    X = np.array([[np.inf, 1.0], [np.nan, 0.0], [1e-39, 1.0], [2.0**-70, 0.0]], BF)
    W = np.array([[1.0, 0.0], [2.0**-70, 1.0], [-1.0, 0.0]], BF)
    got = _run(X, W)
    ref = X.astype(np.float32) @ W.astype(np.float32).T
    assert np.array_equal(np.isnan(got[:2]), np.isnan(ref[:2]))
    assert np.array_equal(got[0], ref[0])
    # VDPBF16PS: subnormal inputs read as zero, subnormal results flushed to zero (the FMA
    # variants too: MXCSR DAZ + FTZ for the call)
    assert got[2, 0] == 0 and ref[2, 0] != 0
    assert got[3, 1] == 0 and ref[3, 1] != 0
    assert got[3, 0] == ref[3, 0]


def test_variants_need_their_cpu_flags():
    """A variant is built only where the CPU has its instructions; the bf16 operands fall back
    from vdpbf16ps to AVX-512F FMAs to AVX2 + FMA, and without AVX2 + FMA nothing runs."""
    S = _native.SPECS
    assert _native.compiled(S["avx512_bf16dp"], flags=frozenset({"avx512f", "fma", "avx2"})) is None
    assert not _native.runnable(S["avx512_bf16dp"], frozenset({"avx512f"}))
    assert _native.runnable(S["avx512_bf16"], frozenset({"avx512f"}))
    assert _native.runnable(S["avx2_bf16"], frozenset({"avx2", "fma"}))
    assert not _native.runnable(S["avx2_bf16"], frozenset({"avx2"}))  # no FMA
    assert _native.compiled(S["avx512_f32"], flags=frozenset({"avx2", "fma"})) is None
    assert _native.compiled(S["avx2_f32"], flags=frozenset({"sse2"})) is None


def test_the_training_loss_uses_it_only_on_auto(monkeypatch):
    calls = []
    real = B.matmul_nt
    monkeypatch.setattr(B, "matmul_nt", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 66, generator=g).bfloat16()
    w = (torch.randn(301, 66, generator=g) * 0.2).bfloat16()
    t = torch.randint(0, 301, (37,), generator=g)
    res = {}
    for eng in ("auto", "blas"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        calls.clear()
        with fg.gemm(eng):
            loss = fg.torch.linear_cross_entropy(hh, ww, t)
            loss.backward()
        res[eng] = (loss.item(), hh.grad.float(), ww.grad.float(), len(calls))
    assert res["blas"][3] == 0
    assert (res["auto"][3] > 0) == B.available()
    assert abs(res["auto"][0] - res["blas"][0]) <= 1e-5 * abs(res["blas"][0])
    for i in (1, 2):  # bf16 gradients: equal but for a last-bit rounding flip here and there
        d = (res["auto"][i] - res["blas"][i]).abs()
        assert d.max().item() <= 2.0**-7 * res["blas"][i].abs().max().item()


def _bf16_valued_f32(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (7, 5, 3), (6, 2, 64), (13, 131, 70), (517, 263, 1031), (3, 600, 65)])
def test_gradient_operands_and_accumulation_match_float64(M, K, N):
    """The FLCE grad's GEMM forms: ``A`` from fp32 values that are bf16 values, along its rows or
    transposed, ``B`` as consecutive rows interleaved; summed onto ``out``'s values."""
    rng = np.random.default_rng(M + 7 * K + 13 * N)
    A = _bf16_valued_f32(rng, (M, K), 3.0)
    Bm = rng.standard_normal((K, N)).astype(BF)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    bp = B.interleave(Bm)
    a64, b64 = A.astype(np.float64), Bm.astype(np.float64)
    ref = C0 + a64 @ b64
    den = np.abs(C0) + np.abs(a64) @ np.abs(b64)
    got = C0.copy()
    B.matmul(B.pairs_of_f32(A), bp, N, got, acc=True, spec=kspec("bf16"))
    # K products exact, K fp32 additions onto C: |error| <= (K+1)·2⁻²⁴·(|C| + Σ|a||b|)
    assert np.all(np.abs(got - ref) <= (K + 1) * 2.0**-24 * den + 1e-30)
    # the transposed pairs of Aᵀ are the same operand, bitwise the same result
    got_t = C0.copy()
    B.matmul(B.pairs_of_f32(np.ascontiguousarray(A.T), transpose=True), bp, N, got_t, acc=True, spec=kspec("bf16"))
    assert np.array_equal(got.view(np.uint32), got_t.view(np.uint32))
    # Aᵀ paired per task by matmul_tn; A paired in place over itself
    got_tn = C0.copy()
    B.matmul_tn(np.ascontiguousarray(A.T), bp, N, got_tn, acc=True, form=kform(), spec=kspec("bf16"))
    assert np.array_equal(got.view(np.uint32), got_tn.view(np.uint32))
    got_ip = C0.copy()
    B.matmul(B.pairs_in_place(A.copy(), kform()), bp, N, got_ip, acc=True, spec=kspec("bf16"))
    assert np.array_equal(got.view(np.uint32), got_ip.view(np.uint32))
    # without acc the output's old values are ignored
    fresh = np.full((M, N), np.nan, np.float32)
    B.matmul(B.pairs_of_f32(A), bp, N, fresh, spec=kspec("bf16"))
    assert np.all(np.abs(fresh - a64 @ b64) <= K * 2.0**-24 * (np.abs(a64) @ np.abs(b64)) + 1e-30)


@needs_kernel
def test_k_blocking_is_bitwise_one_sum(monkeypatch):
    """Passes over ``k`` store and reload the fp32 sums: the same additions in the same order."""
    rng = np.random.default_rng(11)
    A = _bf16_valued_f32(rng, (50, 1001))
    bp = B.interleave(rng.standard_normal((1001, 130)).astype(BF))
    xp = B.pairs_of_f32(A)
    res = []
    for kc in (10**6, 256, 7):
        monkeypatch.setattr(B, "_KC", kc)
        out = np.empty((50, 130), np.float32)
        B.matmul(xp, bp, 130, out, spec=kspec("bf16"))
        res.append(out)
    for r in res[1:]:
        assert np.array_equal(res[0].view(np.uint32), r.view(np.uint32))


def _flce(x, w, t, masked, grad, m, s):
    return fg.fused_linear_cross_entropy_loss_grad(
        grad, x, w, np.packbits(masked, bitorder="little"), t, logits_max=m, sum_exp_logits=s
    )


@needs_kernel
@pytest.mark.parametrize("BT,H,V,budget", [(37, 33, 1031, 60_000), (260, 64, 3000, None), (1, 1, 1, None)])
def test_flce_grad_on_the_kernel_matches_float64_and_blas(monkeypatch, BT, H, V, budget):
    """The NumPy-level FLCE grad of bf16 operands runs its three GEMMs on the kernel (on "auto"),
    within the contract's bound of float64, equal to the BLAS path but for last-bit flips."""
    from common import flce_grad_on_and_off_kernel

    rng = np.random.default_rng(BT + H + V)
    x = rng.standard_normal((BT, H)).astype(BF)
    w = (rng.standard_normal((V, H)) / max(H, 1) ** 0.5 * 2).astype(BF)
    t = rng.integers(0, V, BT)
    masked = rng.random(BT) < 0.2
    grad = rng.uniform(0.1, 1.0, BT).astype(np.float32)
    got, ref = flce_grad_on_and_off_kernel(monkeypatch, x, w, t, masked, grad, budget)
    for a, c in zip(got, ref):
        a64, c64 = a.astype(np.float64), c.astype(np.float64)
        assert np.all(np.abs(a64 - c64) <= 2.0**-7 * np.abs(c64) + 2.0**-7 * np.abs(c64).max())


@needs_kernel
def test_the_a_operand_takes_the_variants_form(request):
    """``vdpbf16ps`` reads ``A`` as pairs (``g`` paired over itself); the FMA variants read fp32
    ``A`` (``g`` itself, untouched); either way the same sums (the tests above, per ISA)."""
    spec = kspec("bf16")
    g = _bf16_valued_f32(np.random.default_rng(0), (5, 9))
    keep = g.copy()
    p = B.pairs_in_place(g, kform())
    if spec.a_forms[0] == "f32":
        assert kform() == "f32" and p is g and np.array_equal(g, keep)
    else:
        assert kform() == "pairs" and p.dtype == np.uint32 and p.shape == (5, 5)
    if request.node.callspec.params["native_isa"] == "avx2":
        assert spec.name == "avx2_bf16" and spec.a_forms[0] == "f32"
    if "f32" not in spec.a_forms:  # fp32 A on the pairs-only variant: refused, not misread
        with pytest.raises(InternalError, match="takes A"):
            B.gemm_tile(
                keep, B.interleave(keep.astype(BF).T.copy()), 0, 5, np.empty((5, 5), np.float32), spec=kspec("bf16")
            )


@needs_kernel
def test_packed_rows_leave_power_of_two_strides():
    """``pack`` writes rows of ``b_cols(n)`` (64 more where ``npad(n)`` is a multiple of 256:
    rows 1 KiB · 2ʲ apart would share cache sets), zero past ``n``; the GEMM reads the same
    values: bitwise what an unpadded ``B`` gives, within the fp32 bound of float64."""
    assert B.b_cols(8192) == 8256 and B.b_cols(256) == 320 and B.b_cols(896) == 896 and B.b_cols(70) == 128
    assert B.b_size(5, 256) == 3 * 320
    rng = np.random.default_rng(11)
    X = rng.standard_normal((37, 90)).astype(BF)
    W = rng.standard_normal((256, 90)).astype(BF)
    bp = B.pack(B.pairs(W))
    assert bp.shape == (45, 320) and not bp[:, 256:].any()
    xa = X.astype(np.float32) if kform() == "f32" else B.pairs(X)
    got = np.full((37, 256), np.nan, np.float32)
    B.matmul_nt(xa, bp, 256, got, spec=kspec("bf16"))
    flat = np.full_like(got, np.nan)
    B.gemm_tile(xa, np.ascontiguousarray(bp[:, :256]), 0, 256, flat, spec=kspec("bf16"))
    assert np.array_equal(got.view(np.uint32), flat.view(np.uint32))
    ref, den = _oracle(X, W)
    assert np.all(np.abs(got - ref) <= 90 * 2.0**-24 * den + 1e-30)


@needs_kernel
@pytest.mark.parametrize("kind", ["bf16", "f32"])
@pytest.mark.parametrize("layout", ["transposed", "rows_1KiB_apart"])
@pytest.mark.parametrize("ak", [2048, 64, 1])
def test_matmul_copies_an_fp32_a_that_would_alias(monkeypatch, kind, layout, ak):
    """``matmul`` with an fp32 ``A`` read down its columns (``gᵀ`` in place) or with rows
    1 KiB · 2ʲ apart copies each row task into scratch first (the AVX2 variants), in blocks of ``_AK`` values of
    ``k`` (one block, four, one per pair): the same bits as the same GEMM on a contiguous ``A``,
    with and without ``acc``, within fp32's bound of float64."""
    monkeypatch.setattr(B, "_AK", ak)
    if not B.available(kind) or (kind == "bf16" and kform("bf16") != "f32"):
        pytest.skip(f"no {kind} variant taking fp32 A under this ISA setting (vdpbf16ps takes pairs)")
    rng = np.random.default_rng(12)
    M, K, N = 600, 255, 130  # two row tasks; an odd K (bf16: a last pair with a zero)
    dt = BF if kind == "bf16" else np.float16
    src = rng.standard_normal((K, M) if layout == "transposed" else (M, 256)).astype(dt).astype(np.float32)
    A = src.T if layout == "transposed" else src[:, :K]  # rows 1 KiB apart
    assert (A.strides[1] != 4) == (layout == "transposed") and A.shape == (M, K)
    Bm = rng.standard_normal((K, N)).astype(dt)
    if kind == "bf16":
        bp = B.interleave(Bm.view(np.uint16))
    else:
        bp = np.zeros((K, B.npad(N)), np.float32)
        bp[:, :N] = Bm
    Ac = np.empty((M, K + 3), np.float32)[:, :K]  # a copy read in place: unit column stride,
    Ac[...] = A  # rows 1036 bytes apart
    assert Ac.strides == (4 * (K + 3), 4)
    C = rng.standard_normal((M, N)).astype(np.float32)
    for acc in (False, True):
        got, want = C.copy(), C.copy()
        B.matmul(A, bp, N, got, acc=acc, spec=kspec(kind))
        B.matmul(Ac, bp, N, want, acc=acc, spec=kspec(kind))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        a64, b64 = A.astype(np.float64), Bm.astype(np.float64)
        ref = a64 @ b64 + (C if acc else 0)
        den = np.abs(a64) @ np.abs(b64) + (np.abs(C) if acc else 0)
        assert np.all(np.abs(got - ref) <= (K + 1) * 2.0**-24 * den + 1e-30)
