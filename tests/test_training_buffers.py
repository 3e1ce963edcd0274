"""The training loss's plan lists the buffers its kernel allocates (issue 26: the memory estimate
*is* the list, as for the aclnn LM-head ops in test_lm_head_buffers.py).

For the forward alone, the fused step (loss and gradients), the recompute from a saved lse
(vocabulary-major), gradient filtering, a 16-bit ``grad_weight`` (``accum_dtype``) and
``precision="fast"``; fp32, bf16, fp16 and fp64; the bf16 logits on BLAS and on the native kernel
of each ISA this machine runs (inside ``fastgrad.torch``'s setting, ``prefer_onednn``); H even
and odd; one row block and several:

* the kernel takes exactly the listed buffers, each once (``_lm_head.Workspace`` records them);
* what the call allocates (``tracemalloc``: NumPy reports its data buffers) is the plan's
  ``workspace_bytes`` plus the outputs, to within the unlisted ``[BT]`` row vectors and ``[K]``
  index arrays.
"""

import contextlib

import numpy as np
import pytest
from common import BF16, least_peak, native_isas, native_transients, record_calls, set_isa, warm_calls, workspace_budget

import fastgrad as fg
from fastgrad import _config, _outcache, tiling
from fastgrad.lm_head import loop as _lm_head

DTYPES = {"fp32": np.float32, "bf16": BF16, "fp16": np.float16, "fp64": np.float64}
ENGINES = ["blas"] + [f"native-{i}" for i in native_isas() if i != "auto"]
MODES = ["forward", "step", "recompute", "filtered", "accum16", "fast"]


@contextlib.contextmanager
def _engine(engine):
    """BLAS, or the native kernel of one ISA with the bf16 logits on it (the torch loss's setting)."""
    if engine == "blas":
        with fg.gemm("blas"):
            yield
        return
    set_isa(engine.split("-")[1])
    try:
        with fg.gemm("auto"), _config.prefer_onednn():
            yield
    finally:
        set_isa(None)


def _kwargs(mode, dt, lse):
    if mode == "forward":
        return {}
    kw: dict = {"return_grad": True}
    if mode == "recompute":
        kw["lse"] = lse
    elif mode == "filtered":
        kw["filter_eps"] = 1e-3
    elif mode == "accum16":
        kw["accum_dtype"] = dt
    elif mode == "fast":
        kw.update(lse=lse, precision="fast")
    return kw


def _output_bytes(r, BT) -> int:
    """The arrays the op returns (or holds while it runs): the gradients, [BT] statistics."""
    n = 0
    for a in (r.grad_input, r.grad_weight, r.grad_bias):
        n += 0 if a is None else a.nbytes
    return n + 8 * 8 * BT  # lse, z_target, z_sum, argmax and their float64 copies


#: (mode, dtype, engine): a 16-bit ``accum_dtype`` needs 16-bit operands; the training loss runs
#: the native kernel for bf16 logits only
CASES = [
    (m, d, e)
    for m in MODES
    for d in DTYPES
    for e in ENGINES
    if (m != "accum16" or d in ("bf16", "fp16")) and (e == "blas" or d == "bf16")
]


@pytest.mark.parametrize("H", [48, 49])
@pytest.mark.parametrize("budget", [1 << 30, 120_000], ids=["one-block", "blocks"])
@pytest.mark.parametrize(("mode", "dt", "engine"), CASES, ids=["-".join(c) for c in CASES])
def test_the_training_loss_takes_and_holds_exactly_its_buffers(mode, dt, engine, budget, H, monkeypatch):
    dtype = DTYPES[dt]
    BT, V = 120, 3000
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((BT, H)) * 0.5).astype(dtype)
    w = (rng.standard_normal((V, H)) * 0.5).astype(dtype)
    t = rng.integers(0, V, BT)
    t[::7] = -100
    taken = record_calls(monkeypatch, _lm_head.Workspace, "take")
    plans = record_calls(monkeypatch, tiling, "plan_training_loss")
    with workspace_budget(budget), _engine(engine), _outcache.output_cache(0):
        lse = fg.linear_cross_entropy(x, w, t).lse
        kw = _kwargs(mode, dtype, lse)
        for _ in range(warm_calls()):  # warm: JIT, the pool, each pool thread's kept scratch
            r = fg.linear_cross_entropy(x, w, t, **kw)

        def call():
            taken.clear()
            plans.clear()
            fg.linear_cross_entropy(x, w, t, **kw)

        peak = least_peak(call)
    assert len(plans) == 1
    plan = plans[0][2]
    names = [b.name for b in plan.buffers]
    assert sorted(a[1] for a, _, _ in taken) == sorted(names), ([a[1] for a, _, _ in taken], names)
    assert len(set(names)) == len(names)
    assert plan.workspace_bytes == sum(b.nbytes for b in plan.buffers) > 0
    if budget < (1 << 30) and mode in ("step", "filtered", "accum16"):
        assert plan.n_blocks > 1
    if mode in ("recompute", "fast"):
        assert plan.vocab_major
    slack = 200 * BT + 48 * V + (1 << 16)
    if engine != "blas":
        slack += native_transients()
    held = peak - _output_bytes(r, BT)
    assert plan.workspace_bytes - 8 * 8 * BT <= held <= plan.workspace_bytes + slack, (
        held,
        plan.workspace_bytes,
        slack,
        plan.buffers,
    )


def test_the_buffers_follow_what_the_call_computes():
    def names(**kw):
        args = dict(itemsize=4, widen=True, want_grad=True, recompute=False, filtered=False, logits16=False)
        args.update(kw)
        p = tiling.plan_training_loss(512, 8192, 8192, 96, v_chunk=4096, budget_bytes=1 << 24, **args)
        return {b.name for b in p.buffers}

    step = names()
    assert {"logits_block", "x_block", "grad_input_product", "grad_weight_product"} <= step
    assert "w_chunk_next" in step or "w_whole" in step
    assert not names(widen=False) & {"x_block", "w_chunk", "w_whole"}  # fp32 operands: no copies
    fwd = names(want_grad=False)
    assert not fwd & {"grad_input_product", "grad_weight_product"}
    assert "grad_input_product" not in names(grads=(False, True, False))
    rec = names(recompute=True)
    assert "grad_weight_chunk" not in rec and "grad_weight_chunk" in names(recompute=True, accum16=True)
    assert {"kept_g", "filter_flags"} <= names(filtered=True)
    fast = names(recompute=True, logits16=True, fast=True, a_form="f32", itemsize=4)
    assert {"x32", "w_packed", "x_pairs_block", "w_pairs_chunk", "fast_e_row"} <= fast
    assert not fast & {"x_block", "x_whole", "w_chunk"}  # the kernel's forms only
    # the accumulating tiles summed in the BLAS call (GemmChoice.beta1): no scratch products,
    # except a 16-bit grad_weight's (its products are rounded onto the output) and the recompute's
    acc = names(beta1=True)
    assert not acc & {"grad_input_product", "grad_weight_product"} and "logits_block" in acc
    assert "grad_weight_product" in names(beta1=True, accum16=True)
    assert "grad_input_product" in names(beta1=True, recompute=True)
    assert not names(beta1=False) ^ step


def test_the_result_carries_the_plan_it_ran():
    """``r.plan``: the plan the op made for this call (the one ``tiling.plan_training_loss``
    returned), so a user reads the memory the call held besides its outputs."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 32)).astype(BF16)
    w = rng.standard_normal((500, 32)).astype(BF16)
    t = rng.integers(0, 500, 64)
    with workspace_budget(64 * 500 * 4 // 2):
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
        q = fg.linear_cross_entropy(x, w, t, return_grad=True, lse=r.lse)
    assert isinstance(r.plan, tiling.TrainingPlan) and not r.plan.vocab_major and r.plan.n_blocks == 2
    assert q.plan.vocab_major and q.plan.buffers != r.plan.buffers
    assert r.plan.workspace_bytes == sum(b.nbytes for b in r.plan.buffers) > 0
    got = {b.name for b in r.plan.buffers}
    assert "logits_block" in got and ("grad_weight_product" in got) == (not r.plan.accumulate_in_gemm)
