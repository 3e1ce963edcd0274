"""``precision="fast"``'s fused pass over a chunk (``lm_head/passes._grad_round_bf16``, taken by
``train_rows._RowStep._grad_round16`` when there is no ``grad_bias``): the gradient pass, the
rounding of ``g`` to bf16 with its error sums and — on the ``vdpbf16ps`` form — both gradient
GEMMs' ``A`` operands (``gᵀ``'s pairs, ``G``'s rows paired in place) in one pass, row group by
row group.  Pinned bitwise against the separate passes (``_grad``, ``_colsum``, ``_round16``,
then ``matmul_tn`` / ``pairs_in_place`` inside the products), which a bias forces: a zero bias
adds exactly 0 to every logit, so the loss and the hidden and weight gradients must be the same
bits.  Odd row counts (a last pair with a zero half), several row blocks and chunks, ``H`` off
the 64-column granule; every native ISA of the machine (the AVX2 variants take the fp32 ``A``
form: the fused pass then makes no pairs).  Likewise the FLCE grad's dense tile in both
modes, whose epilogue makes both ``A`` operands (``flce_grad._epilogue_pairs``,
``_epilogue_hp_pairs``), against the epilogue alone and the products' own pairing."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from common import native_isa, workspace_budget  # noqa: E402, F401

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
from fastgrad.lm_head.epilogues import train_rows as TR  # noqa: E402
from fastgrad.ops._engines import bf16_kernel_available  # noqa: E402

pytestmark = pytest.mark.skipif(not bf16_kernel_available(), reason="no native bf16 kernel on this CPU")

# (BT, H, V, workspace budget or None)
SHAPES = [(37, 64, 700, None), (150, 96, 4500, 2 * 2048 * 4 * 40), (67, 130, 5000, None), (1, 8, 129, None)]


def _run(h, w, t, bias, kw, grads=(True, True)):
    hh = h.detach().clone().requires_grad_(grads[0])
    ww = w.detach().clone().requires_grad_(grads[1])
    b = None if bias is None else bias.detach().clone().requires_grad_()
    loss = ft.linear_cross_entropy(hh, ww, t, precision="fast", bias=b, **kw)
    loss.backward()
    return [v for v in (loss.detach(), hh.grad, ww.grad) if v is not None]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1, "ignore_index": 3}, {"lse_square_scale": 1e-3}])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)], ids=["both", "input", "weight"])
def test_fused_pass_equals_separate_passes(shape, kw, threads, grads, native_isa, monkeypatch):  # noqa: F811
    BT, H, V, budget = shape
    g = torch.Generator().manual_seed(BT * 31 + V)
    h = torch.randn(BT, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H**0.5).bfloat16()
    t = torch.randint(0, V, (BT,), generator=g)
    t[::5] = 3
    fused = []
    real = TR._RowStep._grad_round16
    monkeypatch.setattr(TR._RowStep, "_grad_round16", lambda self, c: (fused.append(c), real(self, c))[1])
    old = fg.get_num_threads()
    fg.set_num_threads(threads)
    try:
        with workspace_budget(budget):
            a = _run(h, w, t, None, kw, grads)
            n_fused = len(fused)
            b = _run(h, w, t, torch.zeros(V).bfloat16(), kw, grads)
    finally:
        fg.set_num_threads(old)
    assert n_fused > 0 and len(fused) == n_fused  # the first call fused, the biased one did not
    assert len(a) == len(b) == 1 + sum(grads)
    for x, y in zip(a, b):
        bits = [np.atleast_1d(v.float().numpy()).view(np.uint32) for v in (x, y)]
        np.testing.assert_array_equal(*bits)


# (BT, H, V, workspace budget or None): one tile, several row tiles (odd last), V off the 64 granule
FLCE_SHAPES = [(37, 70, 1001, None), (517, 130, 9999, 4 << 20), (300, 64, 20001, 2 << 20), (1, 8, 129, None)]


@pytest.mark.parametrize("shape", FLCE_SHAPES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["memory-saving", "high-performance"])
def test_flce_epilogue_pairs_equal_separate_passes(shape, label_smoothing, threads, mode, native_isa, monkeypatch):  # noqa: F811
    """The FLCE grad's dense tile on ``vdpbf16ps``, both modes: the epilogue that also makes
    ``gᵀ``'s pairs and the paired rows (``flce_grad._epilogue_pairs`` / ``_epilogue_hp_pairs``)
    against the epilogue alone
    followed by ``matmul_tn`` / ``pairs_in_place`` (the plan's ``g_pairs_t`` withheld): the same
    bits of both gradients."""
    import ml_dtypes

    from fastgrad.lm_head.epilogues import flce_grad as FG

    BT, H, V, budget = shape
    rng = np.random.default_rng(BT + V)
    bf = ml_dtypes.bfloat16
    x = rng.standard_normal((BT, H)).astype(bf)
    w = (rng.standard_normal((V, H)) / H**0.5).astype(bf)
    t = rng.integers(0, V, BT)
    mask = np.zeros((BT + 7) // 8, np.uint8)
    mask[0] = 5
    grad = rng.random(BT).astype(np.float32)
    m, e = (np.asarray(a, np.float32) for a in fg.fused_linear_online_max_sum(x, w, t, 0, V)[:2])
    stats: dict = {"logits_max": m, "sum_exp_logits": e}
    if mode == "high-performance":  # the softmax given: the device's other epilogue
        lg = x.astype(np.float64) @ w.astype(np.float64).T
        sm = np.exp(lg - lg.max(1, keepdims=True))
        stats = {"softmax": (sm / sm.sum(1, keepdims=True)).astype(np.float32)}
    paired = []
    real = FG.FlceGrad.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        paired.append(self.gt_buf is not None)
        if withhold:
            self.gt_buf = None

    monkeypatch.setattr(FG.FlceGrad, "__init__", init)
    old = fg.get_num_threads()
    fg.set_num_threads(threads)
    try:
        with workspace_budget(budget):
            res = []
            for withhold in (False, True):
                r = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, t, label_smoothing, **stats)
                res.append([np.asarray(a).view(np.uint16) for a in r[:2]])
    finally:
        fg.set_num_threads(old)
    assert paired[0] == (native_isa == "avx512" and fg.gemm_choice("bfloat16").a_form == "pairs")
    for a, b in zip(*res):
        np.testing.assert_array_equal(a, b)
