"""A setting this machine cannot honour is never silent (issue 47): the plan records what runs
instead (``GemmChoice.fallback``, ``TrainingPlan.fallback``) and the op layer warns once per
distinct fallback (``fastgrad.ops._engines.FallbackWarning``); what runs is unchanged."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import fastgrad as fg
from fastgrad.ops import _engines

BF = ml_dtypes.bfloat16


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(_engines, "_warned", set())


def _inputs(BT=12, H=16, V=40):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((BT, H)).astype(BF),
        (rng.standard_normal((V, H)) * 0.3).astype(BF),
        rng.integers(0, V, BT).astype(np.int64),
    )


def test_fast_outside_its_kernel_is_recorded_and_warned_once():
    x, w, t = _inputs()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with fg.gemm("blas"):  # no bf16 logits kernel: "fast" cannot change anything
            r1 = fg.linear_cross_entropy(x, w, t, return_grad=True, precision="fast")
            r2 = fg.linear_cross_entropy(x, w, t, return_grad=True, precision="fast")
            acc = fg.linear_cross_entropy(x, w, t, return_grad=True)
    got = [m for m in rec if issubclass(m.category, _engines.FallbackWarning)]
    assert len(got) == 1 and "precision='fast' computes as 'accurate'" in str(got[0].message)
    assert got[0].filename == __file__  # points at the user's call, not into fastgrad
    assert r1.plan.fallback is not None and r2.plan.fallback == r1.plan.fallback and acc.plan.fallback is None
    for a, b in ((r1.grad_input, acc.grad_input), (r1.grad_weight, acc.grad_weight)):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_fast_forward_only_has_nothing_to_fall_back_from():
    x, w, t = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", _engines.FallbackWarning)
        with fg.gemm("blas"):
            r = fg.linear_cross_entropy(x, w, t, precision="fast")  # no gradient: "fast" changes nothing
    assert r.plan.fallback is None


def test_onednn_setting_where_it_is_not_usable_is_recorded_and_warned(monkeypatch):
    pytest.importorskip("torch")
    from fastgrad import _onednn

    monkeypatch.setattr(_onednn, "usable", lambda: False)  # e.g. an AMX CPU: the probe fails
    x, w, t = _inputs()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with fg.gemm("onednn"):
            choice = _engines.gemm_choice(np.float32)
            s = fg.fused_linear_online_max_sum(x.astype(np.float32), w.astype(np.float32), t, 0, w.shape[0])
    assert choice.engine == "blas" and "onednn" in (choice.fallback or "")
    got = [m for m in rec if issubclass(m.category, _engines.FallbackWarning)]
    assert len(got) == 1
    with fg.gemm("blas"):
        ref = fg.fused_linear_online_max_sum(x.astype(np.float32), w.astype(np.float32), t, 0, w.shape[0])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(s[:2], ref[:2]))


def test_no_fallback_no_warning():
    x, w, t = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", _engines.FallbackWarning)
        fg.linear_cross_entropy(x, w, t, return_grad=True)
        fg.fused_linear_online_max_sum(x, w, t, 0, w.shape[0])
