"""op_kernel: FusedCrossEntropyLossWithMaxSum on the CPU.

``loss = log(sum_exp) - predicted``; with ``vocab_parallel_logits`` given,
``softmax = exp(logits - max) · (1 / sum_exp)`` (reciprocal multiply, as the kernel and its golden).
"""

from __future__ import annotations

import numpy as np

from .. import dtypes as D
from .._jit import pjit, prange
from ..vocab_parallel import smoothed_loss
from ._vmath import exp_f32

OP = "fused_cross_entropy_loss_with_max_sum"


@pjit
def _softmax16(logits, code, lmax, sexp, out):
    n, v = logits.shape
    for i in prange(n):
        m = lmax[i]
        inv = np.float32(1.0) / sexp[i]
        for j in range(v):
            out[i, j] = exp_f32(D.to_f32(logits[i, j], code) - m) * inv


@pjit
def _softmax32(logits, lmax, sexp, out):
    n, v = logits.shape
    for i in prange(n):
        m = lmax[i]
        inv = np.float32(1.0) / sexp[i]
        for j in range(v):
            out[i, j] = exp_f32(logits[i, j] - m) * inv


def fused_cross_entropy_loss_with_max_sum(
    *,
    logits_max: np.ndarray,
    sum_exp_logits: np.ndarray,
    predicted_logits: np.ndarray,
    label_smoothing: float,
    vocab_parallel_logits: np.ndarray | None,
    out: tuple[np.ndarray, np.ndarray | None],
) -> None:
    loss, softmax = out
    se = np.asarray(sum_exp_logits, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.subtract(np.log(se), np.asarray(predicted_logits, dtype=np.float32), out=loss)
    if softmax is not None and softmax.size:
        lm = np.ascontiguousarray(logits_max, dtype=np.float32)
        sc = np.ascontiguousarray(se)
        lg = np.ascontiguousarray(vocab_parallel_logits)
        if lg.dtype == D.FLOAT32:
            _softmax32(lg, lm, sc, softmax)
        else:
            _softmax16(lg.view(np.uint16), D.code_of(lg.dtype), lm, sc, softmax)
    if label_smoothing != 0.0 and softmax is not None:
        loss[...] = smoothed_loss(loss, softmax, label_smoothing)
