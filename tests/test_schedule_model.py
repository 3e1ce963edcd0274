"""bench/schedule_model.py's list-scheduling model: makespans worked out by hand, and a trace of a
real LM-head call (its pool tasks recorded where they run, the results unchanged)."""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import schedule_model as sm  # noqa: E402

import fastgrad as fg  # noqa: E402


def test_fifo_hands_tasks_out_in_order():
    assert sm._fifo([3, 1, 1, 1], 2, 0.0) == 3  # one worker on the long task, the other on the rest
    assert sm._fifo([1, 1, 1, 3], 2, 0.0) == 4  # the long one last: it starts at 1 on the free worker
    assert sm._fifo([1] * 5, 2, 0.0) == 3
    assert sm._fifo([1] * 5, 1, 0.0) == 5
    assert sm._fifo([2, 2], 4, 0.5) == 2.5  # the per-task cost


def test_graph_follows_the_edges_and_the_lowest_ready_group():
    two = [[1.0, 1.0], [1.0, 1.0]]
    assert sm._graph(two, [set(), set()], 4, 0.0) == 1.0
    assert sm._graph(two, [set(), {0}], 4, 0.0) == 2.0
    assert sm._graph(two, [set(), {0}], 1, 0.0) == 4.0
    # g0 (2) and g1 (1, 1) ready; g2 (1) after g0: 0-2 g0 | 0-1, 1-2 g1; then g2 2-3
    assert sm._graph([[2.0], [1.0, 1.0], [1.0]], [set(), set(), {0}], 2, 0.0) == 3.0
    # an empty group finishes at once and releases its successors
    assert sm._graph([[], [1.0]], [set(), {0}], 2, 0.0) == 1.0


def test_a_traced_call_keeps_its_results_and_the_model_its_bounds(monkeypatch):
    import fastgrad.lm_head.loop as loop
    from fastgrad.kernels import _gemm

    rng = np.random.default_rng(0)
    BF = ml_dtypes.bfloat16
    BT, H, V = 300, 64, 5000
    x = rng.standard_normal((BT, H)).astype(BF)
    w = (rng.standard_normal((V, H)) * 0.2).astype(BF)
    t = rng.integers(0, V, BT)
    s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
    m, e = np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)
    gl, mask = np.full(BT, 1.0 / BT, np.float32), np.zeros((BT + 7) // 8, np.uint8)

    def call():
        r = fg.fused_linear_cross_entropy_loss_grad(gl, x, w, mask, t, logits_max=m, sum_exp_logits=e)
        return [np.asarray(a).view(np.uint16).copy() for a in r]

    ref = call()
    tr = sm.Trace()
    monkeypatch.setattr(_gemm, "_run", tr.run)
    monkeypatch.setattr(_gemm, "run_graph", tr.graph)
    monkeypatch.setattr(loop, "run_graph", tr.graph)
    got = call()
    tr.end()
    for a, b in zip(ref, got):
        assert np.array_equal(a, b)
    phases = [ev for ev in tr.events if ev[0] != "serial"]
    assert phases and all(len(ev[2]) > 1 for ev in phases)
    longest = max(max(ev[2]) if ev[0] == "tasks" else max(max(g) for g in ev[2] if g) for ev in phases)
    wall1, work, _ = sm.model(tr.events, 1, 0.0)
    assert wall1 == pytest.approx(work)
    for T in (2, 16):
        wall, work_t, sites = sm.model(tr.events, T, 0.0)
        assert work_t == pytest.approx(work)
        assert work / T - 1e-12 <= wall <= work + 1e-12 and wall >= longest
        assert sum(v[0] for v in sites.values()) == pytest.approx(work)
