"""op: ``linear_cross_entropy`` — the training LM-head loss (not an aclnn op; docs/spec.md "Training loss").

Validates its arguments (``AclnnError`` 161001/161002), makes the row-block plan from the shapes
and the memory budget (never from BT's parity with the thread count), computes the per-row
coefficients of the gradient, calls the backend, and forms the per-row and reduced losses from
the kernel's row statistics.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import _config, _outcache, arrays, tiling
from .. import dtypes as D
from .._config import is_strict
from ..arrays import ArrayLike
from ..errors import AclnnError, invalid
from ._engines import gemm_choice

OP = "linear_cross_entropy"

#: vocabulary columns per GEMM chunk inside a row block
V_CHUNK = 8192
_FLOATS = (D.BFLOAT16, D.FLOAT16, D.FLOAT32, D.FLOAT64)
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def parse_float(value, name: str, op: str) -> float:
    if isinstance(value, (bool, np.bool_)) or value is None:
        raise invalid(name, "a real number", repr(value), op)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (numbers.Real, np.floating, np.integer)):
        return float(value)
    raise invalid(name, "a real number", repr(value), op)


def parse_int(value, name: str, op: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise invalid(name, "an integer", repr(value), op)
    v = int(value)
    if not -(2**63) <= v < 2**63:
        raise invalid(name, "an integer within int64", v, op)
    return v


def parse_reduction(reduction, op: str) -> str:
    if isinstance(reduction, str) and reduction.strip().lower() in ("none", "mean", "sum"):
        return reduction.strip().lower()
    if isinstance(reduction, numbers.Integral) and not isinstance(reduction, bool) and 0 <= int(reduction) <= 2:
        return ("none", "mean", "sum")[int(reduction)]
    raise invalid("reduction", "'mean' | 'sum' | 'none' (or 1 | 2 | 0)", repr(reduction), op)


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


#: the backends whose missing implementation was reported (once per process each)
_FALLBACK_WARNED: set[str] = set()


def _impl() -> Callable:
    """The selected backend's implementation: ``"cpu"`` the Numba kernel, ``"reference"`` the
    float64 golden (``fastgrad/reference/linear_cross_entropy.py``).  A backend without one (the
    ``"acl"`` device backend: this is a training tool, not an aclnn op) runs the cpu kernel and
    says so with a ``RuntimeWarning``, once per process and backend.  An unknown or unavailable
    backend raises ``AclnnError`` 361001, as for every op."""
    import warnings

    from ..backends import dispatch, get_backend

    name = get_backend()
    try:
        return dispatch(OP, name)
    except AclnnError:
        if name not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(name)
            warnings.warn(
                f"{OP} has no {name!r} implementation (not an aclnn op): ran the 'cpu' kernel",
                RuntimeWarning,
                stacklevel=3,
            )
        return dispatch(OP, "cpu")


def _opt_float(x, name):
    if x is None:
        return None
    return parse_float(x, name, OP)


def parse_filter_eps(value, dtype, op: str = OP) -> float | None:
    """``filter_eps``: None (off), "auto" (the dtype's machine epsilon / 32, as CCE's and the
    FLCE grad's) or a number in (0, 1].  Strict mode rejects anything but None (161002)."""
    from .fused_linear_cross_entropy_loss_grad import FILTER_EPS_VALUES, filter_eps_value

    if value is None:
        return None
    if is_strict():
        raise invalid("filter_eps", "None (the device has no gradient filtering; strict mode)", repr(value), op)
    try:
        return filter_eps_value(value, dtype)
    except ValueError:
        raise invalid("filter_eps", FILTER_EPS_VALUES, repr(value), op) from None


def round_grad(grad: np.ndarray, dtype: Any, scale: float | None = None) -> np.ndarray:
    """A 2-D fp32 gradient rounded to the 16-bit ``dtype`` (bf16 or fp16; RNE, bitwise
    ``ml_dtypes``), times ``scale`` in fp32 first when given (two roundings: PyTorch's
    ``(g * s).to(dtype)``), on a recycled block of the output cache (``fastgrad._outcache``).

    The fused training step's ``grad_weight``: the row blocks' freed logits scratch is such a
    block (``_config.workspace_floor``), so the rounded gradient takes no new memory.  Raises
    ``ValueError`` for another shape or dtype."""
    from ..kernels._linear import narrow  # validates: 2-D float32 grad, a bf16/fp16 dtype

    return narrow(grad, _outcache.empty(grad.shape, np.dtype(dtype)), scale)


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

    Raises
    ------
    AclnnError 161001 (input, weight or target None) / 161002 (dtypes, shapes, ranges, targets,
    ``filter_eps`` not None/"auto"/(0, 1], or given in strict mode; ``precision`` not
    "accurate"/"fast", or "fast" in strict mode).
    """
    st = _config.settings()  # every setting, read once for this call
    kind = arrays.kind_of(input, weight, target)
    x = arrays.as_numpy(input, "input", op=OP)
    w = arrays.as_numpy(weight, "weight", op=OP)
    t = arrays.as_numpy(target, "target", op=OP)
    b = arrays.as_numpy(bias, "bias", required=False, op=OP)
    cw = arrays.as_numpy(ce_weight, "ce_weight", required=False, op=OP)
    arrays.check_dtype(x, "input", _FLOATS, OP)
    if w.dtype != x.dtype:
        raise invalid("weight", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(w.dtype), OP)
    arrays.check_dtype(t, "target", INDEX_DTYPES, OP)
    arrays.check_ndim(x, "input", 2, OP)
    arrays.check_ndim(w, "weight", 2, OP)
    arrays.check_ndim(t, "target", 1, OP)
    BT, H = x.shape
    K = w.shape[0]
    if w.shape[1] != H:
        raise invalid("weight", f"weight.shape[1] == input.shape[1] == {H}", f"shape {w.shape}", OP)
    if t.shape[0] != BT:
        raise invalid("target", f"target.shape[0] == input.shape[0] == {BT}", f"shape {t.shape}", OP)
    if b is not None:
        if b.dtype != x.dtype:
            raise invalid("bias", f"the dtype of input ({D.dtype_name(x.dtype)})", D.dtype_name(b.dtype), OP)
        arrays.check_shape(b, "bias", (K,), OP)
    start = parse_int(vocab_start_index, "vocab_start_index", OP)
    V = K if vocab_size is None else parse_int(vocab_size, "vocab_size", OP)
    if start < 0 or start + K > V:
        raise invalid("vocab_start_index", f"a shard [start, start + {K}) inside [0, vocab_size={V})", start, OP)
    if cw is not None:
        arrays.check_dtype(cw, "ce_weight", _FLOATS, OP)
        arrays.check_shape(cw, "ce_weight", (V,), OP)
    ign = parse_int(ignore_index, "ignore_index", OP)
    red = parse_reduction(reduction, OP)
    eps = parse_float(label_smoothing, "label_smoothing", OP)
    if not 0.0 <= eps <= 1.0:
        raise invalid("label_smoothing", "a float in [0, 1]", eps, OP)
    cap = _opt_float(softcap, "softcap")
    if cap is not None and not (cap > 0 and math.isfinite(cap)):
        raise invalid("softcap", "a finite float > 0 or None", cap, OP)
    temp = parse_float(temperature, "temperature", OP)
    if not (temp > 0 and math.isfinite(temp)):
        raise invalid("temperature", "a finite float > 0", temp, OP)
    zsc = parse_float(lse_square_scale, "lse_square_scale", OP)
    if not (zsc >= 0 and math.isfinite(zsc)):
        raise invalid("lse_square_scale", "a finite float >= 0", zsc, OP)
    if isinstance(return_grad, (bool, np.bool_)):
        need: tuple[bool, ...] = (bool(return_grad),) * 3
    elif isinstance(return_grad, (tuple, list)) and len(return_grad) == 3:
        need = tuple(bool(v) for v in return_grad)
    else:
        raise invalid("return_grad", "a bool or a (input, weight, bias) triple of bools", repr(return_grad), OP)
    need = (need[0], need[1], need[2] and b is not None)
    if combine is not None and not callable(combine):
        raise invalid("combine", "a callable or None", type(combine).__name__, OP)
    feps = parse_filter_eps(filter_eps, x.dtype)
    if precision not in ("accurate", "fast"):
        raise invalid("precision", "'accurate' or 'fast'", repr(precision), OP)
    if precision == "fast" and st.strict:
        raise invalid("precision", "'accurate' (the device rounds no gradient this way; strict mode)", "'fast'", OP)
    if not isinstance(return_entropy, (bool, np.bool_)):
        raise invalid("return_entropy", "a bool", repr(return_entropy), OP)
    if grad_entropy is not None and feps is not None:
        raise invalid("filter_eps", "None with grad_entropy (the filter is on the cross-entropy term)", feps, OP)

    cdt = np.float64 if x.dtype == D.FLOAT64 else np.float32
    gw_dt = np.dtype(cdt)
    if accum_dtype is not None:
        try:
            gw_dt = D.parse_dtype(accum_dtype)
        except Exception:
            raise invalid("accum_dtype", "None or a dtype", repr(accum_dtype), OP) from None
        if gw_dt not in (np.dtype(cdt), np.dtype(x.dtype)):
            allowed = " / ".join(sorted({D.dtype_name(cdt), D.dtype_name(x.dtype)}))
            raise invalid("accum_dtype", f"None or {allowed}", D.dtype_name(gw_dt), OP)
    tl = np.asarray(t).astype(np.int64, copy=False)
    valid = tl != ign
    bad = valid & ((tl < 0) | (tl >= V))
    if bad.any():
        first = int(tl[np.flatnonzero(bad)[0]])
        raise invalid(
            "target", f"class ids in [0, {V}) or ignore_index ({ign})", f"Target {first} is out of bounds", OP
        )
    owned = valid & (tl >= start) & (tl < start + K)
    tcol = np.where(owned, tl - start, -1).astype(np.int64)
    n_valid = int(valid.sum())
    cw64 = None if cw is None else np.asarray(cw, dtype=np.float64)
    if cw64 is None:
        wt = valid.astype(np.float64)
        wsum_all = float(V)
        cw_local = None
    else:
        wt = np.where(valid, cw64[np.where(valid, tl, 0)], 0.0)
        wsum_all = float(cw64.sum())
        cw_local = np.ascontiguousarray(cw64[start : start + K])
    weight_sum = float(wt.sum())

    recompute = lse is not None
    want_grad = any(need)
    coef_ce = coef_z = coef_h = None
    want = () if red != "none" else (BT,)
    if want_grad:

        def upstream(g, name):
            a = np.asarray(arrays.as_numpy(g, name, op=OP), dtype=np.float64)
            if a.shape != want:
                raise invalid(name, f"shape {want}", f"shape {a.shape}", OP)
            return a

        if grad_output is None:
            go = np.float64(1.0) if red != "none" else np.ones(BT)
        else:
            go = upstream(grad_output, "grad_output")
        gh = None if grad_entropy is None else upstream(grad_entropy, "grad_entropy")

        def per_row(g, denom):
            """The upstream gradient on each valid row: divided by ``denom`` for mean."""
            if red == "mean":
                g = g / denom if denom else g * np.inf
            return np.where(valid, g, 0.0)

        with np.errstate(divide="ignore", invalid="ignore"):
            coef_ce = per_row(go, weight_sum)
            coef_z = per_row(go, n_valid) if zsc else np.zeros(BT)  # z-loss: mean over the rows
            coef_h = None if gh is None else per_row(gh, n_valid)  # entropy: likewise
    if recompute:
        lse_a = np.asarray(arrays.as_numpy(lse, "lse", op=OP))
        if lse_a.shape != (BT,):
            raise invalid("lse", f"shape ({BT},)", f"shape {lse_a.shape}", OP)
        if coef_h is not None:
            if z_mean is None:
                raise invalid("z_mean", "the saved z_mean with grad_entropy and lse", None, OP)
            zm_a = np.asarray(arrays.as_numpy(z_mean, "z_mean", op=OP))
            if zm_a.shape != (BT,):
                raise invalid("z_mean", f"shape ({BT},)", f"shape {zm_a.shape}", OP)

    params = {
        "softcap": cap,
        "temperature": temp,
        "eps": eps,
        "eps_over_V": eps / V if V else 0.0,
        "eps_wsum_over_V": eps * wsum_all / V if V else 0.0,
        "z_scale2": 2.0 * zsc,
        "need_zsum": eps != 0.0 and not recompute,
        "vocab_start_index": start,
        "filter_eps": feps,
        "round_grad": precision == "fast",
        "filter_rows": tiling.FILTER_ROWS,
        "filter_cols": tiling.FILTER_COLS,
        # the GEMMs, chosen once from the settings (the kernel reads none): ops/_engines.py
        "gemm": gemm_choice(x.dtype, st),
    }
    fstats: dict | None = {} if (feps is not None and want_grad) else None
    out: dict = {
        "lse": None if recompute else np.empty(BT, cdt),
        "z_target": None if recompute else np.empty(BT, cdt),
        "z_sum": None if recompute else np.empty(BT, cdt),
        "argmax": None if recompute else np.empty(BT, np.int64),
        "z_mean": np.empty(BT, cdt) if (return_entropy and not recompute) else None,
        "entropy": np.empty(BT, np.float64) if (return_entropy and not recompute) else None,
        # the gradients on recycled memory (a training loop calls this with the same shapes
        # every step: no fresh pages, whose clearing costs a pass each)
        "grad_input": _outcache.empty((BT, H), cdt) if need[0] else None,
        "grad_weight": _outcache.empty((K, H), gw_dt) if need[1] else None,
        "grad_bias": np.empty(K, cdt) if need[2] else None,
        "filter_stats": fstats,
    }
    # the plan (tiling.plan_training_loss): row blocks from the global V and the budget, chunks,
    # the vocabulary-major recompute, whether the weight is widened once, and every buffer the
    # kernel takes (tiling.training_buffers)
    logits16 = cdt == np.float32 and x.dtype == D.BFLOAT16 and w.dtype == D.BFLOAT16 and bool(params["gemm"].logits16)
    plan = tiling.plan_training_loss(
        BT,
        K,
        max(V, 1),
        H,
        itemsize=np.dtype(cdt).itemsize,
        widen=w.dtype != cdt,
        want_grad=any(need),
        recompute=recompute,
        filtered=params.get("filter_eps") is not None,
        logits16=logits16,
        v_chunk=V_CHUNK,
        budget_bytes=st.workspace_bytes,
        grads=(need[0], need[1], need[2]),
        accum16=gw_dt != np.dtype(cdt),
        fast=precision == "fast",
        a_form=params["gemm"].a_form,
    )
    _impl()(
        input=x,
        weight=w,
        target_cols=tcol,
        bias=b,
        class_weight=cw_local,
        target_weight=wt,
        coef_ce=coef_ce,
        coef_z=coef_z,
        coef_h=coef_h,
        z_mean=zm_a if (recompute and coef_h is not None) else None,
        params=params,
        plan=plan,
        lse=None if not recompute else lse_a,
        combine=combine,
        out=out,
    )

    wrap = lambda a: arrays.wrap(a, kind)  # noqa: E731
    grads = (wrap(out["grad_input"]), wrap(out["grad_weight"]), wrap(out["grad_bias"]))
    if fstats is not None:
        fstats = {
            "filter_eps": feps,
            "blocks_total": int(fstats.get("blocks_total", 0)),
            "blocks_skipped": int(fstats.get("blocks_skipped", 0)),
        }
    if recompute:
        return LinearCrossEntropyResult(None, None, None, None, None, *grads, n_valid, weight_sum, fstats)

    lse_r = out["lse"].astype(np.float64)
    zt = out["z_target"].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        ce = wt * (1.0 - eps) * (lse_r - zt)
        if eps:
            ce = ce + np.where(valid, (eps / V) * (wsum_all * lse_r - out["z_sum"].astype(np.float64)), 0.0)
        ce = np.where(valid, ce, 0.0)
        zl = np.where(valid, zsc * lse_r * lse_r, 0.0) if zsc else np.zeros(BT)
    am = out["argmax"]
    hit = (valid & (am == tl)).astype(np.float64)
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
    )
