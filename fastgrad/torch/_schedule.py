"""The training loss's schedule inputs (``fastgrad.torch.functional``): the fused step's memory
test and workspace floor, the recompute's ``grad_weight`` dtype."""

from __future__ import annotations

import torch

from .options import choose_schedule, fused_held_bytes


def recycled_scratch_bytes(rows: int, weight: torch.Tensor) -> int:
    """The workspace floor of the fused step (``fastgrad._config.workspace_floor``): twice the
    16-bit ``grad_weight`` (``V·H·4`` bytes) for a bf16/fp16 weight, at most half of ``[rows, V]``
    in fp32 (the row blocks never hold ``[BT, V]``); 0 for an fp32 weight.  The row blocks'
    logits scratch is freed at the end of the forward and the backward rounds ``grad_weight``
    into that block (``fastgrad._outcache``), so this scratch adds nothing to the step's peak."""
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return 0
    V, H = weight.shape
    return min(V * H * 4, (rows * V * 4) // 2)


def _fused_fits(h, weight, bias, accum_dtype, filter_eps, opts):
    """The ``"auto"`` schedule's memory test (:func:`fastgrad.torch.options.choose_schedule`): the
    gradients the fused step holds from the forward to the backward (fp32 ``[BT, H]``, fp32
    ``[V, H]`` — 16-bit with a 16-bit ``accum_dtype`` —, fp32 ``[V]``, each only when its input
    requires grad) fit the options' fraction of the available memory (or their byte limit);
    with ``filter_eps`` always (its skipping is in the fused step's row blocks)."""
    if filter_eps is not None:
        return True
    V, H = weight.shape
    wsize = 4 if accum_dtype is None or accum_dtype in (torch.float32, torch.float64) else 2
    held = fused_held_bytes(
        h.shape[0],
        H,
        V,
        grad_input=h.requires_grad,
        grad_weight=weight.requires_grad,
        grad_bias=bias is not None and bias.requires_grad,
        weight_bytes=wsize,
    )
    if weight.requires_grad and accum_dtype is None:  # the forward's row-block scratch beside them
        held += recycled_scratch_bytes(h.shape[0], weight)
    sched = choose_schedule(held, fraction=opts.fused_memory_fraction, limit=opts.fused_memory_limit)
    return sched == "fused"


def _recompute_gw_dtype(weight, kw):
    """The dense recompute returns a 16-bit weight's gradient in its own dtype: the op sums each
    vocabulary chunk in fp32 and rounds it once (no fp32 ``[V, H]`` is held).  With
    ``filter_eps`` the recompute runs by row blocks: the caller's ``accum_dtype``."""
    if weight.dtype in (torch.bfloat16, torch.float16) and kw.get("filter_eps") is None:
        return weight.dtype
    return kw.get("accum_dtype")
