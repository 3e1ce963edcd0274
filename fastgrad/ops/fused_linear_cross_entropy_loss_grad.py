"""op_api: aclnnFusedLinearCrossEntropyLossGrad — validation, plan, dispatch."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .. import dtypes as D
from .._config import Options
from ..arrays import ArrayLike
from ..errors import ACLNN_ERR_INNER_NULLPTR, ACLNN_ERR_RUNTIME_ERROR
from ..vocab_parallel import live_filter_eps
from ._engines import lm_head_plan
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "fused_linear_cross_entropy_loss_grad"

#: The device's minimum V in high-performance mode (a softmax row must be >= 512 bytes).
MIN_V_HIGH_PERFORMANCE = 128
#: The tiling's largest H (both modes) and BT-derived bound (high-performance mode).
MAX_H_TILING = 65535
#: The tiling's largest V in high-performance mode (``(256 - 1) * 256``: a 512-byte-aligned bf16 row < 64 KiB).
MAX_V_HIGH_PERFORMANCE = 65280


def _float_in(name: str) -> TensorDef:
    return TensorDef(name, (D.BFLOAT16, D.FLOAT16), ext_dtypes=(D.FLOAT32,), ndim=(2, 2))


def _stats_optional(raw: dict, strict: bool) -> bool:
    """logits_max / sum_exp_logits are required (161001) in memory-saving mode (softmax None)."""
    return raw.get("softmax") is not None


#: ``filter_eps="auto"``: the dtype's machine epsilon / 32, as Cut Cross-Entropy's ``_handle_eps``
#: (bf16: 2**-12, fp16: 2**-15, fp32: 2**-28).
def auto_filter_eps(dtype: npt.DTypeLike) -> float:
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) / 32


#: what ``filter_eps`` takes (this op and the training loss, ``ops/linear_cross_entropy.py``)
FILTER_EPS_VALUES = 'None, "auto" or a number in (0, 1]'


def filter_eps_value(v: str | float | None, dtype: npt.DTypeLike) -> float | None:
    """``filter_eps`` as a threshold: None (off, the device's behaviour), ``"auto"``
    (:func:`auto_filter_eps` of ``dtype``) or a number in (0, 1]; raises ``ValueError`` for
    anything else (each caller reports it as 161002 with :data:`FILTER_EPS_VALUES`)."""
    if v is None:
        return None
    if isinstance(v, str) and v == "auto":
        return auto_filter_eps(dtype)
    if (
        isinstance(v, (bool, np.bool_))
        or not isinstance(v, (numbers.Real, np.floating, np.integer))
        or not 0.0 < float(v) <= 1.0
    ):
        raise ValueError(FILTER_EPS_VALUES)
    return float(v)


def _filter_eps(c: Call) -> float | None:
    """Parse ``filter_eps`` (:func:`filter_eps_value`); None in high-performance mode."""
    v = c.raw.get("filter_eps")
    if v is None:
        return None
    if c.a["softmax"] is not None:
        c.bad("filter_eps", "None in high-performance mode (filtering applies to memory-saving mode)", repr(v))
        return None
    try:
        return filter_eps_value(v, c.a["input"].dtype)
    except ValueError:
        c.bad("filter_eps", FILTER_EPS_VALUES, repr(v))
        return None


def _relations(c: Call) -> None:
    x, w, tm = c.a["input"], c.a["weight"], c.a["target_mask"]
    BT = c.shape_of("grad")[0]
    H = x.shape[1]
    V = w.shape[0]
    if w.dtype != x.dtype:
        c.bad("weight", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(w.dtype))
    if x.shape[0] != BT:
        c.bad("input", f"input.shape[0] == grad.shape[0] == {BT}", f"shape {tuple(x.shape)}")
    if w.shape[1] != H:
        c.bad("weight", f"weight.shape[1] == input.shape[1] == {H}", f"shape {tuple(w.shape)}")
    if tm.dtype == np.bool_ and tm.shape[0] != BT:
        c.bad("target_mask", f"bool length == grad.shape[0] == {BT}", f"shape {tuple(tm.shape)}")
    elif tm.dtype != np.bool_ and tm.shape[0] * 8 < BT:
        c.bad("target_mask", f"uint8 length * 8 >= grad.shape[0] == {BT}", f"shape {tuple(tm.shape)}")
    c.expect_shape("masked_target", (BT,))
    if c.a["softmax"] is not None:
        c.expect_shape("softmax", (BT, V))
    else:
        c.expect_shape("logits_max", (BT,))
        c.expect_shape("sum_exp_logits", (BT,))
    fp32_gi = () if c.strict or x.dtype == D.FLOAT32 else (D.FLOAT32,)  # the unrounded accumulator
    c.outs["grad_input"] = OutSpec((BT, H), x.dtype, accept=fp32_gi)
    c.outs["grad_weight"] = OutSpec((V, H), x.dtype)
    c.info["filter_eps"] = _filter_eps(c)
    ret = c.raw.get("return_plan", False)
    if not isinstance(ret, (bool, np.bool_)):
        c.bad("return_plan", "a bool", repr(ret))
    c.info["want_stats"] = bool(ret)


def _device_limits(c: Call) -> None:
    V = c.a["weight"].shape[0]
    if c.a["softmax"] is not None and V < MIN_V_HIGH_PERFORMANCE:
        c.bad(
            "weight",
            f"weight.shape[0] >= {MIN_V_HIGH_PERFORMANCE} in high-performance mode (strict mode)",
            f"shape {c.shape_of('weight')}",
        )
    empty = c.a["input"].size == 0 or c.a["weight"].size == 0
    if c.a["softmax"] is not None and c.soc.fused_linear_ops and not empty:
        # high-performance mode has no range check: softmax[V*i + t] -= 1 for every unmasked
        # row (high_perf.h:177-197), out of bounds or in another row for t outside [0, V);
        # fastgrad skips such a row (as memory-saving mode does), strict mode rejects it.  On a
        # SoC without the kernel (950) the op_api's platform check (:317, after its parameter
        # checks) answers 361001 first and nothing runs: no data check there (row 3g).  An
        # empty input or weight returns success before any kernel (op_api :289-294, ops-nn
        # e5c3fa9): masked_target is never read, so no data check there either (row 3h)
        BT = c.a["grad"].shape[0]
        tm = c.a["target_mask"]
        bits = (
            tm[:BT]
            if tm.dtype == np.bool_
            else np.unpackbits(np.asarray(tm, np.uint8), bitorder="little")[:BT].astype(bool)
        )
        t = np.asarray(c.a["masked_target"])[:BT]
        bad = ~bits & ((t < 0) | (t >= V))
        if bad.any():
            i = int(np.argmax(bad))
            c.bad(
                "masked_target",
                f"values in [0, {V}) on the rows target_mask leaves unmasked "
                "(high-performance mode has no range check; strict mode)",
                f"{int(t[i])} at row {i}",
            )
    if c.raw.get("filter_eps") is not None:
        c.bad("filter_eps", "None (the device has no gradient filtering; strict mode)", repr(c.raw["filter_eps"]))
    if empty:
        c.skip_compute = True  # the device returns success without launching
        return
    # past the op_api's 161002 checks: the platform check, then the l0 op's tiling
    if not c.soc.fused_linear_ops:  # aclnn_fused_linear_cross_entropy_loss_grad.cpp:215-223,317
        c.fail(
            ACLNN_ERR_RUNTIME_ERROR,
            "input",
            'an Atlas A2/A3 SoC (the op_api: "Current platform is not supported"; strict mode)',
            c.soc.name,
        )
    for param, expected, got in _tiling_failures(c):
        c.fail(ACLNN_ERR_INNER_NULLPTR, param, expected + " (the op_host tiling; strict mode)", got)


#: the Vector unit's Unified Buffer on Atlas A2/A3 (``GetCoreMemSize(UB)``): 192 KiB
UB_BYTES = 192 * 1024


def _tiling_failures(c: Call) -> list:
    """What ``fused_linear_cross_entropy_loss_grad_tiling.cpp`` at ops-nn e5c3fa9 refuses
    (``ge::GRAPH_FAILED``; the l0 op then gives no result and the op_api returns
    ACLNN_ERR_INNER_NULLPTR, ``aclnn_fused_linear_cross_entropy_loss_grad.cpp:324``)."""
    BT, H = c.shape_of("input")
    V = c.a["weight"].shape[0]
    out = []
    if H > MAX_H_TILING:  # both modes: :237-240 (high-performance), :527-530 (memory-saving)
        out.append(("input", f"input.shape[1] <= {MAX_H_TILING}", f"H = {H}"))
    if c.a["softmax"] is None:
        return out
    bt16 = -(-BT // 16) * 16  # BT_16ALIGNED (:87)
    tail_k = BT % 64 or 64  # mm2TailK with baseK = 64 (tiling.h:49; :151-157)
    if bt16 - tail_k > MAX_H_TILING:  # :220-223
        out.append(("grad", f"ceil16(BT) - (BT % 64 or 64) <= {MAX_H_TILING} in high-performance mode", f"BT = {BT}"))
    if V > MAX_V_HIGH_PERFORMANCE:  # :231-235
        out.append(("weight", f"weight.shape[0] <= {MAX_V_HIGH_PERFORMANCE} in high-performance mode", f"V = {V}"))
    elif ((UB_BYTES - 32) // 2) // (-(-V * 4 // 64) * 16 * 4) == 0:  # btPerEpochSingle == 0: :181-182, :242-246
        out.append(("weight", "a softmax row of at most (192 KiB - 32) / 2 bytes in high-performance mode", f"V = {V}"))
    return out


def _plan(c: Call):
    BT, H = c.shape_of("input")
    mode = "memory_saving" if c.a["softmax"] is None else "high_performance"
    V = c.a["weight"].shape[0]
    # no filtering where the smoothing term alone reaches it (the kernel's rule): no unused buffers
    eps = live_filter_eps(c.info.get("filter_eps"), float(c.attrs["label_smoothing"]), V)
    return lm_head_plan(BT, V, H, mode, c.a["input"].dtype, c.settings, filter_eps=eps)


def _result(c: Call, r: dict):
    gi, gw = r["grad_input"], r["grad_weight"]
    if not c.info.get("want_stats"):
        return gi, gw
    plan = c.info.get("plan") or _plan(c)
    st = c.info.get("stats") or {}
    return (
        gi,
        gw,
        dataclasses.replace(plan, blocks_total=st.get("blocks_total", 0), blocks_skipped=st.get("blocks_skipped", 0)),
    )


DECL = OpDef(
    name=OP,
    aclnn="aclnnFusedLinearCrossEntropyLossGrad",
    inputs=(
        TensorDef("grad", (D.FLOAT32,), ndim=(1, 1)),
        _float_in("input"),
        _float_in("weight"),
        TensorDef("target_mask", (np.uint8, np.bool_), ndim=(1, 1)),
        TensorDef("masked_target", (np.int32, np.int64), ndim=(1, 1)),
        TensorDef("logits_max", (D.FLOAT32,), ndim=(1, 1), optional=_stats_optional),
        TensorDef("sum_exp_logits", (D.FLOAT32,), ndim=(1, 1), optional=_stats_optional),
        TensorDef("softmax", (D.FLOAT32,), ndim=(2, 2), optional=True),
    ),
    attrs=(
        AttrDef(
            "label_smoothing",
            "float",
            lo=0.0,
            hi=1.0,
            device=(0.0,),
            device_why="0 (the device supports only 0; strict mode)",
            c_float=True,
        ),
    ),
    outputs=("grad_input", "grad_weight"),
    relations=_relations,
    device_limits=_device_limits,
    plan=_plan,
    result=_result,
    source="aclnnFusedLinearCrossEntropyLossGrad.md; ops-nn matmul/fused_linear_cross_entropy_loss_grad",
)


def fused_linear_cross_entropy_loss_grad(
    grad: ArrayLike,
    input: ArrayLike,
    weight: ArrayLike,
    target_mask: ArrayLike,
    masked_target: ArrayLike,
    label_smoothing: float = 0.0,
    logits_max: ArrayLike | None = None,
    sum_exp_logits: ArrayLike | None = None,
    softmax: ArrayLike | None = None,
    *,
    filter_eps: float | str | None = None,
    return_plan: bool = False,
    out: Any = None,
    options: Options | None = None,
) -> tuple:
    r"""Gradient of the vocabulary-parallel linear cross-entropy w.r.t. ``input`` and ``weight``.

    The CPU counterpart of ``aclnnFusedLinearCrossEntropyLossGrad`` (the CANN doc
    ``aclnnFusedLinearCrossEntropyLossGrad.md``; ops-nn ``matmul/fused_linear_cross_entropy_loss_grad``).  Its
    inputs come from :func:`fused_linear_online_max_sum` and the caller's all-reduce of
    ``logits_max`` / ``sum_exp_logits`` over the vocabulary shards (Megatron's
    ``_VocabParallelCrossEntropy``).

    Parameters
    ----------
    grad : fp32 [BT]
        Upstream gradient of each row's loss.
    input : bf16 | fp16 [BT, H]
        Hidden states (the matmul's left operand).  fp32 is accepted as an extension.
    weight : same dtype as ``input``, [V, H]
        This shard's LM-head weight (V = local vocabulary size).
    target_mask : uint8 [ceil(BT/8)] packed LSB-first, or bool [BT]
        Bit ``i`` (``(mask[i >> 3] >> (i & 7)) & 1``) is 1 when row ``i``'s target is **not** in
        this shard: nothing is subtracted for that row.
    masked_target : int32 | int64 [BT]
        Local target column (``target - vocab_start_index``; any value where masked).  Values
        outside ``[0, V)`` subtract nothing.
    label_smoothing : float, default 0
        Must be 0 on the device (strict mode: 161002).  Extension: Megatron's semantics with
        K = V (local): ``s = α·K/(K-1)``; ``g[r, t] -= (1-s)``; ``g[r, :] -= s/K``.
    logits_max, sum_exp_logits : fp32 [BT], required when ``softmax`` is None
        Global (all-reduced) row max of the logits and ``Σ exp(logits - max)``.
    softmax : fp32 [BT, V], optional
        High-performance mode: the softmax from :func:`fused_cross_entropy_loss_with_max_sum`.
        ``logits_max``/``sum_exp_logits`` are then ignored, unchecked, as on the device (its
        op_api checks their dtype, rank and shape only when ``softmax`` is None:
        ``aclnn_fused_linear_cross_entropy_loss_grad.cpp:101-106,152-157,204-209``): a 0-d
        placeholder or anything else passes.  **Not modified** (the device overwrites it in
        place; fastgrad does not).
    out : (grad_input, grad_weight), optional
        Preallocated outputs (shapes ``[BT, H]`` and ``[V, H]``, input's dtype).  Untouched when
        validation fails.  Extension (not in strict mode): an fp32 ``grad_input`` receives the
        fp32 accumulator unrounded — what a vocabulary-parallel caller all-reduces.  An ``out``
        sharing memory with an input is refused (161002).
    filter_eps : None, "auto" or float in (0, 1], keyword-only
        Gradient filtering (extension; memory-saving mode; strict mode rejects it — the device
        has no such option).  None (default): dense, the device's result.  A number: blocks of
        256 rows × 64 vocabulary columns of the logits tile where every
        ``|p - onehot·(1-s) - s/K| < filter_eps`` (``p`` the softmax, before the scaling by
        ``grad``; the target column is never filtered) are skipped in both gradient GEMMs, as
        Cut Cross-Entropy does.  ``"auto"``: the dtype's machine epsilon / 32 (CCE's choice:
        2⁻¹² for bf16, 2⁻¹⁵ for fp16, 2⁻²⁸ for fp32).
        **Error bound** (each skipped ``|g[r, c]| < eps·|grad[r]|``): against the unfiltered
        result, before the final rounding,
        ``|Δgrad_input[r, h]| <= eps·|grad[r]|·Σ_{c skipped for r} |weight[c, h]|`` and
        ``|Δgrad_weight[c, h]| <= eps·Σ_{r skipped for c} |grad[r]|·|input[r, h]|``; each
        output then differs by that plus one rounding of its dtype.
    return_plan : bool, keyword-only
        Also return the tile plan, with ``blocks_total`` and ``blocks_skipped`` filled in.
    options : fastgrad.Options, keyword-only, optional
        This call's own settings (GEMM setting, native ISA, workspace budget) over those in
        force (``fastgrad._config.Options``): no context manager, nothing process-wide; 161002
        for another type or a field out of range.

    Returns
    -------
    (grad_input [BT, H], grad_weight [V, H])
        In ``input``'s dtype and kind (NumPy array or torch tensor); with ``return_plan=True``
        a third item, the :class:`fastgrad.tiling.LinearCETiling` that ran.

    Notes
    -----
    Memory-saving mode (``softmax is None``) recomputes the logits tile by tile
    (:func:`fastgrad.tiling.plan_linear_cross_entropy`) and never holds ``[BT, V]``:

    .. math::
        l = x w^T \;(\text{fp32});\quad p = e^{l - \text{logits\_max}} / \text{sum\_exp\_logits};
        \quad g = \mathrm{round}_{dtype}\big((p - \text{onehot}\cdot(1-\text{mask}))\cdot\text{grad}\big)

    then ``grad_input = g·weight`` and ``grad_weight = gᵀ·input`` accumulated in fp32 over the
    whole V (resp. BT) and rounded once to the dtype (RNE).  The doc's ``softmax·weightᵀ`` and
    weightGradOut shape ``[V, BT]`` are doc typos; the kernel's are ``[BT,V]@[V,H]`` and ``[V,H]``.

    Raises
    ------
    AclnnError 161001
        A required input is None, or ``softmax`` is None and ``logits_max`` or ``sum_exp_logits``
        is None.
    AclnnError 161002
        Wrong dtype (grad/logits_max/sum_exp_logits/softmax not fp32; input/weight not
        bf16/fp16/fp32 or different; target_mask not uint8/bool; masked_target not int32/int64),
        wrong rank or shape (``input.shape[0] != BT``, ``weight.shape[1] != H``, bool mask length
        ``!= BT``, packed mask length·8 ``< BT``, ...), label_smoothing outside [0, 1], ``out`` of
        the wrong shape/dtype or overlapping an input, ``filter_eps`` not None/"auto"/(0, 1] or
        given with ``softmax``.  Strict mode also: label_smoothing ≠ 0, fp32 input, V < 128 in
        high-performance mode, ``filter_eps`` given.
    AclnnError 361001
        The selected backend is unavailable.  Strict mode, SoC profile ``"Ascend950"``
        (``fg.soc_version``) and non-empty input/weight: the op_api's platform check ("Current
        platform is not supported", ``aclnn_fused_linear_cross_entropy_loss_grad.cpp:215-223,317``).
    AclnnError 561103
        Strict mode, what the op_host tiling refuses (the op_api then returns
        ACLNN_ERR_INNER_NULLPTR, :324): ``H > 65535`` (both modes, tiling :237-240, :527-530);
        in high-performance mode ``ceil16(BT) - (BT % 64 or 64) > 65535`` (:220-223),
        ``V > 65280`` (:231-235), and a softmax row larger than half the 192 KiB Unified Buffer,
        ``ceil(V/16)·64 > 98288`` bytes, i.e. ``V > 24560`` (``btPerEpochSingle == 0``, :181-182,
        :242-246).  Outside strict mode fastgrad computes these shapes.
    """
    if softmax is not None:  # the device never reads or checks them then (op_api :101-106, :152-157, :204-209)
        logits_max = sum_exp_logits = None
    return execute(
        DECL,
        dict(
            grad=grad,
            input=input,
            weight=weight,
            target_mask=target_mask,
            masked_target=masked_target,
            label_smoothing=label_smoothing,
            logits_max=logits_max,
            sum_exp_logits=sum_exp_logits,
            softmax=softmax,
            filter_eps=filter_eps,
            return_plan=return_plan,
        ),
        out,
        options=options,
    )
