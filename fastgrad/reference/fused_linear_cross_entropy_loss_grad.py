"""float64 golden for FusedLinearCrossEntropyLossGrad with the device's roundings.

Materializes ``[BT, V]`` in float64: it is the oracle, not the fast path.  The device's two
roundings are kept: ``g`` is rounded to the input dtype (via fp32, as the device computes fp32 and
casts for the Cube unit) and each output is rounded once to the input dtype.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..vocab_parallel import megatron_smoothing, unpack_target_mask

OP = "fused_linear_cross_entropy_loss_grad"


def _round(a64: np.ndarray, dtype) -> np.ndarray:
    return a64.astype(np.float32).astype(dtype)


def grad_logits(
    grad: np.ndarray,
    input: np.ndarray,
    weight: np.ndarray,
    target_mask: np.ndarray,
    masked_target: np.ndarray,
    label_smoothing: float = 0.0,
    logits_max: np.ndarray | None = None,
    sum_exp_logits: np.ndarray | None = None,
    softmax: np.ndarray | None = None,
    rows: npt.ArrayLike | None = None,
    cols: npt.ArrayLike | None = None,
) -> np.ndarray:
    """float64 ``g`` (already rounded to the input dtype's values) for ``rows`` × ``cols``.

    ``rows``/``cols``: optional index arrays selecting a sub-block (for sampled checks of large
    problems); default all.
    """
    BT = input.shape[0]
    V = weight.shape[0]
    rows = np.arange(BT) if rows is None else np.asarray(rows)
    cols = np.arange(V) if cols is None else np.asarray(cols)
    masked = unpack_target_mask(target_mask, BT)[rows]
    t = np.asarray(masked_target, dtype=np.int64)[rows]
    if softmax is None:
        X = np.asarray(input[rows], dtype=np.float64)
        W = np.asarray(weight[cols], dtype=np.float64)
        logits = X @ W.T
        m = np.asarray(logits_max, dtype=np.float64)[rows][:, None]
        s = np.asarray(sum_exp_logits, dtype=np.float64)[rows][:, None]
        p = np.exp(logits - m) / s
    else:
        p = np.asarray(softmax, dtype=np.float64)[np.ix_(rows, cols)]
    s_, s_over_k = megatron_smoothing(float(label_smoothing), V)
    onehot = (cols[None, :] == t[:, None]) & (~masked)[:, None] & (t >= 0)[:, None] & (t < V)[:, None]
    p = p - onehot * (1.0 - s_) - s_over_k
    g = p * np.asarray(grad, dtype=np.float64)[rows][:, None]
    return _round(g, input.dtype).astype(np.float64)


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
) -> None:
    gi_out, gw_out = out
    g = grad_logits(
        grad, input, weight, target_mask, masked_target, label_smoothing, logits_max, sum_exp_logits, softmax
    )
    X = np.asarray(input, dtype=np.float64)
    W = np.asarray(weight, dtype=np.float64)
    gi_out[...] = _round(g @ W, gi_out.dtype)
    gw_out[...] = _round(g.T @ X, gw_out.dtype)
