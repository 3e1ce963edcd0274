"""op_api: aclnnFusedLinearOnlineMaxSum — the companion forward of the FLCE grad."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import dtypes as D
from .._config import Options
from ..arrays import ArrayLike
from ..errors import ACLNN_ERR_INNER_NULLPTR
from ._engines import lm_head_plan
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "fused_linear_online_max_sum"

#: The device's limit on H (strict mode).
MAX_H_DEVICE = 65534


class OnlineMaxSum(NamedTuple):
    """Outputs of :func:`fused_linear_online_max_sum` (the aclnn output names, snake_case)."""

    logits_max_local: Any  #: fp32 [BT]
    sum_exp_logits_local: Any  #: fp32 [BT]
    predicted_logits_local: Any  #: fp32 [BT]
    target_mask: Any  #: uint8 [ceil(BT/8)], packed LSB-first
    masked_target: Any  #: target's dtype [BT]
    vocab_parallel_logits: Any  #: logits_dtype [BT, V], or None


OUTPUTS = OnlineMaxSum._fields


def _relations(c: Call) -> None:
    x, w, t = c.a["input"], c.a["weight"], c.a["target"]
    BT, H = c.shape_of("input")
    V = w.shape[0]
    start, end = c.attrs["vocab_start_index"], c.attrs["vocab_end_index"]
    if w.dtype != x.dtype:
        c.bad("weight", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(w.dtype))
    if w.shape[1] != H:
        c.bad("weight", f"weight.shape[1] == input.shape[1] == {H}", f"shape {tuple(w.shape)}")
    if t.shape[0] != BT:
        c.bad("target", f"target.shape[0] == input.shape[0] == {BT}", f"shape {tuple(t.shape)}")
    if end < start:  # op_api CheckAttrValid (aclnn_fused_linear_online_max_sum.cpp:154-171): nothing more
        c.bad("vocab_end_index", f"a value >= vocab_start_index ({start})", end)
    ldt = c.attrs["logits_dtype"]
    if ldt is None:
        ldt = x.dtype  # the kernel's: the matmul output is the input dtype
    elif ldt not in (D.FLOAT32, x.dtype):
        c.bad("logits_dtype", f"float32 or the input's dtype ({D.dtype_name(x.dtype)})", D.dtype_name(ldt))
    c.attrs["logits_dtype"] = ldt
    f32 = D.FLOAT32
    c.outs.update(
        logits_max_local=OutSpec((BT,), f32),
        sum_exp_logits_local=OutSpec((BT,), f32),
        predicted_logits_local=OutSpec((BT,), f32),
        target_mask=OutSpec(((BT + 7) // 8,), np.dtype(np.uint8)),
        masked_target=OutSpec((BT,), t.dtype),
        vocab_parallel_logits=OutSpec((BT, V), ldt, size_param="return_logits") if c.attrs["return_logits"] else None,
    )


def _device_limits(c: Call) -> None:
    BT, H = c.shape_of("input")
    if H > MAX_H_DEVICE:
        c.bad("input", f"input.shape[1] <= {MAX_H_DEVICE} (strict mode)", f"shape {(BT, H)}")
    if c.a["weight"].shape[0] == 0:
        c.bad("weight", "weight.shape[0] > 0 (strict mode)", f"shape {c.shape_of('weight')}")
    if c.raw.get("logits_dtype") is not None and c.attrs["logits_dtype"] != c.a["input"].dtype:
        c.bad(
            "logits_dtype",
            "the input's dtype (the device's matmul output; strict mode)",
            D.dtype_name(c.attrs["logits_dtype"]),
        )
    if not c.soc.fused_linear_ops and BT > 0:
        # no kernel for the SoC (op_host/config holds ascend910b and ascend910_93 only,
        # fused_linear_online_max_sum_def.cpp:75-76).  The l0 op discards its launcher's status
        # (op_api/fused_linear_online_max_sum.cpp:68-74: ADD_TO_LAUNCHER_LIST_AICORE's result is
        # never read) and returns its allocated outputs, so GetWorkspaceSize succeeds
        # (aclnn_fused_linear_online_max_sum.cpp:274-284); the run call fails at the launch
        # (opbase op_kernel.h:1268-1285).  An empty input returns success before it (:258-263)
        c.fail(
            ACLNN_ERR_INNER_NULLPTR,
            "input",
            "an Atlas A2/A3 SoC (aclnnFusedLinearOnlineMaxSum has no kernel for this SoC; strict mode)",
            c.soc.name,
            phase="run",
        )


def _plan(c: Call):
    BT, H = c.shape_of("input")
    return lm_head_plan(BT, c.a["weight"].shape[0], H, "forward", c.a["input"].dtype, c.settings)


DECL = OpDef(
    name=OP,
    aclnn="aclnnFusedLinearOnlineMaxSum",
    inputs=(
        TensorDef("input", (D.BFLOAT16, D.FLOAT16), ext_dtypes=(D.FLOAT32,), ndim=(2, 2)),
        TensorDef("weight", (D.BFLOAT16, D.FLOAT16), ext_dtypes=(D.FLOAT32,), ndim=(2, 2)),
        TensorDef("target", (np.int32, np.int64), ndim=(1, 1)),
    ),
    attrs=(
        AttrDef("vocab_start_index", "int", lo=0),
        AttrDef("vocab_end_index", "int", lo=0),
        AttrDef("return_logits", "bool"),
        AttrDef("logits_dtype", "dtype"),
    ),
    outputs=OUTPUTS,
    relations=_relations,
    device_limits=_device_limits,
    plan=_plan,
    result=lambda c, r: OnlineMaxSum(*(r[n] for n in OUTPUTS)),
    source="ops-nn matmul/fused_linear_online_max_sum; Megatron _VocabParallelCrossEntropy",
)


def fused_linear_online_max_sum(
    input: ArrayLike,
    weight: ArrayLike,
    target: ArrayLike,
    vocab_start_index: int,
    vocab_end_index: int,
    return_logits: bool = False,
    *,
    logits_dtype: Any = None,
    out: Any = None,
    options: Options | None = None,
) -> OnlineMaxSum:
    """This shard's logits statistics for vocabulary-parallel cross-entropy.

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
        formula says ``>``).  ``0 <= start <= end`` is all the device checks
        (``aclnn_fused_linear_online_max_sum.cpp:154-171``): ``end - start`` need not equal V
        (the CANN example runs V = 5 with ``[0, 2)``; its doc allows ``end`` in
        ``[start, min(start + V - 1, max(target) - 1)]``; ``end == start`` masks every row).
    return_logits : bool
        Also return ``vocab_parallel_logits`` (the device's high-performance branch).
    logits_dtype : None, float32 or the input's dtype, keyword-only
        The precision of the logits before max / exp / sum.  None (default): the input dtype —
        the kernel's matmul output type (ops-nn ``op_kernel/fused_linear_online_max_sum.cpp:38,41``;
        docs/device_parity.md row 2).  ``np.float32``: the fp32 logits unrounded, as the CANN
        golden script and a training loss want them (an extension: strict mode and the acl
        backend refuse it).  ``vocab_parallel_logits`` is returned in this dtype.
    out : tuple of six arrays, optional
        Preallocated outputs in the order of :class:`OnlineMaxSum` (``None`` for the logits
        when ``return_logits`` is False).
    options : fastgrad.Options, keyword-only, optional
        This call's own settings (GEMM setting, native ISA, workspace budget) over those in
        force (``fastgrad._config.Options``): no context manager, nothing process-wide; 161002
        for another type or a field out of range.

    Returns
    -------
    OnlineMaxSum
        ``logits = round_dtype(input·weightᵀ)`` (fp32 accumulation, rounded to the input dtype as
        the device's matmul output); ``logits_max_local[r] = max_v logits[r, v]``;
        ``sum_exp_logits_local[r] = Σ_v exp(logits[r, v] - max)``;
        ``predicted_logits_local[r] = logits[r, masked_target[r]] - max`` (0 where masked;
        ``0 - max = -max`` for an unmasked target whose ``masked_target >= V``, i.e. a target in
        ``[start, end)`` beyond the shard's rows: the kernel adds the gathered logit of the tile
        holding the column into a zeroed sum, no tile holds it, and the final pass subtracts the
        max wherever the mask bit is 0 — ``fused_linear_online_max_sum.h:846-878,948-953,
        1061-1076``);
        ``target_mask`` bit r = 1 when ``target[r] < start or >= end`` (padding bits beyond BT
        are those of a 0 target, as the kernel pads the target with 0: ``(0 < start) |
        (0 >= end)``, so 0 on the first shard); ``masked_target = target - start`` (0 where
        masked).
        Combining shards (the caller's all-reduce): ``gmax = max_k m_k``;
        ``sum = Σ_k s_k·exp(m_k - gmax)``; ``predicted = Σ_k (p_k + (m_k - gmax)·owned_k)``.

    Notes
    -----
    Target compares are exact int64 compares.  The device casts the targets and
    ``vocab_start_index``/``vocab_end_index`` to fp32 (RINT) before comparing and takes
    ``masked_target = rint(fp32(t) - fp32(start))`` (ops-nn ``fused_linear_online_max_sum.h:
    213-214,272-273,545-561,1061-1075``): identical below 2**24, which every real vocabulary
    is; fastgrad does not emulate the rounding above it (docs/device_parity.md, row 6).

    Raises
    ------
    AclnnError 161001
        input, weight or target is None.
    AclnnError 161002
        dtypes (input/weight not bf16/fp16[/fp32] or different, target not int32/int64), ranks,
        ``target.shape[0] != BT``, ``weight.shape[1] != H``, ``vocab_start_index < 0``,
        ``vocab_end_index < vocab_start_index``.  Strict mode also: fp32 input, ``H > 65534``,
        ``weight.shape[0] == 0`` (outside it, an empty shard gives max -inf, sum 0, predicted 0).
    AclnnError 561103
        Strict mode, SoC profile ``"Ascend950"`` (``fg.soc_version``) and ``BT > 0``: the op has
        no kernel there (``op_host/config`` holds ascend910b and ascend910_93 only; its doc:
        "Ascend 950PR/Ascend 950DT：不支持"), and the op_api returns ACLNN_ERR_INNER_NULLPTR
        when the l0 op gives no result (:274-276).  Outside strict mode fastgrad computes the
        A2/A3 kernel's result on every profile.
    """
    return execute(
        DECL,
        dict(
            input=input,
            weight=weight,
            target=target,
            vocab_start_index=vocab_start_index,
            vocab_end_index=vocab_end_index,
            return_logits=return_logits,
            logits_dtype=logits_dtype,
        ),
        out,
        options=options,
    )
