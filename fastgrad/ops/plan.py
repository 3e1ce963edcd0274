"""``fastgrad.plan``: the tile plan an LM-head op will run, without running it — what the
command's memory estimate, the benchmarks and a user sizing a job read (the op makes the same
plan from the same settings when it is called)."""

from __future__ import annotations

import numbers

import numpy as np
import numpy.typing as npt

from .. import _config
from ..dtypes import parse_dtype
from ..errors import ACLNN_ERR_PARAM_INVALID, AclnnError
from ..tiling import GemmChoice, LinearCETiling
from . import _engines
from .fused_linear_cross_entropy_loss_grad import DECL as _FLCE
from .fused_linear_cross_entropy_loss_grad import FILTER_EPS_VALUES, filter_eps_value
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
    options: _config.Options | None = None,
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
        The operands' dtype (``float32``, ``float16``, ``bfloat16``, any spelling the ops take,
        a ``torch.dtype`` too): it picks the GEMMs.
    mode : str, optional
        The FLCE grad's ``"memory_saving"`` (default) or ``"high_performance"`` (``softmax``
        given); the online max-sum's is ``"forward"``.
    filter_eps : float or "auto", optional
        Gradient filtering's threshold (memory-saving mode), as the op takes it: the filter's
        buffers are planned.
    budget_bytes : int > 0, optional
        The workspace budget; default the setting in force (``FASTGRAD_WORKSPACE_MB``,
        ``fastgrad.settings().workspace_bytes``).
    options : fastgrad.Options, optional
        The call's own settings (``options=`` of the op): the plan is the one the op makes when
        called with them — their GEMM setting, ISA and ``workspace_bytes`` over those in force
        (``budget_bytes``, when given, over both).

    Returns
    -------
    tiling.LinearCETiling
        Frozen: the tile sizes and order, the GEMM choice (``plan.gemm``, with ``describe()``),
        every buffer the loop will allocate (``plan.buffers``) and their sum
        (``plan.workspace_bytes``), as the op makes it under the settings in force now.

    Raises
    ------
    AclnnParamError (161002)
        An unknown ``op``, a ``mode`` the op does not run, a size that is not an int ≥ 0, a
        ``dtype`` other than the three, a ``filter_eps`` the op refuses, a ``budget_bytes`` that
        is not a positive int, ``options`` that are not a ``fastgrad.Options`` (or hold a bad value).
    """
    modes = _OPS.get(op) if isinstance(op, str) else None
    if modes is None:
        raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"plan: op must be one of {sorted(_OPS)}, got {op!r}", "op")
    m = modes[0] if mode is None else mode
    if m not in modes:
        raise AclnnError(
            ACLNN_ERR_PARAM_INVALID, f"plan: mode for {op} must be one of {list(modes)}, got {mode!r}", "mode"
        )
    BT, V, H = (_count(name, v) for name, v in (("BT", BT), ("V", V), ("H", H)))
    dt = _operand_dtype(dtype)
    eps = None
    if filter_eps is not None:
        if m != "memory_saving":
            raise _bad("filter_eps", f"None in {m} mode (filtering applies to memory-saving mode)", filter_eps)
        try:
            eps = filter_eps_value(filter_eps, dt)
        except ValueError:
            raise _bad("filter_eps", FILTER_EPS_VALUES, filter_eps) from None
    if budget_bytes is not None:
        budget_bytes = _count("budget_bytes", budget_bytes, least=1)
    s = _config.settings()
    if options is not None:
        if not isinstance(options, _config.Options):
            raise _bad("options", "a fastgrad.Options or None", type(options).__name__)
        s = options.resolve(s)
    return _engines.lm_head_plan(BT, V, H, m, dt, s, budget_bytes=budget_bytes, filter_eps=eps)


def gemm_choice(dtype: npt.DTypeLike) -> GemmChoice:
    """The GEMMs the NumPy-level LM-head ops run for operands of ``dtype`` (``float32``,
    ``float16``, ``bfloat16``; any spelling the ops take) under the settings in force now
    (``GemmChoice``: the fp32 engine, the native exact-product kernel and its variant;
    ``describe()`` says it in words).  AclnnParamError (161002) for another dtype."""
    return _engines.gemm_choice(_operand_dtype(dtype, "gemm_choice"))


#: the LM-head ops' operand dtypes
_DTYPES = ("float32", "float16", "bfloat16")


def _bad(param: str, expected: str, got: object, op: str = "plan") -> AclnnError:
    return AclnnError(ACLNN_ERR_PARAM_INVALID, f"{op}: {param} must be {expected}, got {got!r}", param)


def _count(name: str, v: object, least: int = 0) -> int:
    """``v`` as an int ≥ ``least`` (a Python or NumPy integer, not a bool); else 161002."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)) or int(v) < least:
        raise _bad(name, f"an int >= {least}", v)
    return int(v)


def _operand_dtype(dtype: object, op: str = "plan") -> np.dtype:
    """``dtype`` (any spelling :func:`fastgrad.dtypes.parse_dtype` takes) as one of the LM-head
    ops' operand dtypes; else 161002."""
    try:
        dt = parse_dtype(dtype)  # type: ignore[arg-type]
    except (AclnnError, TypeError, ValueError):
        dt = None
    if dt is None or dt.name not in _DTYPES:
        raise _bad("dtype", "one of " + ", ".join(_DTYPES), dtype, op)
    return dt
