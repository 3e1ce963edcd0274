"""grad_input's GEMM grid (``tiling.grad_input_tile``) is the plan's, from the shapes only.

So the results never depend on the thread count — on any engine, here with a pool of 1, 2 and 16
threads (``_gemm.pool_threads`` patched: 16 Python threads on any machine).  The grid itself
decides bits where the GEMM does: OpenBLAS's AVX2 kernels (its Haswell / Zen cores) sum an output
element differently with the call's rows and columns, its AVX-512 kernels do not
(``OPENBLAS_CORETYPE=Haswell`` on a Zen 4: a 683 × 8192 × 896 product split in 2 column parts
differs in the last bits from one call) — so a new grid is a change of results, re-pinned in
tests/pins, and another grid here is checked against a float64 oracle to fp32 rounding, not
bitwise."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numba
import numpy as np
import pytest
from common import BF16, mean_ce_oracle64, workspace_budget

import fastgrad as fg
from fastgrad import tiling
from fastgrad.kernels import _gemm

DTYPES = pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])


def _inputs(BT, H, V, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(dtype)
    w = (rng.standard_normal((V, H)) / np.sqrt(H)).astype(dtype)
    return x, w, rng.integers(0, V, BT)


def _close(actual, oracle, name):
    a = np.asarray(actual)
    # fp32 rounding of sums over <= 3000 terms; the FLCE grad of bf16 operands computes as the
    # device (its softmax grad a bf16 GEMM operand, its grads bf16): that rounding, summed; a lost
    # or doubled tile is off by the gradient itself
    rtol, atol = (1e-4, 2e-6) if a.dtype == np.float32 else (2.0**-7, 2.0**-8)
    np.testing.assert_allclose(a.astype(np.float64), oracle, rtol=rtol, atol=atol * np.abs(oracle).max(), err_msg=name)


@contextlib.contextmanager
def _threads(monkeypatch, T):
    old = numba.get_num_threads()
    with monkeypatch.context() as m:
        m.setattr(_gemm, "pool_threads", lambda: T)
        fg.set_num_threads(min(T, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            fg.set_num_threads(old)


def _training(x, w, t, engine):
    with fg.gemm(engine), workspace_budget(x.shape[0] * w.shape[0] * 4 // 3):  # 3 row blocks
        return fg.linear_cross_entropy(x, w, t, return_grad=True)


def _flce(x, w, t):
    BT, V = x.shape[0], w.shape[0]
    mask = np.zeros((BT + 7) // 8, np.uint8)  # no row masked
    grad = np.full(BT, 1.0 / BT, np.float32)
    with fg.gemm("blas"):
        m, s = fg.fused_linear_online_max_sum(x, w, t, 0, V)[:2]
        return fg.fused_linear_cross_entropy_loss_grad(
            grad, x, w, mask, t, logits_max=np.asarray(m, np.float32), sum_exp_logits=np.asarray(s, np.float32)
        )


@DTYPES
@pytest.mark.parametrize("engine", ["blas", "auto"])
def test_training_results_do_not_depend_on_the_thread_count(monkeypatch, dtype, engine):
    x, w, t = _inputs(1000, 512, 3000, dtype)  # 3 row blocks of <= 328 rows: 2 x 4 tiles
    plan = tiling.plan_training_loss(
        1000, 3000, 3000, 512, itemsize=4, widen=dtype != np.float32, want_grad=True, recompute=False,
        filtered=False, logits16=False, v_chunk=8192, budget_bytes=1000 * 3000 * 4 // 3,
    )  # fmt: skip
    assert plan.grad_input_tile != tiling.TRAIN_GRAD_INPUT_TILE  # the rule cut the grid here
    runs = []
    for T in (1, 2, 16):
        with _threads(monkeypatch, T):
            runs.append(_training(x, w, t, engine))
    for r in runs[1:]:
        for name in ("loss", "grad_input", "grad_weight"):
            np.testing.assert_array_equal(np.asarray(getattr(r, name)), np.asarray(getattr(runs[0], name)), name)


@DTYPES
def test_flce_grad_results_do_not_depend_on_the_thread_count(monkeypatch, dtype):
    x, w, t = _inputs(600, 512, 2500, dtype, seed=1)
    assert tiling.plan_linear_cross_entropy(600, 2500, 512, dtype="float32").grad_input_tile != (512, 512)
    runs = []
    for T in (1, 2, 16):
        with _threads(monkeypatch, T):
            runs.append(_flce(x, w, t))
    for r in runs[1:]:
        for a, b in zip(r, runs[0], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@DTYPES
@pytest.mark.parametrize("engine", ["blas", "auto"])
def test_training_on_another_grid_is_the_same_gradient_to_fp32(monkeypatch, dtype, engine):
    x, w, t = _inputs(700, 200, 3000, dtype)
    loss, gi, gw = mean_ce_oracle64(x, w, t)[:3]  # no row ignored
    real = tiling.plan_training_loss
    for tile in (None, (1024, 512), (100, 48)):
        if tile is not None:
            monkeypatch.setattr(tiling, "plan_training_loss", lambda *a, _t=tile, **k: replace(real(*a, **k), grad_input_tile=_t))
        r = _training(x, w, t, engine)
        assert abs(float(r.loss) - loss) <= 1e-6 * abs(loss)
        _close(r.grad_input, gi, f"grad_input, grid {tile}")
        _close(r.grad_weight, gw, f"grad_weight, grid {tile}")


@DTYPES
def test_flce_grad_on_another_grid_is_the_same_gradient_to_fp32(monkeypatch, dtype):
    x, w, t = _inputs(600, 200, 2500, dtype, seed=1)
    gi, gw = mean_ce_oracle64(x, w, t)[1:3]  # the FLCE grad's grad = 1 / BT, no row masked
    real = tiling.plan_linear_cross_entropy
    for tile in (None, (512, 512), (64, 200)):
        if tile is not None:
            monkeypatch.setattr(tiling, "plan_linear_cross_entropy", lambda *a, _t=tile, **k: replace(real(*a, **k), grad_input_tile=_t))
        r = _flce(x, w, t)
        _close(r[0], gi, f"grad_input, grid {tile}")
        _close(r[1], gw, f"grad_weight, grid {tile}")


def test_the_grid_rule():
    train = tiling.TRAIN_GRAD_INPUT_TASKS
    assert tiling.grad_input_tile(683, 896, tasks=train) == (342, 256)  # 2 x 4 tiles instead of 1 x 2
    assert tiling.grad_input_tile(683, 896) == (171, 256)  # 16 tasks: 4 x 4
    assert tiling.grad_input_tile(1024, 896, largest=(512, 512)) == (256, 256)  # 4 x 4 instead of 2 x 2
    assert tiling.grad_input_tile(4096, 8192) == (1024, 512)  # 4 x 16 already
    assert tiling.grad_input_tile(64, 32) == (64, 32)  # nothing to cut below 128
    assert tiling.grad_input_tile(600, 40, tasks=train) == (128, 40)  # one column: the rows alone
    for rows in (1, 5, 127, 129, 683, 5000):
        for H in (1, 40, 896, 4096):
            for tasks in (1, train, tiling.GRAD_INPUT_TASKS):
                r, c = tiling.grad_input_tile(rows, H, tasks=tasks)
                assert 1 <= r <= min(rows, 1024) and 1 <= c <= min(H, 512)
                n = -(-rows // r) * -(-H // c)
                m = tiling.GRAD_INPUT_MIN_TILE
                assert n >= tasks or (r <= m and c <= m)  # enough tiles, or nothing left to halve
