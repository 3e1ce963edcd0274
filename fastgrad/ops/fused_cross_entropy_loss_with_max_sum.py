"""op_api: aclnnFusedCrossEntropyLossWithMaxSum — the loss (and softmax) from the all-reduced stats."""

from __future__ import annotations

from typing import Any

from ..dtypes import FLOAT32, FLOAT_DTYPES
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "fused_cross_entropy_loss_with_max_sum"

_STATS = ("logits_max", "sum_exp_logits", "predicted_logits")


def _relations(c: Call) -> None:
    BT = c.shape_of("logits_max")[0]
    for name in _STATS[1:]:
        c.expect_shape(name, (BT,))
    lg = c.a["vocab_parallel_logits"]
    if lg is not None and lg.shape[0] != BT:
        c.bad("vocab_parallel_logits", f"shape[0] == {BT}", f"shape {tuple(lg.shape)}")
    if c.attrs["label_smoothing"] != 0.0 and lg is None:
        c.bad("label_smoothing", "0 unless vocab_parallel_logits is given", c.attrs["label_smoothing"])
    c.outs["loss"] = OutSpec((BT,), FLOAT32)
    c.outs["softmax"] = None if lg is None else OutSpec(tuple(lg.shape), FLOAT32)


DECL = OpDef(
    name=OP,
    aclnn="aclnnFusedCrossEntropyLossWithMaxSum",
    inputs=tuple(TensorDef(n, (FLOAT32,), ndim=(1, 1)) for n in _STATS)
    + (TensorDef("vocab_parallel_logits", FLOAT_DTYPES, ndim=(2, 2), optional=True),),
    attrs=(AttrDef("label_smoothing", "float", lo=0.0, hi=1.0, device=(0.0,), device_why="0 (strict mode)"),),
    outputs=("loss", "softmax"),
    relations=_relations,
    source="ops-nn loss/fused_cross_entropy_loss_with_max_sum; Megatron _VocabParallelCrossEntropy",
)


def fused_cross_entropy_loss_with_max_sum(
    logits_max: Any,
    sum_exp_logits: Any,
    predicted_logits: Any,
    label_smoothing: float = 0.0,
    vocab_parallel_logits: Any = None,
    *,
    out: Any = None,
) -> tuple[Any, Any]:
    """Per-row cross-entropy loss from the (all-reduced) online max/sum statistics.

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
    return execute(
        DECL,
        dict(
            logits_max=logits_max,
            sum_exp_logits=sum_exp_logits,
            predicted_logits=predicted_logits,
            label_smoothing=label_smoothing,
            vocab_parallel_logits=vocab_parallel_logits,
        ),
        out,
    )
