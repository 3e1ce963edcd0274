"""op_api: aclnnFusedLinearCrossEntropyLossGrad — validation, plan, dispatch."""

from __future__ import annotations

import numpy as np

from .. import arrays
from .. import dtypes as D
from .._config import is_strict
from ..backends import dispatch
from ..errors import ACLNN_ERR_PARAM_NULLPTR, AclnnError, invalid
from ._common import INDEX_DTYPES, parse_float

OP = "fused_linear_cross_entropy_loss_grad"


def fused_linear_cross_entropy_loss_grad(grad, input, weight, target_mask, masked_target,
                                         label_smoothing=0.0, logits_max=None,
                                         sum_exp_logits=None, softmax=None, *, out=None):
    r"""Gradient of the vocabulary-parallel linear cross-entropy w.r.t. ``input`` and ``weight``.

    The CPU counterpart of ``aclnnFusedLinearCrossEntropyLossGrad`` (seed document
    ``000_e15f902cbf80e4bf.txt``; ops-nn ``matmul/fused_linear_cross_entropy_loss_grad``).  Its
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
        ``logits_max``/``sum_exp_logits`` are then ignored.  **Not modified** (the device
        overwrites it in place; fastgrad does not).
    out : (grad_input, grad_weight), optional
        Preallocated outputs (shapes ``[BT, H]`` and ``[V, H]``, input's dtype).  Untouched when
        validation fails.  Extension (not in strict mode): an fp32 ``grad_input`` receives the
        fp32 accumulator unrounded — what a vocabulary-parallel caller all-reduces.

    Returns
    -------
    (grad_input [BT, H], grad_weight [V, H])
        In ``input``'s dtype and kind (NumPy array or torch tensor).

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
        ``!= BT``, packed mask length·8 ``< BT``, ...), non-finite label_smoothing, ``out`` of the
        wrong shape/dtype.  Strict mode also: label_smoothing ≠ 0, fp32 input, V < 128 in
        high-performance mode.
    AclnnError 361001
        The selected backend is unavailable.
    """
    kind = arrays.kind_of(input, weight, grad)
    # 161001 first, as the device's CheckNotNull: the softmax/logits_max/sum_exp rule leads.
    if softmax is None and (logits_max is None or sum_exp_logits is None):
        raise AclnnError(ACLNN_ERR_PARAM_NULLPTR,
                         f"{OP}: logits_max and sum_exp_logits are required when softmax is None "
                         f"(got logits_max={'None' if logits_max is None else 'given'}, "
                         f"sum_exp_logits={'None' if sum_exp_logits is None else 'given'})",
                         "logits_max" if logits_max is None else "sum_exp_logits")
    g = arrays.as_numpy(grad, "grad", op=OP)
    x = arrays.as_numpy(input, "input", op=OP)
    w = arrays.as_numpy(weight, "weight", op=OP)
    tm = arrays.as_numpy(target_mask, "target_mask", op=OP)
    mt = arrays.as_numpy(masked_target, "masked_target", op=OP)
    sm = arrays.as_numpy(softmax, "softmax", required=False, op=OP)
    lm = se = None
    if sm is None:
        lm = arrays.as_numpy(logits_max, "logits_max", op=OP)
        se = arrays.as_numpy(sum_exp_logits, "sum_exp_logits", op=OP)
    strict = is_strict()

    # dtypes (device order: CheckDtypeValid)
    arrays.check_dtype(g, "grad", [D.FLOAT32], OP)
    float_in = [D.BFLOAT16, D.FLOAT16] if strict else [D.BFLOAT16, D.FLOAT16, D.FLOAT32]
    arrays.check_dtype(x, "input", float_in, OP)
    arrays.check_dtype(w, "weight", float_in, OP)
    if w.dtype != x.dtype:
        raise invalid("weight", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(w.dtype), OP)
    arrays.check_dtype(tm, "target_mask", [np.uint8, np.bool_], OP)
    arrays.check_dtype(mt, "masked_target", INDEX_DTYPES, OP)
    if sm is not None:
        arrays.check_dtype(sm, "softmax", [D.FLOAT32], OP)
    else:
        arrays.check_dtype(lm, "logits_max", [D.FLOAT32], OP)
        arrays.check_dtype(se, "sum_exp_logits", [D.FLOAT32], OP)

    # attribute
    ls = parse_float(label_smoothing, "label_smoothing", OP)
    if not np.isfinite(ls):
        raise invalid("label_smoothing", "a finite number", ls, OP)
    if strict and ls != 0.0:
        raise invalid("label_smoothing", "0 (the device supports only 0; strict mode)", ls, OP)

    # shapes (device order: CheckShapeValid)
    arrays.check_ndim(g, "grad", 1, OP)
    arrays.check_ndim(x, "input", 2, OP)
    arrays.check_ndim(w, "weight", 2, OP)
    arrays.check_ndim(tm, "target_mask", 1, OP)
    arrays.check_ndim(mt, "masked_target", 1, OP)
    if sm is not None:
        arrays.check_ndim(sm, "softmax", 2, OP)
    else:
        arrays.check_ndim(lm, "logits_max", 1, OP)
        arrays.check_ndim(se, "sum_exp_logits", 1, OP)
    BT = g.shape[0]
    H = x.shape[1]
    V = w.shape[0]
    if x.shape[0] != BT:
        raise invalid("input", f"input.shape[0] == grad.shape[0] == {BT}", f"shape {x.shape}", OP)
    if strict and sm is not None and V < 128:
        raise invalid("weight", "weight.shape[0] >= 128 in high-performance mode (strict mode)",
                      f"shape {w.shape}", OP)
    if w.shape[1] != H:
        raise invalid("weight", f"weight.shape[1] == input.shape[1] == {H}", f"shape {w.shape}", OP)
    if tm.dtype == np.bool_:
        if tm.shape[0] != BT:
            raise invalid("target_mask", f"bool length == grad.shape[0] == {BT}", f"shape {tm.shape}", OP)
    elif tm.shape[0] * 8 < BT:
        raise invalid("target_mask", f"uint8 length * 8 >= grad.shape[0] == {BT}", f"shape {tm.shape}", OP)
    arrays.check_shape(mt, "masked_target", (BT,), OP)
    if sm is not None:
        arrays.check_shape(sm, "softmax", (BT, V), OP)
    else:
        arrays.check_shape(lm, "logits_max", (BT,), OP)
        arrays.check_shape(se, "sum_exp_logits", (BT,), OP)

    # outputs
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise invalid("out", "a (grad_input, grad_weight) pair", type(out).__name__, OP)
        gi_dtype = x.dtype
        if not strict and out[0] is not None and arrays.as_numpy(out[0], "out[0]", op=OP).dtype == D.FLOAT32:
            gi_dtype = D.FLOAT32     # extension: the unrounded fp32 accumulator (for all-reduces)
        o_gi = arrays.check_out(out[0], "out[0] (grad_input)", (BT, H), gi_dtype, OP)
        o_gw = arrays.check_out(out[1], "out[1] (grad_weight)", (V, H), x.dtype, OP)
        user_gi, user_gw = out
    else:
        o_gi = o_gw = user_gi = user_gw = None
        gi_dtype = x.dtype

    if strict and (x.size == 0 or w.size == 0):
        # the device returns success without launching: outputs untouched
        b_gi = arrays.prepare_out(user_gi, o_gi, (BT, H), gi_dtype)
        b_gw = arrays.prepare_out(user_gw, o_gw, (V, H), x.dtype)
        if user_gi is None:
            b_gi.buffer[...] = 0
            b_gw.buffer[...] = 0
        return b_gi.result(kind), b_gw.result(kind)

    b_gi = arrays.prepare_out(user_gi, o_gi, (BT, H), gi_dtype)
    b_gw = arrays.prepare_out(user_gw, o_gw, (V, H), x.dtype)
    dispatch(OP)(grad=g, input=x, weight=w, target_mask=tm, masked_target=mt,
                 label_smoothing=ls, logits_max=lm, sum_exp_logits=se, softmax=sm,
                 out=(b_gi.buffer, b_gw.buffer))
    return b_gi.result(kind), b_gw.result(kind)
