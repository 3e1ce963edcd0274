"""``linear_cross_entropy``: the LM-head training loss as a ``torch.autograd.Function``.

Calls only the public op :func:`fastgrad.linear_cross_entropy` (row-block fused forward and
backward, statistics and gradient from the same fp32 logits).  ``precision="device"`` runs the
NPU's exact pipeline instead (:mod:`fastgrad.torch._device`, over the aclnn ops).

When the gradient is computed — the schedule
---------------------------------------------
* **fused** (3 GEMMs per step): ``torch.is_grad_enabled()``, at least one of ``hidden`` /
  ``weight`` / ``bias`` requires grad, ``reduction`` is ``"mean"`` or ``"sum"`` (a scalar
  loss: any later use of it only scales the gradient, so the gradient can be computed in the
  forward and scaled by the incoming gradient in the backward), no entropy output, and — with
  the schedule ``"auto"`` (``fused=None``) — the gradients it holds from the forward to the
  backward (fp32 ``[V, H]`` + ``[BT, H]``, or a 16-bit ``[V, H]`` with ``accum_dtype``) fit
  ``fused_memory_fraction`` (default 1/4) of the available memory, or ``fused_memory_limit``
  bytes (:func:`fastgrad.torch.options.choose_schedule`), or ``filter_eps`` is set.
  ``schedule="fused"`` (``fused=True``) forces it where allowed.
* **recompute** (4 GEMMs, the least memory): otherwise — ``reduction="none"`` (per-row upstream
  gradients are not known in the forward), an entropy output, memory too tight for the held
  gradients, or ``schedule="recompute"`` (``fused=False``).  ``precision="fast"`` follows the
  same rule: fused, its three GEMMs on the bf16 kernel (``TrainingPlan.grad16``), or recomputed,
  its four.  The forward keeps one ``[BT, 2048]`` chunk of
  logits at a time and holds only the fp32 ``[BT]`` log-sum-exp; the backward recomputes the
  logits vocabulary chunk by vocabulary chunk and writes a 16-bit ``weight``'s gradient in its
  own dtype, each chunk summed in fp32 and rounded once — no fp32 ``[V, H]`` exists.
* no grad mode / nothing requires grad: forward only (1 GEMM).

Differentiable once: a backward with ``create_graph=True`` (``torch.autograd.functional.hessian``,
a gradient penalty) raises :class:`fastgrad.AclnnError` 361001 (a ``RuntimeError``) instead of
returning a gradient whose own derivative would silently be zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from typing import TYPE_CHECKING, Any, NamedTuple

import ml_dtypes
import numpy as np
import torch

from .._config import gemm, is_strict, prefer_onednn, workspace_floor
from ..errors import invalid
from ..ops.linear_cross_entropy import linear_cross_entropy as _lce_op
from ..ops.linear_cross_entropy import round_grad as _round_grad
from . import distributed as _vp
from ._autograd import differentiable_once
from ._checks import OP, autocast_operands, bad, check_args, real, shift_target, values_of
from ._device import DeviceLinearCrossEntropyFunction
from ._errors import torch_error
from ._schedule import _fused_fits, _recompute_gw_dtype, recycled_scratch_bytes
from ._torch_grads import torch_grads, torch_tangent
from .options import resolve_options

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch._functorch.autograd_function import VmapInfo

__all__ = ["linear_cross_entropy", "LinearCrossEntropyFunction", "LinearCrossEntropyOutput"]


class LinearCrossEntropyOutput(NamedTuple):
    """Returned when ``return_z_loss``, ``return_token_accuracy``, ``return_predicted_tokens``
    or ``return_entropy`` is set (Liger's order, then the entropy)."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None
    predicted_tokens: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _engine(cfg):
    """The options' GEMM engine for this call (forward and backward), or the process setting."""
    e = cfg.get("engine")
    return contextlib.nullcontext() if e is None else gemm(e)


class _State:
    """What the Functions of one call share besides tensors: the checked configuration, the
    op's keywords, the schedule and which inputs want a gradient (never a tensor: under
    ``vmap`` every tensor must be an argument, so that the batch rule slices it)."""

    __slots__ = ("cfg", "kw", "fused", "need")

    def __init__(self, cfg, kw, fused, need):
        self.cfg, self.kw, self.fused, self.need = cfg, kw, fused, need


def _loop_vmap(fn, info, in_dims, *args):
    """A ``vmap`` rule by a loop: ``fn`` on each slice of the batched arguments, the tensor
    outputs stacked along dim 0 (the kernels take plain tensors; a batch of cotangents or of
    tangents — ``is_grads_batched``, ``gradcheck(check_batched_grad=True)``, batched forward AD —
    is a handful of vectors, each one more pass of the kernel)."""
    outs = []
    for i in range(info.batch_size):
        outs.append(fn(*(a.select(d, i) if isinstance(d, int) else a for a, d in zip(args, in_dims))))
    if not outs:
        raise invalid("vmap", "a batch of at least one", "batch size 0", OP)
    res: list = []
    dims: list[int | None] = []
    for k in range(len(outs[0])):
        col = [o[k] for o in outs]
        if isinstance(col[0], torch.Tensor):
            res.append(torch.stack(col))
            dims.append(0)
        else:
            res.append(col[0])
            dims.append(None)
    return tuple(res), tuple(dims)


def _op_kw(cfg):
    return dict(
        ignore_index=cfg["ignore_index"],
        reduction=cfg["reduction"],
        label_smoothing=cfg["label_smoothing"],
        softcap=cfg["softcap"],
        temperature=cfg["temperature"],
        lse_square_scale=cfg["lse_square_scale"],
        vocab_start_index=cfg["start"],
        vocab_size=cfg["V"],
        filter_eps=cfg.get("filter_eps"),
        accum_dtype=cfg.get("accum_dtype"),
        precision=cfg.get("op_precision", "accurate"),
    )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd Function behind :func:`linear_cross_entropy` (arguments already validated).

    ``apply(hidden2d, weight, bias, ce_weight, target1d, cfg)`` returns ``(loss, z_loss,
    token_accuracy, predicted_tokens, entropy, lse, z_mean, grad_input, grad_weight,
    grad_bias)``; ``loss`` and ``entropy`` (None unless ``cfg["return_entropy"]``) are
    differentiable, the rest are not (the last five are what the backward and the jvp read:
    the fp32 log-sum-exp, the entropy's ``μ``, the fused step's gradients or None).
    ``cfg["need"]``: which of hidden / weight / bias want a gradient (read by the caller, where
    the user's tensors are visible).

    * backward: the fused step's gradients scaled, or the recompute on the kernel; a batch of
      cotangents (``torch.autograd.grad(..., is_grads_batched=True)``, gradcheck's batched
      grad, ``torch.func.jacrev``) in chunked torch ops (:func:`torch_grads`).
    * jvp (forward-mode AD, ``torch.autograd.forward_ad``, ``torch.func.jvp``): the loss's
      tangent ``Σ_v dloss/dL_v · L̇_v`` with ``L̇ = Ẋ·Wᵀ + X·Ẇᵀ + ḃ`` — one more recompute of the
      kernel (:func:`_kernel_tangent`), a batch of tangents in chunked torch ops
      (:func:`torch_tangent`); never ``[BT, V]``.
    * vmap: a loop over the batch (``torch.func.vmap`` of the loss).
    """

    @staticmethod
    def forward(
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ce_weight: torch.Tensor | None,
        t: torch.Tensor,
        cfg: dict[str, Any],
    ) -> tuple[torch.Tensor | None, ...]:
        need = cfg["need"]
        fused = cfg["fused"] and any(need)
        group = cfg["group"]
        # the fused step's row blocks may take as much scratch as the 16-bit grad_weight they
        # are recycled into in the backward (``recycled_scratch_bytes``): fewer, larger blocks
        # (one process only: the ranks of a vocabulary-parallel group must plan the same row
        # blocks for their per-block all-reduce, and their shards may differ in size)
        floor = recycled_scratch_bytes(h.shape[0], weight) if (fused and need[1] and group is None) else 0
        with prefer_onednn(), _engine(cfg), workspace_floor(floor):  # the GEMM engine: fastgrad.gemm_engine
            r = _lce_op(
                h.detach(),
                weight.detach(),
                t,
                None if bias is None else bias.detach(),
                ce_weight,
                return_grad=need if fused else False,
                combine=None if group is None else _vp.block_combiner(group),
                return_entropy=cfg["return_entropy"],
                **_op_kw(cfg),
            )
        gi = gw = gb = None
        if fused:
            gi, gw, gb = r.grad_input, r.grad_weight, r.grad_bias
            if group is not None and gi is not None:
                gi = _vp.all_reduce_sum_fp32(gi, group)
        # Liger's predicted tokens: the argmax, -1 where the target is ignored
        pred = torch.where(t == cfg["ignore_index"], torch.full_like(r.predicted, -1), r.predicted)
        return r.loss, r.z_loss, r.token_accuracy, pred, r.entropy, r.lse, r.z_mean, gi, gw, gb

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor | None, ...]) -> None:
        h, weight, bias, ce_weight, t, cfg = inputs
        _loss, z_loss, acc, pred, _ent, lse, z_mean, gi, gw, gb = output
        ctx.state = _State(cfg, _op_kw(cfg), cfg["fused"] and any(cfg["need"]), cfg["need"])
        ctx.fused = ctx.state.fused  # which schedule ran (tests read loss.grad_fn.fused)
        ctx.save_for_backward(h, weight, bias, ce_weight, t, lse, z_mean, gi, gw, gb)
        ctx.save_for_forward(h, weight, bias, ce_weight, t, lse, z_mean)
        ctx.mark_non_differentiable(*(x for x in (z_loss, acc, pred, lse, z_mean, gi, gw, gb) if x is not None))
        # an output not used in the graph (the entropy of a metric) gets None, not zeros: no
        # entropy gradient is computed for it
        ctx.set_materialize_grads(False)

    @staticmethod
    @differentiable_once
    def backward(
        ctx: Any,
        grad_loss: torch.Tensor | None,
        _gz: torch.Tensor | None = None,
        _ga: torch.Tensor | None = None,
        _gp: torch.Tensor | None = None,
        grad_entropy: torch.Tensor | None = None,
        *_saved: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        if not any(ctx.needs_input_grad[:3]) or (grad_loss is None and grad_entropy is None):
            return (None,) * 6
        h, weight, bias, ce_weight, t, lse, z_mean, gi, gw, gb = ctx.saved_tensors
        st = ctx.state
        need = tuple(ctx.needs_input_grad[:3])
        if not (_plain(grad_loss) and _plain(grad_entropy)):
            # a batch of cotangents (is_grads_batched, gradcheck's batched grad, torch.func's
            # jacrev/vmap of a vjp): the kernels take plain tensors, so the gradient is computed
            # by torch ops — the fused step's gradients scaled, or the chunked recompute
            if st.fused and grad_entropy is None:
                assert grad_loss is not None  # the early return above: one of the two is given
                out = [
                    None if g is None or not n else (g * grad_loss.to(g.dtype)).to(x.dtype)
                    for g, n, x in zip((gi, gw, gb), need, (h, weight, bias))
                ]
            else:
                out = list(torch_grads(st, need, grad_loss, grad_entropy, h, weight, bias, ce_weight, t, lse, z_mean))
            return (*out, None, None, None)
        out = _kernel_grads(st, need, grad_loss, grad_entropy, h, weight, bias, ce_weight, t, lse, z_mean, gi, gw, gb)
        return (*out, None, None, None)

    @staticmethod
    def jvp(
        ctx: Any,
        th: torch.Tensor | None,
        tw: torch.Tensor | None,
        tb: torch.Tensor | None,
        _tcw: torch.Tensor | None = None,
        _tt: torch.Tensor | None = None,
        _tcfg: None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, ce_weight, t, lse, z_mean = ctx.saved_tensors
        st = ctx.state
        if bias is None:
            tb = None
        if th is None and tw is None and tb is None:
            return (None,) * 10
        if all(_plain(x) for x in (th, tw, tb)):
            lt, et = _kernel_tangent(st, th, tw, tb, h, weight, bias, ce_weight, t, lse, z_mean)
        else:  # a batch of tangents (batched forward AD): the chunked torch computation
            lt, et = torch_tangent(st, th, tw, tb, h, weight, bias, ce_weight, t, lse, z_mean)
        return lt, None, None, None, et, None, None, None, None, None

    @staticmethod
    def vmap(
        info: VmapInfo,
        in_dims: tuple[int | None, ...],
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ce_weight: torch.Tensor | None,
        t: torch.Tensor,
        cfg: dict[str, Any],
    ) -> tuple[tuple[Any, ...], tuple[int | None, ...]]:
        return _loop_vmap(LinearCrossEntropyFunction.apply, info, in_dims, h, weight, bias, ce_weight, t, cfg)


def _plain(x):
    """A plain CPU tensor (or None) that the kernels can take — not a batch of them under
    ``vmap`` (``torch.func``'s wrappers, or the ``Batched`` tensors of ``is_grads_batched`` and
    gradcheck's batched checks, which have no CPU key)."""
    if x is None:
        return True
    return torch._C._dispatch_keys(x).has(
        torch._C.DispatchKey.CPU
    ) and not torch._C._functorch.is_functorch_wrapped_tensor(x)


def _kernel_grads(st, need, grad_loss, grad_entropy, h, weight, bias, ce_weight, t, lse, z_mean, gi, gw, gb):
    """The backward on the kernel: the fused step's gradients scaled by the cotangent, or the
    recompute (``fastgrad.linear_cross_entropy`` with ``grad_output`` and the saved ``lse``)."""
    if grad_loss is None:  # only the entropy is differentiated
        grad_loss = torch.zeros(t.shape if st.cfg["reduction"] == "none" else (), dtype=torch.float64)
    if st.fused:
        unit = bool((grad_loss == 1).all())

        def scaled(g, like):
            if g is None:
                return None
            if g.dim() == 2 and g.dtype == torch.float32 and like.dtype in _NARROW and grad_loss.numel() == 1:
                # the 16-bit gradient on a recycled block (the forward's freed row-block
                # scratch): no new memory; the same bits as the two lines below
                s = None if unit else float(grad_loss.to(torch.float32))
                u = _round_grad(g.numpy(), _NARROW[like.dtype], s)
                return torch.from_numpy(u.view(np.uint16)).view(like.dtype)
            if unit:  # x·1 is exact: one rounding, no fp32 temporary
                return g.to(like.dtype, copy=True)
            return (g * grad_loss.to(g.dtype)).to(like.dtype)

        return (
            scaled(gi, h) if need[0] else None,
            scaled(gw, weight) if need[1] else None,
            scaled(gb, bias) if (need[2] and bias is not None) else None,
        )
    want = (need[0], need[1], bias is not None and need[2])
    with_h = grad_entropy is not None  # an entropy output: z_mean was saved
    with prefer_onednn(), _engine(st.cfg):
        r = _lce_op(
            h.detach(),
            weight.detach(),
            t,
            None if bias is None else bias.detach(),
            ce_weight,
            return_grad=want,
            grad_output=grad_loss.detach().double(),
            lse=lse,
            grad_entropy=grad_entropy.detach().double() if with_h else None,
            z_mean=z_mean if with_h else None,
            **{**st.kw, "accum_dtype": _recompute_gw_dtype(weight, st.kw)},
        )
    rgi, rgw, rgb = r.grad_input, r.grad_weight, r.grad_bias
    group = st.cfg["group"]
    if group is not None and rgi is not None:
        rgi = _vp.all_reduce_sum_fp32(rgi, group)
    return (
        rgi.to(h.dtype) if (rgi is not None and need[0]) else None,
        rgw.to(weight.dtype) if (rgw is not None and need[1]) else None,
        rgb.to(bias.dtype) if (rgb is not None and need[2]) else None,
    )


def _kernel_tangent(st, th, tw, tb, h, weight, bias, ce_weight, t, lse, z_mean):
    """Forward-mode AD on the kernel: ``losṡ_r = Σ_v g_rv · L̇_rv`` with ``g = dloss/dL`` (the
    backward's coefficient at a unit cotangent, every feature's chain rule included) and
    ``L̇ = Ẋ·Wᵀ + X·Ẇᵀ + ḃ``.  One recompute on widened operands gives every term without
    ``[BT, V]``: ``X' = [X | 0 | 0]`` and ``W' = [W | Ẇ | ḃ]`` have the logits ``X'·W'ᵀ = X·Wᵀ``,
    and the kernel's ``grad_input' = g·W' = [g·W | g·Ẇ | g·ḃ]``, so ``losṡ_r = Ẋ_r·(g·W)_r +
    X_r·(g·Ẇ)_r + (g·ḃ)_r`` (summed over the rows for a reduced loss; over the ranks of a
    vocabulary-parallel group).  The entropy's tangent the same way with ``grad_entropy = 1``.
    Dense and ``"accurate"`` (no filtering)."""
    cfg = st.cfg
    BT, H = h.shape
    cols, wcols = [h.detach()], [weight.detach()]
    if tw is not None:
        cols.append(torch.zeros((BT, H), dtype=h.dtype))
        wcols.append(tw.detach().to(weight.dtype))
    if tb is not None:
        cols.append(torch.zeros((BT, 1), dtype=h.dtype))
        wcols.append(tb.detach().to(weight.dtype)[:, None])
    hp = torch.cat(cols, 1).contiguous() if len(cols) > 1 else h.detach()
    wp = torch.cat(wcols, 1).contiguous() if len(wcols) > 1 else weight.detach()
    kw = {**st.kw, "filter_eps": None, "accum_dtype": None, "precision": "accurate"}
    none = cfg["reduction"] == "none"

    def rows(grad_output, grad_entropy):
        with prefer_onednn(), _engine(cfg):
            r = _lce_op(
                hp,
                wp,
                t,
                None if bias is None else bias.detach(),
                ce_weight,
                return_grad=(True, False, False),
                grad_output=grad_output,
                lse=lse,
                grad_entropy=grad_entropy,
                z_mean=z_mean if grad_entropy is not None else None,
                **kw,
            )
        g = r.grad_input
        cdt = g.dtype
        acc = torch.zeros(BT, dtype=cdt)
        k = H
        if th is not None:
            acc += (th.detach().to(cdt) * g[:, :H]).sum(1)
        if tw is not None:
            acc += (h.detach().to(cdt) * g[:, k : k + H]).sum(1)
            k += H
        if tb is not None:
            acc += g[:, k]
        if cfg["group"] is not None:
            acc = _vp.all_reduce_sum_fp32(acc, cfg["group"])
        return acc if none else acc.sum()

    one = torch.ones(BT if none else (), dtype=torch.float64)
    loss_t = rows(one, None)
    ent_t = rows(torch.zeros_like(one), one) if cfg["return_entropy"] else None
    return loss_t, ent_t


_NARROW = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}


# ----------------------------------------------------------------------------------------------
# public function
# ----------------------------------------------------------------------------------------------


@torch.compiler.disable  # one graph break at the loss: dynamo never traces the kernels' Python
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    process_group: dist.ProcessGroup | None = None,
    *,
    bias: torch.Tensor | None = None,
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    return_entropy: bool = False,
    shift: bool | int = False,
    precision: str | None = None,
    fused: bool | None = None,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    filter_eps: float | str | None = None,
    accum_dtype: torch.dtype | None = None,
    # None, a preset name, a LinearCrossEntropyOptions or PyTorch's torch.nn.LinearCrossEntropyOptions
    # (torch >= 2.13 only, so not nameable here): resolve_options checks it
    options: Any = None,
) -> torch.Tensor | LinearCrossEntropyOutput:
    r"""``F.cross_entropy(softcap(hidden @ weight.T + bias) / temperature, target, ...)`` (+ z-loss)
    without ever materializing the ``[BT, V]`` logits.

    PyTorch's own signature (``input, linear_weight, target, *, linear_bias, weight, ...,
    options``) is :func:`fastgrad.torch.nn.functional.linear_cross_entropy`.

    Parameters
    ----------
    hidden : Tensor [..., H]; bfloat16, float16, float32, float64; CPU
    weight : Tensor [V, H] (or this rank's shard [V_k, H] with ``process_group``), hidden's dtype
        (under ``torch.autocast("cpu")`` fp32/fp16/bf16 ``hidden``, ``weight`` and ``bias`` are
        first cast to the autocast dtype, as ``F.linear``'s operands are there)
    target : Tensor hidden.shape[:-1]; int64 / int32 ids in ``[0, V)`` or ``ignore_index``
    ignore_index : int, default -100
    reduction : "mean" | "sum" | "none"
    label_smoothing : float in [0, 1] — PyTorch's ε over the global vocabulary
    process_group : vocabulary parallelism (Megatron); every rank calls with the same arguments
    bias : Tensor [V] (or the shard's [V_k]), optional — LM-head bias
    ce_weight : Tensor [V] (global), optional — PyTorch's ``weight`` (per-class rescaling; mean
        divides by ``Σ ce_weight[target]``)
    softcap : float, optional — ``c·tanh(logits/c)`` (Gemma-2's final logit softcapping)
    temperature : float > 0 — logits divided by it (after the softcap); with ``reduction="none"``
        ``-loss`` is the per-token log-probability at that temperature (RL fine-tuning)
    lse_square_scale : float ≥ 0 — z-loss ``scale·lse²`` per token, added to the loss and reduced
        like it (mean over the non-ignored tokens, not weighted by ``ce_weight``)
    return_z_loss, return_token_accuracy : bool — also return the reduced z-loss / the fraction
        of non-ignored tokens whose argmax is the target (per token for ``"none"``); then the
        result is a :class:`LinearCrossEntropyOutput` ``(loss, z_loss, token_accuracy,
        predicted_tokens, entropy)``, the fields not asked for None
    return_predicted_tokens : bool — Liger's predicted tokens: the argmax of the final logits
        per token (int64, the first index on ties; -1 where the target is ignored), shaped like
        ``target`` (shifted as the loss with ``shift``); not differentiable
    return_entropy : bool — the entropy ``-Σ_v p_v log p_v`` (nats) of each token's softmax at
        the given ``temperature`` and ``softcap`` (verl's fused linear cross-entropy returns it
        with the per-token log-probabilities ``-loss`` of ``reduction="none"``), reduced like the
        z-loss (mean over the non-ignored tokens, sum, or per token with 0 where the target is
        ignored); **differentiable** — its exact gradient ``p_v·(μ - z_v)``, ``μ = Σ p·z``,
        is added in the same recompute pass as the loss's.  The entropy's upstream gradient is
        unknown in the forward, so the step is never fused with it (four GEMMs: forward, then
        recompute + two in the backward).  Not with ``filter_eps`` nor ``precision="device"``.
    shift : bool or int — CCE's ``shift``: position ``i`` predicts ``target[..., i + shift]``
        (the last ``shift`` positions are ignored; ``"none"`` returns ``[..., T - shift]``)
    precision : "accurate" (default) | "device" | "fast" — ``"device"`` (the default in strict
        mode) runs the NPU's pipeline: statistics from logits rounded to the input dtype, ``g``
        rounded before the GEMMs; only the plain loss (no bias, ce_weight, softcap, temperature,
        z-loss).  ``"fast"`` (bf16 on a CPU with AVX-512 BF16, GEMM setting ``"auto"``, no
        ``filter_eps``; elsewhere ``"accurate"``, bitwise): ``dloss/dlogits`` rounded to bf16,
        the target column's rounding error restored with its own rows and the rest's mean part
        with rank-one corrections, so every GEMM of the step runs on the exact-product bf16
        kernel — three fused, four recomputed, by ``fused``'s rule (Cut Cross-Entropy's default
        also rounds it).
        Mean error against float64 near fp32's, no elementwise one-rounding bound
        (:func:`fastgrad.linear_cross_entropy`, ``docs/torch.md``).  Strict mode rejects it
        (161002).
    fused : bool, optional — None: the schedule rule of the module docstring (fused — 3 GEMMs —
        when the loss is scalar and its held gradients fit a quarter of the available memory,
        :func:`fastgrad.torch.options.choose_schedule`); True: fuse whenever the loss is scalar;
        False: always recompute in the backward (4 GEMMs, the least memory).  The same as
        ``options=LinearCrossEntropyOptions(schedule="auto" | "fused" | "recompute")``.
    vocab_start_index, vocab_size : keyword-only shard layout (all-gathered when omitted)
    filter_eps : None | "auto" | float in (0, 1] — gradient filtering (Cut Cross-Entropy's
        ``filter_eps``; default None: dense).  In the gradient GEMMs, blocks of 256 rows × 64
        vocabulary columns (of this rank's shard with ``process_group``) where every
        per-element coefficient ``|u| = |dloss/dlogit| / c_r`` is below it are skipped — ``c_r``
        the row's scale (upstream gradient, ``1/Σw`` for mean), so for plain CE ``|p - onehot|``;
        with softcap / temperature / z-loss / smoothing / ce_weight, ``u`` is the final
        coefficient, chain rule included.  The target column is never skipped.  ``"auto"``: the
        dtype's eps / 32 (bf16 2⁻¹²).  The loss is exact; the error bound and the skipped-block
        counts: :func:`fastgrad.linear_cross_entropy`.  Not with ``precision="device"`` nor in
        strict mode (161002).
    options : None | str | LinearCrossEntropyOptions — fastgrad's modes in one object
        (:class:`fastgrad.torch.LinearCrossEntropyOptions`: ``precision``, ``schedule``,
        ``filter_eps``, ``accum_dtype``, ``engine``, the fused schedule's memory share) or a
        preset name (``"default"``, ``"fused"``, ``"low_memory"``, ``"fast"``, ``"filtered"``,
        ``"device"``, ``"blas"``).  The flat keywords ``precision``, ``fused``, ``filter_eps``,
        ``accum_dtype`` are the same fields; giving one of them together with ``options`` is
        refused (161002).
    accum_dtype : None | torch.float32 | hidden's dtype — Liger-Kernel's ``accum_dtype``, the
        dtype in which ``weight``'s gradient is accumulated over the row blocks of the fused
        step.  None (default): fp32, rounded once at the end.  ``hidden.dtype`` (bf16/fp16):
        accumulated in the gradient itself, rounded per row block — no fp32 ``[V, H]``
        accumulator (half its memory), as Liger does by default; the error bound is in
        :func:`fastgrad.linear_cross_entropy`.  Not with ``precision="device"`` (161002).

    Returns
    -------
    Tensor, or LinearCrossEntropyOutput
        fp32 loss (fp64 for fp64 inputs); gradients in the input dtype, rounded once from fp32.

    Raises
    ------
    fastgrad.AclnnError
        161002 (a ``ValueError``) for every bad argument: non-tensor or non-CPU inputs, shapes,
        dtypes, a target outside ``[0, V)`` that is not ``ignore_index``, bad attributes.
        361001 (a ``RuntimeError``) from a backward with ``create_graph=True``.
    """
    opts = resolve_options(options, "options", OP)
    if options is not None:
        flat = {"precision": precision, "fused": fused, "filter_eps": filter_eps, "accum_dtype": accum_dtype}
        given = [k for k, v in flat.items() if v is not None]
        if given:
            raise bad(given[0], f"None when options= is given (set it in the options: {given})", flat[given[0]])
    else:
        if precision not in (None, "accurate", "device", "fast"):
            raise bad("precision", "'accurate', 'device' or 'fast'", repr(precision))
        if fused not in (None, True, False):
            raise bad("fused", "None, True or False", repr(fused))
        if accum_dtype is not None and not isinstance(accum_dtype, torch.dtype):
            raise bad("accum_dtype", "None, torch.float32 or hidden's dtype", repr(accum_dtype))
        schedule = {None: "auto", True: "fused", False: "recompute"}[fused]
        opts = dataclasses.replace(
            opts, precision=precision, schedule=schedule, accum_dtype=accum_dtype, filter_eps=filter_eps
        )
    precision, fused, filter_eps, accum_dtype = opts.precision, opts.fused, opts.filter_eps, opts.accum_dtype
    with _engine({"engine": opts.engine}):
        hidden, weight, bias = autocast_operands(hidden, weight, bias)
        check_args(hidden, weight, target, bias, ce_weight, ignore_index, reduction, label_smoothing)
        if softcap is not None:
            softcap = real("softcap", softcap, "a finite float > 0 or None")
        temperature = real("temperature", temperature, "a finite float > 0")
        lse_square_scale = real("lse_square_scale", lse_square_scale, "a finite float >= 0")
        eps = float(label_smoothing)
        n_shift = int(shift) if isinstance(shift, (bool, numbers.Integral)) else None
        if n_shift is None or n_shift < 0:
            raise bad("shift", "a bool or an int >= 0", repr(shift))
        if precision is None:
            precision = "device" if is_strict() else "accurate"
        if precision not in ("accurate", "device", "fast"):
            raise bad("precision", "'accurate', 'device' or 'fast'", repr(precision))
        if precision == "fast" and is_strict():
            raise bad("precision", "'accurate' or 'device' in strict mode (the device has no 'fast')", "'fast'")
        if fused not in (None, True, False):
            raise bad("fused", "None, True or False", repr(fused))
        K = weight.shape[0]
        if process_group is None:
            if vocab_start_index not in (None, 0) or vocab_size not in (None, K):
                raise bad(
                    "vocab_start_index",
                    "0 and vocab_size == weight.shape[0] without a process_group (a shard layout needs one)",
                    f"vocab_start_index={vocab_start_index}, vocab_size={vocab_size}",
                )
            start, V = 0, K
        else:
            try:
                _vp.check_group(process_group)
            except TypeError as e:  # 161002 that is still the TypeError a wrong type is
                raise torch_error(TypeError, str(e), "process_group", OP) from None
            if vocab_start_index is None or vocab_size is None:
                s0, _, V0 = _vp.vocab_shard_range(K, process_group)
                start = s0 if vocab_start_index is None else int(vocab_start_index)
                V = V0 if vocab_size is None else int(vocab_size)
            else:
                start, V = int(vocab_start_index), int(vocab_size)
            if start < 0 or start + K > V:
                raise bad(
                    "vocab_start_index",
                    f"a shard [start, start + {K}) inside [0, {V})",
                    f"[{start}, {start + K}) of {V}",
                )

        for name, flag in (
            ("return_z_loss", return_z_loss),
            ("return_token_accuracy", return_token_accuracy),
            ("return_predicted_tokens", return_predicted_tokens),
            ("return_entropy", return_entropy),
        ):
            if not isinstance(flag, bool):
                raise bad(name, "a bool", repr(flag))
        t_full = shift_target(target, n_shift, int(ignore_index))
        t = t_full.reshape(-1)
        tv = values_of(t)  # (every slice of a vmap batch)
        out_of_range = (tv != ignore_index) & ((tv < 0) | (tv >= V))
        if bool(out_of_range.any()):
            first = int(tv[out_of_range.nonzero(as_tuple=True)][0])
            raise bad(
                "target", f"class ids in [0, {V}) or ignore_index ({ignore_index})", f"Target {first} is out of bounds"
            )

        if precision == "device":
            extras = {
                "bias": bias is not None,
                "ce_weight": ce_weight is not None,
                "softcap": softcap is not None,
                "temperature": temperature != 1.0,
                "lse_square_scale": lse_square_scale != 0.0,
                "return_z_loss": return_z_loss,
                "return_token_accuracy": return_token_accuracy,
                "return_predicted_tokens": return_predicted_tokens,
                "return_entropy": return_entropy,
            }
            used = [k for k, v in extras.items() if v]
            if filter_eps is not None:
                used.append("filter_eps")
            if accum_dtype is not None:
                used.append("accum_dtype")
            if used:
                raise bad(used[0], "the plain loss with precision='device' (the aclnn pipeline)", used)
            if eps != 0.0 and is_strict():
                raise invalid("label_smoothing", "0 (the device's FLCE grad supports only 0; strict mode)", eps, OP)
            loss = DeviceLinearCrossEntropyFunction.apply(
                hidden, weight, t_full, int(ignore_index), reduction, eps, process_group, start, V
            )
            if reduction == "none" and n_shift:
                loss = loss[..., : target.shape[-1] - n_shift]
            return loss

        if return_entropy and filter_eps is not None:
            raise bad("filter_eps", "None with return_entropy (the filter is on the cross-entropy term)", filter_eps)
        H = hidden.shape[-1]
        h = hidden.reshape(int(np.prod(hidden.shape[:-1])), H)  # (not -1: H may be 0)
        # the upstream gradients must be known in the forward: a reduced loss, no entropy output
        fusable = reduction != "none" and not return_entropy
        if fused is None:
            fused_ok = (
                torch.is_grad_enabled() and fusable and _fused_fits(h, weight, bias, accum_dtype, filter_eps, opts)
            )
        else:
            fused_ok = bool(fused) and fusable
        cfg = {
            "ignore_index": int(ignore_index),
            "reduction": reduction,
            "label_smoothing": eps,
            "softcap": None if softcap is None else float(softcap),
            "temperature": float(temperature),
            "lse_square_scale": float(lse_square_scale),
            "start": start,
            "V": V,
            "group": process_group,
            "fused": fused_ok,
            "filter_eps": filter_eps,
            "accum_dtype": accum_dtype,
            "return_entropy": return_entropy,
            "op_precision": "fast" if precision == "fast" else "accurate",
            "engine": opts.engine,
        }
        cw = None if ce_weight is None else ce_weight.detach()
        # which inputs want a gradient, read here where the caller's tensors are visible (inside
        # the Function, under torch.func transforms, they are unwrapped)
        grad_on = torch.is_grad_enabled()
        cfg["need"] = (
            grad_on and h.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        )
        loss, z_loss, acc, pred, ent, *_ = LinearCrossEntropyFunction.apply(h, weight, bias, cw, t, cfg)
        shape = tuple(target.shape)

        def per_token(x):
            x = x.reshape(shape)
            return x[..., : max(shape[-1] - n_shift, 0)] if n_shift else x

        pred = per_token(pred)
        if reduction == "none":
            loss, z_loss, acc = (per_token(x) for x in (loss, z_loss, acc))
            ent = None if ent is None else per_token(ent)
        if return_z_loss or return_token_accuracy or return_predicted_tokens or return_entropy:
            return LinearCrossEntropyOutput(
                loss,
                z_loss if return_z_loss else None,
                acc if return_token_accuracy else None,
                pred if return_predicted_tokens else None,
                ent,
            )
        return loss
