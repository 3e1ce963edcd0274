"""op: ``linear_cross_entropy`` — the training LM-head loss (not an aclnn op; docs/spec.md "Training loss").

One declaration (``DECL``, an :class:`~fastgrad.ops._opdef.OpDef`) on the generic path
(``_opdef.execute``): the inputs and attributes checked there (every reason in one
``AclnnError`` 161001/161002), the relations between them and the per-row coefficients of the
gradient (``_relations``), what strict mode rejects (``_device_limits``), the row-block plan
from the shapes and the memory budget (``_plan``: ``tiling.plan_training_loss``, never from the
thread count), the backend's arguments (``_kernel_args``: the cpu kernel and the float64 golden
take the same), and the per-row and reduced losses formed from the kernel's row statistics
(``_result``).  A backend without the op (``"acl"``: not an aclnn op) runs the cpu kernel, with one
warning (``OpDef.fallback``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import _outcache, arrays, tiling
from .. import dtypes as D
from .._config import Options
from ..arrays import ArrayLike
from ..errors import AclnnError
from ._engines import gemm_choice, warn_fallback
from ._opdef import AttrDef, Call, OpDef, TensorDef, execute

OP = "linear_cross_entropy"

#: vocabulary columns per GEMM chunk inside a row block
V_CHUNK = 8192
#: the row blocks' sweeps run in stages where the call allows (``TrainingPlan.staged_statistics`` /
#: ``staged_gradient``); False: chunk by chunk, one barrier per step — the same calls on the same
#: operands, so the same bits (tests/test_linear_cross_entropy_staged.py)
STAGED = True
_FLOATS = (D.BFLOAT16, D.FLOAT16, D.FLOAT32, D.FLOAT64)
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


class LinearCrossEntropyResult(NamedTuple):
    """Outputs of :func:`linear_cross_entropy` (None where not computed)."""

    loss: Any  #: 0-d (mean/sum) or [BT] (none): CE (+ smoothing) + z-loss
    z_loss: Any  #: the z-loss part, reduced like ``loss`` (0 when lse_square_scale = 0)
    lse: Any  #: [BT] global log-sum-exp of z (compute dtype)
    predicted: Any  #: int64 [BT] global argmax of z (first index; -1 on an empty shard)
    token_accuracy: Any  #: 0-d fraction of non-ignored rows whose argmax is the target, or [BT] 0/1
    grad_input: Any  #: [BT, H] compute dtype (a partial sum on a vocabulary shard)
    grad_weight: Any  #: [K, H] compute dtype
    grad_bias: Any  #: [K] compute dtype
    n_valid: int  #: rows whose target is not ignore_index
    weight_sum: float  #: Σ ce_weight[target] over those rows (= n_valid without ce_weight)
    filter_stats: Any = None  #: with ``filter_eps`` and a gradient: {filter_eps, blocks_total, blocks_skipped}
    entropy: Any = None  #: with ``return_entropy``: the entropy of softmax(z), reduced like ``z_loss``
    z_mean: Any = None  #: with ``return_entropy``: [BT] ``μ = Σ_v p_v·z_v`` (compute dtype; for the recompute)
    plan: Any = None  #: the ``tiling.TrainingPlan`` the call ran: row blocks, chunks, its ``buffers``


def round_grad(grad: np.ndarray, dtype: Any, scale: float | None = None) -> np.ndarray:
    """A 2-D fp32 gradient rounded to the 16-bit ``dtype`` (bf16 or fp16; RNE, bitwise
    ``ml_dtypes``), times ``scale`` in fp32 first when given (two roundings: PyTorch's
    ``(g * s).to(dtype)``), on a recycled block of the output cache (``fastgrad._outcache``).

    The fused training step's ``grad_weight``: the row blocks' freed logits scratch is such a
    block (``_config.workspace_floor``), so the rounded gradient takes no new memory.  Raises
    ``ValueError`` for another shape or dtype."""
    from ..kernels._linear import narrow  # validates: 2-D float32 grad, a bf16/fp16 dtype

    return narrow(grad, _outcache.empty(grad.shape, np.dtype(dtype)), scale)


def _relations(call: Call) -> None:
    """The shape relations and value checks between the arguments (reasons collected), then the
    call's derived values in ``call.info``: the target columns of this shard, the per-row
    weights and upstream coefficients of the gradient, the kernel's parameters and outputs."""
    a, at, raw = call.a, call.attrs, call.raw
    x, w, t, b, cw = (a[n] for n in ("input", "weight", "target", "bias", "ce_weight"))
    if w.dtype != x.dtype:
        call.bad("weight", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(w.dtype))
    BT, H = x.shape
    K = w.shape[0]
    if w.shape[1] != H:
        call.bad("weight", f"weight.shape[1] == input.shape[1] == {H}", f"shape {w.shape}")
    if t.shape[0] != BT:
        call.bad("target", f"target.shape[0] == input.shape[0] == {BT}", f"shape {t.shape}")
    if b is not None:
        if b.dtype != x.dtype:
            call.bad("bias", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(b.dtype))
        call.expect_shape("bias", (K,))
    start = at["vocab_start_index"]
    V = K if at["vocab_size"] is None else at["vocab_size"]
    if start is not None and V is not None and (start < 0 or start + K > V):
        call.bad("vocab_start_index", f"a shard [start, start + {K}) inside [0, vocab_size={V})", start)
    if cw is not None and V is not None:
        call.expect_shape("ce_weight", (V,))
    cap, temp = at["softcap"], at["temperature"]
    if cap is not None and not cap > 0:
        call.bad("softcap", "a finite float > 0 or None", cap)
    if temp is not None and not temp > 0:
        call.bad("temperature", "a finite float > 0", temp)
    rg = raw.get("return_grad", False)
    need = (False, False, False)
    if isinstance(rg, (bool, np.bool_)):
        need = (bool(rg),) * 3
    elif isinstance(rg, (tuple, list)) and len(rg) == 3:
        need = (bool(rg[0]), bool(rg[1]), bool(rg[2]))
    else:
        call.bad("return_grad", "a bool or a (input, weight, bias) triple of bools", repr(rg))
    need = (need[0], need[1], need[2] and b is not None)
    combine = raw.get("combine")
    if combine is not None and not callable(combine):
        call.bad("combine", "a callable or None", type(combine).__name__)
    feps = None
    if raw.get("filter_eps") is not None:
        from .fused_linear_cross_entropy_loss_grad import FILTER_EPS_VALUES, filter_eps_value

        try:
            feps = filter_eps_value(raw["filter_eps"], x.dtype)
        except ValueError:
            call.bad("filter_eps", FILTER_EPS_VALUES, repr(raw["filter_eps"]))
    if raw.get("grad_entropy") is not None and feps is not None:
        call.bad("filter_eps", "None with grad_entropy (the filter is on the cross-entropy term)", feps)
    cdt = np.float64 if x.dtype == D.FLOAT64 else np.float32
    gw_dt = np.dtype(cdt) if at["accum_dtype"] is None else at["accum_dtype"]
    if gw_dt not in (np.dtype(cdt), np.dtype(x.dtype)):
        allowed = " / ".join(sorted({D.dtype_name(cdt), D.dtype_name(x.dtype)}))
        call.bad("accum_dtype", f"None or {allowed}", D.dtype_name(gw_dt))
    if call.reasons or V is None or start is None:  # (None: a reason is recorded)
        return
    ign, red, eps, zsc = at["ignore_index"], at["reduction"], at["label_smoothing"], at["lse_square_scale"]
    tl = np.asarray(t).astype(np.int64, copy=False)
    valid = tl != ign
    bad = valid & ((tl < 0) | (tl >= V))
    if bad.any():
        first = int(tl[np.flatnonzero(bad)[0]])
        call.bad("target", f"class ids in [0, {V}) or ignore_index ({ign})", f"Target {first} is out of bounds")
        return
    owned = valid & (tl >= start) & (tl < start + K)
    tcol = np.where(owned, tl - start, -1).astype(np.int64)
    n_valid = int(valid.sum())
    if cw is None:
        wt = valid.astype(np.float64)
        wsum_all = float(V)
        cw_local = None
    else:
        cw64 = np.asarray(cw, dtype=np.float64)
        wt = np.where(valid, cw64[np.where(valid, tl, 0)], 0.0)
        wsum_all = float(cw64.sum())
        cw_local = np.ascontiguousarray(cw64[start : start + K])
    weight_sum = float(wt.sum())

    recompute = raw.get("lse") is not None
    coef_ce = coef_z = coef_h = None
    want = () if red != "none" else (BT,)

    def upstream(name):
        """An upstream gradient (scalar; [BT] for 'none') as float64, or None (not given / bad)."""
        try:
            g = np.asarray(arrays.as_numpy(raw[name], name, op=OP), dtype=np.float64)
        except AclnnError as e:
            call.reasons.append((name, e.message.split(": ", 1)[-1]))
            return None
        except (TypeError, ValueError):
            call.bad(name, "a number or an array of numbers", type(raw[name]).__name__)
            return None
        if g.shape != want:
            call.bad(name, f"shape {want}", f"shape {g.shape}")
            return None
        return g

    if any(need):
        if raw.get("grad_output") is None:
            go = np.float64(1.0) if red != "none" else np.ones(BT)
        else:
            go = upstream("grad_output")
        gh = None if raw.get("grad_entropy") is None else upstream("grad_entropy")

        def per_row(g, denom):
            """The upstream gradient on each valid row: divided by ``denom`` for mean."""
            if red == "mean":
                g = g / denom if denom else g * np.inf
            return np.where(valid, g, 0.0)

        if go is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                coef_ce = per_row(go, weight_sum)
                coef_z = per_row(go, n_valid) if zsc else np.zeros(BT)  # z-loss: mean over the rows
                coef_h = None if gh is None else per_row(gh, n_valid)  # entropy: likewise
    lse_a = zm_a = None
    if recompute:
        lse_a = _row_vector(call, "lse", BT)
        if coef_h is not None:
            if raw.get("z_mean") is None:
                call.bad("z_mean", "the saved z_mean with grad_entropy and lse", None)
            else:
                zm_a = _row_vector(call, "z_mean", BT)
    if call.reasons:
        return
    params = tiling.LossParams(
        softcap=cap,
        temperature=temp,
        eps=eps,
        eps_over_V=eps / V if V else 0.0,
        eps_wsum_over_V=eps * wsum_all / V if V else 0.0,
        z_scale2=2.0 * zsc,
        need_zsum=eps != 0.0 and not recompute,
        vocab_start_index=start,
        filter_eps=feps,
        round_grad=at["precision"] == "fast",
    )
    # the GEMMs, chosen once from the settings (the kernel reads none; the plan carries them): ops/_engines.py
    gemm = gemm_choice(x.dtype, call.settings)
    want_grad = any(need)
    fstats: dict | None = {} if (feps is not None and want_grad) else None
    ent = at["return_entropy"] and not recompute
    out: dict = {
        "lse": None if recompute else np.empty(BT, cdt),
        "z_target": None if recompute else np.empty(BT, cdt),
        "z_sum": None if recompute else np.empty(BT, cdt),
        "argmax": None if recompute else np.empty(BT, np.int64),
        "z_mean": np.empty(BT, cdt) if ent else None,
        "entropy": np.empty(BT, np.float64) if ent else None,
        # the gradients on recycled memory (a training loop calls this with the same shapes
        # every step: no fresh pages, whose clearing costs a pass each)
        "grad_input": _outcache.empty((BT, H), cdt) if need[0] else None,
        "grad_weight": _outcache.empty((K, H), gw_dt) if need[1] else None,
        "grad_bias": np.empty(K, cdt) if need[2] else None,
        "filter_stats": fstats,
    }
    call.info.update(
        BT=BT, H=H, K=K, V=V, cdt=cdt, gw_dt=gw_dt, need=need, feps=feps, recompute=recompute, tl=tl,
        valid=valid, tcol=tcol, n_valid=n_valid, wt=wt, wsum_all=wsum_all, cw_local=cw_local,
        weight_sum=weight_sum, coef_ce=coef_ce, coef_z=coef_z, coef_h=coef_h, lse=lse_a, z_mean=zm_a,
        params=params, gemm=gemm, out=out, combine=combine,
    )  # fmt: skip


def _row_vector(call: Call, name: str, BT: int) -> np.ndarray | None:
    """A saved ``[BT]`` row vector (``lse``, ``z_mean``), or None with the reason recorded."""
    try:
        v = np.asarray(arrays.as_numpy(call.raw[name], name, op=OP))
    except AclnnError as e:
        call.reasons.append((name, e.message.split(": ", 1)[-1]))
        return None
    if v.shape != (BT,):
        call.bad(name, f"shape ({BT},)", f"shape {v.shape}")
        return None
    return v


def _device_limits(call: Call) -> None:
    """Strict mode: the device has no gradient filtering, and rounds no gradient as
    ``precision="fast"`` does."""
    if call.raw.get("filter_eps") is not None:
        call.bad("filter_eps", "None (the device has no gradient filtering; strict mode)", repr(call.raw["filter_eps"]))
    if call.attrs["precision"] == "fast":
        call.bad("precision", "'accurate' (the device rounds no gradient this way; strict mode)", "'fast'")


def _plan(call: Call) -> tiling.TrainingPlan:
    """The plan (``tiling.plan_training_loss``): row blocks from the global V and the budget,
    chunks, the vocabulary-major recompute, whether the weight is widened once, and every buffer
    the kernel takes (``tiling.training_buffers``)."""
    i, w = call.info, call.a["weight"]
    cdt, need, gemm = i["cdt"], i["need"], i["gemm"]
    budget = None if call.settings is None else call.settings.workspace_bytes  # (execute sets them)
    logits16 = bool(gemm.logits16)  # the choice for this dtype: set for bf16 operands only (lm_head/engine.resolve)
    plan = tiling.plan_training_loss(
        i["BT"],
        i["K"],
        max(i["V"], 1),
        i["H"],
        itemsize=np.dtype(cdt).itemsize,
        widen=w.dtype != cdt,
        want_grad=any(need),
        recompute=i["recompute"],
        filtered=i["feps"] is not None,
        logits16=logits16,
        v_chunk=V_CHUNK,
        budget_bytes=budget,
        grads=need,
        accum16=i["gw_dt"] != np.dtype(cdt),
        fast=call.attrs["precision"] == "fast",
        a_form=gemm.a_form,
        staged=STAGED,
        beta1=gemm.beta1,
        gemm=gemm,
    )
    warn_fallback(plan.fallback)
    return plan


def _kernel_args(call: Call) -> dict:
    """The backend's arguments (``kernels/linear_cross_entropy.linear_cross_entropy_cpu`` and
    ``reference/linear_cross_entropy.linear_cross_entropy`` take the same)."""
    i = call.info
    return dict(
        input=call.a["input"],
        weight=call.a["weight"],
        target_cols=i["tcol"],
        bias=call.a["bias"],
        class_weight=i["cw_local"],
        target_weight=i["wt"],
        coef_ce=i["coef_ce"],
        coef_z=i["coef_z"],
        coef_h=i["coef_h"],
        z_mean=i["z_mean"] if i["coef_h"] is not None else None,
        params=i["params"],
        plan=i["plan"],
        lse=i["lse"],
        combine=i["combine"],
        out=i["out"],
        progress=None if call.settings is None else call.settings.progress,
    )


def _result(call: Call, _results: dict) -> LinearCrossEntropyResult:
    """The per-row and reduced losses from the kernel's row statistics (the op's docstring)."""
    i = call.info
    out, kind, BT, V, cdt = i["out"], i["kind"], i["BT"], i["V"], i["cdt"]
    red, eps, zsc = call.attrs["reduction"], call.attrs["label_smoothing"], call.attrs["lse_square_scale"]
    valid, wt, n_valid, weight_sum = i["valid"], i["wt"], i["n_valid"], i["weight_sum"]
    wrap = lambda a: arrays.wrap(a, kind)  # noqa: E731
    grads = (wrap(out["grad_input"]), wrap(out["grad_weight"]), wrap(out["grad_bias"]))
    fstats = out["filter_stats"]
    if fstats is not None:
        fstats = {
            "filter_eps": i["feps"],
            "blocks_total": int(fstats.get("blocks_total", 0)),
            "blocks_skipped": int(fstats.get("blocks_skipped", 0)),
        }
    if i["recompute"]:
        return LinearCrossEntropyResult(
            None, None, None, None, None, *grads, n_valid, weight_sum, fstats, plan=i.get("plan")
        )

    lse_r = out["lse"].astype(np.float64)
    zt = out["z_target"].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        ce = wt * (1.0 - eps) * (lse_r - zt)
        if eps:
            ce = ce + np.where(valid, (eps / V) * (i["wsum_all"] * lse_r - out["z_sum"].astype(np.float64)), 0.0)
        ce = np.where(valid, ce, 0.0)
        zl = np.where(valid, zsc * lse_r * lse_r, 0.0) if zsc else np.zeros(BT)
    am = out["argmax"]
    hit = (valid & (am == i["tl"])).astype(np.float64)
    return_entropy = call.attrs["return_entropy"]
    ent_r = np.where(valid, out["entropy"], 0.0) if return_entropy else np.zeros(BT)
    with np.errstate(divide="ignore", invalid="ignore"):
        if red == "mean":
            ce_red = ce.sum() / weight_sum if weight_sum else np.float64(np.nan)
            z_red = zl.sum() / n_valid if n_valid else (np.float64(np.nan) if zsc else np.float64(0.0))
            loss = np.asarray(ce_red + z_red, cdt)
            zred = np.asarray(z_red, cdt)
            acc = np.asarray(hit.sum() / n_valid if n_valid else np.nan, cdt)
            ent = np.asarray(ent_r.sum() / n_valid if n_valid else np.nan, cdt)
        elif red == "sum":
            loss = np.asarray(ce.sum() + zl.sum(), cdt)
            zred = np.asarray(zl.sum(), cdt)
            acc = np.asarray(hit.sum() / n_valid if n_valid else np.nan, cdt)
            ent = np.asarray(ent_r.sum(), cdt)
        else:
            loss = (ce + zl).astype(cdt)
            zred = zl.astype(cdt)
            acc = hit.astype(cdt)
            ent = ent_r.astype(cdt)
    return LinearCrossEntropyResult(
        wrap(loss),
        wrap(zred),
        wrap(out["lse"]),
        wrap(am),
        wrap(acc),
        *grads,
        n_valid,
        weight_sum,
        fstats,
        wrap(ent) if return_entropy else None,
        None if out["z_mean"] is None else wrap(out["z_mean"]),
        plan=i.get("plan"),
    )


DECL = OpDef(
    name=OP,
    aclnn="(none: the training loss, not an aclnn op)",
    inputs=(
        TensorDef("input", _FLOATS, ndim=(2, 2)),
        TensorDef("weight", _FLOATS, ndim=(2, 2)),
        TensorDef("target", INDEX_DTYPES, ndim=(1, 1)),
        TensorDef("bias", _FLOATS, ndim=(1, 1), optional=True),
        TensorDef("ce_weight", _FLOATS, ndim=(1, 1), optional=True),
    ),
    attrs=(
        AttrDef("ignore_index", "int"),
        AttrDef("reduction", "reduction"),
        AttrDef("label_smoothing", "float", lo=0.0, hi=1.0),
        AttrDef("softcap", "float", optional=True),
        AttrDef("temperature", "float"),
        AttrDef("lse_square_scale", "float", lo=0.0),
        AttrDef("vocab_start_index", "int"),
        AttrDef("vocab_size", "int", optional=True),
        AttrDef("return_entropy", "bool"),
        AttrDef("accum_dtype", "dtype"),
        AttrDef("precision", "choice", choices=("accurate", "fast")),
    ),
    outputs=(),
    relations=_relations,
    device_limits=_device_limits,
    plan=_plan,
    result=_result,
    source="docs/spec.md (Training loss); kernels/linear_cross_entropy.py; reference/linear_cross_entropy.py",
    kernel_args=_kernel_args,
    fallback=("cpu", "not an aclnn op"),
)


def linear_cross_entropy(
    input: ArrayLike,
    weight: ArrayLike,
    target: ArrayLike,
    bias: ArrayLike | None = None,
    ce_weight: ArrayLike | None = None,
    *,
    ignore_index: int = -100,
    reduction: str | int = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    lse_square_scale: float = 0.0,
    vocab_start_index: int = 0,
    vocab_size: int | None = None,
    return_grad: bool | tuple[bool, bool, bool] = False,
    grad_output: ArrayLike | float | None = None,
    lse: ArrayLike | None = None,
    combine: Callable | None = None,
    filter_eps: float | str | None = None,
    accum_dtype: Any = None,
    return_entropy: bool = False,
    grad_entropy: ArrayLike | float | None = None,
    z_mean: ArrayLike | None = None,
    precision: str = "accurate",
    options: Options | None = None,
) -> LinearCrossEntropyResult:
    r"""Cross-entropy of ``z = softcap(input·weightᵀ + bias)/temperature`` without ``[BT, V]``.

    Parameters
    ----------
    input : bf16 | fp16 | fp32 | fp64 [BT, H]
    weight : same dtype [K, H] — the whole vocabulary (K = V) or the shard
        ``[vocab_start_index, vocab_start_index + K)`` of a V-word vocabulary.
    target : int32 | int64 [BT] — global ids in ``[0, V)`` or ``ignore_index`` (else 161002).
    bias : same dtype [K], optional.
    ce_weight : float [V], optional — PyTorch's ``weight`` (per-class, global vocabulary).
    ignore_index : int; reduction : 'mean' | 'sum' | 'none'
    label_smoothing : float in [0, 1] — PyTorch's ε over the global V.
    softcap : float > 0 or None — ``c·tanh(l/c)`` (Gemma-2), before the temperature.
    temperature : float > 0.
    lse_square_scale : float ≥ 0 — z-loss ``scale·lse²`` per row, reduced like the loss
        (mean: over the non-ignored rows, not weighted by ce_weight).
    vocab_start_index, vocab_size : the shard layout (defaults: 0, K).
    return_grad : bool or (bool, bool, bool) — compute ``grad_input``, ``grad_weight``,
        ``grad_bias`` for the upstream ``grad_output`` (scalar, default 1; [BT] for 'none').
    lse : [BT], optional — the saved global log-sum-exp: recompute only the gradient (no loss),
        vocabulary-major (chunks of 2048 columns, all rows at once while ``[BT, 2048]`` fits
        half the workspace budget).
    combine : callable, optional — ``combine(max, sum_exp, z_target, z_sum, argmax)`` per row
        block, returning the global values (the caller's all-reduce across vocabulary shards:
        MAX; SUM of ``s·exp(m - gmax)``; SUM; SUM; MIN of the argmax where ``m == gmax``).
    filter_eps : None, "auto" or float in (0, 1] — gradient filtering (an extension, Cut
        Cross-Entropy's ``filter_eps``; strict mode rejects it).  None (default): dense.  Write
        ``dloss/dL[r, v] = c_r·u[r, v]`` with ``c_r`` the row's scale — the upstream gradient
        ``grad_output`` (1 by default) times ``1/Σ_valid w[t]`` for ``"mean"`` — and ``u`` the
        per-element coefficient below (``u = (a·p_v - b·[v=t] - e·w_v)·dz/dL / c``, chained
        through the softcap and the temperature; plain CE: ``u = p - onehot``).  In the
        gradient GEMMs a block of ``tiling.FILTER_ROWS`` rows × ``tiling.FILTER_COLS``
        vocabulary columns (within a row block of the plan; on a vocabulary shard, of this
        shard's columns — the statistics stay global) is skipped when every ``|u| <
        filter_eps`` there (tested on the final fp32 ``dloss/dL``: ``|dloss/dL| <
        filter_eps·|c_r|``); the target column is never skipped, a row whose gradient is
        identically 0 (ignored) always is.  ``"auto"``: the input dtype's machine epsilon / 32
        (bf16 2⁻¹², fp16 2⁻¹⁵, fp32 2⁻²⁸, fp64 2⁻⁵⁷).  The loss, ``lse``, the statistics and
        ``grad_bias`` are exact (unfiltered).  **Error bound** against the unfiltered result
        (both in the compute dtype, before any rounding to the input dtype):
        ``|Δgrad_input[r, h]| <= filter_eps·|c_r|·Σ_{v skipped for r} |weight[v, h]|`` and
        ``|Δgrad_weight[v, h]| <= filter_eps·Σ_{r skipped for v} |c_r|·|input[r, h]|``, up to
        the compute dtype's summation-order rounding.  When nothing is skipped in a row block
        the dense path runs, bitwise unchanged.  The counts are in ``filter_stats``.
    accum_dtype : None or a dtype (any spelling, torch's included) — Liger-Kernel's
        ``accum_dtype``: the dtype in which ``grad_weight`` is accumulated over the row blocks
        and returned.  None (default) or the compute dtype: fp32 (fp64 for fp64 inputs).  The
        input's 16-bit dtype: each row block's fp32 product is added to the 16-bit
        ``grad_weight`` and rounded (RNE), so no fp32 ``[K, H]`` accumulator is held (half the
        memory of the default; Liger's behaviour with ``accum_dtype=None``).  Its error: one
        rounding per row block instead of one in all — with ``n`` row blocks (``BT /
        block_rows``, ``block_rows`` from the workspace budget), ``|Δgrad_weight| <= n·u·Σ_b
        |partial_b|`` with ``u`` the format's unit roundoff (bf16 2⁻⁸, fp16 2⁻¹¹); with one
        row block the result is the default's rounded once, bitwise.  With ``lse`` (the
        recompute, dense) the gradient is computed vocabulary chunk by vocabulary chunk, each
        chunk's ``grad_weight`` summed in fp32 over all rows and then rounded once: the
        16-bit result is always the default's rounded once, bitwise, and no fp32 ``[K, H]`` is
        held.  Anything else: 161002.
    return_entropy : bool — also return the entropy ``-Σ_v p_v·log p_v = lse - Σ_v p_v·z_v`` of
        each row's softmax over the global vocabulary (nats; for RL fine-tuning, as verl's fused
        linear cross-entropy returns it with the per-token log-probabilities ``-loss`` of
        ``reduction="none"``), reduced like the z-loss: mean over the non-ignored rows (not
        weighted by ``ce_weight``), sum, or per row (0 for ignored rows).  Computed online in
        the same pass as ``lse`` (``Σ exp(z - max)·(z - max)`` per row, rescaled when the max
        grows; ``combine`` then takes and returns it as a sixth value: SUM of
        ``exp(m_k - gmax)·(sz_k + (m_k - gmax)·s_k)``), and ``z_mean`` (``μ``) with it.
    grad_entropy : the upstream gradient of the entropy output (scalar; ``[BT]`` for 'none'),
        optional: adds ``h·p_v·(μ - z_v)`` to ``dloss/dz_v`` (``h`` the row's upstream
        coefficient, ``1/n_valid`` for mean; 0 on ignored rows) — the exact derivative of the
        entropy.  With ``lse`` (the recompute) ``z_mean`` is required.  Not with
        ``filter_eps`` (161002: the filter's threshold is on the cross-entropy's coefficient).
    z_mean : [BT], optional — the saved ``μ`` for the recompute with ``grad_entropy``.
    precision : "accurate" (default) | "fast" — ``"fast"``: in the recompute (``lse`` given,
        dense) of bf16 ``input`` and ``weight``, on a CPU with AVX-512 BF16 and the GEMM setting
        ``"auto"`` inside ``fastgrad.torch`` (where the logits already run on the exact-product
        bf16 kernel, ``kernels/_bf16dot.py``), ``dloss/dL`` is rounded to bf16 (RNE; bf16
        subnormals to 0) so that the two gradient GEMMs run on that kernel too (every product
        exact, fp32 sums), and the rounding error's mean part is restored: with ``e = g -
        round(g)``, ``grad_input += Σ_c (Σ_{v∈c} e)·mean_{v∈c} weight`` over the vocabulary chunks
        ``c`` and ``grad_weight[v] += (Σ_t e[t, v])·mean_t input`` per row block.  What is left,
        ``Σ_v (e - mean)·(weight_v - mean)``, is a sum of terms below half a bf16 ulp of ``g``:
        no elementwise bound of one rounding holds for it (unlike ``"accurate"``), but the mean
        absolute error against float64 stays near the fp32 computation's
        (``docs/torch.md``, Precision).  Anywhere else ``"fast"`` is ``"accurate"``, bitwise.
        Strict mode rejects ``"fast"`` (161002); anything else: 161002.
    options : fastgrad.Options, keyword-only, optional
        This call's own settings (GEMM setting, native ISA, workspace budget) over those in
        force (``fastgrad._config.Options``): no context manager, nothing process-wide; 161002
        for another type or a field out of range.

    Returns
    -------
    LinearCrossEntropyResult
        Per row (valid rows; ignored rows give 0): ``nll = lse - z[t]``;
        ``ce = (1-ε)·w[t]·nll + ε/V·Σ_v w_v·(lse - z_v)``; ``zl = scale·lse²``.
        mean: ``Σce/Σw[t] + Σzl/n_valid``; sum: ``Σce + Σzl``; none: ``ce + zl``.
        Gradients: ``dloss/dz_v = a·p_v - b·[v=t] - e·w_v`` with ``p = exp(z - lse)``,
        ``a = c·((1-ε)w[t] + εΣw/V) + c_z·2·scale·lse``, ``b = c·(1-ε)·w[t]``, ``e = c·ε/V``,
        chained through the temperature and the softcap; accumulated in the compute dtype
        (fp32; fp64 for fp64 inputs), not rounded to the input dtype.  ``filter_stats``: with
        ``filter_eps`` and a gradient, ``{"filter_eps", "blocks_total", "blocks_skipped"}``.
        ``plan``: the ``tiling.TrainingPlan`` the call ran (row blocks, chunks, the recompute's
        grid) with every buffer its kernel allocated (``plan.buffers``; ``plan.workspace_bytes``
        bytes besides the outputs, ``tiling.training_buffers``).

    Raises
    ------
    AclnnError 161001 (input, weight or target None) / 161002 (dtypes, shapes, ranges, targets,
    ``filter_eps`` not None/"auto"/(0, 1], or given in strict mode; ``precision`` not
    "accurate"/"fast", or "fast" in strict mode; NumPy arrays and torch tensors mixed) — every
    reason found in one error (``reasons``; ``param`` the first), as for the aclnn ops
    (``DECL``, ``ops/_opdef.execute``); nothing is computed.  361001: the backend is unavailable
    (``"acl"`` without a device; with one, ``"acl"`` runs the cpu kernel and warns once).
    """
    return execute(
        DECL,
        dict(
            input=input,
            weight=weight,
            target=target,
            bias=bias,
            ce_weight=ce_weight,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            softcap=softcap,
            temperature=temperature,
            lse_square_scale=lse_square_scale,
            vocab_start_index=vocab_start_index,
            vocab_size=vocab_size,
            return_grad=return_grad,
            grad_output=grad_output,
            lse=lse,
            combine=combine,
            filter_eps=filter_eps,
            accum_dtype=accum_dtype,
            return_entropy=return_entropy,
            grad_entropy=grad_entropy,
            z_mean=z_mean,
            precision=precision,
        ),
        options=options,
    )
