"""``fastgrad.plan``: the tile plan an LM-head op will run, without running it — what the
command's memory estimate, the benchmarks and a user sizing a job read (the op makes the same
plan from the same settings when it is called)."""

from __future__ import annotations

import numpy.typing as npt

from .. import _config
from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ..tiling import GemmChoice, LinearCETiling
from . import _engines
from .fused_linear_cross_entropy_loss_grad import DECL as _FLCE
from .fused_linear_online_max_sum import DECL as _FLOMS

#: the LM-head ops a plan is made for, by their snake_case and aclnn names (their declarations'),
#: with the modes each runs
_MODES = {_FLOMS.name: ("forward",), _FLCE.name: ("memory_saving", "high_performance")}
_OPS = {**_MODES, _FLOMS.aclnn: _MODES[_FLOMS.name], _FLCE.aclnn: _MODES[_FLCE.name]}


def plan(
    op: str,
    BT: int,
    V: int,
    H: int,
    *,
    dtype: npt.DTypeLike = "bfloat16",
    mode: str | None = None,
    filter_eps: float | None = None,
    budget_bytes: int | None = None,
) -> LinearCETiling:
    """The tile plan of an LM-head op for ``[BT, H]`` rows against a ``[V, H]`` weight shard.

    Parameters
    ----------
    op : str
        ``"fused_linear_online_max_sum"`` or ``"fused_linear_cross_entropy_loss_grad"`` (or their
        aclnn names, ``"aclnnFusedLinearOnlineMaxSum"`` / ``"aclnnFusedLinearCrossEntropyLossGrad"``).
    BT, V, H : int
        Rows, the shard's vocabulary rows, the hidden size (≥ 0).
    dtype : dtype-like
        The operands' dtype (``float32``, ``float16``, ``bfloat16``): it picks the GEMMs.
    mode : str, optional
        The FLCE grad's ``"memory_saving"`` (default) or ``"high_performance"`` (``softmax``
        given); the online max-sum's is ``"forward"``.
    filter_eps : float, optional
        Gradient filtering's threshold (memory-saving mode): the filter's buffers are planned.
    budget_bytes : int, optional
        The workspace budget; default the setting in force (``FASTGRAD_WORKSPACE_MB``,
        ``fastgrad.settings().workspace_bytes``).

    Returns
    -------
    tiling.LinearCETiling
        Frozen: the tile sizes and order, the GEMM choice (``plan.gemm``, with ``describe()``),
        every buffer the loop will allocate (``plan.buffers``) and their sum
        (``plan.workspace_bytes``), as the op makes it under the settings in force now.

    Raises
    ------
    AclnnParamError (161002)
        An unknown ``op``, a ``mode`` the op does not run, or a negative size.
    """
    modes = _OPS.get(op)
    if modes is None:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"plan: op must be one of {sorted(_OPS)}, got {op!r}", "op")
    m = modes[0] if mode is None else mode
    if m not in modes:
        raise AclnnError(
            ACLNN_ERR_PARAM_INVALID, f"plan: mode for {op} must be one of {list(modes)}, got {mode!r}", "mode"
        )
    if min(BT, V, H) < 0:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"plan: BT, V and H must be >= 0, got {(BT, V, H)}", "BT")
    s = _config.settings()
    return _engines.lm_head_plan(BT, V, H, m, dtype, s, budget_bytes=budget_bytes, filter_eps=filter_eps)


def gemm_choice(dtype: npt.DTypeLike) -> GemmChoice:
    """The GEMMs the NumPy-level LM-head ops run for operands of ``dtype`` under the settings in
    force now (``GemmChoice``: the fp32 engine, the native exact-product kernel and its variant;
    ``describe()`` says it in words)."""
    return _engines.gemm_choice(dtype)
