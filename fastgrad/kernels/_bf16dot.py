"""Exact-product bf16 GEMMs on CPUs with AVX-512 BF16: the logits ``X · Wᵀ``, and the FLCE
grad's ``g · W`` and ``gᵀ · X`` where ``g`` is rounded to bf16 by the op's contract.

When ``X`` and ``W`` are bf16, every product ``x·w`` is exact in fp32 (8 + 8 significant bits),
so the logits GEMM needs no fp32 operands: ``vdpbf16ps`` multiplies pairs of bf16 values and
accumulates them into fp32 lanes, at twice the rate of an fp32 FMA on the same vector width
(measured on a Zen 4 EPYC, one thread, 512 × 896 × 512: 226 GF/s against 102 for OpenBLAS's
sgemm and 218 for oneDNN's bf16 GEMM, whose output is rounded to bf16).  The result is an fp32
GEMM of the bf16 operands: each output summed in fp32 in a fixed order (over ``k`` pairs),
independent of the tiling, so the forward and the backward's recompute see the same logits
bitwise, at any thread count.  The instruction treats bf16 subnormals (|x| < 2⁻¹²⁶) as zero and
flushes subnormal sums to zero (Intel SDM, VDPBF16PS: DAZ, FTZ) — values no trained weight or
hidden state holds; this is the one difference from a widened sgemm besides the summation order.

No NumPy or PyTorch API gives a bf16 × bf16 → fp32 GEMM on the CPU (``torch.mm(...,
out_dtype=)`` is not implemented for CPU tensors; MKL's ``cblas_gemm_bf16bf16f32`` runs at the
fp32 rate on AMD), so the micro-kernel is written here in LLVM IR and compiled once per process
with llvmlite (Numba's own LLVM binding): 6 rows × 64 columns of accumulators (24 zmm registers),
``W`` packed per vocabulary chunk as ``[ceil(H/2), 64·⌈N/64⌉]`` 32-bit pairs — its own row-major
pairs, transposed — and ``X`` read in place as 32-bit pairs (broadcast per row).  Calls go through
``ctypes``, which releases the GIL, so the tiles run on fastgrad's GEMM pool.  Passes of at most
``_KC`` pairs over ``k`` keep ``B``'s strip in L2; a pass after the first sums onto the stored
fp32 values (the same additions in the same order).  The gradient GEMMs read ``B`` as consecutive
rows interleaved (:func:`interleave`) and ``A`` as the top halves of fp32 values that are bf16
values (:func:`pairs_of_f32`, :func:`matmul_tn`).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from .. import dtypes as D
from .._jit import tjit

_NR = 4  # 16-lane vectors of columns per micro-tile: 64 columns
_COLS = 16 * _NR
_MR = 6  # rows per micro-tile
#: pairs of ``k`` per pass over a tile: a 64-column strip of ``B`` (KC × 256 bytes) stays in L2;
#: the next pass sums onto the stored fp32 values, the same additions in the same order
_KC = 256
_lock = threading.Lock()
_state: dict = {}


def _ir(mr: int, acc: bool = False, kind: str = "bf16") -> str:
    """LLVM IR of ``{kind}gemm_mr{mr}(A, lda, ska, B, ldb, C, ldc, M, N, K)``: ``C[M, N] = A · B``,
    ``M % mr == 0``, ``N % 64 == 0``, K ≥ 1; ``A[i, k]`` at ``A + i·lda + k·ska`` (elements);
    ``acc`` (``{kind}gemm_acc_mr{mr}``): ``C += A · B``, the products summed onto ``C``'s values.

    ``kind="bf16"``: ``A`` [M, K] and ``B`` [K, N] 32-bit bf16 pairs, ``vdpbf16ps`` per pair;
    ``kind="f32"``: fp32 ``A`` and ``B``, one fused multiply-add per ``k`` (the fp16 operands'
    kernel: their products are exact in fp32, as bf16's)."""
    f = f"{kind}gemm_acc_mr{mr}" if acc else f"{kind}gemm_mr{mr}"
    elt, vec = ("i32", "<16 x i32>") if kind == "bf16" else ("float", "<16 x float>")
    L = [
        f"define void @{f}(ptr noalias %A, i64 %lda, i64 %ska, ptr noalias %B, i64 %ldb, ptr noalias %C, "
        "i64 %ldc, i64 %M, i64 %N, i64 %KP) #0 {",
        "entry:",
        "  br label %mloop",
        "mloop:",
        "  %m = phi i64 [0, %entry], [%m.next, %mlatch]",
        "  br label %nloop",
        "nloop:",
        "  %n = phi i64 [0, %mloop], [%n.next, %nlatch]",
    ]
    for i in range(mr):  # the store's addresses; with acc, C's values start the sums
        L += [f"  %cr{i} = add i64 %m, {i}", f"  %coa{i} = mul i64 %cr{i}, %ldc", f"  %co{i} = add i64 %coa{i}, %n"]
        for j in range(_NR):
            L += [
                f"  %co{i}_{j} = add i64 %co{i}, {16 * j}",
                f"  %cp{i}_{j} = getelementptr float, ptr %C, i64 %co{i}_{j}",
            ]
            if acc:
                L.append(f"  %c0_{i}_{j} = load <16 x float>, ptr %cp{i}_{j}, align 4")
    L += ["  br label %kloop", "kloop:", "  %kp = phi i64 [0, %nloop], [%kp.next, %kloop]"]
    for i in range(mr):
        for j in range(_NR):
            init = f"%c0_{i}_{j}" if acc else "zeroinitializer"
            L.append(f"  %acc{i}_{j} = phi <16 x float> [{init}, %nloop], [%nacc{i}_{j}, %kloop]")
    L.append("  %brow = mul i64 %kp, %ldb")
    L.append("  %bn = add i64 %brow, %n")
    L.append("  %ak = mul i64 %kp, %ska")
    for j in range(_NR):
        L += [
            f"  %bo{j} = add i64 %bn, {16 * j}",
            f"  %bp{j} = getelementptr {elt}, ptr %B, i64 %bo{j}",
            f"  %bv{j} = load {vec}, ptr %bp{j}, align 4",
        ]
        if kind == "bf16":
            L.append(f"  %bb{j} = bitcast <16 x i32> %bv{j} to <32 x bfloat>")
    for i in range(mr):
        L += [
            f"  %ar{i} = add i64 %m, {i}",
            f"  %aoa{i} = mul i64 %ar{i}, %lda",
            f"  %ao{i} = add i64 %aoa{i}, %ak",
            f"  %ap{i} = getelementptr {elt}, ptr %A, i64 %ao{i}",
            f"  %as{i} = load {elt}, ptr %ap{i}, align 4",
            f"  %ai{i} = insertelement {vec} poison, {elt} %as{i}, i32 0",
            f"  %av{i} = shufflevector {vec} %ai{i}, {vec} poison, <16 x i32> zeroinitializer",
        ]
        if kind == "bf16":
            L.append(f"  %ab{i} = bitcast <16 x i32> %av{i} to <32 x bfloat>")
        for j in range(_NR):
            if kind == "bf16":
                L.append(
                    f"  %nacc{i}_{j} = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512("
                    f"<16 x float> %acc{i}_{j}, <32 x bfloat> %ab{i}, <32 x bfloat> %bb{j})"
                )
            else:
                L.append(
                    f"  %nacc{i}_{j} = call <16 x float> @llvm.fma.v16f32("
                    f"<16 x float> %av{i}, <16 x float> %bv{j}, <16 x float> %acc{i}_{j})"
                )
    L += [
        "  %kp.next = add i64 %kp, 1",
        "  %kdone = icmp eq i64 %kp.next, %KP",
        "  br i1 %kdone, label %store, label %kloop",
        "store:",
    ]
    for i in range(mr):
        for j in range(_NR):
            L.append(f"  store <16 x float> %nacc{i}_{j}, ptr %cp{i}_{j}, align 4")
    L += [
        "  br label %nlatch",
        "nlatch:",
        f"  %n.next = add i64 %n, {_COLS}",
        "  %ndone = icmp eq i64 %n.next, %N",
        "  br i1 %ndone, label %mlatch, label %nloop",
        "mlatch:",
        f"  %m.next = add i64 %m, {mr}",
        "  %mdone = icmp eq i64 %m.next, %M",
        "  br i1 %mdone, label %exit, label %mloop",
        "exit:",
        "  ret void",
        "}",
    ]
    return "\n".join(L)


#: per kernel kind: the CPU flag it needs, the intrinsic it calls, LLVM's target features
_KIND_SPEC = {
    "bf16": (
        "avx512_bf16",
        "declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)",
        "+avx512f,+avx512bw,+avx512vl,+avx512bf16",
    ),
    "f32": (
        "avx512f",
        "declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
        "+avx512f,+fma",
    ),
}


def _host_flags() -> frozenset:
    from .._onednn import cpu_flags

    return cpu_flags()


def _build(kind: str):
    """Compile the ``kind`` kernels (MR = 1..6) once; None where the CPU or LLVM cannot."""
    flag, decl, features = _KIND_SPEC[kind]
    if flag not in _host_flags():
        return None
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        text = "\n".join(
            [
                decl,
                *(_ir(mr, acc, kind) for mr in range(1, _MR + 1) for acc in (False, True)),
                f'attributes #0 = {{ "target-features"="{features}" }}',
            ]
        )
        mod = llvm.parse_assembly(text)
        mod.verify()
        target = llvm.Target.from_default_triple()
        tm = target.create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
        )
        ee = llvm.create_mcjit_compiler(mod, tm)
        ee.finalize_object()
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        proto = ctypes.CFUNCTYPE(None, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64)
        fns = {
            (mr, acc): proto(ee.get_function_address(f"{kind}gemm_{'acc_' if acc else ''}mr{mr}"))
            for mr in range(1, _MR + 1)
            for acc in (False, True)
        }
        return {"ee": ee, "tm": tm, "fns": fns}
    except Exception:  # noqa: BLE001 - an LLVM without the intrinsic: not available
        return None


def _kernels(kind: str = "bf16"):
    with _lock:
        if kind not in _state:
            _state[kind] = _build(kind)
        return _state[kind]


@functools.lru_cache(maxsize=2)
def available(kind: str = "bf16") -> bool:
    """The CPU has the ``kind``'s instructions (``"bf16"``: AVX-512 BF16; ``"f32"``: AVX-512F)
    and its kernels compiled (once per process)."""
    return _kernels(kind) is not None


def pairs(a16: np.ndarray, buf: np.ndarray | None = None) -> np.ndarray:
    """A 2-D bf16 array (its uint16 bits) as ``[rows, ceil(cols/2)]`` uint32 pairs: a view when
    C-contiguous with an even number of columns, else a zero-padded copy into ``buf``."""
    u = a16.view(np.uint16) if a16.dtype != np.uint16 else a16
    r, c = u.shape
    if c % 2 == 0 and u.flags.c_contiguous:
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
    (8x the rate of the column-at-a-time order at the Qwen2.5 head)."""
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


def b_size(k: int, n: int) -> int:
    """uint32 elements of the kernel's ``B`` for a ``[K, N]`` product: ``ceil(K/2)`` rows of
    ``64·⌈N/64⌉`` (the ``out`` that :func:`pack` and :func:`interleave` need)."""
    return ((k + 1) // 2) * npad(n)


def npad(n: int) -> int:
    """Columns of the kernels' ``B`` for ``n`` output columns: ``64·⌈n/64⌉``."""
    return -(-n // _COLS) * _COLS


def _col_spans(n: int) -> list[tuple[int, int]]:
    """``[0, n)`` in spans of ≤ 512 columns on 64-column boundaries, from ``n`` only."""
    from ._gemm import _spans

    return [(a * _COLS, min(n, b * _COLS)) for a, b in _spans(-(-n // _COLS), 512 // _COLS)] if n else []


def _b_operand(kernel, src: np.ndarray, kp: int, n: int, out: np.ndarray | None, *args) -> np.ndarray:
    """The kernel's ``B`` ``[kp, 64·⌈n/64⌉]`` (in ``out`` when given, uint32 without) filled
    from ``src`` by ``kernel(lo, hi, src, *args, B)`` over its rows, on the GEMM pool."""
    from ._gemm import run_rows

    w = npad(n)
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
    (zero past g's rows): ``gᵀ`` as the kernel's ``A``; 16 columns of ``g`` at a time (its rows
    read a cache line at a time)."""
    k = g.shape[0]
    kp = dst.shape[1]
    for v0 in range(lo, hi, 16):
        v1 = min(hi, v0 + 16)
        for p in range(kp):
            r = 2 * p
            if r + 1 < k:
                for v in range(v0, v1):
                    dst[v, p] = (g[r, v] >> np.uint32(16)) | (g[r + 1, v] & np.uint32(0xFFFF0000))
            else:
                for v in range(v0, v1):
                    dst[v, p] = g[r, v] >> np.uint32(16)


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


def pairs_in_place(g: np.ndarray) -> np.ndarray:
    """:func:`pairs_of_f32` of a C-contiguous ``g`` written over ``g``'s own rows (``g`` is
    consumed): a view of row stride ``K``; pair ``p`` of a row lands at or before the values it
    reads (``2p``, ``2p+1``)."""
    from ._gemm import run_rows

    assert g.flags.c_contiguous
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


def gemm_tile(xp: np.ndarray, bp: np.ndarray, c0: int, c1: int, out: np.ndarray, acc: bool = False) -> None:
    """``out[M, c1-c0] (+)= A · B[:, c0:c1]`` in fp32; ``c0`` a multiple of 64; ``acc``: summed
    onto ``out``.  One thread.

    ``xp`` uint32: the bf16 kernel, ``A`` as pairs [M, KP] (rows of unit stride) and ``bp`` the
    packed [KP, NPAD] pairs; ``xp`` float32: the fp32 kernel, ``A`` [M, K] of any strides (``Aᵀ``
    of a C-contiguous array too) and ``bp`` fp32 [K, ≥ 64·⌈c1/64⌉] with unit column stride."""
    kind = "bf16" if xp.dtype == np.uint32 else "f32"
    fns = _kernels(kind)["fns"]
    m, kp = xp.shape
    n = c1 - c0
    if m == 0 or n == 0:
        return
    if kp == 0:
        if not acc:
            out[...] = 0
        return
    assert c0 % _COLS == 0 and out.dtype == np.float32 and out.strides[1] == 4
    assert bp.dtype.itemsize == 4 and bp.strides[1] == 4 and bp.shape[1] >= npad(c1)
    assert kind == "f32" or xp.strides[1] == 4
    ldc = out.strides[0] // 4
    lda, ska = xp.strides[0] // 4, xp.strides[1] // 4
    ldb = bp.strides[0] // 4
    n64 = (n // _COLS) * _COLS
    m6 = (m // _MR) * _MR
    tail = None
    if n64 != n:
        tail = np.zeros((m, _COLS), np.float32)
        if acc:
            tail[:, : n - n64] = out[:, n64:]
    nk = -(-kp // _KC)
    for c in range(nk):
        k0, k1 = (c * kp) // nk, ((c + 1) * kp) // nk
        ac = acc or c > 0
        for r0, r1, mr in ((0, m6, _MR), (m6, m, m - m6)):
            if r1 <= r0:
                continue
            f = fns[(mr, ac)]
            a = xp.ctypes.data + (r0 * lda + k0 * ska) * 4
            b = bp.ctypes.data + (k0 * ldb + c0) * 4
            if n64:
                f(a, lda, ska, b, ldb, out.ctypes.data + r0 * ldc * 4, ldc, r1 - r0, n64, k1 - k0)
            if tail is not None:
                f(a, lda, ska, b + n64 * 4, ldb, tail.ctypes.data + r0 * _COLS * 4, _COLS, r1 - r0, _COLS, k1 - k0)
    if tail is not None:
        out[:, n64:] = tail[:, : n - n64]


def matmul(xp: np.ndarray, bp: np.ndarray, n: int, out: np.ndarray, acc: bool = False) -> None:
    """``out[M, n] (+)= A · B`` over the GEMM pool from the pairs ``xp`` [M, KP] and the packed
    ``bp`` [KP, ≥ n]: tiles of ≤ 512 rows × ≤ 512 columns (column spans on 64-column
    boundaries), from the shapes only (bitwise the same at any thread count, and any tiling:
    each output is one fixed sequence of additions, onto ``out``'s value with ``acc``)."""
    from ._gemm import ROW_BLOCK, _run, _spans

    cols = _col_spans(n)
    _run(
        [
            (lambda r0=r0, r1=r1, c0=c0, c1=c1: gemm_tile(xp[r0:r1], bp, c0, c1, out[r0:r1, c0:c1], acc))
            for r0, r1 in _spans(xp.shape[0], ROW_BLOCK)
            for c0, c1 in cols
        ]
    )


def matmul_nt(xp: np.ndarray, bp: np.ndarray, n: int, out: np.ndarray) -> None:
    """``out[M, n] = X · Wᵀ`` from ``X``'s pairs and ``W``'s :func:`pack`: :func:`matmul`."""
    matmul(xp, bp, n, out)


def matmul_tn(g: np.ndarray, bp: np.ndarray, n: int, out: np.ndarray, acc: bool = False) -> None:
    """``out[M, n] (+)= gᵀ · B`` for ``g`` fp32 ``[K, M]`` of bf16 values and the packed ``bp``
    [ceil(K/2), ≥ n] (:func:`interleave`): tasks of ≤ 512 rows of ``out`` (two from 128 rows), each pairing its
    columns of ``g`` into its thread's scratch (no ``[M, K]`` copy is held), then its
    column spans; the same sums as :func:`matmul` on ``pairs_of_f32(g, transpose=True)``."""
    from ._gemm import ROW_BLOCK, _run, _spans

    k, m = g.shape
    kp = (k + 1) // 2
    cols = _col_spans(n)
    u = g.view(np.uint32)

    def task(r0, r1):
        xp = _local((r1 - r0) * kp)[: (r1 - r0) * kp].reshape(r1 - r0, kp)
        _top_pairs_t(0, r1 - r0, u[:, r0:r1], xp)
        for c0, c1 in cols:
            gemm_tile(xp, bp, c0, c1, out[r0:r1, c0:c1], acc)

    # ≤ 512 rows per task, and at least two tasks from 128 rows on (a filtered tile's few kept
    # columns would otherwise run on one thread); the sums do not depend on the split
    _run([(lambda r0=r0, r1=r1: task(r0, r1)) for r0, r1 in _spans(m, min(ROW_BLOCK, max(64, -(-m // 2))))])


class Logits:
    """The logits GEMM ``X · W[v0:v1]ᵀ`` of 16-bit ``X`` and ``W`` on an exact-product kernel:
    :meth:`chunk` packs at most ``vc`` rows of ``W`` (into recycled scratch), then
    :meth:`logits` for any row block.

    bf16 (the bf16 kernel): ``X`` read in place as pairs, ``W``'s chunk paired and transposed.
    fp16 (the fp32 kernel, ``kind="f32"``): ``X`` widened once into :attr:`x32` ``[BT,
    64·⌈H/64⌉]`` (columns past H zero: also the grad_weight GEMM's ``B``; the caller's when
    given), ``W``'s chunk widened and transposed."""

    def __init__(self, input: np.ndarray, W: np.ndarray, vc: int, x32: np.ndarray | None = None):
        from .._outcache import empty as scratch
        from ._linear import fp32_block

        H = input.shape[1]
        self.W = W
        self.H = H
        self.f16 = input.dtype == np.float16
        if self.f16:
            self.x32 = x32 if x32 is not None else fp32_block(input, 0, input.shape[0], width=npad(H))
            self.xp = self.x32[:, :H]
            self.pbuf = scratch(H * npad(vc), np.float32)
            self.code = D.code_of(input.dtype)
        else:
            self.xp = pairs(input)
            self.pbuf = scratch(b_size(H, vc), np.uint32)
            self.wbuf = scratch(vc * (H + 1), np.uint16) if H % 2 else None
        self.bp = np.empty((0, 0), np.uint32)
        self.n = 0

    def chunk(self, v0: int, v1: int) -> None:
        if self.f16:
            w = self.W[v0:v1].view(np.uint16)
            self.bp = _b_operand(_transpose_widen_rows, w, self.H, v1 - v0, self.pbuf, self.code)
        else:
            self.bp = pack(pairs(self.W[v0:v1], self.wbuf), self.pbuf)
        self.n = v1 - v0

    def logits(self, b0: int, b1: int, out: np.ndarray) -> None:
        matmul_nt(self.xp[b0:b1], self.bp, self.n, out)
