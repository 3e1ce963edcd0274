"""op_api: aclnnFusedLinearOnlineMaxSum — the companion forward of the FLCE grad."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import arrays
from .. import dtypes as D
from .._config import is_strict
from ..backends import dispatch
from ..errors import invalid
from ._common import INDEX_DTYPES, parse_bool, parse_int

OP = "fused_linear_online_max_sum"


class OnlineMaxSum(NamedTuple):
    """Outputs of :func:`fused_linear_online_max_sum` (the aclnn output names, snake_case)."""

    logits_max_local: object       #: fp32 [BT]
    sum_exp_logits_local: object   #: fp32 [BT]
    predicted_logits_local: object #: fp32 [BT]
    target_mask: object            #: uint8 [ceil(BT/8)], packed LSB-first
    masked_target: object          #: target's dtype [BT]
    vocab_parallel_logits: object  #: input dtype [BT, V], or None


def fused_linear_online_max_sum(input, weight, target, vocab_start_index, vocab_end_index,
                                return_logits=False):
    r"""This shard's logits statistics for vocabulary-parallel cross-entropy.

    The CPU counterpart of ``aclnnFusedLinearOnlineMaxSum`` (ops-nn
    ``matmul/fused_linear_online_max_sum``; Megatron's ``_VocabParallelCrossEntropy`` forward).
    Computed tile by tile (online max/sum), so ``[BT, V]`` is never held unless
    ``return_logits=True``.

    Parameters
    ----------
    input : bf16 | fp16 [BT, H]   (fp32 accepted as an extension)
    weight : same dtype, [V, H]   this shard's rows of the LM head, V >= 1
    target : int32 | int64 [BT]   global target ids
    vocab_start_index, vocab_end_index : int
        This shard's vocabulary range ``[start, end)`` (end exclusive, as the kernel; the doc's
        formula says ``>``).  ``0 <= start <= end``.
    return_logits : bool
        Also return ``vocab_parallel_logits`` (the device's high-performance branch).

    Returns
    -------
    OnlineMaxSum
        ``logits = round_dtype(input·weightᵀ)`` (fp32 accumulation, rounded to the input dtype as
        the device's matmul output); ``logits_max_local[r] = max_v logits[r, v]``;
        ``sum_exp_logits_local[r] = Σ_v exp(logits[r, v] - max)``;
        ``predicted_logits_local[r] = logits[r, masked_target[r]] - max`` (0 where masked);
        ``target_mask`` bit r = 1 when ``target[r] < start or >= end`` (padding bits beyond BT
        are 1, as the device); ``masked_target = target - start`` (0 where masked).
        Combining shards (the caller's all-reduce): ``gmax = max_k m_k``;
        ``sum = Σ_k s_k·exp(m_k - gmax)``; ``predicted = Σ_k (p_k + (m_k - gmax)·owned_k)``.

    Raises
    ------
    AclnnError 161001
        input, weight or target is None.
    AclnnError 161002
        dtypes (input/weight not bf16/fp16[/fp32] or different, target not int32/int64), ranks,
        ``target.shape[0] != BT``, ``weight.shape[1] != H``, ``vocab_start_index < 0``,
        ``vocab_end_index < vocab_start_index``.  Strict mode also: fp32 input, ``H > 65534``,
        ``weight.shape[0] == 0`` (outside it, an empty shard gives max -inf, sum 0, all masked).
    """
    kind = arrays.kind_of(input, weight, target)
    x = arrays.as_numpy(input, "input", op=OP)
    w = arrays.as_numpy(weight, "weight", op=OP)
    t = arrays.as_numpy(target, "target", op=OP)
    start = parse_int(vocab_start_index, "vocab_start_index", OP)
    end = parse_int(vocab_end_index, "vocab_end_index", OP)
    ret = parse_bool(return_logits, "return_logits", OP)
    strict = is_strict()
    float_in = [D.BFLOAT16, D.FLOAT16] if strict else [D.BFLOAT16, D.FLOAT16, D.FLOAT32]
    arrays.check_dtype(x, "input", float_in, OP)
    arrays.check_dtype(w, "weight", float_in, OP)
    if w.dtype != x.dtype:
        raise invalid("weight", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(w.dtype), OP)
    arrays.check_dtype(t, "target", INDEX_DTYPES, OP)
    arrays.check_ndim(x, "input", 2, OP)
    arrays.check_ndim(w, "weight", 2, OP)
    arrays.check_ndim(t, "target", 1, OP)
    BT, H = x.shape
    V = w.shape[0]
    if strict and H > 65534:
        raise invalid("input", "input.shape[1] <= 65534 (strict mode)", f"shape {x.shape}", OP)
    if V == 0 and strict:
        raise invalid("weight", "weight.shape[0] > 0 (strict mode)", f"shape {w.shape}", OP)
    if w.shape[1] != H:
        raise invalid("weight", f"weight.shape[1] == input.shape[1] == {H}", f"shape {w.shape}", OP)
    if t.shape[0] != BT:
        raise invalid("target", f"target.shape[0] == input.shape[0] == {BT}", f"shape {t.shape}", OP)
    if start < 0:
        raise invalid("vocab_start_index", ">= 0", start, OP)
    if end < start:
        raise invalid("vocab_end_index", f">= vocab_start_index ({start})", end, OP)

    lmax = np.empty(BT, np.float32)
    sexp = np.empty(BT, np.float32)
    pred = np.empty(BT, np.float32)
    tmask = np.empty((BT + 7) // 8, np.uint8)
    mtarget = np.empty(BT, t.dtype)
    logits = np.empty((BT, V), x.dtype) if ret else None
    dispatch(OP)(input=x, weight=w, target=t, vocab_start_index=start, vocab_end_index=end,
                 return_logits=ret, out=(lmax, sexp, pred, tmask, mtarget, logits))
    wrap = lambda a: arrays.wrap(a, kind)  # noqa: E731
    return OnlineMaxSum(wrap(lmax), wrap(sexp), wrap(pred), wrap(tmask), wrap(mtarget), wrap(logits))
