"""The training op's recompute (gradient from a saved log-sum-exp), vocabulary-major, and its
forward alone, one chunk of logits at a time; the torch loss's rule for fusing.

Against a float64 autograd oracle of the materialized formula written here, with the plan cut
small (many row blocks, many vocabulary chunks of a prime width) so every edge is crossed; a
16-bit ``grad_weight`` of the recompute must be the fp32 one rounded once (bitwise), and no fp32
``[V, H]`` may be allocated on the way.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from common import lm_head_problem  # noqa: E402

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
from fastgrad import tiling  # noqa: E402

IGN = -100


_data = lm_head_problem


def _oracle(x, w, t, b=None, cw=None, label_smoothing=0.0, softcap=None, lse_square_scale=0.0):
    """(loss, lse, grad_input, grad_weight, grad_bias) in float64 autograd (reduction mean)."""
    X = torch.from_numpy(np.asarray(x, np.float64)).requires_grad_()
    W = torch.from_numpy(np.asarray(w, np.float64)).requires_grad_()
    B = None if b is None else torch.from_numpy(np.asarray(b, np.float64)).requires_grad_()
    z = X @ W.T
    if B is not None:
        z = z + B
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    tt = torch.from_numpy(t)
    valid = tt != IGN
    lse = torch.logsumexp(z, 1)
    loss = F.cross_entropy(z, tt, weight=None if cw is None else torch.from_numpy(cw),
                           ignore_index=IGN, label_smoothing=label_smoothing)
    loss = loss + torch.where(valid, lse_square_scale * lse * lse, 0 * lse).sum() / valid.sum()
    loss.backward()
    return loss.item(), lse.detach().numpy(), X.grad.numpy(), W.grad.numpy(), None if B is None else B.grad.numpy()


FEATURES = [
    {},
    {"bias": True, "softcap": 3.0},
    {"ce_weight": True, "label_smoothing": 0.1, "lse_square_scale": 1e-2},
]


def _kw(feat, b, cw):
    kw = {k: v for k, v in feat.items() if k not in ("bias", "ce_weight")}
    return kw, (b if feat.get("bias") else None), (cw if feat.get("ce_weight") else None)


@pytest.fixture(params=["default", "small"])
def plan(request, monkeypatch):
    """The default plan, or a small one: 3-row blocks, 7-column chunks (prime)."""
    if request.param == "small":
        monkeypatch.setattr(tiling, "TRAIN_VM_CHUNK", 7)
        monkeypatch.setattr("fastgrad.ops.linear_cross_entropy.V_CHUNK", 7)
        tiling.set_workspace_budget(3 * 7 * 4 * 2)
    yield request.param
    tiling.set_workspace_budget(None)


@pytest.mark.parametrize("feat", FEATURES, ids=["plain", "bias-softcap", "cw-ls-z"])
def test_forward_and_recompute_match_float64(plan, feat):
    BT, H, V = 29, 11, 103
    x, w, b, cw, t = _data(BT, H, V, seed=len(feat) + 3)
    kw, bb, cc = _kw(feat, b, cw)
    loss, lse, gi, gw, gb = _oracle(x, w, t, bb, cc, **kw)
    fwd = fg.linear_cross_entropy(x, w, t, bb, cc, **kw)
    np.testing.assert_allclose(fwd.loss, loss, rtol=1e-5)
    np.testing.assert_allclose(fwd.lse, lse, rtol=1e-6, atol=1e-6)
    r = fg.linear_cross_entropy(x, w, t, bb, cc, return_grad=True, lse=fwd.lse, **kw)
    fused = fg.linear_cross_entropy(x, w, t, bb, cc, return_grad=True, **kw)
    for got, want in ((r.grad_input, gi), (r.grad_weight, gw), (fused.grad_weight, gw)) + (
        ((r.grad_bias, gb),) if bb is not None else ()
    ):
        assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max() + 1e-9


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_recompute_16bit_grad_weight_is_the_fp32_one_rounded_once(plan, dtype):
    BT, H, V = 31, 13, 97
    x, w, b, cw, t = _data(BT, H, V, seed=5, dtype=dtype)
    fwd = fg.linear_cross_entropy(x, w, t, b, cw, label_smoothing=0.05)
    r32 = fg.linear_cross_entropy(x, w, t, b, cw, return_grad=True, lse=fwd.lse, label_smoothing=0.05)
    r16 = fg.linear_cross_entropy(x, w, t, b, cw, return_grad=True, lse=fwd.lse, label_smoothing=0.05,
                                  accum_dtype=np.dtype(dtype))
    assert r16.grad_weight.dtype == np.dtype(dtype) and r32.grad_weight.dtype == np.float32
    np.testing.assert_array_equal(r16.grad_weight.view(np.uint16), r32.grad_weight.astype(dtype).view(np.uint16))
    np.testing.assert_array_equal(r16.grad_input, r32.grad_input)
    np.testing.assert_array_equal(r16.grad_bias, r32.grad_bias)


def test_the_recompute_step_allocates_no_fp32_weight_gradient(monkeypatch):
    """fused=False: every large buffer of the step is smaller than an fp32 [V, H], but for the
    weight's fp32 copy a small weight is widened into (``w_whole``, at most a quarter of the
    budget: a copy of the operand, not a gradient); fused=True holds one (the check can fail).
    The outputs come from ``_outcache.empty``, the kernel's buffers from the plan's list
    (``Workspace.take``: every one of them, named)."""
    from fastgrad import _outcache
    from fastgrad.lm_head import loop as _lm_head

    BT, H, V = 16, 64, 9000  # V > VM_CHUNK: the chunks' buffers are smaller than [V, H]
    x, w, b, cw, t = _data(BT, H, V, seed=2, dtype=ml_dtypes.bfloat16)
    seen = []
    real_empty, real_take = _outcache.empty, _lm_head.Workspace.take

    def spy(shape, dtype):
        seen.append(("output", int(np.prod(shape)), np.dtype(dtype)))
        return real_empty(shape, dtype)

    def take(self, name):
        a = real_take(self, name)  # the declared buffer (its size and dtype: the plan's list)
        seen.append((name, a.size, a.dtype))
        return a

    monkeypatch.setattr(_outcache, "empty", spy)
    monkeypatch.setattr(_lm_head.Workspace, "take", take)
    full = V * H
    for fused in (False, True):
        seen.clear()
        hh = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).requires_grad_()
        ww = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16).requires_grad_()
        ft.linear_cross_entropy(hh, ww, torch.from_numpy(t), fused=fused).backward()
        assert ww.grad.dtype == torch.bfloat16
        assert any(name == "logits_block" for name, _, _ in seen)  # the spy sees the kernel's buffers
        big32 = [(name, n) for name, n, dt in seen if dt == np.float32 and n >= full and name != "w_whole"]
        assert bool(big32) == fused, (fused, seen)


def test_the_default_rule_fuses_small_heads_and_recomputes_large_ones(monkeypatch):
    import fastgrad.torch.functional as fn

    calls = []
    real = fn._lce_op

    def spy(*a, **k):
        calls.append("lse" in k and k["lse"] is not None)
        return real(*a, **k)

    monkeypatch.setattr(fn, "_lce_op", spy)
    x, w, b, cw, t = _data(16, 8, 300, seed=1)

    def step(limit=None, **kw):
        calls.clear()
        hh, ww = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
        if limit is not None:   # the held-gradient limit of the "auto" schedule (issue 28: the
            # rule is a fraction of the available memory, no longer the workspace budget)
            kw["options"] = ft.LinearCrossEntropyOptions(fused_memory_limit=limit, **kw.pop("opts", {}))
        ft.linear_cross_entropy(hh, ww, torch.from_numpy(t), **kw).backward()
        return calls == [False]  # one call, in the forward: fused

    held = 300 * 8 * 4 + 16 * 8 * 4   # fp32 grad_weight + grad_input
    assert step()  # a quarter of the available memory holds them
    assert step(limit=held)
    assert not step(limit=held - 1)  # no longer fits: forward, then the recompute
    assert step(limit=held - 1, opts={"schedule": "fused"})
    assert step(limit=held - 1, opts={"filter_eps": "auto"})
    assert not step(limit=held - 1, opts={"accum_dtype": torch.float32})
    assert not step(fused=False)
