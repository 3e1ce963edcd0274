"""The native GEMMs' tasks fill a wide pool (``kernels/_gemm.pool_grid``, ``_bf16dot._pool_tiles``).

A GEMM whose shape gives fewer tiles than the pool has threads (``grad_input``'s 683 × 896 block
at the Qwen2.5 head: 4 tiles for 16 threads) is cut finer, columns first; the bits do not depend on
the cut (each output one fixed sequence of additions), so every result here is compared bitwise
with the one-thread result and against a float64 oracle.  A pool of 16 is a pool of 16 Python
threads on any machine (``pool_threads`` patched): the grid and the results are what a 16-core
CPU computes."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
import torch
from common import kform, kspec, native_isa  # noqa: F401  (the fixture)

import fastgrad as fg
import fastgrad.torch  # noqa: F401  (fg.torch)
from fastgrad.kernels import _bf16dot as B
from fastgrad.kernels import _gemm

BF = ml_dtypes.bfloat16
needs_kernel = pytest.mark.skipif(not B.available(), reason="the CPU has neither AVX2 + FMA nor AVX-512")


def _width(monkeypatch, T: int) -> None:
    monkeypatch.setattr(_gemm, "pool_threads", lambda: T)


def _balance(n: int, T: int) -> float:
    return n / (T * -(-n // T))


def test_pool_grid_rule(monkeypatch):
    """The shapes' grid unless it leaves the pool idle; else the first count (fewest row parts,
    then fewest column parts) that keeps ≥ POOL_BALANCE busy, or the best balance in bounds."""
    for T in range(1, 34):
        _width(monkeypatch, T)
        for rows, cols, r_max, c_max in itertools.product(range(1, 5), range(1, 4), range(0, 12), range(0, 16)):
            r, c = _gemm.pool_grid(rows, cols, r_max, c_max)
            assert rows <= r <= max(rows, r_max) and cols <= c <= max(cols, c_max)
            if T == 1 or _balance(rows * cols, T) >= _gemm.POOL_BALANCE:
                assert (r, c) == (rows, cols)
                continue
            cands = list(itertools.product(range(rows, max(rows, r_max) + 1), range(cols, max(cols, c_max) + 1)))
            good = [rc for rc in cands if _balance(rc[0] * rc[1], T) >= _gemm.POOL_BALANCE]
            if good:
                assert (r, c) == good[0], (T, rows, cols, r_max, c_max)
            else:
                assert _balance(r * c, T) == max(_balance(a * b, T) for a, b in cands)


def test_the_qwen_grad_input_block_fills_sixteen_threads(monkeypatch):
    """683 × 896 (4 tiles): 16 tasks on 16 threads, columns cut first; one or two threads keep
    the 4 tiles; every row and column covered once."""
    for T, want in ((1, (2, 2)), (2, (2, 2)), (4, (2, 2)), (8, (2, 4)), (16, (2, 8))):
        _width(monkeypatch, T)
        rows, cols = B._pool_tiles(683, 896, 512, True)
        assert (len(rows), len(cols)) == want
        for spans, n in ((rows, 683), (cols, 896)):
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:]))
        assert all(c0 % 64 == 0 for c0, _ in cols)
    _width(monkeypatch, 16)
    rows, cols = B._pool_tiles(683, 896, 512, False)  # tasks that take whole rows: rows only
    assert (len(rows), len(cols)) == (8, 2)


def _bf16_valued(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF).astype(np.float32)


@needs_kernel
@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("M,K,N", [(683, 300, 896), (100, 64, 96), (300, 40, 130), (1, 9, 1100)])
def test_native_gemms_bitwise_on_a_wide_pool(monkeypatch, M, K, N):
    rng = np.random.default_rng(M + K + N)
    A = _bf16_valued(rng, (M, K), 3.0)
    Bm = rng.standard_normal((K, N)).astype(BF)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    bp = B.interleave(Bm)
    a64, b64 = A.astype(np.float64), Bm.astype(np.float64)
    ref, den = C0 + a64 @ b64, np.abs(C0) + np.abs(a64) @ np.abs(b64)
    spec, form = kspec("bf16"), kform()

    def products():
        got = []
        for acc in (False, True):
            o = C0.copy() if acc else np.full((M, N), np.nan, np.float32)
            B.matmul(B.pairs_of_f32(A), bp, N, o, acc=acc, spec=spec)
            t = C0.copy() if acc else np.full((M, N), np.nan, np.float32)
            B.matmul_tn(np.ascontiguousarray(A.T), bp, N, t, acc=acc, form=form, spec=spec)
            got += [o, t]
        if form == "f32":  # the FMA variants' fp32 A down its columns: rows copied per task
            f = np.full((M, N), np.nan, np.float32)
            B.matmul(np.ascontiguousarray(A.T).T, bp, N, f, spec=spec)
            got.append(f)
        return got

    _width(monkeypatch, 1)
    one = products()
    for T in (3, 16):
        _width(monkeypatch, T)
        wide = products()
        for a, b in zip(one, wide):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), T
    for i, g in enumerate(one):
        r, d = (ref, den) if i in (2, 3) else (a64 @ b64, np.abs(a64) @ np.abs(b64))
        assert np.all(np.abs(g - r) <= (K + 1) * 2.0**-24 * d + 1e-30)


@needs_kernel
@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("precision", ["fast", "accurate"])
def test_the_training_loss_and_flce_grad_bitwise_on_a_wide_pool(monkeypatch, precision):
    """The train step (forward + backward) and the FLCE grad: a 16-thread pool's grid gives the
    one-thread bits; the loss against float64."""
    g = torch.Generator().manual_seed(1)
    BT, H, V = 683, 200, 3000
    h = torch.randn(BT, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), generator=g)

    xb, wb, tn = h.view(torch.int16).numpy().view(BF), w.view(torch.int16).numpy().view(BF), t.numpy()

    def step():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = fg.torch.linear_cross_entropy(hh, ww, t, precision=precision)
        loss.backward()
        m, e = (np.asarray(a, np.float32) for a in fg.fused_linear_online_max_sum(xb, wb, tn, 0, V)[:2])
        gl, mask = np.full(BT, 1.0 / BT, np.float32), np.zeros((BT + 7) // 8, np.uint8)
        gi, gw = fg.fused_linear_cross_entropy_loss_grad(gl, xb, wb, mask, tn, logits_max=m, sum_exp_logits=e)
        out = [loss.detach().float().numpy().reshape(1), m, e]
        return out + [a.float().numpy() for a in (hh.grad, ww.grad)] + [np.asarray(a, np.float32) for a in (gi, gw)]

    _width(monkeypatch, 1)
    one = step()
    _width(monkeypatch, 16)
    wide = step()
    for a, b in zip(one, wide):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    ref = torch.nn.functional.cross_entropy(h.double() @ w.double().T, t).item()
    assert abs(float(one[0][0]) - ref) <= 1e-6 * abs(ref)
