"""torch_npu's names and signatures for fastgrad's ops: CPU tensors in, CPU tensors out.

A test written for the NPU runs against fastgrad's CPU golden by changing one import::

    import torch_npu                     # on the NPU host
    from fastgrad import torch_npu       # on any CPU host: the same calls, fastgrad's results

    loss, log_prob, _, _ = torch_npu.npu_cross_entropy_loss(logits, target)
    gi, gw = torch_npu.npu_fused_linear_cross_entropy_loss_with_max_sum_backward(grad, x, w, tm, mt, ...)

The signatures are op-plugin's (``op_plugin/config/op_plugin_functions.yaml`` of Ascend/op-plugin
at 517f2e7: lines 6913, 6918 (masked softmax), 7172, 7192 (cross entropy), 7568-7574 (the three
fused-linear ops), 2027 (``embedding_dense_backward``), 4799 (``smooth_l1_loss_backward``)) and
the return conventions of the torch_npu docs (``docs/zh/custom_APIs/torch_npu/``): an output the
device leaves out is an **empty tensor**, not None (``vocab_parallel_logits`` without
``return_logits``, ``softmax`` without ``vocab_parallel_logits``, ``zloss``/``lse_for_zloss``).

Backward ops call fastgrad's public ops (the device's roundings, see ``docs/spec.md``); the two
forwards fastgrad has no op for (``npu_scaled_masked_softmax``, ``npu_cross_entropy_loss``) are
computed by PyTorch in float32 exactly as op-plugin's own CPU goldens compute them
(``test/test_base_ops/test_scaled_masked_softmax.py``: ``softmax((x·scale).masked_fill(mask,
-10000))``; ``test/test_custom_ops/test_npu_cross_entropy_loss.py``: max-shifted log-softmax,
weighted NLL, label smoothing), rounded once to the input dtype, and their autograd backward is
fastgrad's op (``scaled_masked_softmax_backward``, ``cross_entropy_loss_grad``), as the NPU's
autograd calls ``npu_scaled_masked_softmax_backward`` / ``npu_cross_entropy_loss_backward``.

Differences from the device that stay: inputs are never written; the device's non-determinism
(softmax backward, embedding) is absent; the device's limits (``fixed_triu_mask`` must be False,
``label_smoothing`` must be 0 for the fused-linear ops, S2 <= 4096) are enforced only under
``fastgrad.strict()``.  The ``target_mask`` padding bits of ``npu_fused_linear_online_max_sum``
follow the kernel (see ``docs/spec.md``), where the torch_npu doc's formula says 1.

Errors: fastgrad's :class:`~fastgrad.AclnnError` with the aclnn status (161001 a required input
is None, 161002 a dtype/shape/value out of range).
"""

from __future__ import annotations

from typing import Any

try:
    import torch
except ImportError as _e:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "fastgrad.torch_npu needs PyTorch: `pip install torch --index-url https://download.pytorch.org/whl/cpu`"
    ) from _e

import fastgrad as fg

from .errors import invalid, null_error

__all__ = [
    "npu_fused_linear_online_max_sum",
    "npu_fused_cross_entropy_loss_with_max_sum",
    "npu_fused_linear_cross_entropy_loss_with_max_sum_backward",
    "npu_cross_entropy_loss",
    "npu_cross_entropy_loss_backward",
    "npu_scaled_masked_softmax",
    "npu_scaled_masked_softmax_backward",
    "smooth_l1_loss_backward",
    "embedding_dense_backward",
]

#: Fill value of the masked positions before the softmax (op-plugin's CPU golden, and the
#: device's ``ScaledMaskedSoftmaxV2``: ``masked_fill(mask, -10000)``).
MASK_FILL = -10000.0

_REDUCTIONS = ("mean", "sum", "none")


def _tensor(x: Any, name: str, op: str, *, required: bool = True) -> torch.Tensor | None:
    if x is None:
        if required:
            raise null_error(name, op)
        return None
    if not isinstance(x, torch.Tensor):
        raise invalid(name, "a CPU torch.Tensor", type(x).__name__, op)
    if x.device.type != "cpu":
        raise invalid(name, "a CPU tensor (fastgrad.torch_npu is the CPU golden)", f"device {x.device}", op)
    return x


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


# ------------------------------------------------------------------- fused linear family ----


def npu_fused_linear_online_max_sum(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    return_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_fused_linear_online_max_sum`` (aclnnFusedLinearOnlineMaxSum).

    Parameters
    ----------
    input : Tensor [BT, H], bfloat16 | float16
    weight : Tensor [V, H], input's dtype
    target : Tensor [BT], int32 | int64
    vocab_start_index, vocab_end_index : int
        This shard's vocabulary range ``[start, end)`` (``0 <= start <= end``).
    return_logits : bool
        True: also return ``vocab_parallel_logits`` (the device's high-performance branch).

    Returns
    -------
    (logits_max fp32[BT], sum_exp_logits fp32[BT], predicted_logits fp32[BT],
    target_mask uint8[ceil(BT/8)], masked_target [BT] target's dtype,
    vocab_parallel_logits [BT, V] input's dtype, or an empty tensor without ``return_logits``)

    Raises
    ------
    AclnnError
        161001 for a None tensor, 161002 for dtypes, shapes or indices out of range
        (see :func:`fastgrad.fused_linear_online_max_sum`).
    """
    op = "npu_fused_linear_online_max_sum"
    for n, t in (("input", input), ("weight", weight), ("target", target)):
        _tensor(t, n, op)
    r = fg.fused_linear_online_max_sum(input, weight, target, vocab_start_index, vocab_end_index, return_logits)
    logits = r[5] if r[5] is not None else _empty(input.dtype)
    return r[0], r[1], r[2], r[3], r[4], logits


def npu_fused_cross_entropy_loss_with_max_sum(
    logits_max: torch.Tensor,
    sum_exp_logits: torch.Tensor,
    predicted_logits: torch.Tensor,
    *,
    label_smoothing: float | None = 0.0,
    input: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    vocab_parallel_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_fused_cross_entropy_loss_with_max_sum`` (aclnnFusedCrossEntropyLossWithMaxSum).

    ``loss = log(sum_exp_logits) - predicted_logits`` (fp32 [BT]); with ``vocab_parallel_logits``
    ([BT, V], fp32 | fp16 | bf16) also ``softmax = exp(logits - logits_max) · (1/sum_exp_logits)``
    (fp32 [BT, V]), else an empty fp32 tensor.  ``input`` and ``weight`` are reserved by the
    device ("当前仅支持None"): 161002 when given.  ``label_smoothing`` None means 0.

    Raises
    ------
    AclnnError
        161001 for a None statistic, 161002 for ``input``/``weight`` given or shapes/dtypes out of
        range (see :func:`fastgrad.fused_cross_entropy_loss_with_max_sum`).
    """
    op = "npu_fused_cross_entropy_loss_with_max_sum"
    for n, t in (
        ("logits_max", logits_max),
        ("sum_exp_logits", sum_exp_logits),
        ("predicted_logits", predicted_logits),
    ):
        _tensor(t, n, op)
    if input is not None:
        raise invalid("input", "None (reserved by the device: 当前仅支持None)", "a tensor", op)
    if weight is not None:
        raise invalid("weight", "None (reserved by the device: 当前仅支持None)", "a tensor", op)
    ls = 0.0 if label_smoothing is None else float(label_smoothing)
    loss, softmax = fg.fused_cross_entropy_loss_with_max_sum(
        logits_max, sum_exp_logits, predicted_logits, ls, vocab_parallel_logits
    )
    return loss, (softmax if softmax is not None else _empty(torch.float32))


def npu_fused_linear_cross_entropy_loss_with_max_sum_backward(
    grad: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    target_mask: torch.Tensor,
    masked_target: torch.Tensor,
    label_smoothing: float = 0.0,
    logits_max: torch.Tensor | None = None,
    sum_exp_logits: torch.Tensor | None = None,
    softmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_fused_linear_cross_entropy_loss_with_max_sum_backward``
    (aclnnFusedLinearCrossEntropyLossGrad).

    Parameters
    ----------
    grad : Tensor [BT], float32
    input : Tensor [BT, H], bfloat16 | float16
    weight : Tensor [V, H], input's dtype
    target_mask : Tensor uint8 [ceil(BT/8)] (bit i = row i's target outside this shard)
    masked_target : Tensor [BT], int32 | int64
    label_smoothing : float
        0 on the device; other values are fastgrad's extension (161002 in strict mode).
    logits_max, sum_exp_logits : Tensor [BT] float32, optional
        The memory-saving mode's statistics (required when ``softmax`` is None).
    softmax : Tensor [BT, V] float32, optional
        The high-performance mode (the statistics are then ignored; not modified).

    Returns
    -------
    (grad_input [BT, H], grad_weight [V, H]), both in input's dtype.

    Raises
    ------
    AclnnError
        161001 for a None required tensor (the statistics without ``softmax``), 161002 for
        dtypes/shapes out of range (see :func:`fastgrad.fused_linear_cross_entropy_loss_grad`).
    """
    op = "npu_fused_linear_cross_entropy_loss_with_max_sum_backward"
    for n, t in (
        ("grad", grad),
        ("input", input),
        ("weight", weight),
        ("target_mask", target_mask),
        ("masked_target", masked_target),
    ):
        _tensor(t, n, op)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(
        grad, input, weight, target_mask, masked_target, label_smoothing, logits_max, sum_exp_logits, softmax
    )
    return gi, gw


# --------------------------------------------------------------------------- cross entropy ----


def _reduction(reduction: Any, op: str) -> str:
    if reduction not in _REDUCTIONS:
        raise invalid("reduction", "'mean' | 'sum' | 'none'", repr(reduction), op)
    return str(reduction)


def _ce_forward(x, target, weight, reduction, ignore_index, label_smoothing):
    """op-plugin's golden (test/test_custom_ops/test_npu_cross_entropy_loss.py), in float32."""
    N, C = x.shape
    xf = x.float()
    w = torch.ones(C, dtype=torch.float32) if weight is None else weight.float()
    m = xf.max(dim=1, keepdim=True)[0] if N and C else torch.zeros(N, 1)
    lp = xf - m - torch.log(torch.exp(xf - m).sum(dim=-1, keepdim=True))
    keep = (target != ignore_index) if ignore_index >= 0 else torch.ones(N, dtype=torch.bool)
    safe_t = torch.where(keep, target, torch.zeros_like(target))
    nll = lp.gather(1, safe_t.reshape(-1, 1)).reshape(-1)
    w_yn = w.gather(0, safe_t) * keep.float()
    loss = -nll * w_yn
    smooth = -(lp * w.unsqueeze(0)).sum(dim=-1) * keep.float()
    if reduction == "mean":
        den = w_yn.sum()
        out = ((1 - label_smoothing) * loss.sum() / den + smooth.sum() / den * label_smoothing / C).reshape(1)
    elif reduction == "sum":
        out = ((1 - label_smoothing) * loss.sum() + smooth.sum() * label_smoothing / C).reshape(1)
    else:
        out = (1 - label_smoothing) * loss + smooth * label_smoothing / C
    return out.to(x.dtype), lp.to(x.dtype)


class _CrossEntropyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, weight, reduction, ignore_index, label_smoothing):
        loss, log_prob = _ce_forward(x, target, weight, reduction, ignore_index, label_smoothing)
        ctx.save_for_backward(log_prob, target, weight if weight is not None else torch.empty(0))
        ctx.has_weight = weight is not None
        ctx.attrs = (reduction, ignore_index, label_smoothing)
        ctx.mark_non_differentiable(log_prob)
        return loss, log_prob

    @staticmethod
    def backward(ctx, grad_loss, _grad_log_prob):
        log_prob, target, weight = ctx.saved_tensors
        reduction, ignore_index, label_smoothing = ctx.attrs
        g = npu_cross_entropy_loss_backward(
            grad_loss.contiguous(),
            log_prob,
            target,
            weight if ctx.has_weight else None,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
        )
        return g, None, None, None, None, None


def npu_cross_entropy_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale_for_zloss: float = 0.0,
    return_zloss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_cross_entropy_loss`` (aclnnCrossEntropyLoss): loss and log-probabilities.

    Parameters
    ----------
    input : Tensor [N, C], float32 | float16 | bfloat16
    target : Tensor [N], int64, in [0, C)
    weight : Tensor [C], float32, optional (all ones when None)
    reduction : {"mean", "sum", "none"}
    ignore_index : int
        Rows whose target equals it are ignored; a negative value ignores none (the device's rule).
    label_smoothing : float in [0, 1)
    lse_square_scale_for_zloss, return_zloss
        Not supported by the device ("当前暂不支持"): must be 0.0 / False (161002 otherwise).

    Returns
    -------
    (loss, log_prob, zloss, lse_for_zloss)
        ``loss`` in input's dtype, shape [1] for mean/sum and [N] for none;
        ``log_prob = x - logsumexp(x)`` [N, C] in input's dtype; ``zloss`` and
        ``lse_for_zloss`` empty tensors (the device returns them empty).  Only ``loss`` carries a
        gradient: its backward is :func:`npu_cross_entropy_loss_backward` (fastgrad's
        ``cross_entropy_loss_grad``).

    Formula (float32, rounded once): with ``w_n = weight[t_n]·[t_n != ignore_index]``,
    ``l_n = -w_n·log_prob[n, t_n]``, ``s_n = -Σ_c weight_c·log_prob[n, c]`` (ignored rows 0):
    mean ``((1-ls)·Σl + ls/C·Σs) / Σw``; sum ``(1-ls)·Σl + ls/C·Σs``; none ``(1-ls)·l + ls/C·s``.

    Raises
    ------
    AclnnError
        161001 for a None input/target; 161002 for a shape/dtype/value out of range.
    """
    op = "npu_cross_entropy_loss"
    x = _tensor(input, "input", op)
    t = _tensor(target, "target", op)
    w = _tensor(weight, "weight", op, required=False)
    assert x is not None and t is not None  # (for mypy; _tensor raised otherwise)
    red = _reduction(reduction, op)
    if x.dim() != 2:
        raise invalid("input", "a 2-D tensor [N, C]", f"shape {tuple(x.shape)}", op)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise invalid("input", "float32 | float16 | bfloat16", str(x.dtype), op)
    if t.dtype != torch.int64 or tuple(t.shape) != (x.shape[0],):
        raise invalid("target", f"int64 of shape ({x.shape[0]},)", f"{t.dtype} of shape {tuple(t.shape)}", op)
    N, C = x.shape
    if C == 0 and N > 0:  # (every row ignored would otherwise reach a gather over no class)
        raise invalid("input", "[N, C] with C >= 1 classes", f"shape {tuple(x.shape)}", op)
    keep = (t != ignore_index) if ignore_index >= 0 else torch.ones(N, dtype=torch.bool)
    if bool(((t < 0) | (t >= C))[keep].any()):
        raise invalid("target", f"values in [0, {C}) (or ignore_index)", "a value out of range", op)
    if w is not None and (w.dtype != torch.float32 or tuple(w.shape) != (C,)):
        raise invalid("weight", f"float32 of shape ({C},)", f"{w.dtype} of shape {tuple(w.shape)}", op)
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise invalid("label_smoothing", "a value in [0, 1)", repr(label_smoothing), op)
    if float(lse_square_scale_for_zloss) != 0.0:
        raise invalid("lse_square_scale_for_zloss", "0.0 (z-loss: 当前暂不支持)", repr(lse_square_scale_for_zloss), op)
    if return_zloss:
        raise invalid("return_zloss", "False (z-loss: 当前暂不支持)", repr(return_zloss), op)
    loss, log_prob = _CrossEntropyLoss.apply(x, t, w, red, int(ignore_index), float(label_smoothing))
    return loss, log_prob, _empty(x.dtype), _empty(x.dtype)


def npu_cross_entropy_loss_backward(
    grad_loss: torch.Tensor,
    log_prob: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    grad_zloss: torch.Tensor | None = None,
    lse_for_zloss: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale_for_zloss: float = 0.0,
) -> torch.Tensor:
    """``torch_npu.npu_cross_entropy_loss_backward`` (aclnnCrossEntropyLossGrad).

    ``grad_loss``: [1] or 0-d for mean/sum (a one-element tensor is taken as 0-d), [N] for none;
    ``log_prob`` [N, C] (float32 | float16 | bfloat16); ``target`` int64 [N]; ``weight`` float32 [C].
    Returns ``x_grad`` [N, C] in log_prob's dtype: ``s_n·[(1-ls)·w_{t_n}·(p - onehot) +
    ls/C·(p·Σweight - weight)]`` with ``p = exp(log_prob)`` (see
    :func:`fastgrad.cross_entropy_loss_grad`).  ``grad_zloss``/``lse_for_zloss`` are accepted and
    ignored, as on A2/A3.

    Raises
    ------
    AclnnError
        161001 for a None required tensor, 161002 for shapes/dtypes/values out of range.
    """
    op = "npu_cross_entropy_loss_backward"
    g = _tensor(grad_loss, "grad_loss", op)
    assert g is not None
    _tensor(log_prob, "log_prob", op)
    _tensor(target, "target", op)
    red = _reduction(reduction, op)
    if red != "none" and g.numel() == 1:
        g = g.reshape(())
    return fg.cross_entropy_loss_grad(
        g,
        log_prob,
        target,
        weight,
        red,
        ignore_index,
        label_smoothing,
        grad_zloss,
        lse_for_zloss,
        lse_square_scale_for_zloss,
    )


# ------------------------------------------------------------------------- masked softmax ----


def _triu(shape) -> torch.Tensor:
    S1, S2 = shape[-2], shape[-1]
    return torch.ones(S1, S2, dtype=torch.bool).triu(1)


class _ScaledMaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale, fixed_triu_mask):
        m = mask
        if fixed_triu_mask:
            m = _triu(x.shape) if m is None else (m | _triu(x.shape))
        z = x.float() * scale
        if m is not None:
            z = z.masked_fill(m, MASK_FILL)
        y = torch.softmax(z, dim=-1).to(x.dtype)
        ctx.save_for_backward(y, mask if mask is not None else torch.empty(0, dtype=torch.bool))
        ctx.has_mask = mask is not None
        ctx.attrs = (scale, fixed_triu_mask)
        return y

    @staticmethod
    def backward(ctx, y_grad):
        y, mask = ctx.saved_tensors
        scale, fixed_triu_mask = ctx.attrs
        g = npu_scaled_masked_softmax_backward(
            y_grad.contiguous(), y, mask if ctx.has_mask else None, scale, fixed_triu_mask
        )
        return g, None, None, None


def npu_scaled_masked_softmax(
    x: torch.Tensor, mask: torch.Tensor | None, scale: float = 1, fixed_triu_mask: bool = False
) -> torch.Tensor:
    """``torch_npu.npu_scaled_masked_softmax``: ``softmax((x·scale).masked_fill(mask, -10000), -1)``.

    Parameters
    ----------
    x : Tensor [B, N, S1, S2] (any rank >= 1 outside strict mode), float32 | float16 | bfloat16
    mask : Tensor bool, broadcastable to x (True = masked); None only with ``fixed_triu_mask``
    scale : float
    fixed_triu_mask : bool
        Reserved on the device ("当前只支持False"); True also masks j > i (fastgrad's extension).

    Returns
    -------
    Tensor, x's shape and dtype: computed in float32, rounded once.  Its autograd backward is
    :func:`npu_scaled_masked_softmax_backward` (fastgrad's ``scaled_masked_softmax_backward``).

    Raises
    ------
    AclnnError
        161001 for a None ``x`` (or ``mask`` without ``fixed_triu_mask``), 161002 for a dtype or
        a mask shape that does not broadcast.
    """
    op = "npu_scaled_masked_softmax"
    xx = _tensor(x, "x", op)
    assert xx is not None
    mm = _tensor(mask, "mask", op, required=not fixed_triu_mask)
    if xx.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise invalid("x", "float32 | float16 | bfloat16", str(xx.dtype), op)
    if mm is not None:
        if mm.dtype != torch.bool:
            raise invalid("mask", "a bool tensor", str(mm.dtype), op)
        try:  # broadcastable *to* x: the result has x's shape (the backward's rule too)
            fits = torch.broadcast_shapes(mm.shape, xx.shape) == xx.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise invalid("mask", f"a shape broadcastable to {tuple(xx.shape)}", f"shape {tuple(mm.shape)}", op)
    return _ScaledMaskedSoftmax.apply(xx, mm, float(scale), bool(fixed_triu_mask))


def npu_scaled_masked_softmax_backward(
    y_grad: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, scale: float, fixed_triu_mask: bool
) -> torch.Tensor:
    """``torch_npu.npu_scaled_masked_softmax_backward`` (aclnnScaledMaskedSoftmaxBackward).

    With ``S = Σ_last(y_grad·y)`` (fp32, the vector unit's reduce order): the row padded to a
    multiple of 64 is ``<= 1024`` wide → the AscendC SoftmaxGrad form ``((y_grad - S)·y)·scale``
    (``scaled_masked_softmax_grad_v2_norm_headdim.h:137-154``); wider → ``(y_grad·y - y·S)·scale``
    (``…_large_headdim.h:163-205``) — docs/device_parity.md row 7a.  Each step rounded to fp32,
    0 where ``mask`` is True, rounded once to y_grad's dtype; y_grad's shape (see
    :func:`fastgrad.scaled_masked_softmax_backward`).

    Raises
    ------
    AclnnError
        161001 for a None tensor, 161002 for dtypes/shapes out of range.
    """
    op = "npu_scaled_masked_softmax_backward"
    _tensor(y_grad, "y_grad", op)
    _tensor(y, "y", op)
    return fg.scaled_masked_softmax_backward(y_grad, y, mask, float(scale), bool(fixed_triu_mask))


# ------------------------------------------------------------------------- ATen backward ops ----


def smooth_l1_loss_backward(
    grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor, reduction: int, beta: float
) -> torch.Tensor:
    """ATen ``smooth_l1_loss_backward`` as op-plugin binds it on the NPU (aclnnSmoothL1LossBackward).

    ``reduction``: 0 none, 1 mean, 2 sum (ATen's enum; the strings are accepted too).  Returns
    ``grad_input`` with the broadcast shape, ``d = self - target``, the SoC profile's kernel
    (docs/device_parity.md rows 5-5f): on the 910B (A2/A3, the TBE kernel)
    ``-[d <= -beta] + [d >= beta] + [|d| < beta]·d/(beta + 1e-6)`` — exactly ±1 at
    ``|d| = beta``, a true division by ``fp32(beta + 1e-6)`` inside, NaN d read as 0, so with
    beta = 0 a zero difference gives 0 (PyTorch's CPU kernel gives -1); on Ascend 950 the arch35
    DAG ``[d > beta] - [d < -beta] + [|d| <= beta]·d·fp32(1/beta)``, where ``fp32(1/beta)`` is NaN
    for beta < 1e-6 (beta = 0 included: the ``|d| <= beta`` zone is NaN; rows 5a, 5f).  Times grad_output; mean
    multiplies by ``fp32(1/n)`` (see :func:`fastgrad.smooth_l1_loss_backward`).

    Raises
    ------
    AclnnError
        161001 for a None tensor, 161002 for beta < 0, an unknown reduction or shapes that do not
        broadcast.
    """
    op = "smooth_l1_loss_backward"
    for n, t in (("grad_output", grad_output), ("self", self), ("target", target)):
        _tensor(t, n, op)
    return fg.smooth_l1_loss_backward(grad_output, self, target, reduction, beta)


def embedding_dense_backward(
    grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> torch.Tensor:
    """ATen ``embedding_dense_backward`` as op-plugin binds it on the NPU (aclnnEmbeddingDenseBackward).

    ``out[k] = Σ_{i: indices_i = k} grad_output[i]`` accumulated in float32 (PyTorch's CPU kernel
    accumulates bf16/fp16 in 16 bits), rounded once; row ``padding_idx`` stays 0 (negative: none);
    ``scale_grad_by_freq`` multiplies row k's fp32 sum by the fp32 reciprocal ``1.0f / count``
    (the device's ``Muls``, ``embedding_dense_grad_v2_scale.h:92-108``; not a division, which
    differs by one ulp in a third to a half of random sums — docs/device_parity.md row 9).
    Returns [num_weights, D] in grad's dtype.

    Raises
    ------
    AclnnError
        161001 for a None tensor, 161002 for an index outside [0, num_weights).
    """
    op = "embedding_dense_backward"
    _tensor(grad_output, "grad_output", op)
    _tensor(indices, "indices", op)
    return fg.embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
