"""op_kernel: FusedLinearOnlineMaxSum on the CPU (the companion forward).

Per tile of the op_host plan: ``L = X[b] · W[v]ᵀ`` in fp32 (BLAS), rounded to ``logits_dtype``
(the input dtype by default: the device's matmul output type; fp32 keeps the logits), then a
parallel Numba pass updates each row's running max and sum of exponentials online
(``s <- s·exp(m - m') + Σ exp(l - m')``) and picks the target logit.
The tile order is fixed by the plan, so results do not depend on the thread count.

bf16 ``input`` and ``weight`` on the GEMM setting ``"auto"``, on a CPU with AVX-512 BF16: the
logits GEMM runs on the exact-product bf16 kernel (``_bf16dot``): the same fp32 GEMM of the
same bf16 values (products exact), summed in another fixed order, at about twice sgemm's rate;
bf16 subnormals read as zero.  fp16 ``input`` and ``weight`` on ``"auto"``, on a CPU with
AVX-512F: the logits GEMM runs on the fp32 kernel of the same module over the widened values
(products of fp16 values exact in fp32; summed in another fixed order), faster than OpenBLAS's
sgemm where OpenBLAS lacks a kernel for the CPU (Zen 5 EPYC; figures in bench/results/README.md,
"Measurements behind the source's choices").

The tile loop and the logits GEMM are the LM-head loop's (``lm_head/loop.py``, shared with
the FLCE grad); the op's epilogue is ``lm_head/epilogues/online_stats.OnlineStats``; this module holds the entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from .. import dtypes as D
from ..lm_head.epilogues.online_stats import OnlineStats
from ..lm_head.loop import Operands
from ..lm_head.loop import run as run_tiles
from ..lm_head.plan_types import LinearCrossEntropyPlan
from ..vocab_parallel import pack_target_mask, shard_target_mask
from ._gemm import blas_for

OP = "fused_linear_online_max_sum"

#: ``(logits_max, sum_exp_logits, predicted_logits, target_mask, masked_target,
#: vocab_parallel_logits or None)``: the op's outputs, written by :func:`run`.
Outputs: TypeAlias = "tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]"


def run(
    input: np.ndarray,
    weight: np.ndarray,
    target: np.ndarray,
    vocab_start_index: int,
    vocab_end_index: int,
    logits_dtype: np.dtype,
    out: Outputs,
    plan: LinearCrossEntropyPlan,
    progress: Callable[[int, int], object] | None = None,
) -> LinearCrossEntropyPlan:
    """``out = (logits_max, sum_exp, predicted, target_mask, masked_target, logits or None)``."""
    lmax, sexp, pred, tmask, mtarget, logits = out
    BT, H = input.shape
    V = weight.shape[0]
    t = np.asarray(target).astype(np.int64, copy=False)
    masked = shard_target_mask(t, vocab_start_index, vocab_end_index)
    local = np.where(masked, 0, t - vocab_start_index)
    mtarget[...] = local.astype(mtarget.dtype)
    tmask[...] = pack_target_mask(masked, vocab_start_index, vocab_end_index)
    tcol = np.where(masked | (local >= V), -1, local).astype(np.int64)

    lmax[...] = -np.inf
    sexp[...] = 0.0
    picked = np.zeros(BT, np.float32)
    if BT and V:
        # 16-bit operands: the logits on an exact-product kernel where it may run (bf16: the
        # bf16 kernel; fp16: the fp32 kernel over widened operands); BLAS otherwise (plan.gemm)
        ops = Operands(input, weight, plan, logits=True, weight_tiles="logits")
        epi = OnlineStats(ops, plan, D.code_of(logits_dtype), lmax, sexp, tcol, picked, logits)
        run_tiles(plan, ops, epi, progress)
    elif logits is not None:
        logits[...] = 0
    # unmasked rows: picked - max, picked 0 where no tile holds the column (masked_target >= V:
    # the device's zeroed atomic sum, fused_linear_online_max_sum.h:948-953,1070-1076); an
    # empty shard (V = 0, an extension) keeps 0
    pred[...] = np.where(masked | (V == 0), np.float32(0.0), picked - lmax).astype(np.float32)
    return plan


@blas_for(lambda kw: kw["plan"].gemm.engine)
def fused_linear_online_max_sum(
    *,
    input: np.ndarray,
    weight: np.ndarray,
    target: np.ndarray,
    vocab_start_index: int,
    vocab_end_index: int,
    return_logits: bool,
    logits_dtype: npt.DTypeLike,
    out: Outputs,
    plan: LinearCrossEntropyPlan,
    progress: Callable[[int, int], object] | None = None,
) -> None:
    """The ``"cpu"`` entry point (arguments validated by the op; ``return_logits`` is implied
    by ``out[5]``)."""
    run(input, weight, target, vocab_start_index, vocab_end_index, np.dtype(logits_dtype), out, plan, progress)
