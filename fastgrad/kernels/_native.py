"""The native GEMM micro-kernel as a parameterized spec, built with ``llvmlite.ir``.

One generator (:func:`build_ir`) writes every variant from a :class:`KernelSpec`: the ISA and
its LLVM target, the vector width (fp32 lanes), the register tile (``mr`` rows × ``nr`` vectors
of columns of fp32 accumulators), the product (``vdpbf16ps`` per pair of bf16 values, or one
fused multiply-add per product) and the operand kind (bf16 pairs or fp32).  The variants
(:data:`SPECS`):

=================  =======  =====  ======  ===========  ==========================================
spec               ISA      lanes  tile    product      operands
=================  =======  =====  ======  ===========  ==========================================
``avx512_bf16dp``  avx512   16     6 × 64  vdpbf16ps    bf16 pairs (A and B, uint32)
``avx512_bf16``    avx512   16     6 × 64  FMA          B bf16 pairs widened in registers; A fp32
``avx2_bf16``      avx2     8      6 × 16  FMA          B bf16 pairs widened in registers; A fp32
``avx512_f32``     avx512   16     6 × 64  FMA          fp32 (the fp16 operands, widened)
``avx2_f32``       avx2     8      6 × 16  FMA          fp32 (the fp16 operands, widened)
=================  =======  =====  ======  ===========  ==========================================

Every variant computes each output as one fixed sequence of fp32 additions onto its start value
(0, or ``C``'s value with ``acc``): ``k = 0, 1, 2, ...`` in order, one rounding per product
added — the products of bf16 (8 significant bits) and fp16 (11) values are exact in fp32, so a
fused multiply-add *is* that addition.  ``vdpbf16ps`` adds a pair's odd product first, then the
even one, each rounded to nearest even, reading subnormal inputs as zero and flushing subnormal
results (Intel SDM vol. 2, VDPBF16PS, operation: ``srcdest.fp32[i] += src1.bf16[2i+1] ·
src2.bf16[2i+1]; srcdest.fp32[i] += src1.bf16[2i+0] · src2.bf16[2i+0]``, DAZ, FTZ; verified on
a Zen 4 EPYC by ``tests/test_native_spec.py``).  The FMA bf16 variants add the odd product,
then the even one, too, and run with MXCSR's DAZ and FTZ bits set for the call (restored on
return): so **all three bf16 variants give the same bits**, and **both fp32 variants give the
same bits** — the result of a GEMM does not depend on the ISA the machine has
(``tests/test_native_spec.py`` pins both).  The register tile and the ISA change only the speed.

The AVX2 variants need AVX2 and FMA (every x86-64 since Haswell / Zen 1): 6 × 16 fp32
accumulators in 12 of the 16 ymm registers, the B vectors and A's broadcast in the rest.  ``B``'s
bf16 pairs are widened in registers (the even value of a 32-bit pair shifted up 16 bits, the
odd one masked), so no widened copy of the weight exists; ``A`` is read as fp32 values (one
broadcast load each: ``g`` in place, ``X`` widened once per call), or as pairs widened in
registers (``a_forms``).  An AVX-512 machine builds them with
its AVX-512 features switched off (the code an AVX2-only CPU runs).

An ARM NEON/SVE variant is a new :class:`KernelSpec` (lanes 4, ``fma``, the target's features;
the IR of the FMA path is target independent; only the subnormal flush is x86's MXCSR, FPCR.FZ
on ARM), not a new module; the CPU features come from ``fastgrad._cpu``, which reads ARM's
``Features`` too.

Each spec is compiled once per process (MCJIT, Numba's LLVM), on first use; a spec whose CPU
flags are missing is not built; a build that fails is reported once (``RuntimeWarning``) and the
callers fall back to BLAS.  The functions (:func:`function_name`) have the signature
``f(A, lda, ska, B, ldb, C, ldc, M, N, KP, B2)``: ``C[M, N] (+)= A · B``, ``M % mr == 0`` (the
function ``mr<r>`` for ``r ≤ mr`` rows), ``N % (lanes·nr) == 0``, ``KP ≥ 1`` (rows of ``B``:
pairs for bf16, values for fp32); ``A[i, k]`` at ``A + i·lda + k·ska`` (``k`` in pairs for pairs
``A``, in values for fp32 ``A``: a pair ``p`` of ``B`` meets ``A[i, 2p]`` and ``A[i, 2p+1]``),
``B[k, n]`` at ``B + k·ldb + n``, ``C[i, n]`` at ``C + i·ldc + n`` (32-bit elements); ``B2``
is ``B`` again (the FMA bf16 variants load the even halves through it: a second pointer LLVM
cannot prove equal, so it does not merge the two loads and hold the raw pairs across both
halves — without it the 6 × 16 AVX2 tile spilled a register every ``k`` pair and ran slower;
figures in bench/results/README.md, "Measurements behind the source's choices").  They
check nothing: the Python wrapper (``_bf16dot.gemm_tile``) validates every argument with
``ValueError`` before the call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import warnings

from .. import _cpu

try:  # llvmlite ships with Numba
    from llvmlite import ir
except ImportError:  # pragma: no cover - numba always brings it
    ir = None  # type: ignore[assignment]

__all__ = ["KernelSpec", "SPECS", "build_ir", "compiled", "function_name", "runnable"]

#: the 32-bit mask of a pair's odd (high) bf16 value, as a signed i32
_HI16 = -65536


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One variant of the native GEMM micro-kernel.

    * ``name``: the variant's name (:data:`SPECS`' key).
    * ``isa``: the ISA family it targets (``"avx512"``, ``"avx2"``).
    * ``kind``: the operands: ``"bf16"`` (``A`` and ``B`` of 32-bit pairs of bf16 values, the
      even ``k`` in the low half) or ``"f32"`` (fp32 values).
    * ``lanes``: fp32 lanes per vector register (16: zmm, 8: ymm).
    * ``mr``, ``nr``: the register tile, ``mr`` rows × ``nr`` vectors of columns of fp32
      accumulators (``mr·nr`` registers).
    * ``product``: ``"dpbf16"`` (``vdpbf16ps``, one instruction per pair) or ``"fma"`` (one fused
      multiply-add per product, a pair's odd product first).
    * ``flags``: the CPU flags it needs (``fastgrad._cpu`` names).
    * ``features``: the LLVM target features it is compiled with (on top of the host's, or in
      place of them with ``isolate``).
    * ``isolate``: compile with the host's features of newer ISAs switched off (``-avx512f``,
      ``-amx-tile``...): the code a CPU with only ``flags`` runs.
    * ``flush_subnormals``: MXCSR DAZ and FTZ set for the call (vdpbf16ps's subnormal rules).
    * ``order``: the tile loops, ``"mn"`` (rows outer, the default: ``A``'s row tile stays in L1
      while ``B``'s column tiles pass) or ``"nm"`` (columns outer: ``B``'s strip stays while the
      row tiles pass; no faster for the AVX2 variants: bench/results/README.md).  The sums are
      the same either way (``k`` innermost, in order).
    * ``a_forms``: the forms of ``A`` compiled, the first preferred: ``"pairs"`` (32-bit bf16
      pairs, ``k`` counted in pairs) or ``"f32"`` (fp32 values; with bf16 pairs as ``B``: values
      that are bf16 values, two per pair of ``B``, ``A[i, 2p]`` and ``A[i, 2p+1]``).  The FMA bf16
      variants prefer fp32 ``A``: a broadcast load per value, no widening of ``A`` in registers,
      and the gradient GEMMs read ``g`` in place (no pairing pass).
    """

    name: str
    isa: str
    kind: str
    lanes: int
    mr: int
    nr: int
    product: str
    flags: tuple[str, ...]
    features: str
    isolate: bool = False
    flush_subnormals: bool = False
    a_forms: tuple[str, ...] = ()
    order: str = "mn"

    def __post_init__(self) -> None:
        if self.kind not in ("bf16", "f32"):
            raise ValueError(f"kind must be 'bf16' or 'f32', got {self.kind!r}")
        if self.product not in ("dpbf16", "fma"):
            raise ValueError(f"product must be 'dpbf16' or 'fma', got {self.product!r}")
        if self.product == "dpbf16" and self.kind != "bf16":
            raise ValueError("product 'dpbf16' needs kind 'bf16'")
        fma16 = self.kind == "bf16" and self.product == "fma"
        ok = {"pairs", "f32"} if fma16 else {"pairs" if self.kind == "bf16" else "f32"}
        if not self.a_forms:  # the default: fp32 A first where the product allows it
            object.__setattr__(self, "a_forms", ("f32", "pairs") if fma16 else tuple(ok))
        if not set(self.a_forms) <= ok:
            raise ValueError(
                f"a_forms of a {self.kind}/{self.product} spec must be among {sorted(ok)}, got {self.a_forms}"
            )
        if self.order not in ("mn", "nm"):
            raise ValueError(f"order must be 'mn' or 'nm', got {self.order!r}")
        if self.mr < 1 or self.nr < 1 or self.lanes < 1:
            raise ValueError(f"mr, nr and lanes must be >= 1, got {self.mr}, {self.nr}, {self.lanes}")

    @property
    def cols(self) -> int:
        """Columns of the register tile (``lanes · nr``): ``N`` is a multiple of it."""
        return self.lanes * self.nr


_AVX512 = "+avx512f,+avx512bw,+avx512vl,+fma"
_AVX2 = "+avx,+avx2,+fma,+f16c"

#: the variants, by name; :data:`PREFERENCE` orders them per operand kind
SPECS: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        KernelSpec(
            "avx512_bf16dp", "avx512", "bf16", 16, 6, 4, "dpbf16", ("avx512f", "avx512_bf16"), _AVX512 + ",+avx512bf16"
        ),
        KernelSpec(
            "avx512_bf16", "avx512", "bf16", 16, 6, 4, "fma", ("avx512f",), _AVX512, False, True, ("f32", "pairs")
        ),
        KernelSpec("avx2_bf16", "avx2", "bf16", 8, 6, 2, "fma", ("avx2", "fma"), _AVX2, True, True, ("f32", "pairs")),
        KernelSpec("avx512_f32", "avx512", "f32", 16, 6, 4, "fma", ("avx512f",), _AVX512),
        KernelSpec("avx2_f32", "avx2", "f32", 8, 6, 2, "fma", ("avx2", "fma"), _AVX2, True),
    )
}

#: per operand kind, the variants in order of preference (the first that runs is used)
PREFERENCE: dict[str, tuple[str, ...]] = {
    "bf16": ("avx512_bf16dp", "avx512_bf16", "avx2_bf16"),
    "f32": ("avx512_f32", "avx2_f32"),
}


def function_name(spec: KernelSpec, mr: int, acc: bool, a_form: str | None = None) -> str:
    """The name of ``spec``'s function for ``mr`` rows (``acc``: summed onto ``C``) and ``A`` of
    form ``a_form`` (default: the spec's first)."""
    a = spec.a_forms[0] if a_form is None else a_form
    return f"{spec.name}_{a}_gemm_{'acc_' if acc else ''}mr{mr}"


class _BFloat(ir.Type if ir is not None else object):  # type: ignore[misc]
    """LLVM's ``bfloat`` (llvmlite.ir has no class for it): the operand type of ``vdpbf16ps``."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _declare(module, name: str, ret, args):
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ret, args), name)


def _splat(b, value, vty):
    """``value`` in every lane of a vector of type ``vty``."""
    i32 = ir.IntType(32)
    v = b.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(i32, 0))
    return b.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(i32, vty.count), None))


def _emit(module, spec: KernelSpec, mr: int, acc: bool, a_form: str) -> None:
    """Append ``spec``'s function for ``mr`` rows and ``A`` of form ``a_form`` to ``module`` (see
    the module doc)."""
    i64, i32, f32, ptr = ir.IntType(64), ir.IntType(32), ir.FloatType(), ir.PointerType()
    L = spec.lanes
    vf, vi = ir.VectorType(f32, L), ir.VectorType(i32, L)
    elt = i32 if spec.kind == "bf16" else f32
    velt = vi if spec.kind == "bf16" else vf
    a_f32 = a_form == "f32"  # fp32 A (with bf16 pairs as B: two values per pair)
    aelt = f32 if a_f32 else i32
    fn = ir.Function(
        module,
        ir.FunctionType(ir.VoidType(), [ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ptr]),
        function_name(spec, mr, acc, a_form),
    )
    A, lda, ska, B, ldb, C, ldc, M, N, KP, B2 = fn.args
    for p in (A, B, C):
        p.add_attribute("noalias")
    fma = _declare(module, f"llvm.fma.v{L}f32", vf, [vf, vf, vf])
    if spec.product == "dpbf16":
        vbf = ir.VectorType(_BFloat(), 2 * L)
        dp = _declare(module, f"llvm.x86.avx512bf16.dpbf16ps.{32 * L}", vf, [vf, vbf, vbf])
    c = lambda ty, v: ir.Constant(ty, v)  # noqa: E731
    hi_mask, sh16 = c(vi, [_HI16] * L), c(vi, [16] * L)

    # the tile loops: rows outer, columns inner ("mn"), or columns outer ("nm": a column strip of
    # B stays in L1 while the row tiles pass under it); the k loop innermost either way
    names = ("oloop", "iloop", "kloop", "store", "ilatch", "olatch")
    blocks = {n: fn.append_basic_block(n) for n in ("entry", *names, "exit")}
    b = ir.IRBuilder(blocks["entry"])
    if spec.flush_subnormals:  # MXCSR |= DAZ | FTZ for the call, restored at the exit
        st = _declare(module, "llvm.x86.sse.stmxcsr", ir.VoidType(), [ptr])
        ld = _declare(module, "llvm.x86.sse.ldmxcsr", ir.VoidType(), [ptr])
        saved, flushed = b.alloca(i32, name="mxcsr"), b.alloca(i32, name="mxcsr.ftz")
        b.call(st, [saved])
        b.store(b.or_(b.load(saved, typ=i32), c(i32, 0x8040)), flushed)
        b.call(ld, [flushed])
    b.branch(blocks["oloop"])

    b.position_at_end(blocks["oloop"])
    outer = b.phi(i64, "n" if spec.order == "nm" else "m")
    b.branch(blocks["iloop"])

    b.position_at_end(blocks["iloop"])
    inner = b.phi(i64, "m" if spec.order == "nm" else "n")
    m, n = (inner, outer) if spec.order == "nm" else (outer, inner)
    cptr, c0 = {}, {}
    for i in range(mr):  # the store's addresses; with acc, C's values start the sums
        co = b.add(b.mul(b.add(m, c(i64, i)), ldc), n)
        for j in range(spec.nr):
            cptr[i, j] = b.gep(C, [b.add(co, c(i64, L * j))], source_etype=f32)
            if acc:
                c0[i, j] = b.load(cptr[i, j], typ=vf, align=4)
    b.branch(blocks["kloop"])

    b.position_at_end(blocks["kloop"])
    kp = b.phi(i64, "kp")
    accs = {(i, j): b.phi(vf, f"acc{i}_{j}") for i in range(mr) for j in range(spec.nr)}
    bn = b.add(b.mul(kp, ldb), n)
    ak = b.mul(kp, ska)
    bv = [b.load(b.gep(B, [b.add(bn, c(i64, L * j))], source_etype=elt), typ=velt, align=4) for j in range(spec.nr)]
    # the FMA bf16 variants read each B vector twice, through B (the odd half) and B2 (the same
    # address, the even half): LLVM cannot merge the loads, so the pair is not held across both
    # halves (12 accumulators + 2 widened vectors + a broadcast fill the 16 ymm registers)
    bv2 = [b.load(b.gep(B2, [b.add(bn, c(i64, L * j))], source_etype=elt), typ=velt, align=4) for j in range(spec.nr)]
    arow = [b.add(b.mul(b.add(m, c(i64, i)), lda), ak) for i in range(mr)]  # A[i, k] offsets
    if spec.kind == "bf16" and a_f32:  # A[i, 2p] and A[i, 2p+1]: ak = p·2·ska
        ak2 = b.mul(ak, c(i64, 2))
        arow = [b.add(b.mul(b.add(m, c(i64, i)), lda), ak2) for i in range(mr)]
        a_even = [b.load(b.gep(A, [o], source_etype=f32), typ=f32, align=4) for o in arow]
        a_odd = [b.load(b.gep(A, [b.add(o, ska)], source_etype=f32), typ=f32, align=4) for o in arow]
    else:
        arow = [b.load(b.gep(A, [o], source_etype=aelt), typ=aelt, align=4) for o in arow]
    new = dict(accs)
    if spec.product == "dpbf16":
        bb = [b.bitcast(v, vbf) for v in bv]
        for i in range(mr):
            ab = b.bitcast(_splat(b, arow[i], vi), vbf)
            for j in range(spec.nr):
                new[i, j] = b.call(dp, [new[i, j], ab, bb[j]])
    elif spec.kind == "bf16":
        # a pair's odd (high) product first, then the even (low) one: vdpbf16ps's order
        for half in ("odd", "even"):
            bh = (
                [b.bitcast(b.and_(v, hi_mask), vf) for v in bv]
                if half == "odd"
                else [b.bitcast(b.shl(v, sh16), vf) for v in bv2]
            )
            for i in range(mr):
                if a_f32:
                    av = _splat(b, a_odd[i] if half == "odd" else a_even[i], vf)
                else:
                    a32 = b.and_(arow[i], c(i32, _HI16)) if half == "odd" else b.shl(arow[i], c(i32, 16))
                    av = _splat(b, b.bitcast(a32, f32), vf)
                for j in range(spec.nr):
                    new[i, j] = b.call(fma, [av, bh[j], new[i, j]])
    else:
        for i in range(mr):
            av = _splat(b, arow[i], vf)
            for j in range(spec.nr):
                new[i, j] = b.call(fma, [av, bv[j], new[i, j]])
    kp_next = b.add(kp, c(i64, 1))
    b.cbranch(b.icmp_signed("==", kp_next, KP), blocks["store"], blocks["kloop"])

    b.position_at_end(blocks["store"])
    for key, p in cptr.items():
        b.store(new[key], p, align=4)
    b.branch(blocks["ilatch"])

    (ostep, obound), (istep, ibound) = ((spec.cols, N), (mr, M)) if spec.order == "nm" else ((mr, M), (spec.cols, N))
    b.position_at_end(blocks["ilatch"])
    i_next = b.add(inner, c(i64, istep))
    b.cbranch(b.icmp_signed("==", i_next, ibound), blocks["olatch"], blocks["iloop"])

    b.position_at_end(blocks["olatch"])
    o_next = b.add(outer, c(i64, ostep))
    b.cbranch(b.icmp_signed("==", o_next, obound), blocks["exit"], blocks["oloop"])

    b.position_at_end(blocks["exit"])
    if spec.flush_subnormals:
        b.call(ld, [saved])
    b.ret_void()

    outer.add_incoming(c(i64, 0), blocks["entry"])
    outer.add_incoming(o_next, blocks["olatch"])
    inner.add_incoming(c(i64, 0), blocks["oloop"])
    inner.add_incoming(i_next, blocks["ilatch"])
    kp.add_incoming(c(i64, 0), blocks["iloop"])
    kp.add_incoming(kp_next, blocks["kloop"])
    for key, phi in accs.items():
        phi.add_incoming(c0[key] if acc else c(vf, None), blocks["iloop"])
        phi.add_incoming(new[key], blocks["kloop"])


def build_ir(spec: KernelSpec) -> str:
    """The LLVM IR of ``spec``'s functions: ``mr`` = 1 .. ``spec.mr`` rows, with and without
    ``acc`` (:func:`function_name`)."""
    if ir is None:  # pragma: no cover
        raise RuntimeError("llvmlite is not installed")
    module = ir.Module(name=spec.name)
    for a_form in spec.a_forms:
        for mr in range(1, spec.mr + 1):
            for acc in (False, True):
                _emit(module, spec, mr, acc, a_form)
    return str(module)


def runnable(spec: KernelSpec, flags: frozenset | None = None) -> bool:
    """The CPU (``flags``: :func:`fastgrad._cpu.flags` when None) has ``spec``'s instructions."""
    f = _cpu.flags() if flags is None else flags
    return all(x in f for x in spec.flags)


def _target_features(spec: KernelSpec) -> str:
    """The host's LLVM features plus ``spec.features``; with ``isolate``, the host's AVX-512,
    AVX10 and AMX features switched off."""
    import llvmlite.binding as llvm

    feats = dict(llvm.get_host_cpu_features())
    if spec.isolate:
        for k in feats:
            if k.startswith(("avx512", "amx", "avx10", "evex512")):
                feats[k] = False
    for f in spec.features.split(","):
        feats[f[1:]] = f[0] == "+"
    return ",".join(("+" if on else "-") + k for k, on in sorted(feats.items()))


def _compile(spec: KernelSpec) -> dict:
    """Compile ``spec`` (MCJIT): ``{"ee", "tm", "fns": {(a_form, mr, acc): ctypes function}}``."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = llvm.parse_assembly(build_ir(spec))
    mod.verify()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=_target_features(spec), opt=3
    )
    ee = llvm.create_mcjit_compiler(mod, tm)
    ee.finalize_object()
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, vp, i64, i64, vp, i64, vp, i64, i64, i64, i64, vp)
    fns = {
        (a_form, mr, acc): proto(ee.get_function_address(function_name(spec, mr, acc, a_form)))
        for a_form in spec.a_forms
        for mr in range(1, spec.mr + 1)
        for acc in (False, True)
    }
    return {"ee": ee, "tm": tm, "fns": fns}


_lock = threading.Lock()
_built: dict[str, dict | None] = {}
_warned: set[str] = set()


def _after_fork_in_child() -> None:
    """The compiled code stays valid in a forked child (same memory); only the lock, which a
    parent thread may have held at the fork, is replaced."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def compiled(spec: KernelSpec, flags: frozenset | None = None) -> dict | None:
    """``spec``'s compiled functions (built once per process), or None where the CPU lacks its
    instructions or the build failed (reported once per spec with a ``RuntimeWarning``).
    ``flags`` (tests): the CPU flags to judge by instead of the host's; nothing is cached then."""
    if flags is not None:
        return _compile(spec) if runnable(spec, flags) else None
    if spec.name in _built:  # built (or refused) already: no lock on the GEMM tiles' path
        return _built[spec.name]
    with _lock:
        if spec.name not in _built:
            res = None
            if runnable(spec):
                try:
                    res = _compile(spec)
                except Exception as e:  # noqa: BLE001 - any LLVM failure: the callers use BLAS
                    if spec.name not in _warned:
                        _warned.add(spec.name)
                        warnings.warn(
                            f"fastgrad: the native GEMM kernel {spec.name!r} failed to build "
                            f"({type(e).__name__}: {e}); its GEMMs run on BLAS",
                            RuntimeWarning,
                            stacklevel=3,
                        )
            _built[spec.name] = res
        return _built[spec.name]


def assembly(spec: KernelSpec) -> str:
    """The machine code of ``spec``'s functions as assembly text (tests: registers used)."""
    import llvmlite.binding as llvm

    k = compiled(spec)
    if k is None:
        raise ValueError(f"kernel {spec.name!r} does not run on this CPU")
    return k["tm"].emit_assembly(llvm.parse_assembly(build_ir(spec)))
