"""``fastgrad.plan`` / ``fastgrad.gemm_choice``: the plan an LM-head op will run, made without
running it — the same plan the op returns (``return_plan=True``) under the same settings."""

from __future__ import annotations

import numpy as np
import pytest
from common import BF16, workspace_budget

import fastgrad as fg


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
    ],
)
def test_bad_arguments_are_161002(args, kw, match):
    with pytest.raises(fg.AclnnParamError, match=match) as e:
        fg.plan(*args, **kw)
    assert e.value.status == fg.ACLNN_ERR_PARAM_INVALID
