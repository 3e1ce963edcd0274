"""The schedule rule of fastgrad.torch.linear_cross_entropy (issue 28, docs/torch.md "The
schedule"): the three-GEMM fused step whenever its held gradients fit a fraction (default 1/4)
of the available memory, the bounded recompute otherwise.  Memory figures are injected through
choose_schedule's parameters and the options' fused_memory_limit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
from fastgrad.torch.options import FUSED_MEMORY_FRACTION, choose_schedule, fused_held_bytes  # noqa: E402

MiB = 2**20


def test_rule_on_injected_memory_figures():
    assert FUSED_MEMORY_FRACTION == 0.25
    # the Qwen2.5-0.5B head, bf16 parameters: fp32 [V, H] + [BT, H] held = 526 MiB
    held = fused_held_bytes(2048, 896, 151936, grad_input=True, grad_weight=True, grad_bias=False,
                            weight_bytes=4)
    assert held == 151936 * 896 * 4 + 2048 * 896 * 4
    assert choose_schedule(held, available_bytes=16 * 1024 * MiB) == "fused"       # a 16 GiB machine
    assert choose_schedule(held, available_bytes=4 * held) == "fused"               # exactly 1/4
    assert choose_schedule(held, available_bytes=4 * held - 1) == "recompute"
    assert choose_schedule(held, available_bytes=1024 * MiB) == "recompute"         # tight memory
    assert choose_schedule(held, available_bytes=1024 * MiB, fraction=0.6) == "fused"
    assert choose_schedule(held, available_bytes=1, limit=held) == "fused"          # a limit wins
    assert choose_schedule(held, available_bytes=10**15, limit=held - 1) == "recompute"
    # a 16-bit accum_dtype halves [V, H]; a frozen weight holds only [BT, H]
    half = fused_held_bytes(2048, 896, 151936, grad_input=True, grad_weight=True, grad_bias=False,
                            weight_bytes=2)
    assert half == 151936 * 896 * 2 + 2048 * 896 * 4
    frozen = fused_held_bytes(2048, 896, 151936, grad_input=True, grad_weight=False, grad_bias=True,
                              weight_bytes=4)
    assert frozen == 2048 * 896 * 4 + 151936 * 4
    # the live figure: psutil's available memory
    assert ft.options.available_memory() > 0


def _loss(limit=None, fraction=None, reduction="mean", weight_grad=True, **kw):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g, requires_grad=weight_grad)
    t = torch.randint(0, 50, (12,), generator=g)
    o = {}
    if limit is not None:
        o["fused_memory_limit"] = limit
    if fraction is not None:
        o["fused_memory_fraction"] = fraction
    loss = ft.linear_cross_entropy(h, w, t, reduction=reduction, options=ft.LinearCrossEntropyOptions(**o, **kw))
    return loss, h, w


def test_the_loss_follows_the_rule():
    """loss.grad_fn is the autograd Function's context: .fused says which schedule ran; both
    schedules give the same gradients (to fp32 rounding)."""
    held = 12 * 8 * 4 + 50 * 8 * 4
    fused, h1, w1 = _loss(limit=held)
    assert fused.grad_fn.fused
    rec, h2, w2 = _loss(limit=held - 1)
    assert not rec.grad_fn.fused
    only_h, _, _ = _loss(limit=12 * 8 * 4, weight_grad=False)   # frozen weight: only [BT, H] held
    assert only_h.grad_fn.fused
    assert _loss(fraction=1.0)[0].grad_fn.fused      # this machine has more than a few KiB
    assert not _loss(reduction="none")[0].grad_fn.next_functions[0][0].fused   # per-token: recompute
    assert _loss(limit=0, schedule="fused")[0].grad_fn.fused
    assert not _loss(schedule="recompute")[0].grad_fn.fused
    fused.backward()
    rec.backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)


def test_options_conflicts_and_validation():
    h = torch.randn(4, 8)
    w = torch.randn(10, 8)
    t = torch.randint(0, 10, (4,))
    with pytest.raises(fg.AclnnError, match="fused"):
        ft.linear_cross_entropy(h, w, t, fused=True, options="fast")
    for bad in (dict(fused_memory_fraction=0.0), dict(fused_memory_fraction=1.5), dict(fused_memory_limit=-1),
                dict(precision="exact"), dict(engine="mkl"), dict(filter_eps=2.0)):
        with pytest.raises(fg.AclnnError, match=next(iter(bad))) as e:
            ft.LinearCrossEntropyOptions(**bad)
        assert e.value.status == 161002
    assert ft.LinearCrossEntropyOptions.preset("low_memory").fused is False
    assert set(ft.PRESETS) >= {"default", "fused", "low_memory", "fast", "filtered", "device", "blas"}


def test_engine_option_applies_to_forward_and_backward(monkeypatch):
    """options.engine is in force during the forward and the backward's recompute."""
    import fastgrad._config as cfg
    seen = []
    import fastgrad.torch.functional as fn
    real = fn._lce_op

    def spy(*a, **k):
        seen.append(cfg.gemm_setting())
        return real(*a, **k)

    monkeypatch.setattr(fn, "_lce_op", spy)
    loss, h, w = _loss(schedule="recompute", engine="blas")
    loss.backward()
    assert seen == ["blas", "blas"]
