"""op_api: aclnnFusedCrossEntropyLossWithMaxSum — the loss (and softmax) from the all-reduced stats."""

from __future__ import annotations

import numpy as np

from .. import arrays
from .. import dtypes as D
from .._config import is_strict
from ..backends import dispatch
from ..errors import invalid
from ._common import parse_float

OP = "fused_cross_entropy_loss_with_max_sum"


def fused_cross_entropy_loss_with_max_sum(logits_max, sum_exp_logits, predicted_logits,
                                          label_smoothing=0.0, vocab_parallel_logits=None):
    r"""Per-row cross-entropy loss from the (all-reduced) online max/sum statistics.

    The CPU counterpart of ``aclnnFusedCrossEntropyLossWithMaxSum`` (ops-nn
    ``loss/fused_cross_entropy_loss_with_max_sum``, kernel and golden).

    Parameters
    ----------
    logits_max, sum_exp_logits, predicted_logits : fp32 [BT]
        Global row max, ``Σ exp(logits - max)`` and ``logits[target] - max`` after combining
        the shards (see :func:`fused_linear_online_max_sum`).
    label_smoothing : float, default 0
        The device's golden ignores it; strict mode requires 0 (161002).  Extension (needs
        ``vocab_parallel_logits``): Megatron's smoothed loss over the local vocabulary
        ``K``: ``loss = (1 - s)·loss - s·mean_v(log softmax)``, ``s = α·K/(K-1)``.
    vocab_parallel_logits : bf16 | fp16 | fp32 [BT, V], optional
        The shard's logits (``return_logits=True`` of the forward).  When given, the softmax is
        returned too.

    Returns
    -------
    (loss fp32 [BT], softmax fp32 [BT, V] or None)
        ``loss = log(sum_exp_logits) - predicted_logits``;
        ``softmax = exp(logits - logits_max) · (1 / sum_exp_logits)`` (reciprocal multiply, as
        the kernel).

    Raises
    ------
    AclnnError 161001 — a statistics input is None.
    AclnnError 161002 — dtypes (fp32 stats; logits bf16/fp16/fp32), ranks, lengths != BT,
    ``vocab_parallel_logits.shape[0] != BT``, label_smoothing ≠ 0 without logits (or in strict mode).
    """
    kind = arrays.kind_of(logits_max, sum_exp_logits, predicted_logits)
    lm = arrays.as_numpy(logits_max, "logits_max", op=OP)
    se = arrays.as_numpy(sum_exp_logits, "sum_exp_logits", op=OP)
    pr = arrays.as_numpy(predicted_logits, "predicted_logits", op=OP)
    lg = arrays.as_numpy(vocab_parallel_logits, "vocab_parallel_logits", required=False, op=OP)
    for a, n in ((lm, "logits_max"), (se, "sum_exp_logits"), (pr, "predicted_logits")):
        arrays.check_dtype(a, n, [D.FLOAT32], OP)
        arrays.check_ndim(a, n, 1, OP)
    BT = lm.shape[0]
    arrays.check_shape(se, "sum_exp_logits", (BT,), OP)
    arrays.check_shape(pr, "predicted_logits", (BT,), OP)
    if lg is not None:
        arrays.check_dtype(lg, "vocab_parallel_logits", D.FLOAT_DTYPES, OP)
        arrays.check_ndim(lg, "vocab_parallel_logits", 2, OP)
        if lg.shape[0] != BT:
            raise invalid("vocab_parallel_logits", f"shape[0] == {BT}", f"shape {lg.shape}", OP)
    ls = parse_float(label_smoothing, "label_smoothing", OP)
    if not np.isfinite(ls):
        raise invalid("label_smoothing", "a finite number", ls, OP)
    if ls != 0.0 and (is_strict() or lg is None):
        why = "0 (strict mode)" if is_strict() else "0 unless vocab_parallel_logits is given"
        raise invalid("label_smoothing", why, ls, OP)

    loss = np.empty(BT, np.float32)
    softmax = np.empty(lg.shape, np.float32) if lg is not None else None
    dispatch(OP)(logits_max=lm, sum_exp_logits=se, predicted_logits=pr, label_smoothing=ls,
                 vocab_parallel_logits=lg, out=(loss, softmax))
    if ls != 0.0:
        _smooth_loss(loss, softmax, ls)
    return arrays.wrap(loss, kind), arrays.wrap(softmax, kind)


def _smooth_loss(loss: np.ndarray, softmax: np.ndarray, alpha: float) -> None:
    """Megatron's label smoothing applied to the loss, from the shard's softmax."""
    K = softmax.shape[1]
    if K <= 1:
        return
    s = alpha * K / (K - 1)
    with np.errstate(divide="ignore"):
        mean_log = np.log(softmax.astype(np.float64)).mean(axis=1)
    loss[...] = ((1.0 - s) * loss.astype(np.float64) - s * mean_log).astype(np.float32)
