"""The device pipeline of ``linear_cross_entropy`` (``precision="device"``): the NPU's exact semantics.

The aclnn ops as the device runs them: forward statistics from logits rounded to the input dtype,
``g`` rounded to the input dtype before the backward GEMMs.  Kept for comparing with a device run;
the default (``precision="accurate"``) is :mod:`fastgrad.torch.functional`.

Forward (per rank):  :func:`fastgrad.fused_linear_online_max_sum` gives this shard's row max
``m``, ``Σ exp(logits - m)`` and target logit, tile by tile; the shards are combined with two
collectives (:func:`fastgrad.torch.distributed.combine_stats`); the per-row loss comes from
:func:`fastgrad.fused_cross_entropy_loss_with_max_sum`.  Backward: the memory-saving
:func:`fastgrad.fused_linear_cross_entropy_loss_grad` recomputes the logits tile by tile from the
saved global max / sum-exp (fp32 ``[BT]`` each) and returns ``grad_input``, ``grad_weight``.
Nothing of size ``[BT, V]`` is ever allocated.

float64 tensors (which the CANN ops do not take) run the same decomposition with chunked torch
float64 matmuls, so ``torch.autograd.gradcheck`` can check the autograd wiring (reductions,
``ignore_index``, label smoothing, shard combination) exactly.
"""

from __future__ import annotations

import torch

from ..errors import runtime_error
from ..ops.fused_cross_entropy_loss_with_max_sum import fused_cross_entropy_loss_with_max_sum
from ..ops.fused_linear_cross_entropy_loss_grad import fused_linear_cross_entropy_loss_grad
from ..ops.fused_linear_online_max_sum import fused_linear_online_max_sum
from ..vocab_parallel import megatron_smoothing as _kernel_smoothing
from ..vocab_parallel import torch_smoothing_to_megatron as _smoothing_plan
from . import distributed as _vp
from ._autograd import differentiable_once

__all__ = ["DeviceLinearCrossEntropyFunction"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK = 2048

# ----------------------------------------------------------------------------------------------
# local (this shard's) statistics and gradients
# ----------------------------------------------------------------------------------------------


def _stats_torch(h, w, t, start, dtype):
    """Shard statistics in torch (float64 inputs, empty shards): the op's definitions, exactly."""
    BT, K = h.shape[0], w.shape[0]
    tl = t.long()
    owned = (tl >= start) & (tl < start + K)
    mt = torch.where(owned, tl - start, torch.zeros_like(tl))
    m = torch.full((BT,), float("-inf"), dtype=dtype)
    s = torch.zeros(BT, dtype=dtype)
    picked = torch.zeros(BT, dtype=dtype)
    for v0 in range(0, K, _CHUNK):
        v1 = min(K, v0 + _CHUNK)
        L = (h @ w[v0:v1].T).to(dtype)
        mnew = torch.maximum(m, L.amax(1))
        s = s * torch.exp(m - mnew) + torch.exp(L - mnew[:, None]).sum(1)
        m = mnew
        sel = owned & (mt >= v0) & (mt < v1)
        col = (mt - v0).clamp(0, v1 - v0 - 1)
        picked = torch.where(sel, L.gather(1, col[:, None]).squeeze(1), picked)
    p = torch.where(owned, picked - m, torch.zeros_like(picked))
    return m, s, p, ~owned, mt.to(t.dtype)


def _local_stats(h, w, t, start):
    """``(m, s, p, target_mask, masked_target)`` of this shard (fp32 stats; fp64 for fp64)."""
    if h.dtype in _KERNEL_DTYPES:
        if w.shape[0] == 0:
            return _stats_torch(h, w, t, start, torch.float32)
        r = fused_linear_online_max_sum(h, w, t, start, start + w.shape[0])
        return (r.logits_max_local, r.sum_exp_logits_local, r.predicted_logits_local, r.target_mask, r.masked_target)
    return _stats_torch(h, w, t, start, torch.float64)


def _grad_torch(rows, h, w, masked, mt, alpha, m, s):
    """The FLCE grad's memory-saving formula in torch (float64), chunked over the vocabulary."""
    K = w.shape[0]
    sk, uk = _kernel_smoothing(alpha, K)
    mtl = mt.long()
    tcol = torch.where((~masked) & (mtl >= 0) & (mtl < K), mtl, torch.full_like(mtl, -1))
    gi = torch.zeros_like(h)
    gw = torch.empty_like(w)
    for v0 in range(0, K, _CHUNK):
        v1 = min(K, v0 + _CHUNK)
        wc = w[v0:v1]
        P = torch.exp(h @ wc.T - m[:, None]) / s[:, None] - uk
        idx = ((tcol >= v0) & (tcol < v1)).nonzero().squeeze(1)
        P[idx, tcol[idx] - v0] -= 1.0 - sk
        G = P * rows[:, None]
        gi += G @ wc
        gw[v0:v1] = G.T @ h
    return gi, gw


def _local_grad(rows, h, w, target_mask, mt, alpha, m, s):
    """``(grad_input partial, grad_weight)`` of this shard, in the input dtype."""
    if w.shape[0] == 0:
        return torch.zeros_like(h), torch.zeros_like(w)
    if h.dtype in _KERNEL_DTYPES:
        return fused_linear_cross_entropy_loss_grad(
            rows, h, w, target_mask, mt, label_smoothing=alpha, logits_max=m, sum_exp_logits=s
        )
    return _grad_torch(rows, h, w, target_mask, mt, alpha, m, s)


# ----------------------------------------------------------------------------------------------
# the autograd Function
# ----------------------------------------------------------------------------------------------


class DeviceLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd Function behind :func:`linear_cross_entropy` (arguments already validated).

    ``forward(ctx, hidden, weight, target, ignore_index, reduction, label_smoothing,
    process_group, vocab_start_index, vocab_size)``.  Saved for backward: the inputs (no copy),
    the global row max and sum-exp (fp32 ``[BT]``), the packed target mask, the local target
    column and two bool ``[BT]`` masks.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        ignore_index,
        reduction,
        label_smoothing,
        process_group,
        vocab_start_index,
        vocab_size,
    ):
        H = hidden.shape[-1]
        h = hidden.reshape(-1, H)
        t = target.reshape(-1)
        K = weight.shape[0]
        start, V, eps = vocab_start_index, vocab_size, label_smoothing

        m, s, p, tmask, mt = _local_stats(h, weight, t, start)
        sdt = m.dtype
        owned = (t >= start) & (t < start + K)
        zsum = None
        if eps != 0.0:  # Σ_v logits[r, v] = h · Σ_v w_v (for Σ_v log p_v), never materialized
            zsum = h.to(sdt) @ weight.sum(0, dtype=sdt)
        if process_group is not None:
            m, s, p, zsum = _vp.combine_stats(m, s, p, owned, zsum, process_group)

        if sdt == torch.float32:
            nll = fused_cross_entropy_loss_with_max_sum(m, s, p)[0]  # log(sum_exp) - predicted
        else:
            nll = torch.log(s) - p
        if eps != 0.0:  # PyTorch: (1-ε)·nll + ε·(-mean_v log p_v),  log p_v = z_v - m - log s
            nll = (1.0 - eps) * nll + eps * (m + torch.log(s) - zsum / V)
        valid = t != ignore_index
        rows_loss = torch.where(valid, nll, torch.zeros_like(nll))
        n_valid = int(valid.sum())
        if reduction == "mean":
            loss = (rows_loss.sum(dtype=torch.float64) / n_valid).to(sdt)
        elif reduction == "sum":
            loss = rows_loss.sum(dtype=torch.float64).to(sdt)
        else:
            loss = rows_loss.reshape(target.shape)

        ctx.save_for_backward(hidden, weight, tmask, mt, m, s, valid, owned)
        ctx.cfg = (reduction, eps, process_group, V, n_valid)
        return loss

    @staticmethod
    def jvp(ctx, *tangents):
        raise runtime_error(
            "linear_cross_entropy: forward-mode AD is not implemented for precision='device' (the aclnn "
            "pipeline); the default precision='accurate' has it",
            "precision",
        )

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_loss):
        hidden, weight, tmask, mt, m, s, valid, owned = ctx.saved_tensors
        reduction, eps, group, V, n_valid = ctx.cfg
        nones = (None,) * 7
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None, None) + nones
        sdt = m.dtype
        g = grad_loss.to(sdt)
        zero = torch.zeros((), dtype=sdt)
        if reduction == "mean":
            # n_valid == 0: every row is ignored, the where() never reads the inf
            rows = torch.where(valid, g / n_valid if n_valid else g * float("inf"), zero)
        elif reduction == "sum":
            rows = torch.where(valid, g, zero)
        else:
            rows = torch.where(valid, g.reshape(-1), zero)
        rows = rows.contiguous()

        H = hidden.shape[-1]
        h = hidden.reshape(-1, H)
        K = weight.shape[0]
        alpha, d_t, d_u = _smoothing_plan(eps, K, V)
        gi, gw = _local_grad(rows, h, weight, tmask, mt, alpha, m, s)

        if d_t != 0.0 or d_u != 0.0:
            # Vocabulary shard with label smoothing: the op's Megatron smoothing uses the local K;
            # add the (sparse / rank-1) difference to PyTorch's global-V smoothing in fp32.
            gi, gw = gi.to(sdt), gw.to(sdt)
            h32 = h.to(sdt)
            if d_t != 0.0:
                idx = (owned & valid).nonzero().squeeze(1)
                cols = mt[idx].long()
                c = (d_t * rows[idx])[:, None]
                gi.index_add_(0, idx, c * weight[cols].to(sdt))
                gw.index_add_(0, cols, c * h32[idx])
            if d_u != 0.0:
                gi += (d_u * rows)[:, None] * weight.sum(0, dtype=sdt)[None, :]
                gw += d_u * (rows @ h32)[None, :]
        if group is not None and need_h:
            # fp32 sum of the shards' partials (skipped on every rank alike when hidden is frozen)
            gi = _vp.all_reduce_sum_fp32(gi, group)
        gi = gi.to(hidden.dtype).reshape(hidden.shape) if need_h else None
        gw = gw.to(weight.dtype) if need_w else None
        return (gi, gw) + nones
