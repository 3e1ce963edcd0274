"""Gradient filtering's kept blocks on the exact-product bf16 kernel, read in place
(``lm_head/epilogues/flce_grad._filtered_products_b16``): the same bits as the gathered form it
replaced — the kept columns of ``g`` and rows of ``W`` copied out per row block, ``gᵀ·X`` summed
per row block and added onto ``grad_weight``'s rows, ``g·W`` summed onto ``grad_input`` — and
within fp32 rounding of a float64 oracle of the kept blocks' products.

The claim rests on the kernel summing each output over ``k`` in order (``kernels/_native.py``):
a run of adjacent kept blocks is a slice of the same sum.  Keep masks with no kept block, all
kept, single blocks, a partial last block (odd ``nv``), an odd last row block, ``H`` off the
64-column granule; every bf16 variant this machine runs (``vdpbf16ps`` pairs and the AVX2
fp32-A form)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fastgrad.kernels import _bf16dot
from fastgrad.lm_head.epilogues.flce_grad import _filtered_products_b16

BF = ml_dtypes.bfloat16
VARIANTS = [isa for isa in ("avx512", "avx2") if _bf16dot.variant("bf16", isa) is not None]
# (nb, nv, H, rb, fb)
SHAPES = [(16, 256, 64, 8, 64), (37, 333, 70, 8, 64), (64, 1000, 130, 16, 64), (10, 129, 1, 4, 64)]
MASKS = ["random", "none", "all", "single", "last"]


def _keep(kind: str, nrb: int, nkb: int, rng) -> np.ndarray:
    if kind == "random":
        k = rng.random((nrb, nkb)) < 0.35
    elif kind == "none":
        k = np.zeros((nrb, nkb), bool)
    elif kind == "all":
        k = np.ones((nrb, nkb), bool)
    elif kind == "single":
        k = np.zeros((nrb, nkb), bool)
        k[np.arange(nrb), rng.integers(0, nkb, nrb)] = True
    else:  # the partial last block kept in every row block
        k = rng.random((nrb, nkb)) < 0.2
        k[:, -1] = True
    return k


def _gathered(G, keep, fb, rb, gi, gw, X, W, form, spec):
    """The gathered form (the implementation this replaced): per row block its kept columns of G
    and rows of W copied out, then the two GEMMs of the kernel."""
    nb, nv = G.shape
    H = X.shape[1]
    for k in range(keep.shape[0]):
        kb = np.flatnonzero(keep[k])
        if kb.size == 0:
            continue
        cols = (kb[:, None] * fb + np.arange(fb)[None, :]).reshape(-1)
        cols = cols[cols < nv]
        r0, r1 = k * rb, min(nb, (k + 1) * rb)
        Gc = np.ascontiguousarray(G[r0:r1][:, cols])
        Q = np.zeros((cols.size, H), np.float32)
        _bf16dot.matmul_tn(Gc, _bf16dot.interleave(X[r0:r1]), H, Q, form=form, spec=spec)
        wp = _bf16dot.interleave(np.ascontiguousarray(W[cols]))
        A = Gc if form == "f32" else _bf16dot.pairs_of_f32(Gc)
        _bf16dot.matmul(A, wp, H, gi[r0:r1], acc=True, spec=spec)
        gw[cols] += Q


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", MASKS)
def test_in_place_equals_gathered(isa, shape, mask):
    nb, nv, H, rb, fb = shape
    rng = np.random.default_rng(nb * 7 + nv + H)
    spec = _bf16dot.variant("bf16", isa)
    form = _bf16dot.a_form("bf16", isa)
    X = rng.standard_normal((nb, H)).astype(BF)
    W = (rng.standard_normal((nv, H)) / 8).astype(BF)
    G = (rng.standard_normal((nb, nv)) * 1e-2).astype(BF).astype(np.float32)
    keep = _keep(mask, -(-nb // rb), -(-nv // fb), rng)
    gi0 = rng.standard_normal((nb, H)).astype(np.float32)
    gw0 = rng.standard_normal((nv, H)).astype(np.float32)
    gi_ref, gw_ref = gi0.copy(), gw0.copy()
    _gathered(G.copy(), keep, fb, rb, gi_ref, gw_ref, X, W, form, spec)

    gi, gw = gi0.copy(), gw0.copy()
    G1 = G.copy()  # consumed (paired in place)
    xi = _bf16dot.interleave(X)
    wi = _bf16dot.interleave(W)
    _filtered_products_b16(G1, keep, fb, rb, gi, gw, xi, wi, form, spec)
    np.testing.assert_array_equal(gi.view(np.uint32), gi_ref.view(np.uint32))
    np.testing.assert_array_equal(gw.view(np.uint32), gw_ref.view(np.uint32))

    # float64 oracle of the kept blocks' products (the mask expanded to elements)
    m = np.repeat(np.repeat(keep, rb, 0)[:nb], fb, 1)[:, :nv]
    g64 = np.where(m, G, 0).astype(np.float64)
    x64, w64 = X.astype(np.float64), W.astype(np.float64)
    want_gi = gi0 + g64 @ w64
    want_gw = gw0 + g64.T @ x64
    scale_i = 1 + np.abs(g64) @ np.abs(w64)
    scale_w = 1 + np.abs(g64).T @ np.abs(x64)
    assert np.all(np.abs(gi - want_gi) <= 1e-5 * scale_i)
    assert np.all(np.abs(gw - want_gw) <= 1e-5 * scale_w)
