"""Kernel: the training linear cross-entropy, forward and backward fused by row blocks.

Not a device op (docs/spec.md, "Training loss").  For each block of ``nb`` rows (``nb`` from the
memory budget, never from BT or the thread count):

1. ``L = X[b] · Wᵀ`` in the compute dtype (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64) by
   BLAS, vocabulary chunk by vocabulary chunk (16-bit weights widened exactly per chunk);
2. a parallel Numba pass turns the logits into ``z = softcap(L + bias) / temperature`` in place
   and computes this shard's row statistics: max (and its first index), ``Σ exp(z - max)``, the
   target's ``z``, ``Σ_v w_v z_v`` (label smoothing) and, for the entropy,
   ``Σ exp(z - max)·(z - max)``;
3. ``combine`` (optional, the caller's all-reduce for vocabulary parallelism) makes them global;
4. when gradients are wanted, a second pass overwrites ``z`` with ``dloss/dL``
   (``G = (a·p - b·onehot - e·w + h·p·(μ - z))·dz/dL``, ``p = exp(z - lse)`` from the *same*
   logits as the statistics, not rounded; ``h·p·(μ - z)`` the entropy's term, ``μ = Σ p·z``) and two
   GEMMs accumulate ``grad_input[b] = G·W`` and ``grad_weight += Gᵀ·X[b]`` in the compute dtype.

The row blocks run on the LM-head loop's row-major order (``lm_head.loop.run_row_blocks``;
:class:`_RowStep` is its epilogue: steps 1-2 its statistics sweep, 3 ``end_statistics``, 4 its
gradient sweep).  Three GEMMs per row block, run in stages where the plan says so
(``TrainingPlan.staged_statistics`` / ``staged_gradient``, ``lm_head.loop.sweep``): the logits tiles of
chunk ``c`` beside the widening of chunk ``c + 1`` and the statistics of chunk ``c - 1``; then chunk
``c``'s two gradient GEMMs beside chunk ``c + 1``'s gradient pass and widening — the same calls on
the same operands as chunk by chunk (the same bits), the element-wise passes and the widening
hidden behind the GEMMs (faster at the Qwen2.5-0.5B head: bench/results/README.md).  Each step
declares what it reads and writes (``_stats_uses`` / ``_grad_uses``: a chunk's part of the
logits, a widening buffer, the running statistics, ``grad_input``'s accumulator, a chunk's rows
of ``grad_weight``), so the stages run as a dependency graph, not between barriers.  Where the
plan says so (``TrainingPlan.accumulate_in_gemm``) the accumulating tiles add their product in
the BLAS call (``beta = 1``) instead of through a scratch product.
The forward alone (no gradient) keeps one chunk of ``tiling.TRAIN_VM_CHUNK``
columns at a time instead of the block's whole row, with all rows in one block while
``[BT, TRAIN_VM_CHUNK]`` fits half the workspace (the weight widened once).  With ``lse`` given (the
backward of a forward that did not compute the gradient) the dense gradient is recomputed
**vocabulary-major** (``_vocab_major``): per chunk of ``TRAIN_VM_CHUNK`` columns, its logits for all
rows, steps 4's pass and products; a chunk's ``grad_weight`` is complete after its rows, so a
16-bit one is rounded once from fp32 and no ``[K, H]`` accumulator exists.

Gradient filtering (``params.filter_eps``, CCE's ``filter_eps``): after step 4's pass over
each vocabulary chunk (the chunk still in cache) a read-only pass flags, per row and per block
of ``plan.filter_cols`` vocabulary columns, whether some ``|G[r, v]|`` is not below
``filter_eps·|coef_ce[r]|`` (the row's scale: the upstream gradient and the mean's ``1/Σw``;
a row whose gradient is identically 0 — ignored — has nothing to keep), or the block holds
the row's target column.  A block of ``plan.filter_rows`` rows × ``filter_cols`` columns without a
flag is skipped in both GEMMs: the kept blocks' columns of ``G`` and rows of ``W`` are
gathered (at most ``v_chunk`` columns at a time) and the products accumulated.  A row block
with every block kept takes the dense path unchanged (bitwise).  ``grad_bias`` is the column
sum of the whole ``G``, never filtered.

Pure: imports only dtypes helpers, the JIT helpers, the allocator, the vector math and the GEMM helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import dtypes as D
from ..errors import InternalError
from ..lm_head.epilogues.recompute import _vocab_major
from ..lm_head.epilogues.train_rows import _RowStep
from ..lm_head.loop import Workspace, run_row_blocks
from ..lm_head.params import F_ENTROPY_GRAD, GradOutputs, PassConstants, RowCoefficients, kernel_arrays
from ..tiling import LossParams, TrainingPlan, training_modes
from ._gemm import (
    blas_for,
)

__all__ = ["linear_cross_entropy_cpu"]


@blas_for(lambda kw: kw["plan"].gemm.engine)
def linear_cross_entropy_cpu(
    *,
    input: np.ndarray,
    weight: np.ndarray,
    target_cols: np.ndarray,
    bias: np.ndarray | None,
    class_weight: np.ndarray | None,
    target_weight: np.ndarray,
    coef_ce: np.ndarray | None,
    coef_z: np.ndarray | None,
    params: LossParams,
    plan: TrainingPlan,
    coef_h: np.ndarray | None = None,
    z_mean: np.ndarray | None = None,
    lse: np.ndarray | None,
    combine: Callable | None,
    out: dict[str, Any],
    progress: Callable[[int, int], object] | None = None,
) -> None:
    """The ``cpu`` backend's implementation of ``fastgrad.linear_cross_entropy``: the block loop
    (module docstring), BLAS single-threaded, on the GEMMs ``plan.gemm`` names (a
    ``tiling.GemmChoice``: the op layer's choice from the settings).  Arrays are validated by the
    op; a plan that contradicts the call raises ``InternalError``.

    ``params``: the scalar parameters (``tiling.LossParams``; the block sizes are the plan's).
    ``coef_h`` [BT]: the entropy's upstream coefficient per row (None: no entropy term in the
    gradient); ``z_mean`` [BT]: ``μ = Σ p·z`` for the recompute (with ``lse``).
    ``out``: dict of preallocated outputs (``lse``, ``max``, ``sum_exp``, ``z_target``, ``z_sum``,
    ``argmax``, ``z_mean``, ``entropy``, ``grad_input``, ``grad_weight``, ``grad_bias``; absent or
    None: not computed) and ``filter_stats``, a dict receiving ``blocks_total`` /
    ``blocks_skipped``.  With ``z_mean`` or ``entropy`` (or ``coef_h`` in the forward) the
    statistics include ``Σ exp(z - max)·(z - max)`` and ``combine`` takes and returns it as a sixth value.
    ``progress(done, total)``: after each row block (the recompute: after each tile of its grid).
    """
    gemm = plan.gemm
    eng = gemm.engine
    BT, H = input.shape
    K = weight.shape[0]
    cdt = np.float64 if input.dtype == np.float64 else np.float32
    gi, gw, gb = out.get("grad_input"), out.get("grad_weight"), out.get("grad_bias")
    # grad_weight in a 16-bit dtype (``accum_dtype``): its bits, accumulated with rounding
    gw_code = D.code_of(gw.dtype) if (gw is not None and gw.dtype != cdt) else None
    gw_acc = gw.view(np.uint16) if (gw is not None and gw_code is not None) else gw
    want_grad = gi is not None or gw is not None or gb is not None
    recompute = lse is not None
    need_ent = not recompute and (coef_h is not None or any(out.get(k) is not None for k in ("z_mean", "entropy")))
    par, flags = kernel_arrays(
        params,
        cdt,
        softcap=params.softcap is not None,
        bias=bias is not None,
        class_weight=class_weight is not None,
        entropy_stat=need_ent,
        entropy_grad=coef_h is not None,
    )
    bias_c = bias.astype(cdt) if bias is not None else np.zeros(1, cdt)
    cw_c = class_weight.astype(cdt) if class_weight is not None else np.zeros(1, cdt)
    wt_c = target_weight.astype(cdt)
    coef_ce = coef_ce.astype(cdt) if coef_ce is not None else np.zeros(BT, cdt)
    coef_z = coef_z.astype(cdt) if coef_z is not None else np.zeros(BT, cdt)
    coef_h = coef_h.astype(cdt) if coef_h is not None else np.zeros(BT, cdt)
    tcol = np.ascontiguousarray(target_cols, dtype=np.int64)
    # the dense products write every element of grad_input / grad_weight (the first chunk, the
    # first row block) in parallel: no serial first touch of fresh memory; zeros only where
    # something may be left unwritten (filtering skips blocks; K = 0 or BT = 0 writes nothing)
    partial = params.filter_eps is not None or K == 0 or BT == 0
    if gi is not None and partial:
        gi[...] = 0
    # the recompute of the gradient alone runs vocabulary-major (``_vocab_major``); the plan was
    # made by the same rule (a plan made for other arguments is refused below)
    vmajor, filtering = training_modes(
        want_grad=want_grad, recompute=recompute, filtered=params.filter_eps is not None, K=K, BT=BT
    )
    if gw is not None and (partial or (gw_code is not None and not vmajor)):  # 16-bit: accumulated from zero
        gw[...] = 0
    if gb is not None:
        gb[...] = 0
    if not recompute:
        lse_all = out["lse"]
        zmean_all = out.get("z_mean")
    else:
        lse_all = np.ascontiguousarray(lse, dtype=cdt)
        zmean_all = np.ascontiguousarray(z_mean, dtype=cdt) if flags[F_ENTROPY_GRAD] else None
    if zmean_all is None:  # computed (need_ent) or read (flags[F_ENTROPY_GRAD]) only when wanted
        zmean_all = np.zeros(BT, cdt)
    if BT == 0:
        return
    # the plan's row blocks and chunks (made by the op layer: tiling.plan_training_loss): the
    # forward alone keeps one chunk at a time, for all rows while they fit half the budget; with
    # the gradient, the row block's whole row; from the global V, so every rank of a
    # vocabulary-parallel group plans the same row blocks (the combine runs per block)
    W = weight if weight.flags.c_contiguous else np.ascontiguousarray(weight)
    if vmajor != plan.vocab_major:
        raise InternalError(f"plan.vocab_major is {plan.vocab_major}, the call's arguments say {vmajor}")
    if filtering != (plan.filter_rows > 0):
        raise InternalError(f"plan.filter_rows is {plan.filter_rows}, the call's arguments say filtering={filtering}")
    # every buffer from the plan's list (tiling.training_buffers): the memory estimate is what runs
    ws = Workspace(plan)
    grads = GradOutputs(gi, gw, gw_acc, gw_code, gb)
    rows = RowCoefficients(tcol, wt_c, lse_all, coef_ce, coef_z, coef_h, zmean_all)
    consts = PassConstants(cw_c, bias_c, par, flags)
    if vmajor:
        _vocab_major(
            input,
            W,
            cdt,
            grads,
            rows,
            consts,
            plan,
            ws,
            params.round_grad,
            gemm,
            progress,
        )
        return
    # the fused step / the forward: row blocks outer on the LM-head loop's row-major order
    step = _RowStep(
        input,
        W,
        cdt,
        plan,
        gemm,
        ws,
        grads=grads,
        rows=rows,
        consts=consts,
        out=out,
        params=params,
        combine=combine,
        recompute=recompute,
        need_ent=need_ent,
    )
    run_row_blocks(plan, step, eng, progress)
