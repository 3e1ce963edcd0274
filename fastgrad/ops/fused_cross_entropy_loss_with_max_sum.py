"""op_api: aclnnFusedCrossEntropyLossWithMaxSum — the loss (and softmax) from the all-reduced stats."""

from __future__ import annotations

from typing import Any

from ..arrays import ArrayLike
from ..dtypes import FLOAT32, FLOAT_DTYPES
from ..errors import ACLNN_ERR_INNER_NULLPTR
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "fused_cross_entropy_loss_with_max_sum"

_STATS = ("logits_max", "sum_exp_logits", "predicted_logits")


def _relations(c: Call) -> None:
    BT = c.shape_of("logits_max")[0]
    for name in _STATS[1:]:
        c.expect_shape(name, (BT,))
    lg = c.a["vocab_parallel_logits"]
    arch35 = c.soc.name == "Ascend950"
    # The l0 op discards its launcher's status (op_api/fused_cross_entropy_loss_with_max_sum.cpp:
    # 43-47): a refusal of the op_host tiling does not fail aclnnFusedCrossEntropyLossWithMaxSum-
    # GetWorkspaceSize (opbase kernel_workspace.cpp:34-36, op_executor.cpp:1104-1116); the run
    # call re-runs the tiling at the launch and returns ACLNN_ERR_INNER_NULLPTR (opbase
    # op_kernel.h:648-651).  Strict mode raises it in the run phase.
    if lg is not None and lg.shape[0] != BT:
        # the op_api does not check it (aclnn_fused_cross_entropy_loss_with_max_sum.cpp:72-90).
        # A2/A3 tiling splits the rows by vocab_parallel_logits.shape[0]
        # (fused_cross_entropy_loss_with_max_sum_tiling.cpp:96-112): loss rows past it are never
        # written, or the statistics are read past their end — fastgrad refuses (161002) in every
        # mode.  The arch35 tiling refuses it (fused_cross_entropy_loss_with_max_sum_tiling_arch35.cpp:
        # 123-132): strict mode on "Ascend950" reports that failure's code at the run call; outside
        # strict mode fastgrad's 161002.
        expected = f"shape[0] == logits_max.shape[0] == {BT}"
        if c.strict and arch35:
            c.fail(
                ACLNN_ERR_INNER_NULLPTR,
                "vocab_parallel_logits",
                expected + " (the arch35 tiling)",
                tuple(lg.shape),
                phase="run",
            )
        else:
            c.bad(
                "vocab_parallel_logits",
                expected + " (the A2/A3 device does not check it and leaves loss rows unwritten or reads "
                "past the statistics; the Ascend 950 tiling refuses it; fastgrad refuses)",
                f"shape {tuple(lg.shape)}",
            )
    elif c.strict and arch35 and (BT == 0 or (lg is not None and lg.shape[1] == 0)):
        # the arch35 tiling refuses BT <= 0 and V <= 0 (tiling_arch35.cpp:119-122 with the
        # logits, :188-193 without)
        if lg is not None:
            c.fail(
                ACLNN_ERR_INNER_NULLPTR,
                "vocab_parallel_logits",
                "BT > 0 and V > 0 (the arch35 tiling)",
                f"shape {tuple(lg.shape)}",
                phase="run",
            )
        else:
            c.fail(ACLNN_ERR_INNER_NULLPTR, "logits_max", "BT > 0 (the arch35 tiling)", f"shape {(BT,)}", phase="run")
    if c.attrs["label_smoothing"] != 0.0 and lg is None:
        c.bad("label_smoothing", "0 unless vocab_parallel_logits is given", c.attrs["label_smoothing"])
    c.outs["loss"] = OutSpec((BT,), FLOAT32)
    c.outs["softmax"] = None if lg is None else OutSpec(tuple(lg.shape), FLOAT32)


DECL = OpDef(
    name=OP,
    aclnn="aclnnFusedCrossEntropyLossWithMaxSum",
    inputs=tuple(TensorDef(n, (FLOAT32,), ndim=(1, 1)) for n in _STATS)
    + (TensorDef("vocab_parallel_logits", FLOAT_DTYPES, ndim=(2, 2), optional=True),),
    attrs=(
        AttrDef("label_smoothing", "float", lo=0.0, hi=1.0, device=(0.0,), device_why="0 (strict mode)", c_float=True),
    ),
    outputs=("loss", "softmax"),
    relations=_relations,
    source="ops-nn loss/fused_cross_entropy_loss_with_max_sum; Megatron _VocabParallelCrossEntropy",
)


def fused_cross_entropy_loss_with_max_sum(
    logits_max: ArrayLike,
    sum_exp_logits: ArrayLike,
    predicted_logits: ArrayLike,
    label_smoothing: float = 0.0,
    vocab_parallel_logits: ArrayLike | None = None,
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
    label_smoothing ≠ 0 without logits (or in strict mode), and
    ``vocab_parallel_logits.shape[0] != BT``: the device's op_api does not check it
    (``aclnn_fused_cross_entropy_loss_with_max_sum.cpp:72-90``); on A2/A3 the tiling splits the
    rows by ``vocab_parallel_logits.shape[0]`` (``..._tiling.cpp:96-112``), leaving loss rows
    unwritten or reading past the statistics, so fastgrad refuses it in every mode.
    AclnnError 561103 — strict mode on the ``"Ascend950"`` profile, where the arch35 tiling refuses
    ``vocab_parallel_logits.shape[0] != BT`` (``..._tiling_arch35.cpp:123-132``), ``BT = 0`` or
    ``V = 0`` (:119-122, :188-193).  The device's ``GetWorkspaceSize`` succeeds (the l0 op
    discards its launcher's status, ``op_api/fused_cross_entropy_loss_with_max_sum.cpp:43-47``)
    and the run call fails: the error's ``phase`` is ``"run"``, raised after the checks, ``out=``
    untouched (docs/device_parity.md rows 3e, 3f).
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
