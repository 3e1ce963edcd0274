"""op_api layer of ``cross_entropy_loss_grad`` (aclnnCrossEntropyLossGrad)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..arrays import ArrayLike
from ..dtypes import FLOAT32, FLOAT_DTYPES, dtype_name
from ..errors import ACLNN_ERR_INNER_TILING_ERROR
from ._opdef import AttrDef, Call, OpDef, OutSpec, TensorDef, execute

OP = "cross_entropy_loss_grad"

_zloss_warned = False


def _warn_zloss_once() -> None:
    """The device ignores the z-loss inputs (doc at ops-nn e5c3fa9,
    ``docs/aclnnCrossEntropyLossGrad.md:392``; no kernel reads them): say so once per process."""
    global _zloss_warned
    if not _zloss_warned:
        _zloss_warned = True
        warnings.warn(
            "cross_entropy_loss_grad: grad_zloss / lse_for_zloss / lse_square_scale_for_zloss are "
            "accepted and ignored, as on the device (the CANN kernels never read them; "
            "aclnnCrossEntropyLossGrad.md: z-loss '不会生效'); the z-loss of a training loss is "
            "fastgrad.torch.linear_cross_entropy(lse_square_scale=...)",
            UserWarning,
            stacklevel=4,
        )


_RED_SPELLINGS = ("none", "mean", "sum")


def _tiling_refuses(c: Call, param: str, expected: str, got: Any) -> None:
    """A shape or value the op_api passes and the op_host tiling refuses.  CrossEntropyLossGrad
    has no hand-written op_api: the generated aclnn API checks nulls and dtypes (opbase
    ``indv_executor.cpp:300-328,958-968``) and reports a failed tiling as 561002
    (``ACLNN_ERR_INNER_TILING_ERROR``, ``indv_executor.cpp:880-885``) — strict mode's code;
    outside it fastgrad's 161002."""
    if c.strict:
        c.fail(ACLNN_ERR_INNER_TILING_ERROR, param, expected + " (the op_host tiling; strict mode)", got)
    else:
        c.bad(param, expected, got)


def _relations(c: Call) -> None:
    lp, tg, w = c.a["log_prob"], c.a["target"], c.a["weight"]
    n, cc = c.shape_of("log_prob")
    arch35 = c.soc.name == "Ascend950"
    raw_red = c.raw.get("reduction")
    if c.strict and not arch35 and isinstance(raw_red, str) and raw_red not in _RED_SPELLINGS:
        # the A2/A3 tiling compares the C string exactly and has no else: any other spelling
        # ("Mean", " sum") leaves reductionKey at its initial 0 = none (ops-nn e5c3fa9
        # op_host/cross_entropy_loss_grad_tiling.cpp:279-297,323; REDUCTION_NONE = 0,
        # op_kernel/cross_entropy_loss_grad_base.h:25,163): the device runs reduction 'none'
        # (device_parity row 4o; the arch35 tiling refuses it instead, below)
        c.attrs["reduction"] = "none"
    red, ign = c.attrs["reduction"], c.attrs["ignore_index"]
    if c.strict and n * cc == 0:
        # an empty x_grad: the generated aclnn API matches the dtypes (161002; _device_limits)
        # and then skips tiling and launch when every output is empty (opbase aa3cd74
        # indv_executor.cpp:1075-1082, :852-858, indv_executor.h:400-403): none of the tiling's
        # refusals below (561002) is reached and no value is read — success, out untouched
        # (device_parity row 4n, ops-nn e5c3fa9)
        c.info["empty_out"] = True
        c.skip_compute = True
        c.outs["out"] = OutSpec((n, cc), lp.dtype)
        return
    # tiling shape checks: A2/A3 cross_entropy_loss_grad_tiling.cpp:247-254 (target), :256-267
    # (weight); arch35 cross_entropy_loss_grad_tiling_arch35.cpp:368-376, :382-393
    if tuple(tg.shape) != (n,):
        _tiling_refuses(c, "target", f"shape {(n,)} (log_prob.shape[0])", f"shape {tuple(tg.shape)}")
    if w is not None and tuple(w.shape) != (cc,):
        _tiling_refuses(c, "weight", f"shape {(cc,)} (log_prob.shape[1])", f"shape {tuple(w.shape)}")
    ls = c.attrs["label_smoothing"]
    if not 0.0 <= ls <= 1.0:
        # the arch35 tiling refuses it (:427-436); the A2/A3 tiling reads it unchecked
        if arch35:
            _tiling_refuses(c, "label_smoothing", "a value in [0, 1]", ls)
        else:
            c.bad("label_smoothing", "a value in [0, 1]", ls)
    if c.strict and arch35 and not (isinstance(raw_red, str) and raw_red in _RED_SPELLINGS):
        # the arch35 tiling compares the C string exactly (strcmp, :404-418): "Mean", " sum" or
        # an integer (no C string at all) are refused
        c.fail(
            ACLNN_ERR_INNER_TILING_ERROR,
            "reduction",
            "exactly 'none', 'mean' or 'sum' (the arch35 tiling's strcmp; strict mode)",
            repr(raw_red),
        )
    gl = c.a["grad_loss"]
    gshape = tuple(gl.shape)
    if red == "none":
        if gshape != (n,):
            if arch35:  # arch35 tiling :348-358
                _tiling_refuses(c, "grad_loss", f"shape {(n,)} for reduction='none'", f"shape {gshape}")
            else:  # the A2/A3 kernel reads grad_loss[i] for every row: past its end
                c.bad("grad_loss", f"shape {(n,)} for reduction='none'", f"shape {gshape}")
    else:
        if gl.size == 0:  # the kernel reads element 0 (cross_entropy_loss_grad_base.h:243-253)
            expected = f"() or (1,) for reduction={red!r}"
            if arch35:
                _tiling_refuses(c, "grad_loss", expected, f"shape {gshape}")
            else:
                c.bad("grad_loss", expected + " (the kernel reads its element 0)", f"shape {gshape}")
        else:
            if gshape not in ((), (1,)) and arch35:
                # arch35 tiling :359-366: one element of rank <= 1 (a scalar is made (1,))
                _tiling_refuses(c, "grad_loss", f"() or (1,) for reduction={red!r}", f"shape {gshape}")
            # the A2/A3 tiling never reads its shape (cross_entropy_loss_grad_tiling.cpp:238-276)
            # and the kernel reads element 0 (cross_entropy_loss_grad_base.h:243-253): any
            # non-empty grad_loss, its first element
            c.a["grad_loss"] = gl.reshape(-1)[:1].reshape(())
    if w is not None and tuple(w.shape) != (cc,):
        w = None  # refused above; nothing more to check against it
    if c.a["grad_zloss"] is not None or c.a["lse_for_zloss"] is not None or c.attrs["lse_square_scale_for_zloss"]:
        _warn_zloss_once()
    # which rows are ignored: target == ignore_index (910B kernel, any sign), or only when
    # ignore_index >= 0 (arch35): the SoC profile's rule
    any_sign = c.soc.ce_grad_ignore_any_sign
    ign_on = any_sign or ign >= 0
    ignored = (tg == ign) if ign_on else np.zeros(tg.shape, bool)
    if n and w is not None and tg.shape == (n,):
        # with a weight the kernel reads weight[target] (TargetWeight): out of bounds for a target
        # outside [0, C) that is not ignored — fastgrad never reads out of bounds
        bad = ~ignored & ((tg < 0) | (tg >= cc))
        if bad.any():
            k = int(np.argmax(bad))
            if ign_on:
                allowed = f"values in [0, {cc}) or ignore_index ({ign}) when weight is given"
            else:
                allowed = (
                    f"values in [0, {cc}) when weight is given — on {c.soc.name} a negative ignore_index "
                    f"({ign}) ignores no row (the arch35 kernel ignores rows only for ignore_index >= 0, "
                    "arch35/cross_entropy_loss_grad_weight_not_none.h:132-143)"
                )
            c.bad("target", allowed + " (the device reads weight out of bounds)", f"target[{k}] = {int(tg[k])}")
    c.info["kernel_args"] = {"ignore_any_sign": any_sign, "smooth_arch35": c.soc.ce_grad_label_smoothing}
    c.outs["out"] = OutSpec((n, cc), lp.dtype)


def _device_limits(c: Call) -> None:
    gl, lp, tg = c.a["grad_loss"], c.a["log_prob"], c.a["target"]
    if not isinstance(c.raw["grad_loss"], (int, float)) and gl.dtype != lp.dtype:
        c.bad("grad_loss", f"the dtype of log_prob ({dtype_name(lp.dtype)})", dtype_name(gl.dtype))
    for name in ("grad_zloss", "lse_for_zloss"):  # the op's def: one dtype column for all of them
        a = c.a[name]
        if a is not None and a.dtype != lp.dtype:
            c.bad(name, f"the dtype of log_prob ({dtype_name(lp.dtype)}; strict mode)", dtype_name(a.dtype))
    allowed = c.soc.ce_grad_target_dtypes
    if dtype_name(tg.dtype) not in allowed:
        c.bad(
            "target",
            f"dtype in ({', '.join(allowed)}) on {c.soc.name} (cross_entropy_loss_grad_def.cpp; strict mode)",
            dtype_name(tg.dtype),
        )
    if c.attrs["label_smoothing"] != 0.0 and not c.soc.ce_grad_label_smoothing and not c.info.get("empty_out"):
        c.bad(
            "label_smoothing",
            f"0.0 on {c.soc.name}: the device accepts other values but its kernel then never writes "
            "x_grad (cross_entropy_loss_grad_weight_none.h:119-130) or writes garbage "
            "(cross_entropy_loss_grad_weight_not_none.h:133-149); strict mode",
            c.attrs["label_smoothing"],
        )


DECL = OpDef(
    name=OP,
    aclnn="aclnnCrossEntropyLossGrad",
    inputs=(
        TensorDef("grad_loss", FLOAT_DTYPES, ndim=(0, 1), scalar_ok=True),
        TensorDef("log_prob", FLOAT_DTYPES, ndim=(2, 2)),
        TensorDef("target", (np.int64, np.int32), ndim=(1, 1)),  # per SoC in strict mode: _device_limits
        TensorDef("weight", (FLOAT32,), ext_dtypes=FLOAT_DTYPES[:2], ndim=(1, 1), optional=True),
        TensorDef("grad_zloss", FLOAT_DTYPES, ndim=(0, None), optional=True),  # accepted, ignored
        TensorDef("lse_for_zloss", FLOAT_DTYPES, ndim=(0, None), optional=True),  # accepted, ignored
    ),
    attrs=(
        AttrDef("reduction", "reduction"),
        AttrDef("ignore_index", "int"),
        AttrDef(
            "label_smoothing", "float", finite=False, c_float=True
        ),  # [0, 1]: _relations; per SoC in strict mode: _device_limits
        AttrDef("lse_square_scale_for_zloss", "float"),  # accepted, ignored
    ),
    outputs=("out",),
    relations=_relations,
    device_limits=_device_limits,
    source="aclnnCrossEntropyLossGrad.md; ops-nn loss/cross_entropy_loss_grad; ATen LossNLL.cpp",
)


def cross_entropy_loss_grad(
    grad_loss: ArrayLike,
    log_prob: ArrayLike,
    target: ArrayLike,
    weight: ArrayLike | None = None,
    reduction: str | int = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    grad_zloss: ArrayLike | None = None,
    lse_for_zloss: ArrayLike | None = None,
    lse_square_scale_for_zloss: float = 0.0,
    *,
    out: Any = None,
) -> Any:
    r"""Gradient of the cross-entropy loss w.r.t. the logits (aclnnCrossEntropyLossGrad).

    The backward of ``loss = cross_entropy(logits, target, weight, ignore_index, reduction,
    label_smoothing)`` given ``log_prob = log_softmax(logits)``: NLL backward fused with the
    log-softmax backward, in one pass over ``log_prob``.

    Parameters
    ----------
    grad_loss : array, float32 | float16 | bfloat16
        Gradient of the loss: 0-d for ``reduction`` ``"mean"``/``"sum"``, shape ``(N,)`` for
        ``"none"``.  (A Python number is accepted as a 0-d float32 of any precision.)
    log_prob : array (N, C), float32 | float16 | bfloat16
        The forward's ``log_softmax(logits)``.  ``p = exp(log_prob)`` is used as is (not
        renormalised).  N may be 0; C classes.
    target : array (N,), int64 | int32
        Class indices in ``[0, C)``, or ``ignore_index``.  The device's kernel takes int64 on
        A2/A3 and int64 or int32 on Ascend 950 (``cross_entropy_loss_grad_def.cpp:20-21,44-49,
        96-101,126``): strict mode refuses int32 on the ``"Ascend910B"``/``"Ascend910_93"``
        profiles.  Without ``weight`` a target outside ``[0, C)`` that is not ignored is
        computed as the device computes it: the row is ``exp(log_prob)·c_i`` with no −1 (the
        kernel's compare never matches; ``cross_entropy_loss_grad_weight_none.h:97-100``, negative
        targets compared as uint64 in ``arch35/cross_entropy_loss_grad_base.h:487-525``) and the
        row counts in the mean's denominator.
    weight : array (C,), float32, optional
        Class weights (default all ones).  float16/bfloat16 are accepted outside strict mode
        (widened exactly to fp32).
    reduction : {"mean", "sum", "none"} or {1, 2, 0}
        The forward's reduction (case and surrounding blanks ignored).  Strict mode reads it
        as the device: on ``"Ascend910B"``/``"Ascend910_93"`` a string other than exactly
        ``"none"``/``"mean"``/``"sum"`` (``"Mean"``) is reduction ``"none"`` (the A2 tiling's
        strcmp has no else), on ``"Ascend950"`` it is refused (561002).
    ignore_index : int
        Rows whose target equals it contribute nothing (their gradient row is 0).  Which rows
        that is follows the SoC profile (``fg.soc_version``): on ``"Ascend910B"``/
        ``"Ascend910_93"`` ``target == ignore_index`` whatever its sign (the 910B kernel,
        ``cross_entropy_loss_grad_base.h:198-220``, and PyTorch); on ``"Ascend950"`` only when
        ``ignore_index >= 0`` (``arch35/cross_entropy_loss_grad_weight_none.h:143-175``): a
        negative ignore_index ignores nothing and the mean divides by N (Σ weight[t]).  Any
        value is accepted (the device checks none).
    label_smoothing : float in [0, 1]
        Label smoothing ``ls`` with PyTorch's composite semantics.  The Ascend 950 kernel
        computes it (``SmoothLabel``); the 910B kernel does not reject it but then never writes
        ``x_grad`` (``cross_entropy_loss_grad_weight_none.h:119-130``) or writes garbage
        (``..._weight_not_none.h:133-149``): strict mode refuses ``ls != 0`` on the A2/A3
        profiles (161002, the message says why); outside it fastgrad computes the formula.
    grad_zloss, lse_for_zloss : array, optional
        Accepted and **ignored**, as on the device (the doc at ops-nn e5c3fa9,
        ``docs/aclnnCrossEntropyLossGrad.md:392``: z-loss inputs "不会生效"; no kernel reads
        them).  A ``UserWarning`` says so once per process.  The z-loss of a training loss is
        :func:`fastgrad.torch.linear_cross_entropy`'s ``lse_square_scale``.
    lse_square_scale_for_zloss : float
        Accepted and ignored (see above).
    out : array (N, C), dtype of ``log_prob``, optional
        Preallocated output (any strides); returned.

    Returns
    -------
    x_grad : array (N, C), dtype of ``log_prob``
        NumPy in -> NumPy out; torch tensor in -> torch tensor out.

    Notes
    -----
    With ``w_i = weight[t_i]`` (1 without weight) and ``m_i = 0`` for ignored rows (1
    otherwise), ``W = Σ_i m_i·w_i`` and the row scale ``s_i = g/W`` (mean), ``g`` (sum),
    ``g_i`` (none), ``p = exp(log_prob)``:

    .. math::

        x\_grad_{ij} = m_i s_i\left[(1-ls)\,w_i\,(p_{ij} - \delta_{j,t_i})
                      + \frac{ls}{C}\Big(p_{ij}\sum_c weight_c - weight_j\Big)\right]

    (``δ`` is 0 on every column for a target outside ``[0, C)``).  Arithmetic is fp32 (16-bit
    inputs widened exactly, ``W`` summed serially in fp64), the output is rounded once to the
    dtype (RNE).  With ``ls = 0`` the rounding order is the 910B kernel's, bit for bit:
    ``c_i = fl(fl(fl(g·(1-ls))/W)·m_i)·w_i``, ``x = fl(p·c_i)``, at the target ``fl(x - c_i)``, then the cast (ops-nn
    ``cross_entropy_loss_grad_weight_none.h:90-101,164-170``,
    ``cross_entropy_loss_grad_weight_not_none.h:110-150,183-194``).  Ignored rows are
    computed as ``p·c_i`` with ``c_i = ±0``, as on the device: 0, but NaN where ``log_prob``
    is NaN (or ``exp`` overflows), and NaN when their scale is not finite.  With label
    smoothing the row's ``Σ_c weight_c`` term is ``fl(sm_i·fl(Σ weight))`` for a finite
    ``sm_i = m_i s_i ls/C``; for an infinite one it is summed term by term, as the arch35 kernel
    (``arch35/cross_entropy_loss_grad_weight_not_none.h:218-330``) and PyTorch's composite do:
    NaN for weights of both signs or a zero weight (docs/device_parity.md row 4m).

    Deviations, as the device: with ``mean`` and ``W = 0`` (e.g. every row ignored) the
    result is **NaN everywhere** (PyTorch returns 0).  The ignore rule is the profile's (see
    ``ignore_index``; the 910B kernel compares in fp32, which equals the int64 compare below
    2**24); the CANN golden ignores rows only when ``ignore_index >= 0``, as the 950 kernel
    (docs/device_parity.md, rows 4b-4e).

    Raises
    ------
    AclnnError
        161001 (ACLNN_ERR_PARAM_NULLPTR): ``grad_loss``, ``log_prob`` or ``target`` is None.
        161002 (ACLNN_ERR_PARAM_INVALID): a dtype or shape not listed above; ``reduction``
        not one of the three; ``label_smoothing`` outside [0, 1]; **with** ``weight``, a target
        outside [0, C) that is not ignored (the kernel reads ``weight[target]`` out of bounds;
        fastgrad always rejects it); a bad ``out``.  In strict mode (``fg.strict()``) also, as
        the device: target int32 on the A2/A3 profiles; ``label_smoothing != 0`` on the A2/A3
        profiles; weight not float32; ``grad_loss``, ``grad_zloss`` or ``lse_for_zloss`` of
        another dtype than ``log_prob``.  (The old limits ``N < 200000`` and
        ``ignore_index < C`` came from earlier doc revisions; neither today's doc nor the
        tiling checks them, and fastgrad no longer does.)

    Source: the CANN doc aclnnCrossEntropyLossGrad.md and docs/spec.md; CANN kernel
    ``CrossEntropyLossGrad`` (ops-nn ``loss/cross_entropy_loss_grad``) and its golden.
    """
    return execute(
        DECL,
        dict(
            grad_loss=grad_loss,
            log_prob=log_prob,
            target=target,
            weight=weight,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            grad_zloss=grad_zloss,
            lse_for_zloss=lse_for_zloss,
            lse_square_scale_for_zloss=lse_square_scale_for_zloss,
        ),
        out,
    )
