"""``fastgrad.plan`` / ``fastgrad.gemm_choice``: the plan an LM-head op will run, made without
running it — the same plan the op returns (``return_plan=True``) under the same settings."""

from __future__ import annotations

import re

import numpy as np
import pytest
from common import BF16, workspace_budget

import fastgrad as fg

FLCE = "fused_linear_cross_entropy_loss_grad"

def _inputs(BT, H, V, dtype):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((BT, H)).astype(dtype),
        (rng.standard_normal((V, H)) / 8).astype(dtype),
        rng.integers(0, V, BT),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("filtered", [False, True])
def test_the_plan_is_the_one_the_flce_grad_runs(dtype, filtered):
    BT, H, V = 300, 40, 2600
    x, w, t = _inputs(BT, H, V, dtype)
    kw = {"filter_eps": 1e-3} if filtered else {}
    with workspace_budget(400_000):
        s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
        grad = np.full(BT, 1.0 / BT, np.float32)
        ran = fg.fused_linear_cross_entropy_loss_grad(
            grad, x, w, s.target_mask, s.masked_target,
            logits_max=s.logits_max_local, sum_exp_logits=s.sum_exp_logits_local, return_plan=True, **kw,
        )[-1]
        made = fg.plan("fused_linear_cross_entropy_loss_grad", BT, V, H, dtype=dtype, **kw)
        aclnn = fg.plan("aclnnFusedLinearCrossEntropyLossGrad", BT, V, H, dtype=dtype, **kw)
    for p in (made, aclnn):
        assert (p.bt_tile, p.v_tile, p.mode, p.gemm, p.buffers) == (ran.bt_tile, ran.v_tile, ran.mode, ran.gemm, ran.buffers)
        assert p.workspace_bytes == ran.workspace_bytes > 0
    assert made.gemm == fg.gemm_choice(dtype) and isinstance(made.gemm.describe(), str)


def test_the_online_max_sum_plan_and_the_budget():
    small = fg.plan("fused_linear_online_max_sum", 4096, 151936, 896, budget_bytes=64 << 20)
    large = fg.plan("fused_linear_online_max_sum", 4096, 151936, 896, budget_bytes=1 << 30)
    assert small.mode == "forward" and small.n_tiles > large.n_tiles >= 1
    # the budget bounds the tile-sized buffers ([BT, H]-sized copies of X are the call's, outside it)
    assert small.tile_bytes <= 64 << 20 < large.tile_bytes
    hp = fg.plan("fused_linear_cross_entropy_loss_grad", 64, 1000, 32, mode="high_performance")
    assert hp.mode == "high_performance"


@pytest.mark.parametrize(
    ("args", "kw", "match"),
    [
        (("linear", 8, 8, 8), {}, "op must be one of"),
        (("fused_linear_online_max_sum", 8, 8, 8), {"mode": "memory_saving"}, "mode for"),
        (("fused_linear_cross_entropy_loss_grad", -1, 8, 8), {}, ">= 0"),
        # found by fuzzing: builtins errors, or values the op refuses taken silently
        ((FLCE, None, 8, 8), {}, "BT must be an int >= 0, got None"),
        ((FLCE, float("nan"), 8, 8), {}, "BT must be an int"),
        ((FLCE, 8, float("inf"), 8), {}, "V must be an int"),
        ((FLCE, 8, 8, 1.5), {}, "H must be an int"),
        ((FLCE, True, 8, 8), {}, "BT must be an int"),
        ((FLCE, 8, 8, 8), {"dtype": "bogus"}, "dtype must be one of"),
        ((FLCE, 8, 8, 8), {"dtype": "float64"}, "dtype must be one of"),
        ((FLCE, 8, 8, 8), {"filter_eps": -1.0}, "filter_eps must be"),
        ((FLCE, 8, 8, 8), {"filter_eps": "yes"}, "filter_eps must be"),
        ((FLCE, 8, 8, 8), {"filter_eps": 1e-3, "mode": "high_performance"}, "memory-saving"),
        ((FLCE, 8, 8, 8), {"budget_bytes": -1}, "budget_bytes must be an int >= 1"),
        ((FLCE, 8, 8, 8), {"budget_bytes": "x"}, "budget_bytes must be an int >= 1"),
    ],
)
def test_bad_arguments_are_161002(args, kw, match):
    with pytest.raises(fg.AclnnParamError, match=match) as e:
        fg.plan(*args, **kw)
    assert e.value.status == fg.ACLNN_ERR_PARAM_INVALID
    param = re.search(r"plan: (\w+)", str(e.value)).group(1)
    assert e.value.param == param


def test_what_the_ops_take_is_taken():
    """The spellings the ops take: ``filter_eps="auto"`` (the dtype's), a ``torch.dtype``, NumPy
    integers; ``gemm_choice`` of a bad dtype is 161002 too."""
    import ml_dtypes

    assert fg.plan(FLCE, 8, 8, 8, filter_eps="auto").filter_eps == float(ml_dtypes.finfo(BF16).eps) / 32
    assert fg.plan(FLCE, np.int64(8), np.int32(8), 8).BT == 8
    torch = pytest.importorskip("torch")
    assert fg.plan(FLCE, 8, 8, 8, dtype=torch.float16).gemm == fg.gemm_choice(np.float16)
    with pytest.raises(fg.AclnnParamError, match="gemm_choice: dtype must be one of"):
        fg.gemm_choice("bogus")


def test_a_huge_plan_is_made_at_once():
    """Found by fuzzing: the bf16 kernel's ``X`` pairs were summed tile by tile (BT = 2**34 took
    4 s, 2**62 forever); now a closed form — the same sum as the tiles' (checked at small BT)."""
    from fastgrad.kernels._bf16dot import b_size

    for BT in (1, 7, 300, 2049):
        p = fg.plan(FLCE, BT, 2600, 40, budget_bytes=400_000)
        got = {b.name: b.shape for b in p.buffers}.get("x_pairs_tiles")
        assert (got is not None) == (fg.gemm_choice(BF16).exact == "bf16")  # (the bf16 kernel's)
        if got is not None:
            want = sum(b_size(min(p.bt_tile, BT - b0), 40) for b0 in range(0, BT, p.bt_tile))
            assert got == (want,)
    p = fg.plan(FLCE, 2**62, 32, 8)  # returns (no timing asserted: a hang fails by the timeout)
    assert p.BT == 2**62



def test_the_plan_of_a_call_with_options_and_unhashable_names():
    """Found by fuzzing: ``fg.plan`` had no ``options=``, so the plan of a call made with
    ``options=fg.Options(workspace_bytes=..., gemm=...)`` could not be asked for (the plan made
    without them had other tiles), and ``fg.plan(["x"], ...)`` raised ``TypeError: unhashable
    type``.  Now ``options`` gives the call's plan and a non-str op is 161002."""
    BT, H, V = 300, 40, 2600
    x, w, t = _inputs(BT, H, V, BF16)
    opts = fg.Options(workspace_bytes=400_000, gemm="blas", native_isa="avx2")
    s = fg.fused_linear_online_max_sum(x, w, t, 0, V, options=opts)
    grad = np.full(BT, 1.0 / BT, np.float32)
    ran = fg.fused_linear_cross_entropy_loss_grad(
        grad, x, w, s.target_mask, s.masked_target,
        logits_max=s.logits_max_local, sum_exp_logits=s.sum_exp_logits_local, return_plan=True, options=opts,
    )[-1]
    made = fg.plan(FLCE, BT, V, H, dtype=BF16, options=opts)
    assert (made.bt_tile, made.v_tile, made.gemm, made.buffers) == (ran.bt_tile, ran.v_tile, ran.gemm, ran.buffers)
    assert made.workspace_bytes == ran.workspace_bytes
    assert (made.bt_tile, made.v_tile) != (lambda p: (p.bt_tile, p.v_tile))(fg.plan(FLCE, BT, V, H, dtype=BF16))
    assert made.gemm.isa == "avx2"
    # budget_bytes over the options' workspace_bytes, as documented
    assert fg.plan(FLCE, BT, V, H, dtype=BF16, options=opts, budget_bytes=1 << 30).v_tile > made.v_tile
    for bad, match in ((["x"], "op must be one of"), (None, "op must be one of"), (b"x", "op must be one of")):
        with pytest.raises(fg.AclnnParamError, match=match):
            fg.plan(bad, 8, 8, 8)
    with pytest.raises(fg.AclnnParamError, match="plan: options must be a fastgrad.Options"):
        fg.plan(FLCE, 8, 8, 8, options={"gemm": "blas"})
    with pytest.raises(fg.AclnnParamError, match="options.gemm"):
        fg.plan(FLCE, 8, 8, 8, options=fg.Options(gemm="mkl"))
