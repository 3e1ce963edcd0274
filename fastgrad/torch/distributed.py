"""Vocabulary parallelism over ``torch.distributed`` (Megatron's ``_VocabParallelCrossEntropy``).

Each rank of a process group holds the LM-head rows of a contiguous vocabulary range, in rank
order: rank ``k`` owns ``[start_k, start_k + V_k)`` with ``start_k = V_0 + ... + V_{k-1}``.
Shard sizes may differ (``split_vocab`` gives the first ``V % world`` ranks one extra row).

The loss needs three all-reduces of per-row fp32 statistics (docs/spec.md, "Combining shards"),
fused here into two collectives:

1. ``gmax = max_k m_k``                                             (``ReduceOp.MAX``)
2. ``sum = Σ_k s_k·exp(m_k - gmax)``, ``predicted = Σ_k (p_k + (m_k - gmax)·owned_k)`` and, for
   label smoothing, ``Σ_k Σ_{v in shard k} logits[:, v]`` stacked into one ``[n, BT]`` ``SUM``.

The backward all-reduces ``grad_input`` (in fp32, rounded once to the input dtype afterwards);
``grad_weight`` stays local to each shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import invalid

if TYPE_CHECKING:
    import numpy as np

__all__ = ["split_vocab", "shard_weight", "vocab_shard_range", "combine_stats", "all_reduce_sum_fp32"]


def split_vocab(vocab_size: int, world_size: int) -> list[int]:
    """Shard sizes of a vocabulary split over ``world_size`` ranks, in rank order.

    The first ``vocab_size % world_size`` ranks get one extra row (``V = 101`` over 3 ranks:
    ``[34, 34, 33]``), as ``numpy.array_split``.
    """
    vocab_size, world_size = int(vocab_size), int(world_size)
    if vocab_size < 0 or world_size < 1:
        raise invalid(
            "vocab_size", "vocab_size >= 0 and world_size >= 1", f"{vocab_size} and {world_size}", "split_vocab"
        )
    q, r = divmod(vocab_size, world_size)
    return [q + (1 if k < r else 0) for k in range(world_size)]


def shard_weight(
    weight: torch.Tensor,
    rank: int | None = None,
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's rows of a full ``[V, H]`` LM-head weight (a view; ``.clone()`` it to own it).

    ``rank``/``world_size`` default to the process group's (``group``, default WORLD).
    """
    if rank is None or world_size is None:
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    sizes = split_vocab(weight.shape[0], world_size)
    start = sum(sizes[:rank])
    return weight[start : start + sizes[rank]]


def check_group(group: object, name: str = "process_group") -> None:
    """``group`` is None or a ``torch.distributed.ProcessGroup``; else ``TypeError`` naming it."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected None or a torch.distributed.ProcessGroup, got {type(group).__name__}")


def vocab_shard_range(local_vocab_size: int, group: dist.ProcessGroup | None = None) -> tuple[int, int, int]:
    """``(vocab_start_index, vocab_end_index, vocab_size)`` of this rank's shard.

    All-gathers the local shard sizes once over ``group`` (a collective: every rank of the group
    must call it) and places the shards in rank order.  ``vocab_end_index`` is exclusive;
    ``vocab_size`` is the global vocabulary size.

    Raises ``TypeError`` unless ``group`` is None (the default group) or a
    ``torch.distributed.ProcessGroup``; ``RuntimeError`` (torch's) when the default process group
    is not initialised.
    """
    check_group(group)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor([int(local_vocab_size)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    sizes = [int(s.item()) for s in gathered]
    start = sum(sizes[:rank])
    return start, start + sizes[rank], sum(sizes)


def combine_stats(
    logits_max: torch.Tensor,
    sum_exp: torch.Tensor,
    predicted: torch.Tensor,
    owned: torch.Tensor,
    extra: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Combine the shards' row statistics (all ranks of ``group`` must call it).

    Parameters
    ----------
    logits_max, sum_exp, predicted : float [BT]
        This shard's ``m_k``, ``s_k`` (relative to ``m_k``) and ``p_k`` (target logit minus
        ``m_k`` where owned, else 0), as :func:`fastgrad.fused_linear_online_max_sum` returns.
    owned : bool [BT]
        Whether this shard holds the row's target.
    extra : float [BT] or None
        A per-row quantity to sum over the shards as well (the logits' row sums for label
        smoothing).

    Returns
    -------
    (gmax, sum_exp, predicted, extra or None)
        The global values: ``gmax = max_k m_k``; ``sum = Σ_k s_k·exp(m_k - gmax)``;
        ``predicted = Σ_k (p_k + (m_k - gmax)·owned_k)`` (the global target logit minus gmax).
    """
    gmax = logits_max.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    shift = logits_max - gmax  # -inf on an empty shard: exp -> 0
    rows = [sum_exp * torch.exp(shift), torch.where(owned, predicted + shift, predicted)]
    if extra is not None:
        rows.append(extra.to(sum_exp.dtype))
    buf = torch.stack(rows)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return gmax, buf[0], buf[1], (buf[2] if extra is not None else None)


def all_reduce_sum_fp32(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``t`` over ``group`` in fp32 (fp64 stays fp64); returns the fp32/fp64 result."""
    acc = t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    if acc is t:
        acc = t.clone()
    dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
    return acc


def block_combiner(group: dist.ProcessGroup | None) -> Callable[..., tuple[np.ndarray, ...]]:
    """The ``combine=`` hook of :func:`fastgrad.linear_cross_entropy` over ``group``.

    Called once per row block with this shard's NumPy ``(max, sum_exp, z_target, z_sum,
    argmax)``; returns the global values with three collectives (every rank plans the same
    blocks: the block size comes from the global vocabulary):

    1. ``gmax = max_k m_k`` (``MAX``);
    2. ``[Σ_k s_k·exp(m_k - gmax), Σ_k z_target_k, Σ_k z_sum_k]`` (one ``SUM``; the target's
       ``z`` is non-zero on its owner only) — the combination of
       :func:`fastgrad.vocab_parallel.combine_shard_statistics`, on raw target logits;
    3. the first global index attaining ``gmax`` (``MIN`` over the shards that attain it).

    With the entropy (``return_entropy``) it also takes and returns ``sz = Σ exp(z - m)·(z - m)``,
    combined in the same ``SUM`` as ``Σ_k exp(m_k - gmax)·(sz_k + (m_k - gmax)·s_k)``.
    """
    import numpy as np

    def combine(m, s, zt, zs, am, sz=None):
        mt = torch.from_numpy(np.array(m))
        gmax = mt.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        shift = mt - gmax
        st = torch.from_numpy(np.asarray(s))
        empty = st == 0  # no finite logit on this shard (m = -inf): contributes nothing
        zero = torch.zeros_like(mt)
        d = torch.where(empty, zero, shift)
        f = torch.where(empty, zero, torch.exp(d))
        rows = [st * f, torch.from_numpy(np.asarray(zt)), torch.from_numpy(np.asarray(zs))]
        if sz is not None:
            rows.append(f * (torch.from_numpy(np.asarray(sz)) + d * st))
        buf = torch.stack(rows)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        big = torch.iinfo(torch.int64).max
        amt = torch.from_numpy(np.asarray(am))
        cand = torch.where((mt == gmax) & (amt >= 0), amt, torch.full_like(amt, big))
        dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
        cand = torch.where(cand == big, torch.full_like(cand, -1), cand)
        res = (gmax.numpy(), buf[0].numpy(), buf[1].numpy(), buf[2].numpy(), cand.numpy())
        return res if sz is None else (*res, buf[3].numpy())

    return combine
