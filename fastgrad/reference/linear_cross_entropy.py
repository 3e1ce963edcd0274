"""float64 golden of ``linear_cross_entropy``, the training LM-head loss (not an aclnn op).

The ``"reference"`` backend's implementation: the same keyword interface and the same ``out``
entries as the cpu kernel (``kernels/linear_cross_entropy.py``), computed in float64 NumPy
straight from the formulas of the op's docstring (``fastgrad/ops/linear_cross_entropy.py``) and
docs/spec.md, "Training loss" — obvious, slow, clear.  Per block of at most ``plan.budget_rows`` rows
(the plan's, from the global vocabulary, so that ``combine`` is called per the same row blocks on
every shard; the weight is widened per chunk of ``plan.v_chunk`` rows, so the memory is a few
``[budget_rows, K]`` float64 arrays, the float64 ``grad_weight`` accumulator and the outputs)::

    l   = x·wᵀ + b                               (this shard's K columns, float64)
    z   = softcap(l)/T,  softcap(l) = c·tanh(l/c) (identity without a softcap)
    m   = max_v z_v (NaN never the max),  argmax = the first v with z_v = m (global id; -1 if m = -inf)
    s   = Σ_v exp(z_v - m),  sz = Σ_v exp(z_v - m)·(z_v - m)     (a term with exp = 0 adds 0)
    z_target = z_t (0 when the target is not in this shard),  z_sum = Σ_v w_v·z_v (with need_zsum)
    combine(m, s, z_target, z_sum, argmax[, sz])  -> the global values (vocabulary shards)
    lse = m + log s,  μ = z_mean = m + sz/s,  entropy = log s - sz/s

and, when a gradient is wanted (``coef_ce``, ``coef_z``, ``coef_h`` the per-row upstream
coefficients ``c``, ``c_z``, ``h`` the op computes; ``ε`` the label smoothing, ``w`` the class
weights, 1 without)::

    p_v = exp(z_v - lse)
    a = c·((1-ε)·w[t] + ε·Σw/V) + c_z·2·scale·lse,  b = c·(1-ε)·w[t],  e = c·ε/V
    dloss/dz_v = a·p_v - b·[v=t] - e·w_v + h·p_v·(μ - z_v)        (h-term 0 where p_v = 0)
    G = dloss/dl = dloss/dz · (1/T) · (1 - tanh²(l/c))            (the last factor with a softcap)
    grad_input = G·W,  grad_weight += Gᵀ·X,  grad_bias += Σ_rows G

(a row whose ``a``, ``b``, ``e`` and ``h`` are all 0, e.g. an ignored row, has ``G = 0``).
With ``lse`` given (the recompute) no statistic is computed and ``combine`` is not called: the
gradient uses the saved ``lse`` and, with ``coef_h``, the saved ``z_mean``.

Every result is exact up to float64 rounding and rounded once to its ``out`` array's dtype
(``grad_weight`` accumulated in float64 over the row blocks and rounded at the end, a 16-bit
``accum_dtype`` included).  Gradient filtering (``params.filter_eps``) and
``params.round_grad`` (``precision="fast"``) are approximations of this exact gradient: the
golden ignores them, always computes the dense exact value, and reports ``filter_stats`` (when
``out`` has one) with ``blocks_total = blocks_skipped = 0``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the plan's type only (a golden imports no settings)
    from ..tiling import LossParams, TrainingPlan

OP = "linear_cross_entropy"


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _stats(z: np.ndarray, tcol: np.ndarray, cw: np.ndarray | None, need_zsum: bool, col0: int):
    """This shard's row statistics of ``z`` [nb, K]: (m, s, z_target, z_sum, argmax, sz)."""
    nb, K = z.shape
    zn = np.where(np.isnan(z), -np.inf, z)
    m = zn.max(axis=1) if K else np.full(nb, -np.inf)
    live = m != -np.inf  # a row with some finite (or +inf) logit
    with np.errstate(invalid="ignore", over="ignore"):
        d = z - np.where(live, m, 0.0)[:, None]
        e = np.where(live[:, None], np.exp(d), 0.0)
        s = e.sum(axis=1)
        sz = np.where(e != 0, e * d, 0.0).sum(axis=1)
    am = np.full(nb, -1, np.int64)
    if K:
        am[live] = np.argmax(z[live] == m[live, None], axis=1) + col0
    rows = np.flatnonzero(tcol >= 0)
    zt = np.zeros(nb)
    zt[rows] = z[rows, tcol[rows]]
    if need_zsum:
        with np.errstate(invalid="ignore"):
            zs = (z * cw[None, :]).sum(axis=1) if cw is not None else z.sum(axis=1)
        zs = np.where(live, zs, 0.0)  # no finite logit: Σ w·z is 0, as Σ exp
    else:
        zs = np.zeros(nb)
    return m, s, zt, zs, am, sz


def linear_cross_entropy(
    *,
    input: np.ndarray,
    weight: np.ndarray,
    target_cols: np.ndarray,
    bias: np.ndarray | None,
    class_weight: np.ndarray | None,
    target_weight: np.ndarray,
    coef_ce: np.ndarray | None,
    coef_z: np.ndarray | None,
    params: LossParams,
    plan: TrainingPlan,
    coef_h: np.ndarray | None = None,
    z_mean: np.ndarray | None = None,
    lse: np.ndarray | None,
    combine: Callable | None,
    out: dict,
    progress: Callable[[int, int], object] | None = None,
) -> None:
    """The ``reference`` backend's ``linear_cross_entropy`` (module docstring): the cpu kernel's
    interface (``kernels/linear_cross_entropy.py``, ``linear_cross_entropy_cpu``) in float64.

    ``target_cols``: this shard's target column per row (-1: ignored or on another shard);
    ``target_weight``: ``w[t]`` per row (0 on ignored rows); ``class_weight``: this shard's
    ``[K]`` class weights or None.  ``out``: the preallocated outputs (``lse``, ``max``,
    ``sum_exp``, ``z_target``, ``z_sum``, ``argmax``, ``z_mean``, ``entropy``, ``grad_input``,
    ``grad_weight``, ``grad_bias``; absent or None: not computed) and ``filter_stats`` (a dict
    receiving ``blocks_total = blocks_skipped = 0``: the golden never filters).  ``plan``
    (``tiling.TrainingPlan``): the golden takes its row blocks (``budget_rows``, from the global
    V: the per-block ``combine`` of every rank) and its chunk width, nothing else.
    ``progress(done, total)``: after each row block.
    """
    BT, H = input.shape
    K = weight.shape[0]
    recompute = lse is not None
    gi, gw, gb = out.get("grad_input"), out.get("grad_weight"), out.get("grad_bias")
    want_grad = gi is not None or gw is not None or gb is not None
    fstats = out.get("filter_stats")
    if fstats is not None:
        fstats["blocks_total"] = 0
        fstats["blocks_skipped"] = 0

    cap = params.softcap
    T = float(params.temperature)
    eps = float(params.eps)
    eps_over_V = float(params.eps_over_V)
    eps_wsum_over_V = float(params.eps_wsum_over_V)
    z_scale2 = float(params.z_scale2)
    need_zsum = bool(params.need_zsum) and not recompute
    col0 = int(params.vocab_start_index)
    # the entropy's statistic (and combine's sixth value): asked for, or needed by its gradient
    need_ent = not recompute and (coef_h is not None or out.get("z_mean") is not None or out.get("entropy") is not None)

    b64 = None if bias is None else _f64(bias)
    cw = None if class_weight is None else _f64(class_weight)
    tcol = np.asarray(target_cols, dtype=np.int64)
    wt = _f64(target_weight)
    cc_all = np.zeros(BT) if coef_ce is None else _f64(coef_ce)
    cz_all = np.zeros(BT) if coef_z is None else _f64(coef_z)
    ch_all = np.zeros(BT) if coef_h is None else _f64(coef_h)
    lse_all = None if not recompute else _f64(lse)
    mu_all = _f64(z_mean) if (recompute and coef_h is not None) else None

    vc = plan.v_chunk  # ≤ K (the plan's)
    chunks = [(v0, min(K, v0 + vc)) for v0 in range(0, K, vc)]

    def wchunk(v0: int, v1: int) -> np.ndarray:
        return _f64(weight[v0:v1])

    gw_acc = np.zeros((K, H)) if gw is not None else None
    gb_acc = np.zeros(K) if gb is not None else None

    nb_max = max(1, min(int(plan.budget_rows), BT)) if BT else 1
    nblocks = -(-BT // nb_max) if BT else 0
    for k in range(nblocks):
        if progress is not None and k:
            progress(k, nblocks)
        b0, b1 = (k * BT) // nblocks, ((k + 1) * BT) // nblocks
        nb = b1 - b0
        X = _f64(input[b0:b1])
        l = np.empty((nb, K))
        for v0, v1 in chunks:
            l[:, v0:v1] = X @ wchunk(v0, v1).T
        if b64 is not None:
            l += b64[None, :]
        sech2 = None  # dsoftcap/dl = 1 - tanh²(l/c)
        with np.errstate(over="ignore", invalid="ignore"):
            if cap is not None:
                th = np.tanh(l / cap)
                z = cap * th / T
                sech2 = 1.0 - th * th
            else:
                z = l / T
        tc = tcol[b0:b1]

        if not recompute:
            m, s, zt, zs, am, sz = _stats(z, tc, cw, need_zsum, col0)
            if combine is not None:
                if need_ent:
                    m, s, zt, zs, am, sz = combine(m, s, zt, zs, am, sz)
                else:
                    m, s, zt, zs, am = combine(m, s, zt, zs, am)
            m, s, zt, zs, sz = (_f64(a) for a in (m, s, zt, zs, sz))
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                lse_b = m + np.log(s)
                dz = sz / s
                mu_b = m + dz
                ent_b = np.log(s) - dz
            for key, val in (
                ("lse", lse_b),
                ("max", m),
                ("sum_exp", s),
                ("z_target", zt),
                ("z_sum", zs),
                ("argmax", np.asarray(am, np.int64)),
            ):
                if out.get(key) is not None:
                    out[key][b0:b1] = val
            if need_ent:
                if out.get("z_mean") is not None:
                    out["z_mean"][b0:b1] = mu_b
                if out.get("entropy") is not None:
                    out["entropy"][b0:b1] = ent_b
        else:
            if lse_all is None:  # the recompute is given lse (not an assert: python -O)
                raise ValueError("the recompute needs lse")
            lse_b = lse_all[b0:b1]
            mu_b = mu_all[b0:b1] if mu_all is not None else np.zeros(nb)

        if not want_grad:
            continue
        cc, cz, h = cc_all[b0:b1], cz_all[b0:b1], ch_all[b0:b1]
        w_t = wt[b0:b1]
        with np.errstate(over="ignore", invalid="ignore"):
            a = cc * ((1.0 - eps) * w_t + eps_wsum_over_V) + cz * z_scale2 * lse_b
            b = cc * (1.0 - eps) * w_t
            e = cc * eps_over_V
            p = np.exp(z - lse_b[:, None])
            g = a[:, None] * p
            hterm = p * (h[:, None] * (mu_b[:, None] - z))
            g = g + np.where(p != 0, hterm, 0.0)
            g = g - (e[:, None] * cw[None, :] if cw is not None else e[:, None])
            own = np.flatnonzero(tc >= 0)
            g[own, tc[own]] -= b[own]
            if sech2 is not None:
                g = g * sech2
            G = g / T
        G[(a == 0) & (b == 0) & (e == 0) & (h == 0)] = 0.0  # e.g. an ignored row: no gradient
        if gi is not None:
            acc = np.zeros((nb, H))
            for v0, v1 in chunks:
                acc += G[:, v0:v1] @ wchunk(v0, v1)
            gi[b0:b1] = acc
        if gw_acc is not None:
            gw_acc += G.T @ X
        if gb_acc is not None:
            gb_acc += G.sum(axis=0)

    if progress is not None and nblocks:
        progress(nblocks, nblocks)
    if gi is not None and BT == 0:
        gi[...] = 0
    if gw is not None and gw_acc is not None:
        gw[...] = gw_acc.astype(gw.dtype)
    if gb is not None and gb_acc is not None:
        gb[...] = gb_acc.astype(gb.dtype)
