"""grad_input's GEMM grid (``tiling.grad_input_tile``) changes no bit: each output element is one
BLAS call over the same ``K`` whatever the tile's rows and columns, so the plan may cut the
accumulator into more tiles (more parallel tasks per vocabulary step on many cores) without a
new pin.  Checked against the old grids (1024 x 512 for the training loss, 512 x 512 for the FLCE
grad) on every engine this host runs, fp32 and bf16."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from common import BF16, workspace_budget

import fastgrad as fg
from fastgrad import tiling


def _inputs(BT, H, V, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(dtype)
    w = (rng.standard_normal((V, H)) / np.sqrt(H)).astype(dtype)
    return x, w, rng.integers(0, V, BT)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("engine", ["blas", "auto"])
def test_training_grad_input_bits_do_not_depend_on_the_grid(monkeypatch, dtype, engine):
    x, w, t = _inputs(700, 200, 3000, dtype)
    real = tiling.plan_training_loss
    with fg.gemm(engine), workspace_budget(700 * 3000 * 4 // 3):  # row blocks of 233 rows
        new = fg.linear_cross_entropy(x, w, t, return_grad=True)
        plan = real(700, 3000, 3000, 200, itemsize=4, widen=dtype != np.float32, want_grad=True,
                    recompute=False, filtered=False, logits16=False, v_chunk=8192, budget_bytes=700 * 3000 * 4 // 3)
        assert plan.grad_input_tile != tiling.TRAIN_GRAD_INPUT_TILE  # the rule cut the grid here
        monkeypatch.setattr(
            tiling, "plan_training_loss", lambda *a, **k: replace(real(*a, **k), grad_input_tile=(1024, 512))
        )
        old = fg.linear_cross_entropy(x, w, t, return_grad=True)
    for name in ("loss", "grad_input", "grad_weight"):
        np.testing.assert_array_equal(np.asarray(getattr(new, name)), np.asarray(getattr(old, name)), err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_flce_grad_grad_input_bits_do_not_depend_on_the_grid(monkeypatch, dtype):
    BT, H, V = 600, 200, 2500
    x, w, t = _inputs(BT, H, V, dtype, seed=1)
    mask = np.zeros((BT + 7) // 8, np.uint8)
    grad = np.full(BT, 1.0 / BT, np.float32)
    m, s = fg.fused_linear_online_max_sum(x, w, t, 0, V)[:2]
    real = tiling.plan_linear_cross_entropy

    def run():
        with fg.gemm("blas"):
            return fg.fused_linear_cross_entropy_loss_grad(
                grad, x, w, mask, t, logits_max=np.asarray(m, np.float32), sum_exp_logits=np.asarray(s, np.float32)
            )

    new = run()
    assert real(BT, V, H, dtype="float32").grad_input_tile != (512, 512)
    monkeypatch.setattr(
        tiling, "plan_linear_cross_entropy", lambda *a, **k: replace(real(*a, **k), grad_input_tile=(512, 512))
    )
    old = run()
    for a, b in zip(new, old, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_grid_rule():
    assert tiling.grad_input_tile(683, 896) == (171, 128)  # 4 x 7 tiles instead of 1 x 2
    assert tiling.grad_input_tile(1024, 896, largest=(512, 512)) == (256, 128)  # 4 x 7 instead of 2 x 2
    assert tiling.grad_input_tile(4096, 8192) == (1024, 512)  # 4 x 16 already
    assert tiling.grad_input_tile(64, 32) == (64, 32)  # nothing to cut below 128
    for rows in (1, 5, 127, 129, 683, 5000):
        for H in (1, 40, 896, 4096):
            r, c = tiling.grad_input_tile(rows, H)
            assert 1 <= r <= max(rows, 1) and 1 <= c <= H
