"""The training loss's plan (``tiling.plan_training_loss``) is made in the op layer and is what the
kernel runs: row blocks from the global vocabulary and the budget, chunks, the vocabulary-major
recompute, the weight widened once or per chunk (issue 26: no plan decided inside the kernel)."""

from dataclasses import replace

import numpy as np
import pytest
from common import BF16, record_calls, workspace_budget

import fastgrad as fg
from fastgrad import tiling
from fastgrad.errors import InternalError
from fastgrad.kernels import _gemm
from fastgrad.kernels import linear_cross_entropy as K

MiB = 2**20


def _plan(BT=2048, Kl=151936, V=151936, H=896, **kw):
    args = dict(itemsize=4, widen=True, want_grad=True, recompute=False, filtered=False, logits16=False)
    args.update(kw)
    return tiling.plan_training_loss(BT, Kl, V, H, v_chunk=8192, budget_bytes=args.pop("budget", 256 * MiB), **args)


def test_the_qwen_head_plans():
    p = _plan()  # the fused step: row blocks of the whole vocabulary
    assert (p.budget_rows, p.block_rows, p.n_blocks, p.v_chunk) == (440, 440, 5, 8192)
    assert list(p.row_blocks())[:2] == [(0, 409), (409, 819)] and sum(b - a for a, b in p.row_blocks()) == 2048
    assert not p.vocab_major and not p.whole_weight  # [V, H] fp32 is more than a quarter of 256 MiB
    f = _plan(want_grad=False)  # the forward alone: 2048-column chunks, all rows at once
    assert (f.block_rows, f.n_blocks, f.v_chunk) == (2048, 1, 2048)
    r = _plan(recompute=True)  # the recompute: vocabulary-major, all rows per chunk
    assert r.vocab_major and (r.recompute_chunk, r.recompute_rows) == (2048, 2048)
    assert not _plan(recompute=True, filtered=True).vocab_major  # filtering runs by row blocks
    assert _plan(Kl=1000, V=1000, H=64).whole_weight  # a small weight is widened once


def test_every_rank_plans_the_same_row_blocks():
    # the per-block all-reduce: shards of different sizes, the same global V, the same blocks
    a = _plan(Kl=75968)
    b = _plan(Kl=75967)
    assert list(a.row_blocks()) == list(b.row_blocks())


def test_the_budget_moves_the_blocks_not_the_bits_of_one_block():
    assert _plan(budget=512 * MiB).n_blocks == 3
    assert _plan(budget=1).block_rows == 1  # one row at a time, never zero


def test_the_op_layer_makes_the_plan_per_call(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 16)).astype(BF16)
    w = rng.standard_normal((300, 16)).astype(BF16)
    t = rng.integers(0, 300, 40)
    calls = record_calls(monkeypatch, tiling, "plan_training_loss")
    with workspace_budget(40 * 300 * 4 // 4):  # a quarter of [BT, V]: 10 rows, 8 (a multiple of 8)
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
        fg.linear_cross_entropy(x, w, t, return_grad=True, lse=r.lse)
    seen = [res for _, _, res in calls]
    assert len(seen) == 2  # one plan per call, made by the op from the settings in force
    p, q = seen
    assert (p.budget_rows, p.block_rows, p.n_blocks, p.vocab_major) == (8, 8, 5, False)
    assert q.vocab_major and q.recompute_rows == 5  # half the budget / (300 columns x 4 bytes)
    assert np.isfinite(r.loss)


@pytest.mark.parametrize(
    "says,feps,match",
    [
        ({"recompute": True}, None, "vocab_major"),  # the plan says: recompute the gradient
        ({"filtered": True}, None, "filter_rows"),  # the plan says: filtered; the call gives no filter_eps
        ({}, 1e-3, "filter_rows"),  # the call filters; the plan was made without
    ],
)
def test_a_plan_that_contradicts_the_call_is_refused(says, feps, match):
    """The kernel checks its plan against the call by the plan's own rule (tiling.training_modes)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    w = rng.standard_normal((20, 4)).astype(np.float32)
    plan = _plan(BT=8, Kl=20, V=20, H=4, **says)
    out = {"grad_input": np.zeros((8, 4), np.float32), "lse": np.zeros(8, np.float32)}
    extra = {} if feps is None else {"filter_eps": feps}
    with pytest.raises(InternalError, match=match):
        K.linear_cross_entropy_cpu(
            input=x,
            weight=w,
            target_cols=np.zeros(8, np.int64),
            bias=None,
            class_weight=None,
            target_weight=np.ones(8),
            coef_ce=np.ones(8),
            coef_z=None,
            params=tiling.LossParams(**extra),
            plan=plan,
            lse=None,
            combine=None,
            out=out,
        )


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_the_training_loss_reports_progress(backend):
    """``fg.progress``: the fused step after each row block of its plan, the recompute (cpu: on the
    LM-head loop) after each tile of ``plan.recompute_grid``; the golden after each row block."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 16)).astype(BF16)
    w = rng.standard_normal((300, 16)).astype(BF16)
    t = rng.integers(0, 300, 40)
    seen: list = []
    with workspace_budget(40 * 300 * 4 // 4), fg.use_backend(backend), fg.progress(lambda d, n: seen.append((d, n))):
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
        step = list(seen)
        seen.clear()
        fg.linear_cross_entropy(x, w, t, return_grad=True, lse=r.lse)
        rec = list(seen)
    assert step == [(k, 5) for k in range(1, 6)]  # 5 row blocks of 8 rows (test above)
    if backend == "cpu":
        grid = tiling.plan_training_loss(40, 300, 300, 16, itemsize=4, widen=True, want_grad=True, recompute=True,
                                         filtered=False, logits16=False, v_chunk=8192,
                                         budget_bytes=40 * 300 * 4 // 4).recompute_grid
        assert (grid.n_bt, grid.n_tiles) == (8, 8)  # one 300-column chunk, blocks of 5 rows
        assert rec == [(k, grid.n_tiles) for k in range(1, grid.n_tiles + 1)]
    else:
        assert rec == [(k, 5) for k in range(1, 6)]


def _shapes(calls) -> list:
    """``(A, B, out)`` shapes of the recorded ``_gemm._mm_into`` calls (every GEMM tile run)."""
    return [(a[0].shape, a[1].shape, a[2].shape) for a, _, _ in calls]


def test_the_row_blocks_gemm_grids_are_the_plans(monkeypatch):
    # 600 rows x 3000 columns: the logits in 1 x 2 tiles of 600 x 1500 (a 512 x 512 grid would
    # give 2 x 6), grad_weight in 3 blocks of 1000 vocabulary rows, grad_input (an accumulator over
    # the chunks: its tiles are the step's only parallel tasks) cut towards 8 tiles per vocabulary
    # chunk, rows down to 128 here (H = 40 is one column tile): 5 tiles of 120 x 40
    assert _plan().logits_tile == tiling.TRAIN_LOGITS_TILE == (1024, 2048)
    # the Qwen2.5 head's 440-row blocks: 1024 x 512, the longer side halved, to 2 x 4 tiles of <= 220 x 256
    assert (_plan().grad_weight_rows, _plan().grad_input_tile) == (1024, (220, 256))
    # with the logits on the bf16 kernel the chain has less beside it: towards 16 tiles (4 x 7 here)
    assert _plan(logits16=True).grad_input_tile == tiling.grad_input_tile(440, 896) == (128, 128)
    # 2 x 4 at the 2-core default budget's blocks
    assert tiling.grad_input_tile(683, 896, tasks=tiling.TRAIN_GRAD_INPUT_TASKS) == (342, 256)
    assert tiling.grad_input_tile(4096, 8192) == tiling.TRAIN_GRAD_INPUT_TILE  # 4 x 16 already
    rng = np.random.default_rng(2)
    x = rng.standard_normal((600, 40)).astype(np.float32)
    w = (rng.standard_normal((3000, 40)) * 0.1).astype(np.float32)
    t = rng.integers(0, 3000, 600)
    with fg.gemm("blas"):
        ref = fg.linear_cross_entropy(x, w, t, return_grad=True)
        calls = record_calls(monkeypatch, _gemm, "_mm_into")
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
    tiles = _shapes(calls)
    logits = [o for a, b, o in tiles if a == (600, 40) and o[1] != 40]
    gw = [o for a, b, o in tiles if o[1] == 40 and a[1] == 600]
    gi = [o for a, b, o in tiles if o[1] == 40 and a[1] == 3000]
    assert logits == [(600, 1500)] * 2
    assert gw == [(1000, 40)] * 3
    assert gi == [(120, 40)] * 5
    np.testing.assert_array_equal(r.grad_weight, ref.grad_weight)  # the spy changes nothing
    # the plan's grid is what the kernel runs: another grid, other tiles, the same values to fp32
    real = tiling.plan_training_loss

    def other(*a, **kw):
        return replace(real(*a, **kw), logits_tile=(256, 700), grad_weight_rows=128, grad_input_tile=(100, 16))

    monkeypatch.setattr(tiling, "plan_training_loss", other)
    calls.clear()
    with fg.gemm("blas"):
        o = fg.linear_cross_entropy(x, w, t, return_grad=True)
    tiles = _shapes(calls)
    assert [o_ for a, b, o_ in tiles if a[1] == 40 and o_[1] != 40] == [(200, 600)] * 15  # 3 x 5
    assert [o_ for a, b, o_ in tiles if a[1] == 600] == [(125, 40)] * 24
    assert sorted(o_ for a, b, o_ in tiles if a[1] == 3000) == sorted([(100, 13)] * 12 + [(100, 14)] * 6)
    for name in ("loss", "grad_input", "grad_weight"):
        v, want = getattr(o, name), getattr(ref, name)
        np.testing.assert_allclose(v, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())


def test_the_staged_statistics_keep_enough_logits_tiles_in_flight():
    """Widening chunk c + n waits for chunk c's logits (n: weight_buffers), so the buffers are what
    bounds the staged statistics sweep's parallelism: enough for 16 tiles of ≤ 1024 × 2048, 2 to 4,
    from the shapes only; declared as w_chunk + w_chunk_next's n - 1 chunks."""
    p = _plan()  # 440-row blocks, 8192-column chunks: 4 tiles per chunk
    assert p.staged_statistics and p.weight_buffers == 4
    bufs = {b.name: b for b in p.buffers}
    assert bufs["w_chunk"].shape == (8192, 896) and bufs["w_chunk_next"].shape == (3, 8192, 896)
    assert tiling.weight_buffers(409, 8192) == 4 and tiling.weight_buffers(2048, 8192) == 2
    assert tiling.weight_buffers(1, 1) == tiling.MAX_WEIGHT_BUFFERS and tiling.weight_buffers(3000, 8192) == 2
    assert tiling.weight_buffers(1500, 8192) == 2  # 2 x 4 tiles: two chunks hold 16
    assert tiling.weight_buffers(900, 4096) == 4  # 1 x 2 tiles: 8 chunks would; at most 4
    # unstaged (the forward alone, the bf16 logits kernel): one buffer, no w_chunk_next
    for q in (_plan(want_grad=False), _plan(logits16=True)):
        assert not q.staged_statistics and q.weight_buffers == 1
        assert "w_chunk_next" not in {b.name for b in q.buffers}
