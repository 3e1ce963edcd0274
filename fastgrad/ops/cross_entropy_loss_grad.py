"""op_api layer of ``cross_entropy_loss_grad`` (aclnnCrossEntropyLossGrad)."""

from __future__ import annotations

import numbers

import numpy as np

from .. import arrays
from .._config import is_strict
from ..backends import dispatch
from ..dtypes import FLOAT32, FLOAT_DTYPES, dtype_name
from ..errors import invalid, null_error
from ._common import INDEX_DTYPES, parse_float, parse_int, parse_reduction

OP = "cross_entropy_loss_grad"

#: The device's limit on N (seed 001: "logProb第零维N需满足N<200000").
MAX_N_DEVICE = 200000


def cross_entropy_loss_grad(grad_loss, log_prob, target, weight=None, reduction="mean",
                            ignore_index=-100, label_smoothing=0.0, grad_zloss=None,
                            lse_for_zloss=None, lse_square_scale_for_zloss=0.0, *, out=None):
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
    target : array (N,), int64 (int32 accepted outside strict mode)
        Class indices in ``[0, C)``, or ``ignore_index``.
    weight : array (C,), float32, optional
        Class weights (default all ones).  float16/bfloat16 are accepted outside strict mode
        (widened exactly to fp32).
    reduction : {"mean", "sum", "none"} or {1, 2, 0}
        The forward's reduction.
    ignore_index : int
        Rows whose target equals it contribute nothing (their gradient row is 0).
    label_smoothing : float in [0, 1]
        Label smoothing ``ls`` with PyTorch's composite semantics (extension: the device
        accepts only 0).
    grad_zloss : array, optional
        Gradient of the z-loss output, shaped like ``grad_loss`` (extension; the device
        accepts only None).
    lse_for_zloss : array (N,), float, optional
        The forward's ``logsumexp(logits)`` per row; required when
        ``lse_square_scale_for_zloss != 0`` (extension).
    lse_square_scale_for_zloss : float
        z-loss scale ``zs`` (extension; the device accepts only 0.0).
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
                      + p_{ij}\cdot 2\,zs\cdot lse_i\, m_i\, gz_i

    where ``gz = grad_loss + grad_zloss`` (``grad_zloss`` defaults to 0), divided by the
    number of non-ignored rows for ``mean``; the z-loss term is present only when
    ``zs != 0``.  Arithmetic is fp32 (16-bit inputs widened exactly, ``W`` summed serially in
    fp64), the output is rounded once to the dtype (RNE).  Ignored rows are 0, or NaN when
    their scale is not finite.

    Deviations, as the device: with ``mean`` and ``W = 0`` (e.g. every row ignored) the
    result is **NaN everywhere** (PyTorch returns 0).  PyTorch treats a target equal to a
    negative ``ignore_index`` as ignored and so does fastgrad (the device's docs call a
    negative ignore_index "no ignored label"; such a target is outside [0, C) there and its
    result undefined).

    Raises
    ------
    AclnnError
        161001 (ACLNN_ERR_PARAM_NULLPTR): ``grad_loss``, ``log_prob`` or ``target`` is None,
        or ``lse_for_zloss`` is None while ``lse_square_scale_for_zloss != 0``.
        161002 (ACLNN_ERR_PARAM_INVALID): a dtype or shape not listed above; ``reduction``
        not one of the three; ``label_smoothing`` outside [0, 1]; a target outside [0, C)
        that is not ``ignore_index`` (the device reads out of bounds; fastgrad always
        rejects it); a bad ``out``.  In strict mode (``fg.strict()``) also, as the device:
        ``label_smoothing != 0``; ``grad_zloss`` or ``lse_for_zloss`` given or
        ``lse_square_scale_for_zloss != 0``; ``N >= 200000``; target not int64; weight
        not float32; ``grad_loss`` dtype different from ``log_prob``'s; ``ignore_index >= C``
        (seed: "must be less than C").

    Source: seed 001 (CANN aclnnCrossEntropyLossGrad doc) and SPEC.md; CANN kernel
    ``CrossEntropyLossGrad`` (ops-nn ``loss/cross_entropy_loss_grad``) and its golden.
    """
    strict = is_strict()
    kind = arrays.kind_of(None if _is_number(grad_loss) else grad_loss, log_prob, target)

    # -- nullptr checks (161001) ---------------------------------------------------------
    if grad_loss is None:
        raise null_error("grad_loss", OP)
    lp = arrays.as_numpy(log_prob, "log_prob", op=OP)
    tg = arrays.as_numpy(target, "target", op=OP)
    if _is_number(grad_loss):
        gl = np.asarray(grad_loss, dtype=FLOAT32)
    else:
        gl = arrays.as_numpy(grad_loss, "grad_loss", op=OP)
    w = arrays.as_numpy(weight, "weight", required=False, op=OP)
    gz = arrays.as_numpy(grad_zloss, "grad_zloss", required=False, op=OP)
    lse = arrays.as_numpy(lse_for_zloss, "lse_for_zloss", required=False, op=OP)

    # -- attributes ------------------------------------------------------------------------
    red = parse_reduction(reduction, OP)
    ign = parse_int(ignore_index, "ignore_index", OP)
    ls = parse_float(label_smoothing, "label_smoothing", OP)
    if not (0.0 <= ls <= 1.0):
        raise invalid("label_smoothing", "a value in [0.0, 1.0]", ls, OP)
    zs = parse_float(lse_square_scale_for_zloss, "lse_square_scale_for_zloss", OP)
    if not np.isfinite(zs):
        raise invalid("lse_square_scale_for_zloss", "a finite number", zs, OP)

    # -- dtypes ----------------------------------------------------------------------------
    arrays.check_dtype(lp, "log_prob", FLOAT_DTYPES, OP)
    arrays.check_dtype(gl, "grad_loss", FLOAT_DTYPES, OP)
    arrays.check_dtype(tg, "target", (np.int64,) if strict else INDEX_DTYPES, OP)
    if w is not None:
        arrays.check_dtype(w, "weight", (FLOAT32,) if strict else FLOAT_DTYPES, OP)
    if gz is not None:
        arrays.check_dtype(gz, "grad_zloss", FLOAT_DTYPES, OP)
    if lse is not None:
        arrays.check_dtype(lse, "lse_for_zloss", FLOAT_DTYPES, OP)
    if strict and gl.dtype != lp.dtype and not _is_number(grad_loss):
        raise invalid("grad_loss", f"the dtype of log_prob ({dtype_name(lp.dtype)})",
                      dtype_name(gl.dtype), OP)

    # -- shapes ----------------------------------------------------------------------------
    arrays.check_ndim(lp, "log_prob", 2, OP)
    n, c = (int(d) for d in lp.shape)
    arrays.check_shape(tg, "target", (n,), OP)
    red_shape = (n,) if red == "none" else ()
    arrays.check_shape(gl, "grad_loss", red_shape, OP)
    if w is not None:
        arrays.check_shape(w, "weight", (c,), OP)
    if gz is not None:
        arrays.check_shape(gz, "grad_zloss", red_shape, OP)
    if lse is not None:
        arrays.check_shape(lse, "lse_for_zloss", (n,), OP)

    # -- strict device parity --------------------------------------------------------------
    if strict:
        if ls != 0.0:
            raise invalid("label_smoothing", "0.0 (device limit; fastgrad computes other values "
                          "outside strict mode)", ls, OP)
        if zs != 0.0:
            raise invalid("lse_square_scale_for_zloss", "0.0 (device: z-loss unsupported)", zs, OP)
        if gz is not None:
            raise invalid("grad_zloss", "None (device: z-loss unsupported)", "an array", OP)
        if lse is not None:
            raise invalid("lse_for_zloss", "None (device: z-loss unsupported)", "an array", OP)
        if n >= MAX_N_DEVICE:
            raise invalid("log_prob", f"N < {MAX_N_DEVICE} (device limit)", f"N = {n}", OP)
        if ign >= c:
            raise invalid("ignore_index", f"a value < C = {c} (device limit)", ign, OP)
    if zs != 0.0 and lse is None:
        raise null_error("lse_for_zloss", OP)

    # -- target values (never read out of bounds) ------------------------------------------
    if n:
        bad = (tg != ign) & ((tg < 0) | (tg >= c))
        if bad.any():
            k = int(np.argmax(bad))
            raise invalid("target", f"values in [0, {c}) or ignore_index ({ign})",
                          f"target[{k}] = {int(tg[k])}", OP)

    # -- out, then compute ------------------------------------------------------------------
    chk = arrays.check_out(out, "out", (n, c), lp.dtype, OP)
    buf = arrays.prepare_out(out, chk, (n, c), lp.dtype)
    dispatch(OP)(grad_loss=gl, log_prob=lp, target=tg, weight=w, reduction=red,
                 ignore_index=ign, label_smoothing=ls, grad_zloss=gz, lse_for_zloss=lse,
                 lse_square_scale_for_zloss=zs, out=buf.buffer)
    return buf.result(kind)


def _is_number(x) -> bool:
    """A Python int/float (not bool, not a NumPy scalar, which carries its own dtype)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.generic, np.ndarray))
