"""Strict mode against the newest ops-nn source (hicann/ops-nn e5c3fa9, the newest snapshot, and
hicann/opbase aa3cd74): each disagreement found, pinned from the source line that decides it.

The oracles here are the device's answers as the cited lines give them (success, or a status
code and the phase), not fastgrad's own behaviour; docs/device_parity.md names the rows.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fastgrad as fg

F32 = np.float32
BF16 = ml_dtypes.bfloat16
A2A3 = ["Ascend910B", "Ascend910_93"]
ALL = ["Ascend910B", "Ascend910_93", "Ascend950"]


def _status(fn, soc, strict=True):
    """The status and phase fastgrad answers (0 for success) under ``soc``."""
    try:
        with fg.soc_version(soc):
            if strict:
                with fg.strict():
                    fn()
            else:
                fn()
    except fg.AclnnError as e:
        return e.status, e.phase
    return 0, None


# --- row 3h: FLCE grad, empty input/weight with an out-of-range masked_target --------------------
# aclnn_fused_linear_cross_entropy_loss_grad.cpp:289-294 returns success for an empty input or
# weight after the shape checks (:143-213) and before any kernel: masked_target is never read.


@pytest.mark.parametrize("soc", A2A3)
@pytest.mark.parametrize("bt, h", [(4, 0), (0, 8)])
def test_flce_empty_high_performance_out_of_range_target_succeeds(soc, bt, h):
    V = 128
    mt = np.full(bt, 999, np.int64)  # outside [0, V) on every (unmasked) row
    mask = np.zeros((bt + 7) // 8, np.uint8)
    softmax = np.zeros((bt, V), F32)
    gi = np.full((bt, h), 3.0, BF16)
    gw = np.full((V, h), 3.0, BF16)
    args = (np.zeros(bt, F32), np.zeros((bt, h), BF16), np.zeros((V, h), BF16), mask, mt)
    with fg.soc_version(soc), fg.strict():
        r = fg.fused_linear_cross_entropy_loss_grad(*args, softmax=softmax, out=(gi, gw))
    assert r[0] is gi and r[1] is gw
    assert (gw.astype(F32) == 3).all()  # out= untouched, as the device writes nothing
    # not empty: the high-performance data check (row 3) still refuses it
    x = np.zeros((4, 8), BF16)
    st = _status(
        lambda: fg.fused_linear_cross_entropy_loss_grad(
            np.zeros(4, F32), x, np.zeros((V, 8), BF16), np.zeros(1, np.uint8), np.full(4, 999), softmax=np.zeros((4, V), F32)
        ),
        soc,
    )
    assert st == (161002, "workspace")


# --- row 9d: embedding backward, an empty grad (D = 0) with indices outside [0, num_weights) -----
# aclnn_embedding_dense_backward.cpp:154-176 (CheckParams: dtypes, ranks, CheckDimension — which
# returns true for D = 0, :105-107 — and out's shape; no value check), then :312-326: an empty
# grad or indices zero-fills out (ZerosLike) and returns success; the indices are never read.


@pytest.mark.parametrize("soc", ALL)
def test_embedding_empty_grad_reads_no_index(soc):
    grad = np.zeros((3, 0), F32)
    idx = np.array([5, -7, 100], np.int64)  # num_weights = 2: every one out of range
    out = np.zeros((2, 0), F32)
    with fg.soc_version(soc), fg.strict():
        r = fg.embedding_dense_backward(grad, idx, 2, out=out)
    assert r is out and r.shape == (2, 0)
    # D = 0 also skips the row-count relation (CheckDimension :105-107): 5 rows of grad, 3 indices
    with fg.soc_version(soc), fg.strict():
        assert fg.embedding_dense_backward(np.zeros((5, 0), F32), idx, 2).shape == (2, 0)
    # D > 0: the values are read by the kernel; an out-of-range index stays refused (161002)
    st = _status(lambda: fg.embedding_dense_backward(np.zeros((3, 4), F32), idx, 2), soc)
    assert st == (161002, "workspace")
