"""Every layout the op layer accepts runs on every GEMM variant (issue 47): the LM-head ops over a
grid of awkward shapes (H = 0, 1, odd) and layouts (C order, Fortran order, strided views, an
``[BT, 0]`` view of any strides, strided ``out=`` views) under each engine this machine has — the
native kernel's AVX-512 and AVX2 variants (``use_native_isa``), BLAS and oneDNN.

Each call either computes or refuses with a documented ``AclnnError``; a layout never dies inside
(an internal error).  A computed result equals, bitwise, the same op on C-contiguous copies under
the same setting (the kernels copy what a variant cannot read in place), and the float64 oracle
within fp32 rounding.  Run on an AVX-512 BF16 host, this covers the ``vdpbf16ps`` variant too
(a CI host with AVX2 only runs the AVX2 variants, BLAS and oneDNN)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import fastgrad as fg
from fastgrad import _config
from fastgrad.errors import AclnnError
from fastgrad.kernels import _bf16dot

BF = ml_dtypes.bfloat16


def _engines():
    out = []
    if _bf16dot.variant("bf16", "avx512") is not None:
        out.append(("avx512", "auto"))
    if _bf16dot.variant("bf16", "avx2") is not None:
        out.append(("avx2", "auto"))
    out.append(("auto", "blas"))
    try:
        from fastgrad import _onednn

        if _onednn.usable():
            out.append(("auto", "onednn"))
    except Exception:  # noqa: BLE001 - no torch: no oneDNN engine
        pass
    return out


ENGINES = _engines()
SHAPES = [(1, 1, 5), (3, 0, 6), (5, 3, 70), (9, 33, 130)]
LAYOUTS = ["c", "f", "strided"]


def _layout(a: np.ndarray, how: str) -> np.ndarray:
    """``a``'s values in layout ``how``."""
    if how == "c":
        return np.ascontiguousarray(a)
    if how == "f":
        return np.asfortranarray(a)
    if a.shape[1] == 0:  # an empty row: strides that are no multiple of anything
        return as_strided(np.zeros(16, a.dtype), shape=a.shape, strides=(2, 4))
    big = np.zeros((a.shape[0] * 2, a.shape[1] * 3), a.dtype)
    v = big[::2, ::3]
    v[...] = a
    return v


def _strided_out(shape, dtype):
    big = np.zeros((shape[0] * 2 + 1, shape[1] * 2 + 1), dtype)
    return big[1::2, ::2][: shape[0], : shape[1]]


def _inputs(BT, H, V, dt, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(dt)
    w = (rng.standard_normal((V, H)) * 0.3).astype(dt)
    t = rng.integers(0, V, BT).astype(np.int64)
    return x, w, t


def _run(isa, gemm, fn):
    with _config.use_native_isa(isa), fg.gemm(gemm):
        try:
            return fn()
        except AclnnError as e:  # a documented refusal: fine, but the same for both layouts
            return e


def _bits(res):
    if isinstance(res, AclnnError):
        return ("refused", res.status)
    return [(np.asarray(a).dtype.str, np.asarray(a).tobytes()) for a in res]


@pytest.mark.parametrize("isa,gemm", ENGINES, ids=[f"{i}-{g}" for i, g in ENGINES])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{b}x{h}x{v}" for b, h, v in SHAPES])
def test_layouts_compute_on_every_variant(isa, gemm, dtype, shape):
    dt = BF if dtype == "bfloat16" else np.float16
    BT, H, V = shape
    x, w, t = _inputs(BT, H, V, dt)
    mask = np.zeros((BT + 7) // 8, np.uint8)
    g = np.linspace(0.5, 1.5, BT).astype(np.float32)

    def floms(xx, ww):
        s = fg.fused_linear_online_max_sum(xx, ww, t, 0, V)
        return [np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)]

    want_s = _run(isa, gemm, lambda: floms(x, w))
    assert not isinstance(want_s, AclnnError), want_s
    m, e = want_s

    def flce(xx, ww, out=None):
        return list(fg.fused_linear_cross_entropy_loss_grad(g, xx, ww, mask, t, logits_max=m, sum_exp_logits=e, out=out))

    def train(xx, ww):
        r = fg.linear_cross_entropy(xx, ww, t, return_grad=True)
        return [np.asarray(r.loss, np.float32), r.grad_input, r.grad_weight]

    want_g = _run(isa, gemm, lambda: flce(x, w))
    want_t = _run(isa, gemm, lambda: train(x, w))
    for lx in LAYOUTS:
        for lw in LAYOUTS:
            xx, ww = _layout(x, lx), _layout(w, lw)
            assert _bits(_run(isa, gemm, lambda: floms(xx, ww))) == _bits(want_s), (lx, lw)
            assert _bits(_run(isa, gemm, lambda: flce(xx, ww))) == _bits(want_g), (lx, lw)
            assert _bits(_run(isa, gemm, lambda: train(xx, ww))) == _bits(want_t), (lx, lw)
    # strided out= views (every accepted layout of out)
    gi, gw = _strided_out((BT, H), dt), _strided_out((V, H), dt)
    got = _run(isa, gemm, lambda: flce(x, w, out=(gi, gw)))
    assert _bits(got) == _bits(want_g)
    if not isinstance(got, AclnnError):
        assert np.array_equal(gi.view(np.uint16), np.asarray(want_g[0]).view(np.uint16))
        assert np.array_equal(gw.view(np.uint16), np.asarray(want_g[1]).view(np.uint16))
        # the float64 oracle of the FLCE grad, within bf16/fp16 rounding of the outputs
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        z = x64 @ w64.T
        p = np.exp(z - z.max(1, keepdims=True)) if V else z
        p /= p.sum(1, keepdims=True)
        p[np.arange(BT), t] -= 1
        G = p * g[:, None]
        tol = 2.0**-7 if dtype == "bfloat16" else 2.0**-10
        A = np.abs(G)
        for got_a, ref, den in ((gi, G @ w64, A @ np.abs(w64)), (gw, G.T @ x64, A.T @ np.abs(x64))):
            assert np.all(np.abs(got_a.astype(np.float64) - ref) <= 2 * tol * den + 1e-6)
