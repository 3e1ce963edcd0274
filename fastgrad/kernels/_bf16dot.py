"""Exact-product bf16 GEMMs on x86-64 CPUs with AVX2 + FMA or AVX-512: the logits ``X · Wᵀ``,
and the FLCE grad's ``g · W`` and ``gᵀ · X`` where ``g`` is rounded to bf16 by the op's contract.

When ``X`` and ``W`` are bf16, every product ``x·w`` is exact in fp32 (8 + 8 significant bits),
so the logits GEMM needs no fp32 operands: ``vdpbf16ps`` multiplies pairs of bf16 values and
accumulates them into fp32 lanes, at twice the rate of an fp32 FMA on the same vector width
(on a Zen 4 EPYC about twice OpenBLAS's sgemm and as fast as oneDNN's bf16 GEMM, whose output
is rounded to bf16; figures in bench/results/README.md, "Measurements behind the source's
choices").  The result is an fp32
GEMM of the bf16 operands: each output summed in fp32 in a fixed order (over ``k`` pairs),
independent of the tiling, so the forward and the backward's recompute see the same logits
bitwise, at any thread count.  The instruction treats bf16 subnormals (|x| < 2⁻¹²⁶) as zero and
flushes subnormal sums to zero (Intel SDM, VDPBF16PS: DAZ, FTZ) — values no trained weight or
hidden state holds; this is the one difference from a widened sgemm besides the summation order.

No NumPy or PyTorch API gives a bf16 × bf16 → fp32 GEMM on the CPU (``torch.mm(...,
out_dtype=)`` is not implemented for CPU tensors; MKL's ``cblas_gemm_bf16bf16f32`` runs at the
fp32 rate on AMD), so the micro-kernel is generated in LLVM IR from a spec and compiled once per
process with llvmlite (Numba's own LLVM binding): ``fastgrad/kernels/_native.py``, whose
variants — AVX-512 BF16 (``vdpbf16ps``, 6 × 64 accumulators in 24 zmm registers), AVX-512F and
AVX2 + FMA (one fused multiply-add per product, the bf16 pairs widened in registers; 6 × 16
accumulators in 12 ymm registers on AVX2) — all give the same bits (the module's doc).  This
module is the layouts and the calls: ``W`` packed per vocabulary chunk as ``[ceil(H/2),
64·⌈N/64⌉]`` 32-bit pairs — its own row-major pairs, transposed — the same ``B`` for every
variant; ``A`` in the form the variant prefers (the plan's ``GemmChoice.a_form``, which
``lm_head/engine.resolve`` takes from the spec): ``X`` read in place as 32-bit pairs
(broadcast per row) on ``vdpbf16ps``, fp32 values on the FMA variants (``X`` widened
once, ``g`` read in place, ``gᵀ`` copied transposed per task: one broadcast load per value, no
pairing pass).  Every GEMM takes the variant as an argument (``spec``: the plan's
``GemmChoice.variant``, which ``lm_head/engine.resolve`` picks with :func:`auto_variant` from the
ISA setting the op layer passes); the module holds no setting.  Calls go through
``ctypes``, which releases the GIL, so the tiles run on fastgrad's GEMM pool; every operand is
checked first (:func:`gemm_tile`: ``InternalError``, never ``assert``).  Passes of at most
``_KC`` pairs over ``k`` keep ``B``'s strip in L2; a pass after the first sums onto the stored
fp32 values (the same additions in the same order).  The gradient GEMMs read ``B`` as consecutive
rows interleaved (:func:`interleave`) and, on ``vdpbf16ps``, ``A`` as the top halves of fp32
values that are bf16 values (:func:`pairs_of_f32`, :func:`pairs_in_place`, :func:`matmul_tn`).
"""

from __future__ import annotations

import threading

import numpy as np

from .. import _cpu
from .. import dtypes as D
from .._jit import tjit
from ..errors import InternalError
from ..lm_head.plan_types import NATIVE_COLS, Buffer, BufferSource, b_cols, b_size, npad  # noqa: F401  (b_size: re-exported)
from . import _native

_COLS = NATIVE_COLS  #: the packed ``B``'s column granule (``tiling``: the plan sizes the layout)
#: pairs of ``k`` per pass over a tile: a 64-column strip of ``B`` (KC × 256 bytes) stays in L2;
#: the next pass sums onto the stored fp32 values, the same additions in the same order
_KC = 256
#: columns per call of the native function within a pass: its ``B`` block (``_KC`` pairs × 128
#: columns × 4 bytes = 128 KiB) stays in the core's L2 while every row tile of the task passes
#: under it.  A whole 512-column span (512 KiB, a Zen 3 core's entire L2) went to L3 for every
#: row tile: two cores then contend there, and two cores ran 128-column calls faster than
#: 512-column ones (one core alone runs either at sgemm's rate; figures in
#: bench/results/README.md, "Measurements behind the source's choices").  The same additions in
#: the same order (each output's ``k`` in order within a pass): the same bits.  At least four
#: register tiles wide (an AVX-512 variant's 64 columns: 256, a 256 KiB block — every AVX-512
#: CPU's L2 holds it; not measured on one: none was at hand), so each row tile's ``A`` stays in
#: L1 over several column tiles.
_NS = 128
#: the native ISA settings (``fastgrad._config.set_native_isa``): ``"auto"`` (the best variant the CPU
#: runs), ``"avx512"`` or ``"avx2"`` (only that ISA's).  This module keeps no setting: the op layer
#: resolves the variant once per call (``lm_head/engine.resolve`` → ``GemmChoice.variant``) and every
#: GEMM here takes that spec as an argument, so a call runs the variant its plan names whatever
#: another thread's call chose (``tests/test_lm_head_threads.py``)
ISAS = ("auto", "avx512", "avx2")


def _check_isa(isa: str) -> str:
    if isa not in ISAS:
        raise ValueError(f"native ISA must be one of {', '.join(ISAS)}; got {isa!r}")
    return isa


def variant(kind: str = "bf16", isa: str = "auto") -> _native.KernelSpec | None:
    """The kernel variant the GEMMs of operand ``kind`` (``"bf16"``: bf16 pairs; ``"f32"``: fp32)
    run on under the ISA setting ``isa``: the first of ``_native.PREFERENCE[kind]`` of that ISA
    (``"auto"``: any) that the CPU runs and that compiled; None: BLAS.  Pure: a function of the
    CPU and ``isa``.  Raises ``ValueError`` for an ISA not in :data:`ISAS`."""
    _check_isa(isa)
    for name in _native.PREFERENCE[kind]:
        spec = _native.SPECS[name]
        if isa in ("auto", spec.isa) and _native.compiled(spec) is not None:
            return spec
    return None


def spec_named(name: str | None) -> _native.KernelSpec | None:
    """The spec a plan names (``GemmChoice.variant``), or None for None."""
    return None if name is None else _native.SPECS[name]


#: per operand kind, whether the GEMM setting ``"auto"`` runs the AVX2 + FMA variant when it is
#: the best the CPU has (ISA setting ``"auto"``): no — on a Zen 4 EPYC running the AVX2 code
#: against OpenBLAS's Haswell sgemm path the BLAS path was faster for the FLCE grad and the
#: online max-sum (bf16 and fp16) and tied on the training loss: the AVX2 GEMM runs at about
#: sgemm's rate, and the BLAS path's tiles beat it; the AVX-512 variants win.  Still no on a Zen 3
#: EPYC (2 cores, AVX2 only) after the column blocks (``_NS``) and the row-by-row copy of
#: contiguous ``A`` rows: the bf16 FLCE grad still slower on the native kernel than on BLAS
#: (figures for both CPUs in bench/results/README.md, "Measurements behind the source's choices")
AUTO_AVX2 = {"bf16": False, "f32": False}


#: per operand kind, the CPU vendors (``fastgrad._cpu.vendor``) on which the GEMM setting
#: ``"auto"`` runs an AVX-512 variant (ISA setting ``"auto"``); elsewhere BLAS.  AMD: the AVX-512
#: variants win on a Zen 4 and a Zen 5 EPYC (``bench/results/zen4.md``).  Intel: on an Emerald
#: Rapids Xeon (family 6, model 207, AVX-512 BF16 + AMX) the bf16 kernel, and the fp32 kernel on
#: fp16, lose to the BLAS path on one thread and on 16 (``bench/results/xeon_emr.md``; the figures
#: in bench/results/README.md, "Measurements behind the source's choices").
AUTO_AVX512_VENDORS = {"bf16": frozenset({"AuthenticAMD"}), "f32": frozenset({"AuthenticAMD"})}


def auto_variant(kind: str = "bf16", isa: str = "auto") -> _native.KernelSpec | None:
    """The variant the GEMM setting ``"auto"`` runs for operand ``kind`` under the ISA setting
    ``isa``: :func:`variant`, except None (BLAS) under the ISA setting ``"auto"`` where that is an
    AVX2 variant and :data:`AUTO_AVX2` says BLAS is faster there, or an AVX-512 variant on a CPU
    whose vendor is not in :data:`AUTO_AVX512_VENDORS`.  An explicit ISA setting (``"avx2"``,
    ``"avx512"``: CI, tests) runs its variant."""
    spec = variant(kind, isa)
    if spec is None or isa != "auto":
        return spec
    if spec.isa == "avx2" and not AUTO_AVX2[kind]:
        return None
    if spec.isa == "avx512" and _cpu.vendor() not in AUTO_AVX512_VENDORS[kind]:
        return None
    return spec


def _kernels(kind: str, spec: _native.KernelSpec | None) -> dict:
    if spec is None:
        raise InternalError(f"no native {kind} GEMM variant given (the plan's GemmChoice.variant is None)")
    if spec.kind != kind:
        raise InternalError(f"variant {spec.name!r} takes {spec.kind} operands, not {kind}")
    k = _native.compiled(spec)
    if k is None:
        raise InternalError(f"the native variant {spec.name!r} does not run on this CPU; check available()")
    return {"spec": spec, **k}


def a_form(kind: str = "bf16", isa: str = "auto") -> str | None:
    """The form of ``A`` the variant for ``kind`` prefers (its ``a_forms[0]``): ``"pairs"``
    (``vdpbf16ps``) or ``"f32"`` (the FMA variants: fp32 values, for bf16 two per pair of ``B``);
    None where no variant runs.  The kernels take the form from their plan (``GemmChoice.a_form``,
    the same rule: ``lm_head/engine.resolve``) and pass it to :func:`pairs_in_place`,
    :func:`matmul_tn` and :class:`Logits`; this query is for tests and tools."""
    spec = variant(kind, isa)
    return None if spec is None else spec.a_forms[0]


def available(kind: str = "bf16", isa: str = "auto") -> bool:
    """A variant for operand ``kind`` runs here (:func:`variant`): ``"bf16"`` on AVX-512 BF16,
    AVX-512F or AVX2 + FMA; ``"f32"`` (the fp16 operands) on AVX-512F or AVX2 + FMA; compiled
    once per process."""
    return variant(kind, isa) is not None


def pairs(a16: np.ndarray, buf: np.ndarray | None = None) -> np.ndarray:
    """A 2-D bf16 array (its uint16 bits) as ``[rows, ceil(cols/2)]`` uint32 pairs: a view when
    C-contiguous with an even, non-zero number of columns (an empty row's strides may be anything:
    ``(2, 4)`` for a ``[BT, 0]`` view), else a zero-padded copy into ``buf``."""
    u = a16.view(np.uint16) if a16.dtype != np.uint16 else a16
    r, c = u.shape
    if c % 2 == 0 and c > 0 and u.flags.c_contiguous and u.strides[0] == 2 * c:
        return u.view(np.uint32)
    kp = (c + 1) // 2
    p = np.empty((r, 2 * kp), np.uint16) if buf is None else buf[: r * 2 * kp].reshape(r, 2 * kp)
    p[:, :c] = u
    p[:, c:] = 0
    return p.view(np.uint32)


@tjit
def _transpose_rows(lo, hi, src, dst):
    """dst[k, j] = src[j, k] for the rows ``lo:hi`` of ``dst`` (zero past src's rows).  In blocks
    of 16 columns of ``dst``: each store a cache line, the 16 source rows' segments stay in L1
    (several times the rate of the column-at-a-time order at the Qwen2.5 head:
    bench/results/README.md)."""
    n = src.shape[0]
    for j0 in range(0, n, 16):
        j1 = min(j0 + 16, n)
        for k in range(lo, hi):
            for j in range(j0, j1):
                dst[k, j] = src[j, k]
    for k in range(lo, hi):
        for j in range(n, dst.shape[1]):
            dst[k, j] = 0


@tjit
def _transpose_widen_rows(lo, hi, src, code, dst):
    """dst[k, j] = fp32(src[j, k]) for the rows ``lo:hi`` of ``dst`` (zero past src's rows):
    :func:`_transpose_rows` of 16-bit values (uint16 bits of the dtype ``code``) widened."""
    n = src.shape[0]
    for j0 in range(0, n, 16):
        j1 = min(j0 + 16, n)
        for k in range(lo, hi):
            for j in range(j0, j1):
                dst[k, j] = D.to_f32(src[j, k], code)
    for k in range(lo, hi):
        for j in range(n, dst.shape[1]):
            dst[k, j] = 0


def _col_spans(n: int, k: int | None = None) -> list[tuple[int, int]]:
    """``[0, n)`` in spans of ≤ 512 columns on 64-column boundaries, from ``n`` only (or in ``k``
    spans on those boundaries)."""
    from ._gemm import _spans, parts

    g = -(-n // _COLS)
    cut = _spans(g, 512 // _COLS) if k is None else parts(g, k)
    return [(a * _COLS, min(n, b * _COLS)) for a, b in cut] if n else []


def _pool_tiles(m: int, n: int, row_step: int, split_cols: bool) -> tuple[list, list]:
    """(row spans, column spans) of a native GEMM ``[m, n]``'s tasks: ≤ ``row_step`` rows ×
    :func:`_col_spans`, cut finer where the pool would idle (``_gemm.pool_grid``: columns first
    where the tasks are tiles, ``split_cols``; rows of ≥ 64)."""
    from ._gemm import POOL_MIN_SIDE, _spans, parts, pool_grid

    rows, cols = _spans(m, row_step), _col_spans(n)
    c_max = -(-n // _COLS) if split_cols else len(cols)
    r, c = pool_grid(len(rows), len(cols), m // POOL_MIN_SIDE, c_max)
    return (rows if r == len(rows) else parts(m, r)), (cols if c == len(cols) else _col_spans(n, c))


def _b_operand(kernel, src: np.ndarray, kp: int, n: int, out: np.ndarray | None, *args) -> np.ndarray:
    """The kernel's ``B`` ``[kp, b_cols(n)]`` (in ``out`` when given, uint32 without) filled
    from ``src`` by ``kernel(lo, hi, src, *args, B)`` over its rows, on the GEMM pool."""
    from ._gemm import run_rows

    w = b_cols(n)
    bp = np.empty((kp, w), np.uint32) if out is None else out[: kp * w].reshape(kp, w)
    run_rows(kernel, kp, src, *args, bp)
    return bp


def pack(wpairs: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``W``'s pairs ``[N, KP]`` → the kernel's ``[KP, 64·⌈N/64⌉]`` (transposed, zero-padded),
    on the GEMM pool."""
    n, kp = wpairs.shape
    return _b_operand(_transpose_rows, wpairs, kp, n, out)


@tjit
def _interleave_rows(lo, hi, a, dst):
    """dst[p, n] = a[2p, n] | a[2p+1, n] << 16 for the rows ``lo:hi`` of ``dst`` (zero past a's
    rows and columns)."""
    k, n = a.shape
    npad = dst.shape[1]
    for p in range(lo, hi):
        r0 = 2 * p
        for j in range(n):
            lo16 = np.uint32(a[r0, j]) if r0 < k else np.uint32(0)
            hi16 = np.uint32(a[r0 + 1, j]) if r0 + 1 < k else np.uint32(0)
            dst[p, j] = lo16 | (hi16 << np.uint32(16))
        for j in range(n, npad):
            dst[p, j] = 0


def interleave(a16: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A ``[K, N]`` bf16 operand (its uint16 bits) read down its rows as the kernel's ``B``:
    ``[ceil(K/2), 64·⌈N/64⌉]`` pairs of consecutive rows, zero-padded; on the GEMM pool."""
    u = a16.view(np.uint16) if a16.dtype != np.uint16 else a16
    k, n = u.shape
    return _b_operand(_interleave_rows, u, (k + 1) // 2, n, out)


@tjit
def _top_pairs(lo, hi, g, dst):
    """dst[i, p] = top16(g[i, 2p]) | top16(g[i, 2p+1]) << 16 for the rows ``lo:hi`` (zero past
    g's columns): fp32 values that are bf16 values, as the kernel's ``A``."""
    n = g.shape[1]
    kp = dst.shape[1]
    for i in range(lo, hi):
        for p in range(kp):
            j = 2 * p
            lo16 = g[i, j] >> np.uint32(16)
            hi16 = (g[i, j + 1] & np.uint32(0xFFFF0000)) if j + 1 < n else np.uint32(0)
            dst[i, p] = lo16 | hi16


@tjit
def _top_pairs_t(lo, hi, g, dst):
    """dst[v, p] = top16(g[2p, v]) | top16(g[2p+1, v]) << 16 for the rows ``lo:hi`` of ``dst``
    (zero past g's rows): ``gᵀ`` as the kernel's ``A``.  In strips of 16 pairs: the strip's 32
    rows of ``g`` read along their rows into a small buffer (contiguous loads, vectorized), then
    written transposed, 16 contiguous pairs per row of ``dst`` (faster than reading ``g`` down
    its columns 16 at a time: rows 8 KiB apart at a 2048-column chunk, one TLB entry each)."""
    k = g.shape[0]
    kp = dst.shape[1]
    hm = np.uint32(0xFFFF0000)
    tmp = np.empty((16, hi - lo), np.uint32)
    for p0 in range(0, kp, 16):
        p1 = min(kp, p0 + 16)
        for p in range(p0, p1):
            r = 2 * p
            t = tmp[p - p0]
            if r + 1 < k:
                for v in range(lo, hi):
                    t[v - lo] = (g[r, v] >> np.uint32(16)) | (g[r + 1, v] & hm)
            else:
                for v in range(lo, hi):
                    t[v - lo] = g[r, v] >> np.uint32(16)
        for v in range(lo, hi):
            for p in range(p0, p1):
                dst[v, p] = tmp[p - p0, v - lo]


@tjit
def gt_pairs_rows(u, i0, i1, gt, p0):
    """``gt[v, p0 + p] = top16(u[i0 + 2p, v]) | top16(u[i0 + 2p + 1, v]) << 16`` for the pairs of
    rows ``i0:i1`` (zero past ``i1``): :func:`_top_pairs_t` of a row group (``u``: the
    uint32 bits of fp32 values that are bf16 values), in column blocks of 256 — the group's pairs
    along its rows into a small buffer, then ``gt``'s rows written ``(i1 - i0 + 1) // 2``
    contiguous pairs each."""
    w = u.shape[1]
    npair = (i1 - i0 + 1) // 2
    hm = np.uint32(0xFFFF0000)
    tmp = np.empty((npair, 256), np.uint32)
    for v0 in range(0, w, 256):
        v1 = min(w, v0 + 256)
        for p in range(npair):
            r = i0 + 2 * p
            t = tmp[p]
            a = u[r, v0:v1]
            if r + 1 < i1:
                b = u[r + 1, v0:v1]
                for v in range(a.size):
                    t[v] = (a[v] >> np.uint32(16)) | (b[v] & hm)
            else:
                for v in range(a.size):
                    t[v] = a[v] >> np.uint32(16)
        for v in range(v1 - v0):
            g = gt[v0 + v, p0 : p0 + npair]
            for p in range(npair):
                g[p] = tmp[p, v]


@tjit
def pairs_rows(u, i0, i1, up):
    """``up[i, p] = top16(u[i, 2p]) | top16(u[i, 2p+1]) << 16`` for the rows ``i0:i1`` (zero past
    the row), written over the row's own first half (``up``: ``u[:, :ceil(w/2)]``, the same
    memory; pair ``p`` lands at or before the values it reads): :func:`pairs_in_place`."""
    w = u.shape[1]
    hm = np.uint32(0xFFFF0000)
    for i in range(i0, i1):
        a = u[i]
        d = up[i]
        for p in range(w // 2):
            d[p] = (a[2 * p] >> np.uint32(16)) | (a[2 * p + 1] & hm)
        if w % 2:
            d[w // 2] = a[w - 1] >> np.uint32(16)


@tjit
def group_pairs(u, i0, i1, gt, up):
    """Both gradient GEMMs' ``A`` on ``vdpbf16ps`` from the row group ``i0:i1`` of ``u`` (the
    uint32 bits of fp32 values that are bf16 values; ``i0`` even): ``gᵀ``'s pairs into ``gt``
    (:func:`gt_pairs_rows`, skipped when ``gt`` has no rows), then the rows paired in place
    (:func:`pairs_rows` into ``up`` = ``u[:, :ceil(w/2)]``, skipped when ``up`` has no rows)."""
    if gt.shape[0] > 0:
        gt_pairs_rows(u, i0, i1, gt, i0 // 2)
    if up.shape[0] > 0:
        pairs_rows(u, i0, i1, up)


def pairs_of_f32(g: np.ndarray, transpose: bool = False) -> np.ndarray:
    """An fp32 ``[M, K]`` array whose values are bf16 values (its low 16 bits zero, e.g. rounded
    to bf16 by the epilogue) as the kernel's ``A``: ``[M, ceil(K/2)]`` pairs along its rows, or
    with ``transpose`` ``gᵀ``'s ``[K, ceil(M/2)]`` pairs; exact (the top halves).  On the pool."""
    from ._gemm import run_rows

    u = g.view(np.uint32)
    m, k = u.shape
    dst = np.empty((k, (m + 1) // 2) if transpose else (m, (k + 1) // 2), np.uint32)
    run_rows(_top_pairs_t if transpose else _top_pairs, dst.shape[0], u, dst)
    return dst


def _check_form(form: str | None) -> None:
    if form not in ("pairs", "f32"):
        raise InternalError(f"form (the plan's GemmChoice.a_form) must be 'pairs' or 'f32', got {form!r}")


def pairs_in_place(g: np.ndarray, form: str | None) -> np.ndarray:
    """``g`` (C-contiguous fp32 of bf16 values) as the bf16 kernel's ``A`` of form ``form`` (the
    plan's ``GemmChoice.a_form``): ``"pairs"`` (``vdpbf16ps``): :func:`pairs_of_f32` written over
    ``g``'s own rows (``g`` is consumed): a view of row stride ``K``; pair ``p`` of a row lands at
    or before the values it reads (``2p``, ``2p+1``).  ``"f32"`` (the FMA variants): ``g`` itself,
    untouched."""
    from ._gemm import run_rows

    _check_form(form)
    if g.dtype != np.float32 or g.ndim != 2 or not g.flags.c_contiguous:
        raise InternalError(f"g must be a C-contiguous 2-D float32 array, got {g.dtype}, ndim {g.ndim}")
    if form == "f32":
        return g
    u = g.view(np.uint32)
    dst = u[:, : (u.shape[1] + 1) // 2]
    run_rows(_top_pairs, u.shape[0], u, dst)
    return dst


_tl = threading.local()


def _local(size: int) -> np.ndarray:
    """A uint32 scratch of at least ``size`` elements, one per pool thread (kept)."""
    b = getattr(_tl, "buf", None)
    if b is None or b.size < size:
        b = _tl.buf = np.empty(size, np.uint32)
    return b


def _check_tile(xp: np.ndarray, bp: np.ndarray, c0: int, c1: int, out: np.ndarray) -> None:
    """Every precondition of the native call, as ``ValueError`` (never ``assert``: ``python -O``
    removes those, and the kernel reads and writes through raw pointers)."""
    for name, a in (("xp", xp), ("bp", bp), ("out", out)):
        if not isinstance(a, np.ndarray) or a.ndim != 2:
            raise InternalError(
                f"{name} must be a 2-D numpy array, got {type(a).__name__} of ndim {getattr(a, 'ndim', None)}"
            )
        if any(st % 4 for st in a.strides):
            raise InternalError(f"{name}'s strides must be multiples of 4 bytes, got {a.strides}")
    if xp.dtype not in (np.uint32, np.float32):
        raise InternalError(f"xp must be uint32 (bf16 pairs) or float32, got {xp.dtype}")
    if bp.dtype not in (np.uint32, np.float32) or (bp.dtype == np.float32 and xp.dtype != np.float32):
        raise InternalError(
            f"bp must be uint32 (bf16 pairs) or, with float32 xp, float32; got {bp.dtype}, xp {xp.dtype}"
        )
    if xp.dtype == np.uint32 and xp.strides[1] != 4:
        raise InternalError(f"xp (bf16 pairs) must have unit column stride, got strides {xp.strides}")
    if out.dtype != np.float32 or out.strides[1] != 4 or not out.flags.writeable:
        raise InternalError(
            f"out must be writeable float32 with unit column stride, got {out.dtype}, strides {out.strides}"
        )
    if not (
        isinstance(c0, (int, np.integer)) and isinstance(c1, (int, np.integer)) and 0 <= c0 <= c1 and c0 % _COLS == 0
    ):
        raise InternalError(f"c0, c1 must satisfy 0 <= c0 <= c1 with c0 a multiple of {_COLS}, got {c0}, {c1}")
    if out.shape != (xp.shape[0], c1 - c0):
        raise InternalError(f"out must have shape {(xp.shape[0], c1 - c0)}, got {out.shape}")
    krows = (xp.shape[1] + 1) // 2 if (xp.dtype == np.float32 and bp.dtype == np.uint32) else xp.shape[1]
    if bp.strides[1] != 4 or bp.shape[0] < krows or bp.shape[1] < npad(c1):
        raise InternalError(
            f"bp must have unit column stride and shape at least {(krows, npad(c1))}, "
            f"got {bp.shape}, strides {bp.strides}"
        )


def gemm_tile(
    xp: np.ndarray,
    bp: np.ndarray,
    c0: int,
    c1: int,
    out: np.ndarray,
    acc: bool = False,
    *,
    spec: _native.KernelSpec | None,
) -> None:
    """``out[M, c1-c0] (+)= A · B[:, c0:c1]`` in fp32; ``c0`` a multiple of 64; ``acc``: summed
    onto ``out``.  One thread, on the variant ``spec`` (the plan's ``GemmChoice.variant``,
    :func:`spec_named`; tests: :func:`variant`).

    ``xp`` uint32: the bf16 kernel, ``A`` as pairs [M, KP] (rows of unit stride) and ``bp`` the
    packed [KP, NPAD] pairs; ``xp`` float32: the fp32 kernel, ``A`` [M, K] of any strides (``Aᵀ``
    of a C-contiguous array too) and ``bp`` fp32 [K, ≥ 64·⌈c1/64⌉] with unit column stride.

    Raises :class:`fastgrad.errors.InternalError` on any operand that breaks these rules (checked
    before the native call, also under ``python -O``), or a ``spec`` that is None, of another
    operand kind or A form, or not runnable here (:func:`available`)."""
    _check_tile(xp, bp, c0, c1, out)
    kind = "bf16" if bp.dtype == np.uint32 else "f32"
    a_form = "pairs" if xp.dtype == np.uint32 else "f32"
    m, ka = xp.shape
    n = c1 - c0
    if m == 0 or n == 0:
        return
    if ka == 0:
        if not acc:
            out[...] = 0
        return
    k = _kernels(kind, spec)
    sp = k["spec"]
    if a_form not in sp.a_forms:
        raise InternalError(f"variant {sp.name!r} takes A as {' or '.join(sp.a_forms)}, not {a_form}")
    fns, MR = k["fns"], sp.mr
    ns = max(_NS, 4 * sp.cols)
    lda, ska = xp.strides[0] // 4, xp.strides[1] // 4
    # segments of k: (A, its lda, ska, elements of A per k step, first and end row of B); fp32 A
    # with bf16 pairs: two values per pair, an odd K's last value as a pair with a zero (+0·0
    # added first, as the zero-padded pair of the other forms)
    if kind == "bf16" and a_form == "f32":
        segs = [(xp, lda, ska, 2 * ska, 0, ka // 2)] if ka // 2 else []
        if ka % 2:
            last = np.zeros((m, 2), np.float32)
            last[:, 0] = xp[:, ka - 1]
            segs.append((last, 2, 1, 2, ka // 2, ka // 2 + 1))
    else:
        segs = [(xp, lda, ska, ska, 0, ka)]
    ldc = out.strides[0] // 4
    ldb = bp.strides[0] // 4
    n64 = (n // _COLS) * _COLS
    m6 = (m // MR) * MR
    tail = None
    if n64 != n:
        tail = np.zeros((m, _COLS), np.float32)
        if acc:
            tail[:, : n - n64] = out[:, n64:]
    first = True
    for A, la, sa, step, p0, p1 in segs:
        nk = -(-(p1 - p0) // _KC)
        for c in range(nk):
            k0, k1 = p0 + (c * (p1 - p0)) // nk, p0 + ((c + 1) * (p1 - p0)) // nk
            ac = acc or not first
            first = False
            for r0, r1, mr in ((0, m6, MR), (m6, m, m - m6)):
                if r1 <= r0:
                    continue
                f = fns[(a_form, mr, ac)]
                a = A.ctypes.data + (r0 * la + (k0 - p0) * step) * 4
                b = bp.ctypes.data + (k0 * ldb + c0) * 4
                for s0 in range(0, n64, ns):  # B's block of this pass stays in L2 (_NS)
                    s1 = min(n64, s0 + ns)
                    f(
                        a,
                        la,
                        sa,
                        b + s0 * 4,
                        ldb,
                        out.ctypes.data + (r0 * ldc + s0) * 4,
                        ldc,
                        r1 - r0,
                        s1 - s0,
                        k1 - k0,
                        b + s0 * 4,
                    )
                if tail is not None:
                    t = tail.ctypes.data + r0 * _COLS * 4
                    f(a, la, sa, b + n64 * 4, ldb, t, _COLS, r1 - r0, _COLS, k1 - k0, b + n64 * 4)
    if tail is not None:
        out[:, n64:] = tail[:, : n - n64]


#: the most values of ``k`` of an fp32 ``A`` that :func:`matmul` copies into scratch at a time
_AK = 2048


def _a_stride(k: int) -> int:
    """The row stride (elements) of an ``A`` copied into scratch with ``k`` columns: ``k``, plus
    16 where ``k`` is a multiple of 256 (the row tile's broadcasts, rows 1 KiB · 2ʲ apart, would
    share L1 sets)."""
    return k + 16 if k % 256 == 0 else k


@tjit
def _copy_rows(lo, hi, src, dst):
    """dst[i, :] = src[i, :] for the rows ``lo:hi`` (any strides of ``src``: rows of unit column
    stride row by row; a transposed view 16 rows of ``dst`` at a time, each source row's segment a
    cache line — that order on contiguous rows copied an order of magnitude slower than row by
    row: bench/results/README.md)."""
    n = src.shape[1]
    if src.strides[1] == src.itemsize:
        for i in range(lo, hi):
            for j in range(n):
                dst[i, j] = src[i, j]
        return
    for i0 in range(lo, hi, 16):
        i1 = min(hi, i0 + 16)
        for j in range(n):
            for i in range(i0, i1):
                dst[i, j] = src[i, j]


def matmul(
    xp: np.ndarray, bp: np.ndarray, n: int, out: np.ndarray, acc: bool = False, *, spec: _native.KernelSpec | None
) -> None:
    """``out[M, n] (+)= A · B`` over the GEMM pool from the pairs ``xp`` [M, KP] and the packed
    ``bp`` [KP, ≥ n]: tiles of ≤ 512 rows × ≤ 512 columns (column spans on 64-column
    boundaries), from the shapes — cut finer where a pool would idle with so few tiles
    (:func:`_pool_tiles`: e.g. ``grad_input``'s 683 × 896 block, 4 tiles, is 16 on 16 threads) —
    bitwise the same at any thread count, and any tiling: each output is one fixed sequence of
    additions, onto ``out``'s value with ``acc``; on the variant ``spec`` (:func:`gemm_tile`)."""
    from ._gemm import _run

    _run(matmul_tasks(xp, bp, n, out, acc, spec=spec))


def matmul_tasks(
    xp: np.ndarray, bp: np.ndarray, n: int, out: np.ndarray, acc: bool = False, *, spec: _native.KernelSpec | None
) -> list:
    """:func:`matmul`'s tasks (callables of no argument), to run with another GEMM's on the pool
    at once (``_gemm.run_tasks``: one barrier for both)."""
    from ._gemm import ROW_BLOCK

    if (
        xp.dtype == np.float32
        and spec is not None
        and spec.isa == "avx2"
        and xp.ndim == 2
        and xp.shape[1] > 0
        and (xp.strides[1] != 4 or xp.strides[0] % 1024 == 0)
    ):
        # fp32 A read down its columns (gᵀ in place), or rows 1 KiB · 2ʲ apart (g of a vocabulary
        # chunk of 8192): the row tile's broadcasts would share a few L1 sets.  On the AVX2
        # variants each task copies its rows into the thread's scratch first (exact; a padded
        # row stride), then its column spans — the same sums (faster on the AVX2 code; on
        # AVX-512 the copy cost more than it saved, so it is not made there; figures in
        # bench/results/README.md, "Measurements behind the source's choices").  In
        # blocks of ≤ _AK values of k (the scratch ≤ 512 × _AK values): a block after the first
        # sums onto the stored values, the same additions in the same order (gemm_tile's passes)
        k = xp.shape[1]
        rows, cols = _pool_tiles(xp.shape[0], n, ROW_BLOCK, False)
        per = 2 if bp.dtype == np.uint32 else 1  # values of k per row of B (bf16 pairs: 2)
        kb = max(per, (_AK // per) * per)
        ka = _a_stride(kb)

        def task(r0, r1):
            buf = _local((r1 - r0) * ka)[: (r1 - r0) * ka].view(np.float32).reshape(r1 - r0, ka)
            for k0 in range(0, k, kb):
                k1 = min(k, k0 + kb)
                a = buf[:, : k1 - k0]
                _copy_rows(0, r1 - r0, xp[r0:r1, k0:k1], a)
                for c0, c1 in cols:
                    gemm_tile(a, bp[k0 // per :], c0, c1, out[r0:r1, c0:c1], acc or k0 > 0, spec=spec)

        return [(lambda r0=r0, r1=r1: task(r0, r1)) for r0, r1 in rows]
    rows, cols = _pool_tiles(xp.shape[0], n, ROW_BLOCK, True)
    return [
        (lambda r0=r0, r1=r1, c0=c0, c1=c1: gemm_tile(xp[r0:r1], bp, c0, c1, out[r0:r1, c0:c1], acc, spec=spec))
        for r0, r1 in rows
        for c0, c1 in cols
    ]


def matmul_nt(xp: np.ndarray, bp: np.ndarray, n: int, out: np.ndarray, *, spec: _native.KernelSpec | None) -> None:
    """``out[M, n] = X · Wᵀ`` from ``X``'s pairs and ``W``'s :func:`pack`: :func:`matmul`."""
    matmul(xp, bp, n, out, spec=spec)


def matmul_tn(
    g: np.ndarray,
    bp: np.ndarray,
    n: int,
    out: np.ndarray,
    acc: bool = False,
    *,
    form: str | None,
    spec: _native.KernelSpec | None,
) -> None:
    """``out[M, n] (+)= gᵀ · B`` for ``g`` fp32 ``[K, M]`` of bf16 values and the packed ``bp``
    [ceil(K/2), ≥ n] (:func:`interleave`): tasks of ≤ 512 rows of ``out`` (two from 128 rows),
    each pairing its columns of ``g`` into its thread's scratch (``form="pairs"``: ``vdpbf16ps``)
    or copying them there transposed (``form="f32"``: the FMA variants, fp32 ``A``: read in place,
    ``g``'s rows, a power of two apart, would share one L1 set), no ``[M, K]`` copy held, then its
    column spans; the same sums as :func:`matmul` on ``pairs_of_f32(g, transpose=True)``.
    ``form``: the plan's ``GemmChoice.a_form``."""
    from ._gemm import ROW_BLOCK, _run

    _check_form(form)
    k, m = g.shape
    kp = (k + 1) // 2
    # ≤ 512 rows per task, and at least two tasks from 128 rows on (a filtered tile's few kept
    # columns would otherwise run on one thread), more where the pool would idle (_pool_tiles);
    # the sums do not depend on the split
    rows, cols = _pool_tiles(m, n, min(ROW_BLOCK, max(64, -(-m // 2))), False)
    u = g.view(np.uint32)
    f32a = form == "f32"
    ka = _a_stride(k)

    def task(r0, r1):
        if f32a:  # gᵀ's columns copied transposed into the thread's scratch (fp32, exact)
            xp = _local((r1 - r0) * ka)[: (r1 - r0) * ka].view(np.float32).reshape(r1 - r0, ka)[:, :k]
            _transpose_rows(0, r1 - r0, g[:, r0:r1], xp)
        else:
            xp = _local((r1 - r0) * kp)[: (r1 - r0) * kp].reshape(r1 - r0, kp)
            _top_pairs_t(0, r1 - r0, u[:, r0:r1], xp)
        for c0, c1 in cols:
            gemm_tile(xp, bp, c0, c1, out[r0:r1, c0:c1], acc, spec=spec)

    _run([(lambda r0=r0, r1=r1: task(r0, r1)) for r0, r1 in rows])


class Logits:
    """The logits GEMM ``X · W[v0:v1]ᵀ`` of 16-bit ``X`` and ``W`` on an exact-product kernel:
    :meth:`chunk` packs at most ``vc`` rows of ``W`` (into recycled scratch), then
    :meth:`logits` for any row block.

    bf16 (the bf16 kernel): ``X`` read in place as pairs (``form="pairs"``: ``vdpbf16ps``) or
    widened once to fp32 (``form="f32"``: the FMA variants), ``W``'s chunk paired and transposed;
    ``form`` is the plan's ``GemmChoice.a_form``.
    fp16 (the fp32 kernel, ``kind="f32"``): ``X`` widened once into :attr:`x32` ``[BT,
    64·⌈H/64⌉]`` (columns past H zero: also the grad_weight GEMM's ``B``; the caller's when
    given), ``W``'s chunk widened and transposed."""

    def __init__(
        self,
        input: np.ndarray,
        W: np.ndarray,
        vc: int,
        x32: np.ndarray | None = None,
        *,
        ws: BufferSource,
        form: str | None,
        spec: _native.KernelSpec | None,
    ):
        """``ws``: where the buffers of :meth:`buffers` come from, by name (the LM-head loop's
        ``Workspace``: the plan's list, which holds this declaration)."""
        from ._linear import fp32_block

        H, BT = input.shape[1], input.shape[0]
        self.W = W
        self.H = H
        self.f16 = input.dtype == np.float16
        if self.f16:
            if x32 is None:
                x32 = fp32_block(input, 0, BT, buf=ws.take("x32"), width=npad(H))
            self.x32 = x32
            self.xp = self.x32[:, :H]
            self.pbuf = ws.take("w_packed")
            self.code = D.code_of(input.dtype)
        else:
            _check_form(form)
            if form == "f32":  # the FMA variants: X widened once (exact)
                self.xp = fp32_block(input, 0, BT, buf=ws.take("x32"))
            else:
                self.xp = pairs(input, ws.get("x_pairs_padded"))  # (odd H: padded to a pair)
            self.pbuf = ws.take("w_packed")
            self.wbuf = ws.get("w_pairs_padded")
        self.bp = np.empty((0, 0), np.uint32)
        self.n = 0
        self.spec = spec

    @staticmethod
    def buffers(BT: int, H: int, vt: int, *, f16: bool, form: str | None, x_given: bool = False) -> list[Buffer]:
        """The buffers a :class:`Logits` over ``[BT, H]`` rows and vocabulary tiles of ``vt`` rows
        takes: fp16 (the fp32 kernel) — ``X`` widened and padded once unless ``x_given`` (the
        caller's fp32 copy), the tile widened transposed; bf16 — ``X`` widened once (``form``
        "f32") or paired with a zero column (odd ``H``), the packed tile, the tile's padded pairs
        (odd ``H``)."""
        if f16:
            out = [] if x_given else [Buffer("x32", (BT, npad(H)), "float32", "call")]
            return out + [Buffer("w_packed", (H, b_cols(vt)), "float32", "tile")]
        out = []
        if form == "f32":
            out.append(Buffer("x32", (BT, H), "float32", "call"))
        elif H % 2:
            out.append(Buffer("x_pairs_padded", (BT, H + 1), "uint16", "call"))
        out.append(Buffer("w_packed", ((H + 1) // 2, b_cols(vt)), "uint32", "tile"))
        if H % 2:
            out.append(Buffer("w_pairs_padded", (vt, H + 1), "uint16", "tile"))
        return out

    def use(self, packed: np.ndarray, n: int) -> None:
        """Take an ``n``-row tile of ``W`` packed earlier by :meth:`chunk` (into ``packed``, this
        object's ``pbuf`` then) instead of packing it again."""
        kp = self.H if self.f16 else (self.H + 1) // 2
        w = b_cols(n)
        self.bp = packed[: kp * w].reshape(kp, w)
        self.n = n

    def chunk(self, v0: int, v1: int) -> None:
        if self.f16:
            w = self.W[v0:v1].view(np.uint16)
            self.bp = _b_operand(_transpose_widen_rows, w, self.H, v1 - v0, self.pbuf, self.code)
        else:
            self.bp = pack(pairs(self.W[v0:v1], self.wbuf), self.pbuf)
        self.n = v1 - v0

    def logits(self, b0: int, b1: int, out: np.ndarray) -> None:
        matmul_nt(self.xp[b0:b1], self.bp, self.n, out, spec=self.spec)
