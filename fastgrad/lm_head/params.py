"""The training loss's parameters as the kernel takes them: the scalars (``LossParams``, frozen,
made by the op layer), the passes' arrays (:func:`kernel_arrays`: ``par``/``flags``, filled in one
place), and the per-call bundles the kernel hands its components — :class:`GradOutputs`,
:class:`RowCoefficients`, :class:`PassConstants` (named, immutable tuples: the components unpack
them by position into the Numba passes' arguments)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from .plan_types import LossParams

# The passes' scalar parameters, one array each (Numba types one array of the compute dtype and
# one of int64 for every combination of features: one compiled pass, not one per combination),
# read by name: ``par[P_SOFTCAP]``, ``flags[F_BIAS]`` (module constants: compile-time indices).
# par (compute dtype): softcap, 1/softcap, 1/temperature, temperature, eps (label smoothing),
#                      eps/V, eps·Σw/V, 2·lse_square_scale, -inf, one, zero
P_SOFTCAP, P_INV_SOFTCAP, P_INV_TEMPERATURE, P_TEMPERATURE = 0, 1, 2, 3
P_EPS, P_EPS_OVER_V, P_EPS_WSUM_OVER_V, P_Z_SCALE2 = 4, 5, 6, 7
P_NEG_INF, P_ONE, P_ZERO = 8, 9, 10
# flags (int64): has a softcap, has a bias, has class weights, needs Σ w·z (smoothing),
#                needs the entropy's statistic Σ e·(z - max), has an entropy gradient (coef_h, μ)
F_SOFTCAP, F_BIAS, F_CLASS_WEIGHT, F_ZSUM, F_ENTROPY_STAT, F_ENTROPY_GRAD = 0, 1, 2, 3, 4, 5


def kernel_arrays(
    p: LossParams,
    cdt: npt.DTypeLike,
    *,
    softcap: bool,
    bias: bool,
    class_weight: bool,
    entropy_stat: bool,
    entropy_grad: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """``(par, flags)``: the passes' scalar parameters in the compute dtype ``cdt`` and their
    feature flags (int64), in the layouts the ``P_*`` / ``F_*`` indices name — the one place they
    are filled."""
    par = np.zeros(11, cdt)
    par[P_SOFTCAP] = p.softcap or 0.0
    par[P_INV_SOFTCAP] = (1.0 / p.softcap) if p.softcap else 0.0
    par[P_INV_TEMPERATURE] = 1.0 / p.temperature
    par[P_TEMPERATURE] = p.temperature
    par[P_EPS] = p.eps
    par[P_EPS_OVER_V] = p.eps_over_V
    par[P_EPS_WSUM_OVER_V] = p.eps_wsum_over_V
    par[P_Z_SCALE2] = p.z_scale2
    par[P_NEG_INF], par[P_ONE], par[P_ZERO] = -np.inf, 1.0, 0.0
    flags = np.zeros(6, np.int64)
    flags[F_SOFTCAP] = softcap
    flags[F_BIAS] = bias
    flags[F_CLASS_WEIGHT] = class_weight
    flags[F_ZSUM] = p.need_zsum
    flags[F_ENTROPY_STAT] = entropy_stat
    flags[F_ENTROPY_GRAD] = entropy_grad
    return par, flags


class GradOutputs(NamedTuple):
    """The gradients a call writes (None: not computed): ``grad_input`` [BT, H], ``grad_weight``
    [K, H], ``grad_weight_bits`` (a 16-bit ``grad_weight``'s uint16 view, else ``grad_weight``),
    ``grad_weight_code`` (its dtype code, None for the compute dtype) and ``grad_bias`` [K]."""

    grad_input: np.ndarray | None
    grad_weight: np.ndarray | None
    grad_weight_bits: np.ndarray | None
    grad_weight_code: int | None
    grad_bias: np.ndarray | None


class RowCoefficients(NamedTuple):
    """The per-row arrays of the passes, [BT] each, in the compute dtype (``target_cols`` int64):
    the target's local column (-1: none), its class weight, the log-sum-exp (written by the
    statistics, or read by the recompute), the upstream coefficients of the cross-entropy, the
    z-loss and the entropy terms, and ``μ = Σ p·z`` (the entropy's gradient)."""

    target_cols: np.ndarray
    target_weight: np.ndarray
    lse: np.ndarray
    coef_ce: np.ndarray
    coef_z: np.ndarray
    coef_h: np.ndarray
    z_mean: np.ndarray


class PassConstants(NamedTuple):
    """What every pass reads besides a row block: the class weights [K] and the bias [K] in the
    compute dtype (a one-element zero where absent), and :func:`kernel_arrays`' ``par``/``flags``."""

    class_weight: np.ndarray
    bias: np.ndarray
    par: np.ndarray
    flags: np.ndarray
