"""fastgrad as a TTK golden plugin for the seven ops.

TTK (``python3 -m ttk kernel -i cases.csv --plugin <dir>``) reads a plugin's literal
``__golden__ = {"kernel": {op_type: function_name}, "aclnn": {api: function_name}}`` — the form
of ops-nn's ``tests/assets/golden.py`` — and calls ``fn(*inputs, **attrs, **ctx)`` with NumPy
inputs in op-definition order (bf16 as ``ml_dtypes.bfloat16``, an absent optional input as
None), the attributes by their op-definition names, and a context: ``output_dtypes`` (and the
other ``{input,output}_{dtypes,ori_shapes,formats,ori_formats}``), ``full_soc_version`` /
``short_soc_version`` and ``testcase_name``.  It expects the list of outputs.

This module is such a plugin: use it directly (``--plugin`` pointing at a folder holding a copy
made by ``fastgrad ttk-plugin --out DIR``, which writes ``DIR/golden.py`` importing these
functions).  Each function runs fastgrad's public op under the SoC profile the context names
(``short_soc_version``, else ``full_soc_version``; unknown names raise ``ValueError``; none: the
current setting) and returns its outputs cast to ``output_dtypes`` when given.

Kernel entries follow ``op_host/<op>_def.cpp`` at hicann/ops-nn e5c3fa9 (inputs, then attributes):

=========================================  ====================================================================
op type (``__golden__["kernel"]``)          inputs; attributes → outputs
=========================================  ====================================================================
``fused_linear_online_max_sum``             input, weight, target; vocab_start_index, vocab_end_index,
                                            vocab_parallel_logits_out_flag → 5 outputs (6 with the flag)
``fused_cross_entropy_loss_with_max_sum``   logits_max, sum_exp_logits, predicted_logits, input, weight,
                                            vocab_parallel_logits; label_smoothing → loss, softmax_logits
``fused_linear_cross_entropy_loss_grad``    grad, input, weight, target_mask, masked_target, logits_max,
                                            sum_expLogits, softmax; label_smoothing → input_grad_out,
                                            weight_grad_out
``cross_entropy_loss_grad``                 grad_loss, log_prob, target, weight, grad_zloss, lse_for_zloss;
                                            reduction, ignore_index, label_smoothing,
                                            lse_square_scale_for_zloss → x_grad
``scaled_masked_softmax_grad_v2``           yGrad, y, mask; scale, fixed_triu_mask → xGrad
``smooth_l1_loss_grad_v2``                  predict, label, dout; sigma, reduction → gradient
``embedding_dense_grad_v2``                 grad, sort_indices, pos_idx; num_weights, padding_idx,
                                            scale_grad_by_freq → y
``embedding_dense_grad``                    grad, indices; num_weights, padding_idx, scale_grad_by_freq
                                            → grad_weight
=========================================  ====================================================================

Kernel-level points (the kernel, not the aclnn API, is under test):

* ``fused_cross_entropy_loss_with_max_sum``: the kernel never reads ``label_smoothing``
  (``op_kernel/`` and both tilings; only the aclnn op_api rejects ≠ 0,
  ``aclnn_fused_cross_entropy_loss_with_max_sum.cpp:114``), so it is passed on as 0; without
  ``vocab_parallel_logits`` the kernel leaves ``softmax_logits`` unwritten and the entry returns
  ones of its shape (``output_ori_shapes``, else ``(1,)``), as ops-nn's golden does for the
  initialised buffer.
* ``embedding_dense_grad_v2``: the indices are recovered from ``(sort_indices, pos_idx)``
  (``indices[pos_idx[i]] = sort_indices[i]``, golden.py's scatter) and ``grad`` is viewed as
  ``indices.shape + (D,)``.

The aclnn entries (``__golden__["aclnn"]``) take the aclnn signature: positional in signature
order (inputs and attributes, then outputs, which are ignored), or by name; see
:mod:`fastgrad.ascend.atk`.  The aclnn case file's columns TTK passes beside them
(``tensor_dtypes``, ``tensor_formats``, ``tensor_view_shapes``, ``tensor_storage_shapes`` …,
``output_tensor_indexes``) are context, not arguments; without ``output_dtypes`` the outputs are
cast to ``tensor_dtypes`` at ``output_tensor_indexes``.  An ``output_dtypes`` that is one string
is the first output's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .atk import as_flag

OP = "ttk_golden"

__golden__ = {
    "kernel": {
        "fused_linear_online_max_sum": "fused_linear_online_max_sum_golden",
        "fused_cross_entropy_loss_with_max_sum": "fused_cross_entropy_loss_with_max_sum_golden",
        "fused_linear_cross_entropy_loss_grad": "fused_linear_cross_entropy_loss_grad_golden",
        "cross_entropy_loss_grad": "cross_entropy_loss_grad_golden",
        "scaled_masked_softmax_grad_v2": "scaled_masked_softmax_grad_v2_golden",
        "smooth_l1_loss_grad_v2": "smooth_l1_loss_grad_v2_golden",
        "embedding_dense_grad_v2": "embedding_dense_grad_v2_golden",
        "embedding_dense_grad": "embedding_dense_grad_golden",
    },
    "aclnn": {
        "aclnnFusedLinearOnlineMaxSum": "aclnn_fused_linear_online_max_sum_golden",
        "aclnnFusedCrossEntropyLossWithMaxSum": "aclnn_fused_cross_entropy_loss_with_max_sum_golden",
        "aclnnFusedLinearCrossEntropyLossGrad": "aclnn_fused_linear_cross_entropy_loss_grad_golden",
        "aclnnCrossEntropyLossGrad": "aclnn_cross_entropy_loss_grad_golden",
        "aclnnScaledMaskedSoftmaxBackward": "aclnn_scaled_masked_softmax_backward_golden",
        "aclnnSmoothL1LossBackward": "aclnn_smooth_l1_loss_backward_golden",
        "aclnnEmbeddingDenseBackward": "aclnn_embedding_dense_backward_golden",
    },
}

#: the context keys TTK passes (``fn(*inputs, **attrs, **ctx)``): never taken for attributes
CONTEXT_KEYS = (
    "input_dtypes",
    "output_dtypes",
    "input_ori_shapes",
    "output_ori_shapes",
    "input_formats",
    "output_formats",
    "input_ori_formats",
    "output_ori_formats",
    "input_shapes",
    "output_shapes",
    "full_soc_version",
    "short_soc_version",
    "soc_version",
    "testcase_name",
)


def _is_context(name: str) -> bool:
    """A keyword TTK passes as context, not as an argument: :data:`CONTEXT_KEYS` and, for the aclnn
    entries, the aclnn case file's columns (``tensor_dtypes``, ``tensor_formats``,
    ``tensor_view_shapes``, ``tensor_storage_shapes`` …, ``output_tensor_indexes``); no aclnn
    parameter is spelled so."""
    return name in CONTEXT_KEYS or name.startswith("tensor_") or name.endswith("_tensor_indexes")


def _soc(ctx: dict) -> str | None:
    for k in ("short_soc_version", "soc_version", "full_soc_version"):
        v = ctx.get(k)
        if v:
            return str(v)
    return None


def _cast(outs: list, ctx: dict) -> list:
    """The outputs as NumPy arrays, each cast to ``output_dtypes[i]`` when TTK gives it."""
    from ..dtypes import parse_dtype

    dts = ctx.get("output_dtypes") or ()
    if isinstance(dts, str):  # one dtype name: the first output's (not one per character)
        dts = (dts,)
    if not dts and ctx.get("tensor_dtypes") and ctx.get("output_tensor_indexes") is not None:
        # an aclnn case: the outputs' dtypes are the tensor_dtypes at output_tensor_indexes
        tds, idx = ctx["tensor_dtypes"], ctx["output_tensor_indexes"]
        tds = (tds,) if isinstance(tds, str) else tds
        dts = tuple(tds[int(i)] if -len(tds) <= int(i) < len(tds) else None for i in idx)
    res: list[np.ndarray | None] = []
    for i, o in enumerate(outs):
        if o is None:
            res.append(None)
            continue
        a = np.asarray(o)
        if i < len(dts) and dts[i] is not None:
            dt = dts[i][0] if isinstance(dts[i], (list, tuple)) else dts[i]
            a = a.astype(parse_dtype(dt), copy=False)
        res.append(a)
    return res


def _run(fn, ctx: dict) -> list:
    import warnings

    import fastgrad as fg

    soc = _soc(ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the device ignores …" notes: the golden says nothing
        if soc is None:
            return fn(fg)
        with fg.soc_version(soc):
            return fn(fg)


# --- kernel entries (op_host/*_def.cpp order) ------------------------------------------------


def fused_linear_online_max_sum_golden(
    input: Any,
    weight: Any,
    target: Any,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    vocab_parallel_logits_out_flag: bool = False,
    **ctx: Any,
) -> list:
    """FusedLinearOnlineMaxSum: logits_max_local, sum_exp_logits_local, predicted_logits_local,
    target_mask, masked_target (+ vocab_parallel_logits_out with the flag)."""
    flag = as_flag(vocab_parallel_logits_out_flag, "vocab_parallel_logits_out_flag", OP)
    r = _run(
        lambda fg: list(
            fg.fused_linear_online_max_sum(
                input, weight, target, int(vocab_start_index), int(vocab_end_index), return_logits=flag
            )
        ),
        ctx,
    )
    return _cast(r if flag else r[:5], ctx)


def fused_cross_entropy_loss_with_max_sum_golden(
    logits_max: Any,
    sum_exp_logits: Any,
    predicted_logits: Any,
    input: Any = None,
    weight: Any = None,
    vocab_parallel_logits: Any = None,
    label_smoothing: float = 0.0,
    **ctx: Any,
) -> list:
    """FusedCrossEntropyLossWithMaxSum: loss, softmax_logits.  ``input``/``weight`` and
    ``label_smoothing`` are not read by the kernel (module docstring)."""
    loss, sm = _run(
        lambda fg: list(
            fg.fused_cross_entropy_loss_with_max_sum(
                logits_max, sum_exp_logits, predicted_logits, 0.0, vocab_parallel_logits
            )
        ),
        ctx,
    )
    if sm is None:
        shapes: Any = ctx.get("output_ori_shapes") or ctx.get("output_shapes") or ()
        shape = tuple(shapes[1]) if len(shapes) > 1 and shapes[1] is not None else (1,)
        sm = np.ones(shape, np.float32)
    return _cast([loss, sm], ctx)


def fused_linear_cross_entropy_loss_grad_golden(
    grad: Any,
    input: Any,
    weight: Any,
    target_mask: Any,
    masked_target: Any,
    logits_max: Any = None,
    sum_expLogits: Any = None,  # noqa: N803 (the op definition's name)
    softmax: Any = None,
    *,
    label_smoothing: float = 0.0,
    **ctx: Any,
) -> list:
    """FusedLinearCrossEntropyLossGrad: input_grad_out, weight_grad_out."""
    r = _run(
        lambda fg: list(
            fg.fused_linear_cross_entropy_loss_grad(
                grad,
                input,
                weight,
                target_mask,
                masked_target,
                float(label_smoothing),
                logits_max,
                sum_expLogits,
                softmax,
            )
        ),
        ctx,
    )
    return _cast(r, ctx)


def cross_entropy_loss_grad_golden(
    grad_loss: Any,
    log_prob: Any,
    target: Any,
    weight: Any = None,
    grad_zloss: Any = None,
    lse_for_zloss: Any = None,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale_for_zloss: float = 0.0,
    **ctx: Any,
) -> list:
    """CrossEntropyLossGrad: x_grad."""
    r = _run(
        lambda fg: [
            fg.cross_entropy_loss_grad(
                grad_loss,
                log_prob,
                target,
                weight,
                reduction,
                int(ignore_index),
                float(label_smoothing),
                grad_zloss,
                lse_for_zloss,
                float(lse_square_scale_for_zloss),
            )
        ],
        ctx,
    )
    return _cast(r, ctx)


def scaled_masked_softmax_grad_v2_golden(
    yGrad: Any,  # noqa: N803 (the op definition's names)
    y: Any,
    mask: Any = None,
    *,
    scale: float = 1.0,
    fixed_triu_mask: bool = False,
    **ctx: Any,
) -> list:
    """ScaledMaskedSoftmaxGradV2: xGrad."""
    fixed = as_flag(fixed_triu_mask, "fixed_triu_mask", OP)
    r = _run(lambda fg: [fg.scaled_masked_softmax_backward(yGrad, y, mask, float(scale), fixed)], ctx)
    return _cast(r, ctx)


def smooth_l1_loss_grad_v2_golden(
    predict: Any, label: Any, dout: Any, *, sigma: float = 1.0, reduction: str = "mean", **ctx: Any
) -> list:
    """SmoothL1LossGradV2: gradient (``sigma`` is the aclnn ``beta``)."""
    r = _run(lambda fg: [fg.smooth_l1_loss_backward(dout, predict, label, reduction, float(sigma))], ctx)
    return _cast(r, ctx)


def embedding_dense_grad_v2_golden(
    grad: Any,
    sort_indices: Any,
    pos_idx: Any,
    *,
    num_weights: int,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    **ctx: Any,
) -> list:
    """EmbeddingDenseGradV2: y, from the sorted indices and their positions (module docstring)."""
    freq = as_flag(scale_grad_by_freq, "scale_grad_by_freq", OP)
    s = np.asarray(sort_indices)
    flat = np.zeros(s.size, s.dtype)
    flat[np.asarray(pos_idx).reshape(-1).astype(np.int64)] = s.reshape(-1)
    indices = flat.reshape(s.shape)
    g = np.asarray(grad)
    g = g.reshape(tuple(s.shape) + (g.shape[-1],))
    r = _run(
        lambda fg: [fg.embedding_dense_backward(g, indices, int(num_weights), int(padding_idx), freq)],
        ctx,
    )
    return _cast(r, ctx)


def embedding_dense_grad_golden(
    grad: Any,
    indices: Any,
    *,
    num_weights: int,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    **ctx: Any,
) -> list:
    """EmbeddingDenseGrad (the arch35 kernel of aclnnEmbeddingDenseBackward): grad_weight."""
    freq = as_flag(scale_grad_by_freq, "scale_grad_by_freq", OP)
    g = np.asarray(grad)
    i = np.asarray(indices)
    if g.ndim != i.ndim + 1:
        g = g.reshape(tuple(i.shape) + (g.shape[-1],))
    r = _run(
        lambda fg: [fg.embedding_dense_backward(g, i, int(num_weights), int(padding_idx), freq)],
        ctx,
    )
    return _cast(r, ctx)


# --- aclnn entries (aclnn signature order; see fastgrad.ascend.atk) ---------------------------


def _aclnn(name: str, args: tuple, kwargs: dict) -> list:
    from .atk import bind, call_api, find_api

    ctx = {k: kwargs.pop(k) for k in list(kwargs) if _is_context(k)}
    api = find_api(name)
    outs = _run(lambda fg: call_api(api, bind(api, args, kwargs)), ctx)
    return _cast(outs, ctx)


def aclnn_fused_linear_online_max_sum_golden(*args: Any, **kwargs: Any) -> list:
    """aclnnFusedLinearOnlineMaxSum(input, weight, target, vocabStartIndex, vocabEndIndex, …)."""
    return _aclnn("aclnnFusedLinearOnlineMaxSum", args, kwargs)


def aclnn_fused_cross_entropy_loss_with_max_sum_golden(*args: Any, **kwargs: Any) -> list:
    """aclnnFusedCrossEntropyLossWithMaxSum(logitsMax, sumExpLogits, predictedLogits, labelSmoothing,
    inputOptional, weightOptional, vocabParallelLogitsOptional, lossOut, softMaxOutOptional)."""
    return _aclnn("aclnnFusedCrossEntropyLossWithMaxSum", args, kwargs)


def aclnn_fused_linear_cross_entropy_loss_grad_golden(*args: Any, **kwargs: Any) -> list:
    """aclnnFusedLinearCrossEntropyLossGrad(grad, input, weight, targetMask, maskedTarget, …)."""
    return _aclnn("aclnnFusedLinearCrossEntropyLossGrad", args, kwargs)


def aclnn_cross_entropy_loss_grad_golden(*args: Any, **kwargs: Any) -> list:
    """aclnnCrossEntropyLossGrad(gradLoss, logProb, target, weightOptional, …, out)."""
    return _aclnn("aclnnCrossEntropyLossGrad", args, kwargs)


def aclnn_scaled_masked_softmax_backward_golden(*args: Any, **kwargs: Any) -> list:
    """aclnnScaledMaskedSoftmaxBackward(gradOutput, y, mask, scale, fixTriuMask, out)."""
    return _aclnn("aclnnScaledMaskedSoftmaxBackward", args, kwargs)


def aclnn_smooth_l1_loss_backward_golden(*args: Any, **kwargs: Any) -> list:
    """aclnnSmoothL1LossBackward(gradOut, self, target, reduction, beta, gradInput)."""
    return _aclnn("aclnnSmoothL1LossBackward", args, kwargs)


def aclnn_embedding_dense_backward_golden(*args: Any, **kwargs: Any) -> list:
    """aclnnEmbeddingDenseBackward(grad, indices, numWeights, paddingIdx, scaleGradByFreq, out)."""
    return _aclnn("aclnnEmbeddingDenseBackward", args, kwargs)


def plugin_source() -> str:
    """The text of a stand-alone plugin file (what ``fastgrad ttk-plugin`` writes): the literal
    ``__golden__`` table and the functions it names, imported from this module."""
    names = sorted({n for table in __golden__.values() for n in table.values()})
    lines = [
        '"""TTK golden plugin: fastgrad (CPU, bit-exact bf16/fp16) for the seven CANN ops.',
        "",
        "Written by `fastgrad ttk-plugin`; the functions live in fastgrad.ascend.ttk (see its docstring).",
        '"""',
        "",
        "from fastgrad.ascend.ttk import (  # noqa: F401",
    ]
    lines += [f"    {n}," for n in names]
    lines += [")", "", "__golden__ = {"]
    for kind, table in __golden__.items():
        lines.append(f"    {kind!r}: {{")
        lines += [f"        {k!r}: {v!r}," for k, v in table.items()]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines).replace("'", '"') + "\n"
