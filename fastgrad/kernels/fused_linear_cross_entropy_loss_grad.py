"""op_kernel: FusedLinearCrossEntropyLossGrad on the CPU.

Memory-saving mode (``softmax is None``), per tile of the plan (``tiling.LinearCETiling``):

1. ``L = X[b] · W[v]ᵀ``                         fp32 GEMM (BLAS), never rounded (device: mm0, fp32 out)
2. ``g = round_dtype((exp(L - logits_max) / sum_exp_logits - onehot) · grad)``
                                                parallel Numba epilogue, in place (device: V1 + cast)
3. ``gi32[b] += g · W[v]``                      fp32 GEMM (device: mm1 accumulated in fp32)
4. ``gw32 += gᵀ · X[b]``                        fp32 GEMM (device: mm2 accumulated in fp32)

after the row tiles of one vocabulary tile, ``grad_weight[v] = round(gw32)``; at the end
``grad_input = round(gi32)``.  High-performance mode reads ``softmax`` instead of steps 1–2's
exponential and never writes to it.

All scratch is tile-sized or ``[BT, H]``-sized: nothing grows with BT×V.

The tile loop and the logits GEMM are the LM-head loop's (``lm_head/loop.py``, shared with
the online max-sum); the op's epilogue (steps 2–4 and the rounding of ``grad_weight``) is
``lm_head/epilogues/flce_grad.FlceGrad``; this module holds the entry point.

bf16 ``input`` and ``weight`` on the GEMM setting ``"auto"``, on a CPU with AVX-512 BF16: the
three GEMMs run on the exact-product bf16 kernel (``_bf16dot``), at about twice sgemm's rate.
Every operand of steps 1, 3 and 4 is a bf16 value (``g`` is rounded to bf16 by step 2, as on the
device), so each product is exact in fp32 and the result is the same fp32 GEMM of the same
values, summed in fp32 in another fixed order — as the device's Cube unit multiplies bf16
operands into fp32.  The one further difference: the instruction reads bf16 subnormals
(|x| < 2⁻¹²⁶, e.g. a ``g`` of a probability below ~1e-38) as zero.  Filtered tiles run their
kept blocks on the kernel too (the kept weight rows gathered as bits, then interleaved).

fp16 ``input`` and ``weight`` on ``"auto"``, on a CPU with AVX-512F: the three GEMMs run on the
fp32 kernel of ``_bf16dot`` (one fused multiply-add per product, 6 × 64 accumulators): ``X`` and
each vocabulary tile of ``W`` widened once into rows padded to 64 columns (the gradient GEMMs'
``B``), the tile also widened transposed (the logits' ``B``), ``gᵀ`` read in place as a strided
``A``.  ``g`` is rounded to fp16 by step 2, so every product of fp16 values is exact in fp32 and
the result is the same fp32 GEMM summed in another fixed order — faster than OpenBLAS's sgemm
on a Zen 5 EPYC, where OpenBLAS lacks a Zen 5 kernel (the FLCE grad then beats its three sgemms;
figures in bench/results/README.md, "Measurements behind the source's choices").  Filtered
tiles keep BLAS for their kept blocks.

Gradient filtering (``plan.filter_eps``, memory-saving mode; an extension, as Cut
Cross-Entropy's ``filter_eps``): before the epilogue a read-only pass over the logits tile
records, per row and per block of ``plan.filter_cols`` columns, whether any
``|softmax - onehot·(1-s) - s/K|`` may reach eps (a threshold on the logit:
``l >= logits_max + log(eps'·sum_exp)``, with a margin); a block of
``plan.filter_rows`` rows × ``filter_cols`` columns where none is (the target column never is
negligible) contributes nothing to steps 3–4 and its ``g`` is never computed (step 2 runs on the
kept blocks only): the kept blocks' columns of ``g`` and rows of ``W`` are gathered and the two
GEMMs run on them.  A tile with every block kept takes the dense path
unchanged (bitwise equal to the unfiltered op).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import dtypes as D
from ..lm_head.epilogues.flce_grad import FlceGrad
from ..lm_head.loop import Operands
from ..lm_head.loop import run as run_tiles
from ..lm_head.plan_types import LinearCrossEntropyPlan
from ..vocab_parallel import live_filter_eps, megatron_smoothing, target_columns, unpack_target_mask
from ._gemm import blas_for
from ._linear import narrow

OP = "fused_linear_cross_entropy_loss_grad"


@blas_for(lambda kw: kw["plan"].gemm.engine)
def fused_linear_cross_entropy_loss_grad(
    *,
    grad: np.ndarray,
    input: np.ndarray,
    weight: np.ndarray,
    target_mask: np.ndarray,
    masked_target: np.ndarray,
    label_smoothing: float,
    logits_max: np.ndarray | None,
    sum_exp_logits: np.ndarray | None,
    softmax: np.ndarray | None,
    out: tuple[np.ndarray, np.ndarray],
    plan: LinearCrossEntropyPlan,
    progress: Callable[[int, int], object] | None = None,
    stats: dict[str, int] | None = None,
) -> LinearCrossEntropyPlan:
    """The ``"cpu"`` entry point (arguments validated by the op): the op over its tile plan, BLAS
    single-threaded (the tile grid is the parallelism), on the GEMMs the plan names
    (``plan.gemm``, the op layer's choice).  ``out = (grad_input, grad_weight)``, C-contiguous.

    ``progress``: optional callable(done, total) invoked after each tile (the CLI's bar).
    ``stats``: optional dict receiving ``blocks_total`` / ``blocks_skipped`` (filtering).
    """
    stats = {} if stats is None else stats
    stats.setdefault("blocks_total", 0)
    stats.setdefault("blocks_skipped", 0)
    gi_out, gw_out = out
    BT, H = input.shape
    V = weight.shape[0]
    if BT == 0 or V == 0 or H == 0:
        gi_out[...] = 0
        gw_out[...] = 0
        return plan
    code = D.code_of(input.dtype)
    grad32 = np.ascontiguousarray(grad, dtype=np.float32)
    masked = unpack_target_mask(target_mask, BT)
    tcol = target_columns(masked_target, masked, V)
    s_, s_over_k = megatron_smoothing(float(label_smoothing), V)
    smooth, inv_k = np.float32(s_), np.float32(1.0 / V if s_ else 0.0)

    eps = live_filter_eps(plan.filter_eps if softmax is None else None, float(label_smoothing), V)
    # 16-bit operands: the three GEMMs on an exact-product kernel where it may run (bf16: the
    # bf16 kernel; fp16: the fp32 kernel over widened operands padded to its 64-column B)
    ops = Operands(input, weight, plan, logits=softmax is None, weight_tiles="all")
    stat: tuple | np.ndarray
    if softmax is None:
        stat = (
            np.ascontiguousarray(logits_max, dtype=np.float32),
            np.ascontiguousarray(sum_exp_logits, dtype=np.float32),
        )
    else:
        stat = np.ascontiguousarray(softmax, dtype=np.float32)  # a view when already contiguous
    epi = FlceGrad(input, plan, ops, stat, grad32, tcol, code, smooth, inv_k, eps, float(s_over_k), gw_out, stats)
    run_tiles(plan, ops, epi, progress)
    narrow(epi.gi32, gi_out)
    return plan
