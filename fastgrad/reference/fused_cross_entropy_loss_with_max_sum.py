"""float64 golden for FusedCrossEntropyLossWithMaxSum."""

from __future__ import annotations

import numpy as np

from ..vocab_parallel import smoothed_loss

OP = "fused_cross_entropy_loss_with_max_sum"


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
    s = np.asarray(sum_exp_logits, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        loss[...] = (np.log(s) - np.asarray(predicted_logits, dtype=np.float64)).astype(np.float32)
        if softmax is not None:
            L = np.asarray(vocab_parallel_logits, dtype=np.float64)
            m = np.asarray(logits_max, dtype=np.float64)[:, None]
            softmax[...] = (np.exp(L - m) / s[:, None]).astype(np.float32)
    if label_smoothing != 0.0 and softmax is not None:
        loss[...] = smoothed_loss(loss, softmax, label_smoothing)
