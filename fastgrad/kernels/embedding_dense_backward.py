"""CPU kernel of ``embedding_dense_backward`` (op_kernel layer of aclnnEmbeddingDenseBackward).

Plan (the op_host "tiling"), O(N + num_weights·D) work, no atomics:

1. Indices are flattened and cast to int64 (floats truncated toward zero, as the device's
   Cast; bool as 0/1).
2. A serial counting sort buckets the N token positions by output row, keeping index order
   inside each bucket (``counts``, ``starts``, ``order``).  O(N + num_weights).
3. The whole output is zero-filled by one ``memset`` call per thread on equal contiguous
   pieces: for a large table libc then takes its streaming-store path (no
   read-for-ownership), several times faster than zeroing the untouched rows run by run
   (runs are short when indices are spread, below libc's threshold) or a store loop (figures
   in bench/results/README.md, "Measurements behind the source's choices").  The indexed rows
   are thus written twice, a small price (they are a fraction of the table for real
   vocabularies).
4. A second parallel pass over fixed blocks of ``ROWS`` output rows writes each indexed row
   (other than ``padding_idx``) once: accumulated in fp32 over its bucket in index order (in the
   fp32 output row itself, or an fp32 scratch row for 16-bit whose last addition is fused
   with the scaling and the rounding), multiplied by the fp32 reciprocal ``1.0f / count`` when
   ``scale_grad_by_freq`` (the device's ``Muls``, ``embedding_dense_grad_v2_scale.h:100-104``),
   and rounded once.

Each row is produced by one thread with a fixed sequence of operations, so results are
bitwise identical for any thread count.

**Deterministic mode** (``deterministic_cores > 0``: the op layer passes the SoC's AI-vector-core
count when ``fg.deterministic()`` is on and the device's result is fp32): each row is summed in
the order of the A2/A3 ``EmbeddingDenseGradV2DeterministKernel`` (ops-nn e5c3fa9,
``index/embedding_dense_grad_v2/op_kernel/embedding_dense_grad_v2_determinist.h``).  The stable
sort of the indices is split over ``cores = min(aiv, N)`` (``min(aiv, num_weights, N)`` with
``scale_grad_by_freq``) in contiguous ranges, the first ``N % cores`` one row longer
(``op_host/embedding_dense_grad_v2_tiling.cpp:191-197,298-300``; kernel :75-115).  A row's run
of sorted positions ``[s, e)`` belongs to the core whose range holds ``s``: that core walks its
range backwards (:58-73; a later core stops at the run it shares with the core before,
:169-182), then continues forward past its end while the index repeats (:270-284).  Each walk
adds the grad rows into a UB accumulator from +0 (:233-245) and atomically adds it to the output
row (fp32, from the zeroed output, :247-268) every ``LIMIT_COUNT_NUM = 10`` rows
(``embedding_dense_grad_v2.h:26``) and at the walk's end (:207-217).  Kernel specializations: fp32 grad/out, and 16-bit
grad/out as ``uint16`` bit patterns with a format code.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import get_num_threads, types
from numba.core import cgutils
from numba.extending import intrinsic

from .._jit import njit, pjit, prange
from ..dtypes import BFLOAT16, FLOAT32, code_of, from_f32, from_float32, storage_view, to_f32, to_float32
from ._strided import strided_base as _base

OP = "embedding_dense_backward"

#: Output rows per parallel block (fixed; results never depend on it).
ROWS = 64


@intrinsic
def _zero_fill(typingctx, arr, start, count):
    """Zero ``count`` elements of the 1-D array ``arr`` from element ``start`` (llvm.memset).

    libc's memset zero-fills large runs far faster than a store loop (no read-for-ownership).
    """
    if not isinstance(arr, types.Array) or arr.ndim != 1:
        return None
    sig = types.void(arr, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        a, s, c = args
        ary = context.make_array(signature.args[0])(context, builder, a)
        ptr = builder.gep(ary.data, [s])
        isz = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        nbytes = builder.mul(c, ir.Constant(ir.IntType(64), isz))
        cgutils.memset(builder, ptr, nbytes, 0)
        return context.get_dummy_value()

    return sig, codegen


@njit
def _bucket(idx, num_weights):
    """Counting sort of token positions by row: (counts, starts, order); order keeps index order."""
    n = idx.size
    counts = np.zeros(num_weights, np.int64)
    for i in range(n):
        k = idx[i]
        if k >= 0 and k < num_weights:
            counts[k] += 1
    starts = np.empty(num_weights + 1, np.int64)
    s = 0
    for k in range(num_weights):
        starts[k] = s
        s += counts[k]
    starts[num_weights] = s
    pos = starts[:num_weights].copy()
    order = np.empty(s, np.int64)
    for i in range(n):
        k = idx[i]
        if k >= 0 and k < num_weights:
            order[pos[k]] = i
            pos[k] += 1
    return counts, starts, order


@njit
def _rows_f32(b, gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob):
    """fp32: the indexed rows among output rows [b*ROWS, (b+1)*ROWS), summed in place."""
    for k in range(b * ROWS, min(counts.size, (b + 1) * ROWS)):
        c = counts[k]
        if c == 0 or k == padding_idx:
            continue
        row = ob[k * d : (k + 1) * d]
        i = order[starts[k]]
        g = gb[goff + i * grs : goff + i * grs + d]
        for j in range(d):
            row[j] = np.float32(0.0) + g[j]  # +0 start: a -0 sum gives +0, as the device
        for p in range(starts[k] + 1, starts[k + 1]):
            i = order[p]
            g = gb[goff + i * grs : goff + i * grs + d]
            for j in range(d):
                row[j] += g[j]
        if scale:  # the device's Muls by reciScale = 1.0f / count (embedding_dense_grad_v2_scale.h:100-104)
            rc = np.float32(1.0) / np.float32(c)
            for j in range(d):
                row[j] = row[j] * rc


@njit(inline="always")
def _row16(gb, goff, grs, d, order, p0, p1, acc, row, scale, c, code):
    """16-bit row: all tokens but the last summed in fp32 ``acc`` (from +0); the last one
    added in the same loop that divides and rounds into ``row`` (one pass fewer)."""
    for j in range(d):
        acc[j] = np.float32(0.0)
    for p in range(p0, p1 - 1):
        i = order[p]
        g = gb[goff + i * grs : goff + i * grs + d]
        for j in range(d):
            acc[j] += to_f32(g[j], code)
    i = order[p1 - 1]
    g = gb[goff + i * grs : goff + i * grs + d]
    if scale:  # times the fp32 reciprocal, as the device
        rc = np.float32(1.0) / np.float32(c)
        for j in range(d):
            row[j] = from_f32((acc[j] + to_f32(g[j], code)) * rc, code)
    else:
        for j in range(d):
            row[j] = from_f32(acc[j] + to_f32(g[j], code), code)


@njit
def _rows_16(b, gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob, acc, code):
    """16-bit: the indexed rows among output rows [b*ROWS, (b+1)*ROWS)."""
    for k in range(b * ROWS, min(counts.size, (b + 1) * ROWS)):
        c = counts[k]
        if c == 0 or k == padding_idx:
            continue
        row = ob[k * d : (k + 1) * d]
        if code == 1:
            _row16(gb, goff, grs, d, order, starts[k], starts[k + 1], acc, row, scale, c, 1)
        else:
            _row16(gb, goff, grs, d, order, starts[k], starts[k + 1], acc, row, scale, c, 2)


@njit(inline="always")
def _zero_parts(ob, nparts, p):
    """Zero piece ``p`` of ``nparts`` equal contiguous pieces of the output (one memset)."""
    n = ob.size
    per = (n + nparts - 1) // nparts
    s = p * per
    if s < n:
        # an @intrinsic's typing context is implicit: mypy sees the Python signature (one argument short)
        _zero_fill(ob, np.int64(s), np.int64(min(per, n - s)))  # type: ignore[call-arg]


@pjit
def _emb_f32(gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob, nparts):
    for p in prange(nparts):  # phase 1: zero-fill
        _zero_parts(ob, nparts, p)
    nblk = (counts.size + ROWS - 1) // ROWS
    for b in prange(nblk):  # phase 2: the indexed rows, in fixed blocks of rows
        _rows_f32(np.int64(b), gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob)


@pjit
def _emb_16(gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob, code, nparts):
    for p in prange(nparts):  # phase 1: zero-fill
        _zero_parts(ob, nparts, p)
    nblk = (counts.size + ROWS - 1) // ROWS
    for b in prange(nblk):  # phase 2: the indexed rows, in fixed blocks of rows
        acc = np.empty(d, np.float32)
        _rows_16(np.int64(b), gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob, acc, code)


#: rows a deterministic-kernel UB accumulator takes before its atomic add (embedding_dense_grad_v2.h:26)
LIMIT_COUNT_NUM = 10


@njit
def _det_walk(gb, goff, grs, d, order, p0, p1, step, acc, row):
    """One walk of the deterministic kernel over sorted positions p0, p0+step, ... (not p1):
    UB partials from +0, flushed into ``row`` every LIMIT_COUNT_NUM rows and at the end."""
    cnt = 0
    for j in range(d):
        acc[j] = np.float32(0.0)
    p = p0
    while p != p1:
        i = order[p]
        g = gb[goff + i * grs : goff + i * grs + d]
        for j in range(d):
            acc[j] = acc[j] + g[j]
        cnt += 1
        if cnt == LIMIT_COUNT_NUM:
            for j in range(d):
                row[j] = row[j] + acc[j]
                acc[j] = np.float32(0.0)
            cnt = 0
        p += step
    if cnt:
        for j in range(d):
            row[j] = row[j] + acc[j]


@njit
def _rows_det(b, gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob, acc, cores):
    """fp32, deterministic kernel's order: the indexed rows among [b*ROWS, (b+1)*ROWS)."""
    n = starts[counts.size]
    tail = n // cores
    former = tail + 1
    rep = n % cores
    for k in range(b * ROWS, min(counts.size, (b + 1) * ROWS)):
        c = counts[k]
        if c == 0 or k == padding_idx:
            continue
        s, e = starts[k], starts[k + 1]
        if s < former * rep:  # the core whose range holds s, and that range's end
            core = s // former
            end = (core + 1) * former
        else:
            core = rep + (s - former * rep) // tail
            end = former * rep + (core - rep + 1) * tail
        row = ob[k * d : (k + 1) * d]
        for j in range(d):
            row[j] = np.float32(0.0)
        _det_walk(gb, goff, grs, d, order, min(e, end) - 1, s - 1, -1, acc, row)  # backwards
        if e > end:
            _det_walk(gb, goff, grs, d, order, end, e, 1, acc, row)  # past the range's end
        if scale:
            rc = np.float32(1.0) / np.float32(c)
            for j in range(d):
                row[j] = row[j] * rc


@pjit
def _emb_det(gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob, cores, nparts):
    for p in prange(nparts):  # phase 1: zero-fill
        _zero_parts(ob, nparts, p)
    nblk = (counts.size + ROWS - 1) // ROWS
    for b in prange(nblk):
        acc = np.empty(d, np.float32)
        _rows_det(np.int64(b), gb, goff, grs, d, counts, starts, order, padding_idx, scale, ob, acc, cores)


def index_int64(indices: np.ndarray) -> np.ndarray:
    """Flat C-contiguous int64 copy of ``indices``: floats truncated toward zero, bool as 0/1."""
    a = np.asarray(indices).reshape(-1)
    if a.dtype == BFLOAT16 or a.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            return np.trunc(a.astype(np.float64)).astype(np.int64)
    return np.ascontiguousarray(a, dtype=np.int64)


def embedding_dense_backward(
    *,
    grad: np.ndarray,
    indices: np.ndarray,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
    out: np.ndarray,
    result_dtype: npt.DTypeLike | None = None,
    deterministic_cores: int = 0,
) -> np.ndarray:
    """Numba implementation (see module docstring); fills ``out`` [num_weights, D] completely.

    ``result_dtype`` (the op's choice, from the SoC profile): the dtype of the device's result
    before its final Cast to ``out``'s dtype; None means ``out``'s dtype.
    ``deterministic_cores`` (the op's choice): > 0 sums an fp32 result in the order of the
    device's deterministic kernel over that many AI vector cores; 0: fastgrad's index order."""
    nw, d = out.shape
    if out.size == 0:
        return out
    rdt = out.dtype if result_dtype is None else np.dtype(result_dtype)
    if rdt != grad.dtype and rdt == FLOAT32:  # the fp32 sums of a widened 16-bit grad (exact widening)
        grad = to_float32(grad)
    if rdt != out.dtype:  # the result in rdt, then one cast to out's dtype (op_api :407)
        tmp = np.empty(out.shape, rdt)
        embedding_dense_backward(
            grad=grad,
            indices=indices,
            num_weights=num_weights,
            padding_idx=padding_idx,
            scale_grad_by_freq=scale_grad_by_freq,
            out=tmp,
            deterministic_cores=deterministic_cores,
        )
        out[...] = from_float32(to_float32(tmp), out.dtype)
        return out
    idx = index_int64(indices) if grad.size else np.zeros(0, np.int64)
    counts, starts, order = _bucket(idx, nw)
    # grad as a read-only 1-D buffer + row offset/stride (no copy unless the last axis is
    # strided); a dummy one-row buffer when there is no token (same Numba type either way)
    g2 = grad.reshape(idx.size, d) if grad.size else np.zeros((1, d), grad.dtype)
    if g2.strides[1] != g2.itemsize:
        g2 = np.ascontiguousarray(g2)
    gb, goff, (grs, _) = _base(g2, g2.shape)
    ob = storage_view(out).reshape(-1)
    pad = int(padding_idx) if 0 <= padding_idx < nw else -1
    # zero-fill pieces: one per thread (the row results never depend on it), each as large
    # as possible so that libc's memset takes its streaming-store path
    scale = bool(scale_grad_by_freq)
    if deterministic_cores > 0 and out.dtype == FLOAT32 and idx.size:
        n_rows = int(idx.size)
        cores = min(int(deterministic_cores), n_rows, nw) if scale else min(int(deterministic_cores), n_rows)
        _emb_det(gb, goff, grs, d, counts, starts, order, pad, scale, ob, np.int64(cores), get_num_threads())
    elif out.dtype == FLOAT32:
        _emb_f32(gb, goff, grs, d, counts, starts, order, pad, scale, ob, get_num_threads())
    else:
        _emb_16(gb, goff, grs, d, counts, starts, order, pad, scale, ob, code_of(out.dtype), get_num_threads())
    return out
