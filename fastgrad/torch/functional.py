"""``linear_cross_entropy``: the LM-head loss as a ``torch.autograd.Function`` over fastgrad's ops.

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

import numbers

import torch
from torch.autograd.function import once_differentiable

from .._config import is_strict
from ..errors import invalid
from ..ops.fused_cross_entropy_loss_with_max_sum import fused_cross_entropy_loss_with_max_sum
from ..ops.fused_linear_cross_entropy_loss_grad import fused_linear_cross_entropy_loss_grad
from ..ops.fused_linear_online_max_sum import fused_linear_online_max_sum
from . import distributed as _vp

__all__ = ["linear_cross_entropy", "LinearCrossEntropyFunction"]

#: dtypes that go through the fastgrad kernels (the CANN ops' bf16/fp16, fp32 as their extension)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALL_DTYPES = _KERNEL_DTYPES + (torch.float64,)
_TARGET_DTYPES = (torch.int64, torch.int32)
_REDUCTIONS = ("mean", "sum", "none")
#: vocabulary columns per chunk of the float64 path
_CHUNK = 2048


# ----------------------------------------------------------------------------------------------
# label smoothing: PyTorch's epsilon (over the global V) -> the op's Megatron alpha (local K)
# ----------------------------------------------------------------------------------------------

def _kernel_smoothing(alpha: float, K: int) -> tuple[float, float]:
    """``(s, s/K)`` that the FLCE grad applies for ``label_smoothing=alpha`` on K local columns.

    Megatron / the op's extension: ``s = α·K/(K-1)``; the gradient of the logits is
    ``p - (1-s)·onehot - s/K``; nothing when ``α == 0`` or ``K <= 1``.
    """
    if alpha == 0.0 or K <= 1:
        return 0.0, 0.0
    s = alpha * K / (K - 1)
    return s, s / K


def _smoothing_plan(eps: float, K: int, V: int) -> tuple[float, float, float]:
    """The op's ``alpha`` for PyTorch's ``label_smoothing=eps`` on a shard of K of V columns.

    PyTorch's gradient w.r.t. the logits is ``p - (1-eps)·onehot - eps/V``.  With
    ``alpha = eps·(K-1)/V`` the op's uniform term is exactly ``s/K = eps/V``; its target term is
    ``1 - eps·K/V``, which equals ``1 - eps`` when the shard is the whole vocabulary (K = V,
    i.e. ``alpha = eps·(V-1)/V``: one kernel call, no correction).  Returns
    ``(alpha, delta_target, delta_uniform)``: what must still be added to ``g/grad`` at the
    target column, and everywhere, after the op (non-zero only for vocabulary shards).
    """
    if eps == 0.0:
        return 0.0, 0.0, 0.0
    if K <= 1:                       # the op applies no smoothing at all on such a shard
        return 0.0, eps, -eps / V
    return eps * (K - 1) / V, eps * (1.0 - K / V), 0.0


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
        return (r.logits_max_local, r.sum_exp_logits_local, r.predicted_logits_local,
                r.target_mask, r.masked_target)
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
        P[idx, tcol[idx] - v0] -= (1.0 - sk)
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
            rows, h, w, target_mask, mt, label_smoothing=alpha, logits_max=m, sum_exp_logits=s)
    return _grad_torch(rows, h, w, target_mask, mt, alpha, m, s)


# ----------------------------------------------------------------------------------------------
# the autograd Function
# ----------------------------------------------------------------------------------------------

class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd Function behind :func:`linear_cross_entropy` (arguments already validated).

    ``forward(ctx, hidden, weight, target, ignore_index, reduction, label_smoothing,
    process_group, vocab_start_index, vocab_size)``.  Saved for backward: the inputs (no copy),
    the global row max and sum-exp (fp32 ``[BT]``), the packed target mask, the local target
    column and two bool ``[BT]`` masks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction, label_smoothing,
                process_group, vocab_start_index, vocab_size):
        H = hidden.shape[-1]
        h = hidden.reshape(-1, H)
        t = target.reshape(-1)
        K = weight.shape[0]
        start, V, eps = vocab_start_index, vocab_size, label_smoothing

        m, s, p, tmask, mt = _local_stats(h, weight, t, start)
        sdt = m.dtype
        owned = (t >= start) & (t < start + K)
        zsum = None
        if eps != 0.0:   # Σ_v logits[r, v] = h · Σ_v w_v (for Σ_v log p_v), never materialized
            zsum = h.to(sdt) @ weight.sum(0, dtype=sdt)
        if process_group is not None:
            m, s, p, zsum = _vp.combine_stats(m, s, p, owned, zsum, process_group)

        if sdt == torch.float32:
            nll = fused_cross_entropy_loss_with_max_sum(m, s, p)[0]   # log(sum_exp) - predicted
        else:
            nll = torch.log(s) - p
        if eps != 0.0:   # PyTorch: (1-ε)·nll + ε·(-mean_v log p_v),  log p_v = z_v - m - log s
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
    @once_differentiable
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


# ----------------------------------------------------------------------------------------------
# public function
# ----------------------------------------------------------------------------------------------

def _check_args(hidden, weight, target, ignore_index, reduction, label_smoothing):
    for name, x in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: {name} must be a torch.Tensor, "
                            f"got {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"linear_cross_entropy: {name} must be a CPU tensor "
                             f"(fastgrad.torch runs the CPU kernels), got device {x.device}")
    if weight.dim() != 2:
        raise ValueError(f"linear_cross_entropy: weight must be 2-D [V, H], "
                         f"got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden must be [..., H] with "
                         f"H == weight.shape[1] == {weight.shape[1]}, "
                         f"got shape {tuple(hidden.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"linear_cross_entropy: target must have shape hidden.shape[:-1] == "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(target.shape)}")
    if hidden.dtype not in _ALL_DTYPES:
        raise TypeError(f"linear_cross_entropy: hidden dtype must be one of bfloat16, float16, "
                        f"float32, float64; got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"linear_cross_entropy: weight dtype must equal hidden's ({hidden.dtype}),"
                        f" got {weight.dtype}")
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"linear_cross_entropy: target must hold int64 or int32 class indices, "
                        f"got {target.dtype}")
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"linear_cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', "
                         f"got {reduction!r}")
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real)
            or not 0.0 <= float(label_smoothing) <= 1.0):
        raise ValueError(f"linear_cross_entropy: label_smoothing must be a float in [0, 1], "
                         f"got {label_smoothing!r}")


def linear_cross_entropy(hidden, weight, target, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, process_group=None, *, vocab_start_index=None,
                         vocab_size=None):
    r"""``F.cross_entropy(hidden @ weight.T, target, ...)`` without materializing the logits.

    A fused LM-head loss for training: forward through :func:`fastgrad.fused_linear_online_max_sum`
    and :func:`fastgrad.fused_cross_entropy_loss_with_max_sum`, backward through the
    memory-saving :func:`fastgrad.fused_linear_cross_entropy_loss_grad` (CANN
    ``aclnnFusedLinearOnlineMaxSum`` / ``aclnnFusedCrossEntropyLossWithMaxSum`` /
    ``aclnnFusedLinearCrossEntropyLossGrad``, seed ``000``).  Peak extra memory is the ops' tile
    workspace (``FASTGRAD_WORKSPACE_MB``, default 256 MiB) plus ``[BT, H]``-sized fp32 buffers —
    never ``[BT, V]``.

    Parameters
    ----------
    hidden : Tensor [..., H]; bfloat16, float16, float32 (or float64, see Notes); CPU
        The LM head's input (last hidden states).  Any leading shape, flattened to BT rows.
    weight : Tensor [V, H], same dtype as ``hidden``
        The LM-head weight (no bias), or with ``process_group`` this rank's vocabulary shard
        ``[V_k, H]``.
    target : Tensor [...] == hidden.shape[:-1]; int64 or int32
        Class indices in ``[0, vocab_size)`` or ``ignore_index``; anything else raises
        IndexError (as PyTorch).  With ``process_group``: the global ids, identical on all ranks.
    ignore_index : int, default -100
        Rows whose target equals it contribute 0 to the loss and get zero gradient; ``mean``
        divides by the number of other rows (all ignored -> NaN loss and zero gradients, as
        PyTorch).
    reduction : {"mean", "sum", "none"}
        ``none`` returns the per-row losses with ``target``'s shape.
    label_smoothing : float in [0, 1], default 0
        **PyTorch's meaning**: ``loss = (1-ε)·nll + ε·mean_v(-log p_v)`` over the global
        vocabulary V.  Converted to the FLCE grad op's Megatron ``α`` (see Notes).
    process_group : torch.distributed.ProcessGroup, optional
        Vocabulary parallelism (Megatron's ``_VocabParallelCrossEntropy``): each rank passes its
        own ``weight`` shard and the same ``hidden`` and ``target``; row statistics are
        all-reduced (2 collectives) in the forward and ``grad_input`` (fp32) in the backward.
        Every rank of the group must call the function with the same arguments.  None: single
        process, ``weight`` is the full vocabulary.
    vocab_start_index, vocab_size : int, optional (keyword-only)
        This shard's first vocabulary id and the global vocabulary size.  When either is missing
        with a ``process_group``, the shard sizes are all-gathered (one small collective) and the
        shards placed in rank order.  Without a group: 0 and ``weight.shape[0]`` (the only
        accepted values).

    Returns
    -------
    Tensor
        The loss: 0-d for ``mean``/``sum``, ``target.shape`` for ``none``.  **float32** for
        16-bit and fp32 inputs (PyTorch returns the input dtype; the per-row statistics are
        fp32 anyway, and an fp32 loss keeps its precision), float64 for float64 inputs.
        Differentiable w.r.t. ``hidden`` and ``weight``.

    Raises
    ------
    TypeError, ValueError, IndexError
        Non-tensor or non-CPU inputs, mismatched shapes or dtypes, a target outside
        ``[0, vocab_size)`` that is not ``ignore_index``, bad reduction / label_smoothing.
    fastgrad.AclnnError
        From the ops, e.g. 161002 in strict mode (``fastgrad.strict()``) for what the device
        rejects: fp32 inputs, label smoothing ≠ 0.

    Notes
    -----
    * Precision follows the device: the forward rounds each logit to the input dtype before the
      max/exp/sum (the device's matmul output type), like ``F.cross_entropy`` on bf16 logits, but
      accumulates the statistics and the loss in fp32.  The backward recomputes the logits in fp32
      (unrounded), rounds ``g = (softmax - onehot)·grad`` once to the input dtype and accumulates
      ``grad_input = g·W`` / ``grad_weight = gᵀ·X`` in fp32, rounded once.
    * Label smoothing: the op's extension follows Megatron with the *local* vocabulary size K:
      ``g = p - (1-s)·onehot - s/K``, ``s = α·K/(K-1)``.  Passing ``α = ε·(K-1)/V`` gives the
      uniform term ``ε/V`` exactly and, when ``K = V`` (one process), the target term ``1-ε``
      too: PyTorch's gradient in one kernel call.  On a vocabulary shard (K < V) the remaining
      target-column difference ``ε·(1-K/V)`` is added afterwards as a sparse fp32 update
      (so 16-bit ``grad_weight`` rows of targets are rounded twice there).  The loss's smoothing
      term uses ``Σ_v logits = hidden · Σ_v weight_v`` in fp32 (all-reduced across shards).
      Megatron's own ``label_smoothing=α`` equals PyTorch's ``ε = α·V/(V-1)`` at world size 1.
    * float64 inputs (an extension: the device has no fp64) run the same decomposition with
      chunked float64 torch matmuls instead of the kernels — for ``gradcheck`` and golden runs.
    * The reference backend (``fastgrad.use_backend("reference")``) works here too.
    * Targets are validated on the host (one synchronizing ``.any()``), as PyTorch's CPU loss.
    """
    _check_args(hidden, weight, target, ignore_index, reduction, label_smoothing)
    eps = float(label_smoothing)
    if eps != 0.0 and is_strict():   # fail in the forward, not later in the backward
        raise invalid("label_smoothing", "0 (the device's FLCE grad supports only 0; strict mode)",
                      eps, "linear_cross_entropy")
    K = weight.shape[0]
    if process_group is None:
        if vocab_start_index not in (None, 0) or vocab_size not in (None, K):
            raise ValueError("linear_cross_entropy: vocab_start_index/vocab_size describe a "
                             "vocabulary shard and need a process_group; without one, weight "
                             f"is the whole vocabulary (start 0, size {K}); got "
                             f"vocab_start_index={vocab_start_index}, vocab_size={vocab_size}")
        start, V = 0, K
    else:
        if vocab_start_index is None or vocab_size is None:
            s0, _, V0 = _vp.vocab_shard_range(K, process_group)
            start = s0 if vocab_start_index is None else int(vocab_start_index)
            V = V0 if vocab_size is None else int(vocab_size)
        else:
            start, V = int(vocab_start_index), int(vocab_size)
        if start < 0 or start + K > V:
            raise ValueError(f"linear_cross_entropy: the shard [{start}, {start + K}) does not "
                             f"fit the vocabulary [0, {V})")
    t = target.reshape(-1)
    bad = (t != ignore_index) & ((t < 0) | (t >= V))
    if bool(bad.any()):
        first = int(t[bad.nonzero()[0, 0]])
        raise IndexError(f"linear_cross_entropy: Target {first} is out of bounds "
                         f"(vocabulary size {V}, ignore_index {ignore_index}).")
    return LinearCrossEntropyFunction.apply(hidden, weight, target, int(ignore_index), reduction,
                                            eps, process_group, start, V)
