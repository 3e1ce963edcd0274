"""The LM-head plans' buffer lists are what the loop allocates (issue 26: the memory estimate *is*
the list).

For the online max-sum and the FLCE grad (memory-saving, filtered, high-performance), every input
dtype, BLAS and the native kernel of each ISA this machine runs, H even and odd, one tile and many:

* the loop takes exactly the listed buffers, each once (``_lm_head.Workspace`` records them);
* the memory the call allocates (``tracemalloc``: NumPy reports its data buffers) is the plan's
  ``workspace_bytes`` plus the outputs, to within the unlisted row vectors and index arrays;
* the buffers depend on the GEMM choice (the native kernel's packed forms are not BLAS's fp32
  tiles), and a plan made for other operands is refused by name, not overrun.
"""

import numpy as np
import pytest
from common import BF16, least_peak, native_isas, native_transients, record_calls, set_isa, warm_calls, workspace_budget

import fastgrad as fg
from fastgrad import _outcache, tiling
from fastgrad.errors import InternalError
from fastgrad.lm_head import loop as _lm_head

DTYPES = {"fp32": np.float32, "bf16": BF16, "fp16": np.float16}
ENGINES = ["blas"] + [f"native-{i}" for i in native_isas() if i != "auto"]


def _inputs(dt, BT, H, V, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((BT, H)) * 0.5).astype(dt)
    w = (rng.standard_normal((V, H)) * 0.5).astype(dt)
    t = rng.integers(0, V, BT)
    return x, w, t


def _names(calls) -> list:
    """The buffer names of recorded ``Workspace.take(self, name, size, dtype)`` calls."""
    return [a[1] for a, _, _ in calls]


def _engine_transients(plan) -> int:
    """The GEMM engine's own buffers (``common.native_transients``) where the plan runs the native kernel."""
    return 0 if plan.gemm.exact is None else native_transients()


def _engine(engine):
    if engine == "blas":
        return fg.gemm("blas")
    set_isa(engine.split("-")[1])
    return fg.gemm("auto")


@pytest.mark.parametrize("H", [96, 97])
@pytest.mark.parametrize("budget", [1 << 30, 700_000], ids=["one-tile", "tiles"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("op", ["memory_saving", "filtered", "hp"])
def test_flce_grad_takes_and_holds_exactly_its_buffers(op, dt, engine, budget, H, monkeypatch):
    BT, V = 300, 2600
    x, w, t = _inputs(DTYPES[dt], BT, H, V)
    taken = record_calls(monkeypatch, _lm_head.Workspace, "take")
    try:
        with workspace_budget(budget), _engine(engine), _outcache.output_cache(0):
            s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
            grad = np.full(BT, 1.0 / BT, np.float32)
            p = None
            if op == "hp":
                z = x.astype(np.float32) @ w.astype(np.float32).T
                p = np.exp(z - z.max(1, keepdims=True))
                p = (p / p.sum(1, keepdims=True)).astype(np.float32)
            kw = {"filter_eps": 1e-3} if op == "filtered" else {}
            stats = (None, None, p) if op == "hp" else (s.logits_max_local, s.sum_exp_logits_local, None)
            gi = np.empty((BT, H), x.dtype)
            gw = np.empty((V, H), x.dtype)
            args = (grad, x, w, s.target_mask, s.masked_target, 0.0, *stats)
            # warm: JIT, the pool, each pool thread's kept scratch (_bf16dot._local: made the
            # first time a thread takes a task; with 16 threads two calls left some unmade, and
            # the timed calls made them: seen on a 16-core Xeon and under NUMBA_NUM_THREADS=16)
            for _ in range(warm_calls()):
                fg.fused_linear_cross_entropy_loss_grad(*args, out=(gi, gw), **kw)
            res = []

            def call():
                taken.clear()
                res[:] = [fg.fused_linear_cross_entropy_loss_grad(*args, out=(gi, gw), return_plan=True, **kw)[-1]]

            peak = least_peak(call)
            plan = res[0]
    finally:
        set_isa(None)
    names = [b.name for b in plan.buffers]
    assert sorted(_names(taken)) == sorted(names), (_names(taken), names)
    assert plan.workspace_bytes == sum(b.nbytes for b in plan.buffers)
    if budget < (1 << 30):
        assert plan.n_tiles > 1
        # within the budget, unless even one device base block (128 x 256) does not fit it
        assert plan.tile_bytes <= budget or (plan.bt_tile, plan.v_tile) == (tiling.BASE_BT, tiling.BASE_V)
    # what the call allocated: the listed buffers, plus row vectors ([BT]) and per-tile index
    # arrays of the filter (a few KiB); nothing of the size of a tile or of [BT, H] besides
    slack = 64 * BT + 24 * plan.v_tile + (1 << 16) + _engine_transients(plan)
    assert plan.workspace_bytes <= peak <= plan.workspace_bytes + slack, (peak, plan.workspace_bytes, slack)


@pytest.mark.parametrize("H", [96, 97])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dt", list(DTYPES))
def test_online_max_sum_takes_and_holds_exactly_its_buffers(dt, engine, H, monkeypatch):
    BT, V = 300, 2600
    x, w, t = _inputs(DTYPES[dt], BT, H, V)
    taken = record_calls(monkeypatch, _lm_head.Workspace, "take")
    inits = record_calls(monkeypatch, _lm_head.Workspace, "__init__")
    try:
        with workspace_budget(400_000), _engine(engine), _outcache.output_cache(0):
            for _ in range(warm_calls()):  # warm (as above)
                fg.fused_linear_online_max_sum(x, w, t, 0, V)

            def call():
                taken.clear()
                inits.clear()
                fg.fused_linear_online_max_sum(x, w, t, 0, V)

            peak = least_peak(call)
    finally:
        set_isa(None)
    plans = [a[1] for a, _, _ in inits]  # Workspace(self, plan)
    assert len(plans) == 1 and plans[0].n_tiles > 1
    plan = plans[0]
    assert sorted(_names(taken)) == sorted(b.name for b in plan.buffers)
    outputs = 3 * 4 * BT + -(-BT // 8) + 4 * BT  # max, sum, predicted (fp32); the mask bits; the target (int32)
    slack = 64 * BT + (1 << 16) + _engine_transients(plan)
    assert plan.workspace_bytes <= peak - outputs <= plan.workspace_bytes + slack, (peak, outputs, plan.workspace_bytes)


def test_buffers_follow_the_gemm_choice():
    BT, V, H = 512, 8192, 896
    blas = tiling.plan_linear_cross_entropy(BT, V, H, dtype="bfloat16")
    native = tiling.plan_linear_cross_entropy(
        BT, V, H, dtype="bfloat16", gemm=tiling.GemmChoice(exact="bf16", variant="avx2_bf16", a_form="f32")
    )
    b = {x.name for x in blas.buffers}
    n = {x.name for x in native.buffers}
    assert {"x32", "w32_tile", "product"} <= b and "w_packed" not in b
    assert {"w_packed", "x_pairs_tiles", "w_pairs_tile"} <= n and "w32_tile" not in n and "product" not in n
    # fp32 operands hold no copies of X or W
    f = {x.name for x in tiling.plan_linear_cross_entropy(BT, V, H, dtype="float32").buffers}
    assert not f & {"x32", "w32_tile"}


def test_a_plan_for_other_operands_is_refused_by_name():
    x, w, t = _inputs(BF16, 64, 32, 700)
    plan = tiling.plan_linear_cross_entropy(64, 700, 32, mode="forward", dtype="float32")  # fp32's list
    with pytest.raises(InternalError, match="x32"):  # an invariant, not the user's error
        _lm_head.Operands(x, w, plan)
