"""The vocabulary-parallel arithmetic, written once.

Used by the ops (op_api/op_host layer), the float64 reference, the torch layer, the CLI and the
tests.  NumPy only (the torch layer passes tensors through ``torch``-agnostic arithmetic where
stated, or converts).  Nothing here imports a kernel, a backend or torch.

Three pieces:

* **Target masks** — ``target_mask`` bit ``i`` is 1 when row ``i``'s target is *not* in this
  shard; packed LSB-first into ``uint8[ceil(BT/8)]`` (``np.packbits(bits, bitorder="little")``),
  as ``aclnnFusedLinearOnlineMaxSum`` writes it and ``aclnnFusedLinearCrossEntropyLossGrad``
  reads it.  Padding bits (rows ``BT .. 8·ceil(BT/8)-1``) are those of a 0 target, as the
  kernel pads the target with 0 before comparing (``(0 < start) | (0 >= end)``); consumers
  ignore them.
* **Combining shard statistics** — what the caller's all-reduce computes (Megatron's
  ``_VocabParallelCrossEntropy``, verl): ``gmax = max_k m_k``; ``sum = Σ_k s_k·exp(m_k - gmax)``;
  ``predicted = Σ_k (p_k + (m_k - gmax)·owned_k)``.
* **Label smoothing** — Megatron's ``α`` over the ``K`` local columns (``s = α·K/(K-1)``; the
  logits gradient is ``p - (1-s)·onehot - s/K``) and its conversion from PyTorch's ``ε`` over
  the global vocabulary ``V``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "pack_target_mask",
    "unpack_target_mask",
    "shard_target_mask",
    "target_columns",
    "combine_shard_statistics",
    "megatron_smoothing",
    "smoothed_loss",
    "torch_smoothing_to_megatron",
]


# ----------------------------------------------------------------------------------------------
# target masks
# ----------------------------------------------------------------------------------------------


def shard_target_mask(target: np.ndarray, vocab_start_index: int, vocab_end_index: int) -> np.ndarray:
    """bool[BT]: True where ``target`` is outside ``[vocab_start_index, vocab_end_index)``."""
    t = np.asarray(target)
    return (t < vocab_start_index) | (t >= vocab_end_index)


def pack_target_mask(masked: np.ndarray, vocab_start_index: int = 0, vocab_end_index: int | None = None) -> np.ndarray:
    """Pack bool[BT] into the device's ``uint8[ceil(BT/8)]``, LSB-first.

    The padding bits past BT are what the kernel computes for its zero-padded target:
    ``(0 < vocab_start_index) | (0 >= vocab_end_index)`` (``vocab_end_index=None``: 0).
    Source: ops-nn ``matmul/fused_linear_online_max_sum/op_kernel`` (target padded with 0).
    """
    bits = np.asarray(masked, dtype=bool).reshape(-1)
    BT = bits.shape[0]
    nbytes = (BT + 7) // 8
    pad = 8 * nbytes - BT
    if pad:
        fill = vocab_end_index is not None and (0 < vocab_start_index or 0 >= vocab_end_index)
        bits = np.concatenate([bits, np.full(pad, fill, dtype=bool)])
    return np.packbits(bits, bitorder="little")


def unpack_target_mask(target_mask: np.ndarray, BT: int) -> np.ndarray:
    """bool[BT] 'target not in this shard' from a packed uint8 (LSB-first) or a bool mask.

    Bits past ``BT`` are ignored whatever they hold.
    """
    m = np.asarray(target_mask)
    if m.dtype == np.bool_:
        return np.ascontiguousarray(m.reshape(-1)[:BT])
    packed = np.ascontiguousarray(m.reshape(-1), dtype=np.uint8)
    return np.unpackbits(packed, bitorder="little")[:BT].astype(np.bool_)


def target_columns(masked_target: np.ndarray, masked: np.ndarray, V: int) -> np.ndarray:
    """int64 local column of each row's target, -1 where masked or outside ``[0, V)``.

    The FLCE grad kernel subtracts nothing for such rows (it skips the one-hot subtraction; the
    CANN golden clamps instead — see docs/device_parity.md).
    """
    t = np.asarray(masked_target).astype(np.int64, copy=False).reshape(-1)
    ok = (~np.asarray(masked, dtype=bool)) & (t >= 0) & (t < V)
    return np.where(ok, t, -1).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# shard statistics
# ----------------------------------------------------------------------------------------------


def combine_shard_statistics(
    logits_max: Sequence[np.ndarray],
    sum_exp_logits: Sequence[np.ndarray],
    predicted_logits: Sequence[np.ndarray],
    owned: Sequence[np.ndarray],
    dtype: npt.DTypeLike = np.float32,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Combine per-shard row statistics as the all-reduce does.

    Parameters
    ----------
    logits_max, sum_exp_logits, predicted_logits : sequences of float [BT], one per shard
        Each shard's ``m_k``, ``s_k`` (relative to ``m_k``) and ``p_k`` (target logit minus
        ``m_k`` where owned, else 0), as ``fused_linear_online_max_sum`` returns them.
    owned : sequence of bool [BT]
        Whether shard ``k`` holds the row's target (``~unpack_target_mask(...)``).
    dtype : the result's dtype (fp32, as the device's all-reduce).

    Returns
    -------
    (gmax, sum_exp, predicted) : arrays of ``dtype`` [BT]
        ``gmax = max_k m_k``; ``sum = Σ_k s_k·exp(m_k - gmax)``;
        ``predicted = Σ_k (p_k + (m_k - gmax)·owned_k)`` — the global target logit minus gmax.
        An empty shard (``m_k = -inf``) contributes nothing.
    """
    m = np.stack([np.asarray(a, dtype=np.float64) for a in logits_max])
    s = np.stack([np.asarray(a, dtype=np.float64) for a in sum_exp_logits])
    p = np.stack([np.asarray(a, dtype=np.float64) for a in predicted_logits])
    o = np.stack([np.asarray(a, dtype=bool) for a in owned])
    gmax = m.max(axis=0)
    with np.errstate(invalid="ignore"):
        shift = m - gmax
    shift = np.where(np.isneginf(m) & np.isneginf(gmax), 0.0, shift)
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.where(s == 0, 0.0, s * np.exp(shift)).sum(axis=0)
    pred = np.where(o, p + shift, p).sum(axis=0)
    return gmax.astype(dtype), total.astype(dtype), pred.astype(dtype)


# ----------------------------------------------------------------------------------------------
# label smoothing
# ----------------------------------------------------------------------------------------------


def live_filter_eps(eps: float | None, alpha: float, K: int) -> float | None:
    """The gradient-filtering threshold that applies: ``eps``, or None where the uniform
    smoothing term alone (``s/K`` of :func:`megatron_smoothing`) is not below it (no block can be
    negligible then).  The op layer plans with it and the FLCE grad kernel filters by it."""
    if eps is None:
        return None
    return None if megatron_smoothing(alpha, K)[1] >= eps else eps


def megatron_smoothing(alpha: float, K: int) -> tuple[float, float]:
    """``(s, s/K)`` applied for Megatron's ``label_smoothing=alpha`` on ``K`` local columns.

    ``s = α·K/(K-1)``; the logits gradient is ``p - (1-s)·onehot - s/K`` and the loss
    ``(1-s)·loss - s·mean_v(log softmax)``; ``(0, 0)`` when ``α == 0`` or ``K <= 1``.
    Source: Megatron-LM ``_VocabParallelCrossEntropy``; the CANN op's label_smoothing attribute.
    """
    if alpha == 0.0 or K <= 1:
        return 0.0, 0.0
    s = alpha * K / (K - 1)
    return s, s / K


def smoothed_loss(loss: np.ndarray, softmax: np.ndarray, alpha: float) -> np.ndarray:
    """Megatron's label-smoothed loss from this shard's softmax (float64 arithmetic, fp32 out).

    ``(1 - s)·loss - s·mean_v(log softmax)`` with ``s = α·K/(K-1)``, ``K = softmax.shape[1]``;
    ``loss`` unchanged when ``s == 0``.  The extension of ``fused_cross_entropy_loss_with_max_sum``.
    """
    s, _ = megatron_smoothing(alpha, softmax.shape[1])
    if s == 0.0:
        return np.asarray(loss, dtype=np.float32)
    with np.errstate(divide="ignore"):
        mean_log = np.log(np.asarray(softmax, dtype=np.float64)).mean(axis=1)
    return ((1.0 - s) * np.asarray(loss, dtype=np.float64) - s * mean_log).astype(np.float32)


def torch_smoothing_to_megatron(eps: float, K: int, V: int) -> tuple[float, float, float]:
    """Megatron's ``alpha`` for PyTorch's ``label_smoothing=eps`` on a shard of K of V columns.

    PyTorch's logits gradient is ``p - (1-eps)·onehot - eps/V``.  With ``alpha = eps·(K-1)/V``
    the op's uniform term is exactly ``s/K = eps/V`` and its target term ``1 - eps·K/V``, which
    equals ``1 - eps`` when ``K = V``.  Returns ``(alpha, delta_target, delta_uniform)``: what
    must still be added to ``g/grad`` at the target column and everywhere after the op
    (non-zero only for a proper shard, or ``K <= 1``).
    """
    if eps == 0.0:
        return 0.0, 0.0, 0.0
    if K <= 1:  # the op applies no smoothing on such a shard
        return 0.0, eps, -eps / V
    return eps * (K - 1) / V, eps * (1.0 - K / V), 0.0
