"""The fused training step's 16-bit grad_weight on the forward's recycled row-block scratch.

``fastgrad.torch``'s fused schedule lets its row blocks take as much scratch as the 16-bit
``grad_weight`` (``recycled_scratch_bytes``: ``_config.workspace_floor``), and the backward rounds
the fp32 gradient into that freed block (``ops.linear_cross_entropy.round_grad``).  Checked here:
the bits equal PyTorch's own rounding (``g.to(dtype)`` / ``(g * s).to(dtype)``) for both 16-bit
dtypes and unit or scaled upstream gradients; the rounded gradient takes no new block; the floor
never lets a row block hold ``[BT, V]``; a negative floor is refused.
"""

import pytest

torch = pytest.importorskip("torch")

from common import workspace_budget  # noqa: E402

import fastgrad as fg  # noqa: E402
from fastgrad import _config, _outcache  # noqa: E402
from fastgrad.errors import AclnnError  # noqa: E402
from fastgrad.torch import functional as F  # noqa: E402


def _inputs(dtype, BT=96, H=40, V=700, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(BT, H, generator=g) * 0.5).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.2).to(dtype)
    return h, w, torch.randint(0, V, (BT,), generator=g)


def _step(dtype, scale):
    h, w, t = _inputs(dtype)
    h.requires_grad_()
    w.requires_grad_()
    loss = fg.torch.linear_cross_entropy(h, w, t, options=fg.torch.LinearCrossEntropyOptions(schedule="fused"))
    (loss * scale).backward()
    return h.grad, w.grad


@pytest.mark.parametrize("scale", [1.0, 0.37, 1 / 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_recycled_grad_has_pytorchs_rounding(dtype, scale, monkeypatch):
    gi, gw = _step(dtype, scale)
    monkeypatch.setattr(F, "_NARROW", {})  # PyTorch's own .to(dtype) path
    gi0, gw0 = _step(dtype, scale)
    assert gw.dtype == dtype and gi.dtype == dtype
    assert torch.equal(gw.view(torch.int16), gw0.view(torch.int16))
    assert torch.equal(gi.view(torch.int16), gi0.view(torch.int16))
    # and right: against float64 autograd of the same loss
    h, w, t = _inputs(dtype)
    h, w = h.double().requires_grad_(), w.double().requires_grad_()
    (torch.nn.functional.cross_entropy(h @ w.T, t) * scale).backward()
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert torch.allclose(gw.double(), w.grad, atol=2 * u * w.grad.abs().max().item(), rtol=2 * u)


def test_the_rounded_grad_takes_the_freed_scratch_block():
    # the row blocks' logits scratch (>= the cache's smallest block) is freed after the forward
    # and the backward's 16-bit grad_weight lands on it: no new block (a cache miss) for it
    BT, H, V = 512, 256, 40000
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(BT, H, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, V, (BT,), generator=g)
    assert F.recycled_scratch_bytes(BT, w) == V * H * 4
    # a budget below the floor (V·H·4 = 41 MB): the floor sizes the blocks
    with workspace_budget(8 << 20), _outcache.output_cache(4096):
        _outcache.empty_cache()
        opts = fg.torch.LinearCrossEntropyOptions(schedule="fused")
        loss = fg.torch.linear_cross_entropy(h, w, t, options=opts)
        before = _outcache.output_cache_info()
        assert before["free_blocks"] >= 1  # the row blocks' scratch, freed
        loss.backward()
        after = _outcache.output_cache_info()
        assert after["misses"] == before["misses"], (before, after)  # no new block for the grad
        # the 16-bit gradient took a free block (a hit); the fused step's fp32 accumulator, a
        # saved tensor of the graph, is handed back when the backward frees the saved tensors
        assert after["hits"] > before["hits"]
        del loss
        w.grad = None  # the block comes back with the gradient
        assert _outcache.output_cache_info()["free_bytes"] >= before["free_bytes"]


def test_the_floor_never_holds_bt_by_v_and_ignores_fp32_weights():
    w16 = torch.zeros(1000, 64, dtype=torch.bfloat16)
    assert F.recycled_scratch_bytes(4096, w16) == 1000 * 64 * 4  # 2 x the 16-bit gradient
    assert F.recycled_scratch_bytes(32, w16) == 32 * 1000 * 4 // 2  # at most half of [BT, V] fp32
    assert F.recycled_scratch_bytes(4096, torch.zeros(1000, 64)) == 0


def test_workspace_floor_raises_the_budget_in_its_block_only():
    base = _config.workspace_budget()
    with _config.workspace_floor(base + 12345):
        assert _config.workspace_budget() == base + 12345
        assert fg.settings().workspace_bytes == base + 12345
        with _config.workspace_floor(1):  # a floor below the budget changes nothing
            assert _config.workspace_budget() == base
    assert _config.workspace_budget() == base
    with pytest.raises(AclnnError, match="nbytes"):
        with _config.workspace_floor(-1):
            pass
