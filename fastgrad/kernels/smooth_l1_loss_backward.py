"""CPU kernel of ``smooth_l1_loss_backward`` (op_kernel layer of aclnnSmoothL1LossBackward).

One fused, parallel, single-pass elementwise kernel.  The plan (the op_host "tiling"): every
input is broadcast to the output shape *by strides* (0 on broadcast axes; nothing is
materialized), the axes are collapsed wherever all four operands are jointly contiguous, and
the work is cut into fixed tasks of at most ``CHUNK`` elements of the innermost axis.  An fp32
task walks its span with one of three loops: all unit strides (the common contiguous case),
``grad_out`` a broadcast scalar (the mean/sum case), or general strides.  A bf16 task with
unit-stride ``input``/``target`` runs the first two loops with the conversions fused (a shift
in, a rounding add out); fp16 (whose conversions are branchy) and strided bf16 tasks stage
sub-blocks of ``SUB`` elements through L1-resident fp32 scratch (widen, compute, round).
The span loops live in small ``@njit`` functions called from the parallel loops: a parfor
body compiles slowly, and this keeps the cold compile of both specializations short (the
figure: bench/results/README.md, "Measurements behind the source's choices").

Per element, in fp32 (the device's ``SmoothL1LossGradV2`` DAG, ``PromteT = float``)::

    d = input - target
    s = d * fp32(1/beta)       if not |d| >= beta'    (NaN stays NaN; -0 gives +0)
        (d > 0) - (d < 0)      otherwise              (sign, sign(0) = 0)
    grad_input = (s * grad_out) * scale               scale = fp32(1/N) for mean, else 1

where ``beta' = beta`` when ``grad_out`` has one element (the device's scalar DAG
``SmoothL1LossGradV2OpScalarDag``: ``>=``/``<=``) and ``beta' = nextafter(beta, inf)`` otherwise
(the tensor DAG ``SmoothL1LossGradV2OpDag`` compares strictly: at ``|d| == beta`` it gives
``d·fp32(1/beta)``, which is ``±(1 - 2**-24)`` for some beta, e.g. 1.7).  Source: ops-nn
``loss/smooth_l1_loss_grad_v2/op_kernel/arch35/smooth_l1_loss_grad_v2_dag.h`` and
``op_host/arch35/smooth_l1_loss_grad_v2_tiling.cpp:87-97`` (``doutIsScalar``).  Below
``beta = fp32(1e-6)`` the device's ``1/beta`` is NaN (``tiling.cpp:145``, :func:`inverse_beta`):
``0 <= beta < 1e-6`` gives NaN in the quadratic zone, as the device (docs/device_parity.md
rows 5f, 5a): at ``beta = 0`` that zone is ``d = ±0`` for a tensor ``grad_out`` (NaN) and
empty for a one-element one (``d = 0`` takes the sign branch: 0).

and one round-to-nearest-even to the output format.  16-bit data is read and written as
``uint16`` bit patterns (format code ``BF16``/``F16``), never widened as whole tensors.

Kernel specializations: one for fp32 operands, one for 16-bit operands (all inputs and the
output of one format).  Mixed input dtypes (promoted to fp32) widen the 16-bit inputs first,
and an ``out`` whose dtype differs from the promoted one is filled through a scratch array:
both are rare extension paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._jit import njit, pjit, prange
from ..dtypes import FLOAT32, code_of, from_f32, promote, storage_view, to_f32
from ._strided import strided_base as _base

OP = "smooth_l1_loss_backward"

#: Elements of the innermost axis handled by one task (fixed: results never depend on it).
CHUNK = 16384


# ----------------------------------------------------------------------------------------
# Element function and loops (inlined; ``code`` is a literal at every call site)
# ----------------------------------------------------------------------------------------


@njit(inline="always")
def _ld(a, i, code):
    if code == 0:
        return np.float32(a[i])
    return to_f32(a[i], code)


@njit(inline="always")
def _st(o, i, v, code):
    if code == 0:
        o[i] = v
    else:
        o[i] = from_f32(v, code)


@njit(inline="always")
def _elem(g, x, t, beta, inv, den, scale):
    d = x - t
    if abs(d) >= beta:  # ``beta`` here is the compare threshold (see ``run``)
        s = np.float32(d > np.float32(0)) - np.float32(d < np.float32(0))
    elif den > np.float32(0):  # 910B TBE: d / (β + 1e-6); a NaN d (the only one here at β = 0) gives 0 there
        s = d / den + np.float32(0.0) if beta > np.float32(0) else np.float32(0.0)
    else:  # |d| < beta, or d is NaN; + 0: the DAG's (pos + neg) + x·invβ turns -0 into +0
        s = d * inv + np.float32(0.0)
    return (s * g) * scale


@njit(inline="always")
def _span_contig(gb, go, gs, xb, xo, tb, to, ob, oo, m, code, beta, inv, den, scale):
    """input/target unit-stride, grad_out unit-stride (gs == 1) or a broadcast scalar (gs == 0)."""
    # Contiguous operands are sliced first: indexing a slice with the loop counter lets LLVM
    # drop Numba's negative-index wraparound and vectorize the loop.
    o = ob[oo : oo + m]
    x = xb[xo : xo + m]
    t = tb[to : to + m]
    if gs == 1:
        g = gb[go : go + m]
        for j in range(m):
            _st(o, j, _elem(_ld(g, j, code), _ld(x, j, code), _ld(t, j, code), beta, inv, den, scale), code)
    else:
        gv = _ld(gb, go, code)
        for j in range(m):
            _st(o, j, _elem(gv, _ld(x, j, code), _ld(t, j, code), beta, inv, den, scale), code)


@njit(inline="always")
def _span(gb, go, gs, xb, xo, xs, tb, to, ts, ob, oo, m, code, beta, inv, den, scale):
    if xs == 1 and ts == 1 and (gs == 1 or gs == 0):
        _span_contig(gb, go, gs, xb, xo, tb, to, ob, oo, m, code, beta, inv, den, scale)
    else:  # general strides (any sign); every index is a valid element, so non-negative
        o = ob[oo : oo + m]
        for j in range(m):
            _st(
                o,
                j,
                _elem(
                    _ld(gb, np.uint64(go + j * gs), code),
                    _ld(xb, np.uint64(xo + j * xs), code),
                    _ld(tb, np.uint64(to + j * ts), code),
                    beta,
                    inv,
                    den,
                    scale,
                ),
                code,
            )


@njit(inline="always")
def _task(task, nchunk, inner, shape, strides, offs):
    """Operand offsets and length of one task (row ``task // nchunk``, chunk ``task % nchunk``)."""
    nd = shape.shape[0]
    r = task // nchunk
    c = task - r * nchunk
    j0 = c * CHUNK
    m = min(inner, j0 + CHUNK) - j0
    go = offs[0]
    xo = offs[1]
    to = offs[2]
    rem = r
    for k in range(nd - 2, -1, -1):
        n = shape[k]
        q = rem // n
        i = rem - q * n
        rem = q
        go += i * strides[0, k]
        xo += i * strides[1, k]
        to += i * strides[2, k]
    go += j0 * strides[0, nd - 1]
    xo += j0 * strides[1, nd - 1]
    to += j0 * strides[2, nd - 1]
    return go, xo, to, r * inner + j0, m


@njit
def _f32_span(gb, go, gs, xb, xo, xs, tb, to, ts, ob, oo, m, beta, inv, den, scale):
    """One fp32 span (any strides)."""
    _span(gb, go, gs, xb, xo, xs, tb, to, ts, ob, oo, m, 0, beta, inv, den, scale)


@njit
def _bf16_contig(gb, go, gs, xb, xo, tb, to, ob, oo, m, beta, inv, den, scale):
    """One contiguous bf16 span, the conversions (a shift, a rounding add) fused in the loop."""
    _span_contig(gb, go, gs, xb, xo, tb, to, ob, oo, m, 1, beta, inv, den, scale)


@njit
def _widen_span(src, off, stride, m, code, dst):
    """dst[:m] = fp32 of the 16-bit elements src[off + j*stride] (format ``code``)."""
    if stride == 0:
        v = to_f32(src[off], code)
        for j in range(m):
            dst[j] = v
    elif stride == 1:
        s = src[off : off + m]
        if code == 1:
            for j in range(m):
                dst[j] = to_f32(s[j], 1)
        else:
            for j in range(m):
                dst[j] = to_f32(s[j], 2)
    elif code == 1:
        for j in range(m):
            dst[j] = to_f32(src[np.uint64(off + j * stride)], 1)
    else:
        for j in range(m):
            dst[j] = to_f32(src[np.uint64(off + j * stride)], 2)


@njit
def _narrow_span(src, m, code, dst, off):
    """dst[off:off+m] = 16-bit patterns (format ``code``, RNE) of src[:m]."""
    d = dst[off : off + m]
    if code == 1:
        for j in range(m):
            d[j] = from_f32(src[j], 1)
    else:
        for j in range(m):
            d[j] = from_f32(src[j], 2)


#: Sub-block of a task staged through fp32 scratch in the 16-bit kernel (L1-resident).
SUB = 2048


@njit
def _staged_span(gb, go, gs, xb, xo, xs, tb, to, ts, ob, oo, m, code, beta, inv, den, scale):
    """One 16-bit span through fp32 scratch: widen SUB elements of each input, compute, round."""
    gf = np.empty(SUB, np.float32)
    xf = np.empty(SUB, np.float32)
    tf = np.empty(SUB, np.float32)
    for j0 in range(0, m, SUB):
        n = min(SUB, m - j0)
        _widen_span(gb, go + j0 * gs, gs, n, code, gf)
        _widen_span(xb, xo + j0 * xs, xs, n, code, xf)
        _widen_span(tb, to + j0 * ts, ts, n, code, tf)
        g = gf[:n]
        x = xf[:n]
        t = tf[:n]
        for j in range(n):
            x[j] = _elem(g[j], x[j], t[j], beta, inv, den, scale)
        _narrow_span(xf, n, code, ob, oo + j0)


@njit(inline="always")
def _task_plan(shape, strides, size):
    """Innermost extent, chunks per row, task count and the three innermost strides."""
    nd = shape.shape[0]
    inner = shape[nd - 1]
    nchunk = (inner + CHUNK - 1) // CHUNK
    return (inner, nchunk, (size // inner) * nchunk, strides[0, nd - 1], strides[1, nd - 1], strides[2, nd - 1])


@pjit
def _sl1_f32(gb, xb, tb, ob, shape, strides, offs, beta, inv, den, scale):
    inner, nchunk, ntask, gs, xs, ts = _task_plan(shape, strides, ob.size)
    for task in prange(ntask):
        go, xo, to, oo, m = _task(task, nchunk, inner, shape, strides, offs)
        _f32_span(gb, go, gs, xb, xo, xs, tb, to, ts, ob, oo, m, beta, inv, den, scale)


@pjit
def _sl1_u16(gb, xb, tb, ob, shape, strides, offs, code, beta, inv, den, scale):
    inner, nchunk, ntask, gs, xs, ts = _task_plan(shape, strides, ob.size)
    for task in prange(ntask):
        go, xo, to, oo, m = _task(task, nchunk, inner, shape, strides, offs)
        if code == 1 and xs == 1 and ts == 1 and (gs == 1 or gs == 0):
            _bf16_contig(gb, go, gs, xb, xo, tb, to, ob, oo, m, beta, inv, den, scale)
        else:  # fp16 (branchy conversions) or strided bf16
            _staged_span(gb, go, gs, xb, xo, xs, tb, to, ts, ob, oo, m, code, beta, inv, den, scale)


# ----------------------------------------------------------------------------------------
# Plan (op_host tiling): strided operands, collapsed axes
# ----------------------------------------------------------------------------------------


def plan(shape: tuple[int, ...], operands: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Collapse ``shape`` for the given operand element strides (out is C-contiguous).

    Returns ``(shape, strides)`` as int64 arrays: size-1 axes dropped, adjacent axes merged
    where every operand (and the output) is contiguous across them; at least one axis.
    """
    dims = [k for k, n in enumerate(shape) if n != 1]
    if not dims:
        return np.ones(1, np.int64), np.zeros((len(operands), 1), np.int64)
    sh = [shape[k] for k in dims]
    st = [[s[k] for k in dims] for s in operands]
    out_st = [int(np.prod(sh[i + 1 :], dtype=np.int64)) for i in range(len(sh))]
    st.append(out_st)
    new_sh = [sh[-1]]
    new_st = [[s[-1]] for s in st]
    for i in range(len(sh) - 2, -1, -1):
        if all(s[i] == s_new[0] * new_sh[0] for s, s_new in zip(st, new_st)):
            new_sh[0] *= sh[i]
        else:
            new_sh.insert(0, sh[i])
            for s, s_new in zip(st, new_st):
                s_new.insert(0, s[i])
    return (
        np.array(new_sh, np.int64),
        np.array([s for s in new_st[:-1]], np.int64).reshape(len(operands), len(new_sh)),
    )


def run(
    grad_out: np.ndarray,
    input: np.ndarray,
    target: np.ndarray,
    beta: float,
    scale: float,
    out: np.ndarray,
    kernel: str = "dag",
) -> None:
    """Fill ``out`` (C-contiguous) from inputs that all have out's dtype family.

    ``kernel``: ``"dag"`` (the arch35 DAG: module docstring) or ``"tbe"`` (the 910B TBE kernel:
    ``|d| >= β`` gives ``sign(d)`` — ±1 at ``|d| == β`` — else ``d / fp32(β + 1e-6)``; a NaN d
    gives 0 at β = 0, NaN otherwise; one formula for tensor and scalar ``grad_out``)."""
    shape = out.shape
    bases = [_base(a, shape) for a in (grad_out, input, target)]
    sh, st = plan(shape, [b[2] for b in bases])
    offs = np.array([b[1] for b in bases], np.int64)
    b32 = np.float32(beta)
    sc = np.float32(scale)
    ob = storage_view(out).reshape(-1)
    if kernel == "tbe":
        # TBE smooth_l1_loss_grad_v2_compute: temp = vdiv(x, vadds(sigma, 1e-6)) in fp32;
        # smooth1 = vcmpsel(x, -sigma, 'le', -1, 0), smooth2 = vcmpsel(x, sigma, 'ge', 1, 0),
        # smooth3 = vcmpsel(|x|, sigma, 'lt', temp, 0) (NaN x replaced by 0 for the compares)
        den = np.float32(b32 + np.float32(1e-6))
        z = np.float32(0.0)
        if out.dtype == FLOAT32:
            _sl1_f32(bases[0][0], bases[1][0], bases[2][0], ob, sh, st, offs, b32, z, den, sc)
        else:
            _sl1_u16(bases[0][0], bases[1][0], bases[2][0], ob, sh, st, offs, code_of(out.dtype), b32, z, den, sc)
        return
    den = np.float32(0.0)
    # compare threshold: a tensor grad_out takes the strict DAG (|d| > beta), a 1-element one
    # the scalar DAG (|d| >= beta); |d| > beta  <=>  |d| >= nextafter(beta) (NaN for beta = inf)
    bcmp = b32
    if grad_out.size != 1:
        bcmp = np.nextafter(b32, np.float32(np.inf)) if np.isfinite(b32) else np.float32(np.nan)
    inv = inverse_beta(b32)
    if out.dtype == FLOAT32:
        _sl1_f32(bases[0][0], bases[1][0], bases[2][0], ob, sh, st, offs, bcmp, inv, den, sc)
    else:
        _sl1_u16(bases[0][0], bases[1][0], bases[2][0], ob, sh, st, offs, code_of(out.dtype), bcmp, inv, den, sc)


#: the arch35 tiling's threshold below which ``1/beta`` is NaN (``fabsf(sigma) < 1e-6f``)
INV_BETA_MIN = np.float32(1e-6)


def inverse_beta(b32: np.float32) -> np.float32:
    """The 950 tiling's fp32 constant ``invertSigma`` (ops-nn ``loss/smooth_l1_loss_grad_v2/
    op_host/arch35/smooth_l1_loss_grad_v2_tiling.cpp:145``): ``fabsf(sigma) < 1e-6f ? NAN :
    1 / sigma`` — NaN for ``0 <= beta < fp32(1e-6)`` (every fp32-subnormal beta and ``beta = 0``
    included), so the quadratic zone's ``d·invβ`` is NaN there (docs/device_parity.md row 5f).
    At ``beta = 0`` the zone is ``d = ±0`` for the tensor DAG (``|d| > 0`` fails: NaN, as the
    device) and empty for the scalar DAG (``|d| >= 0``: ``1 + (-1) + 0 = 0``), row 5a."""
    if abs(b32) < INV_BETA_MIN:
        return np.float32(np.nan)
    return np.float32(np.float32(1.0) / b32)


def smooth_l1_loss_backward(
    *,
    grad_out: np.ndarray,
    input: np.ndarray,
    target: np.ndarray,
    reduction: str,
    beta: float,
    out: np.ndarray,
    smooth_l1_kernel: str = "dag",
) -> np.ndarray:
    """Numba implementation (see module docstring); fills ``out`` completely.  ``smooth_l1_kernel``
    (from the op's SoC profile): ``"tbe"`` (A2/A3) or ``"dag"`` (Ascend 950), see :func:`run`."""
    if out.size == 0:
        return out
    scale = 1.0 / out.size if reduction == "mean" else 1.0
    pdt = promote(grad_out.dtype, input.dtype, target.dtype)
    g, x, t = grad_out, input, target
    if any(a.dtype != pdt for a in (g, x, t)):  # mixed inputs: promoted to fp32 (exact widening)
        g, x, t = (a.astype(pdt) for a in (g, x, t))
    if out.dtype == pdt:
        run(g, x, t, beta, scale, out, smooth_l1_kernel)
    else:  # out= of another float dtype: compute in the promoted dtype, then cast (device)
        tmp = np.empty(out.shape, pdt)
        run(g, x, t, beta, scale, tmp, smooth_l1_kernel)
        out[...] = tmp.astype(out.dtype)
    return out
