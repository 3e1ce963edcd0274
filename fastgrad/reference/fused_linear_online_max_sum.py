"""float64 golden for FusedLinearOnlineMaxSum: logits rounded to ``logits_dtype``, then float64."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..vocab_parallel import pack_target_mask, shard_target_mask

OP = "fused_linear_online_max_sum"


def fused_linear_online_max_sum(
    *,
    input: np.ndarray,
    weight: np.ndarray,
    target: np.ndarray,
    vocab_start_index: int,
    vocab_end_index: int,
    return_logits: bool,
    logits_dtype: npt.DTypeLike,
    out: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None],
) -> None:
    lmax, sexp, pred, tmask, mtarget, logits_out = out
    BT = input.shape[0]
    V = weight.shape[0]
    X = np.asarray(input, dtype=np.float64)
    W = np.asarray(weight, dtype=np.float64)
    logits = (X @ W.T).astype(np.float32).astype(logits_dtype)  # the device's matmul output
    L = logits.astype(np.float64)
    t = np.asarray(target, dtype=np.int64)
    masked = shard_target_mask(t, vocab_start_index, vocab_end_index)
    local = np.where(masked, 0, t - vocab_start_index)
    if V:
        m = L.max(axis=1) if BT else np.zeros(0)
        s = np.exp(L - m[:, None]).sum(axis=1)
    else:
        m = np.full(BT, -np.inf)
        s = np.zeros(BT)
    ok = (~masked) & (local < V)
    picked = np.zeros(BT)
    if V:
        picked[ok] = L[np.nonzero(ok)[0], local[ok]]
        # unmasked rows: the picked logit (0 where masked_target >= V: no tile holds it) - max
        # (fused_linear_online_max_sum.h:948-953,1070-1076)
        picked = np.where(masked, 0.0, picked - m)
    lmax[...] = m.astype(np.float32)
    sexp[...] = s.astype(np.float32)
    pred[...] = picked.astype(np.float32)
    mtarget[...] = local.astype(mtarget.dtype)
    tmask[...] = pack_target_mask(masked, vocab_start_index, vocab_end_index)
    if logits_out is not None:
        logits_out[...] = logits
