"""The native GEMM kernel's spec (fastgrad/kernels/_native.py): every variant against an exact
oracle of its documented summation order, and the variants against each other, bitwise.

The oracle (:func:`_sequential`) is written here from the documentation, not from the kernel:
each output starts at 0 (or ``C``) and adds, for ``k`` pair by pair, the odd product then the
even one (bf16 pairs; fp32 operands: ``k`` in order), each sum rounded once to fp32 (round to
nearest even, from the exact rational value), with the bf16 variants' DAZ/FTZ: subnormal inputs
read as zero, subnormal sums flushed to a zero of their sign.  Every variant this CPU runs is
checked against it, and against the others.
"""

from __future__ import annotations

import re
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fastgrad import _cpu
from fastgrad.kernels import _bf16dot as B
from fastgrad.kernels import _native as N

BF = ml_dtypes.bfloat16
F32_TINY = Fraction(2) ** -126


def _runnable(kind):
    return [n for n in N.PREFERENCE[kind] if N.runnable(N.SPECS[n])]


def _round_f32(x: Fraction) -> np.float32:
    """``x`` rounded to fp32, nearest even, from the exact value (no double rounding)."""
    if x == 0:
        return np.float32(0.0)
    f = np.float32(float(x))  # within one ulp of the answer
    cands = {f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))}
    cands = [c for c in cands if np.isfinite(c)]
    if not cands:
        return f
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - x), int(np.array(c).view(np.uint32)) & 1))
    return np.float32(best)


def _sequential(A: np.ndarray, Bm: np.ndarray, C: np.ndarray | None, pairs: bool, flush: bool) -> np.ndarray:
    """The documented sum of ``A`` [M, K] · ``Bm`` [K, N] (finite fp32 values) onto ``C``."""
    M, K = A.shape
    Nn = Bm.shape[1]

    def daz(v):
        return 0.0 if flush and v != 0 and abs(Fraction(float(v))) < F32_TINY else float(v)

    order = []
    for p in range((K + 1) // 2 if pairs else K):
        order += [2 * p + 1, 2 * p] if pairs else [p]
    out = np.empty((M, Nn), np.float32)
    for i in range(M):
        for j in range(Nn):
            acc = np.float32(0.0) if C is None else C[i, j]
            for k in order:
                if k >= K:  # the padded half of the last pair: + (+0)·0
                    a = b = 0.0
                else:
                    a, b = daz(A[i, k]), daz(Bm[k, j])
                s = Fraction(float(acc)) + Fraction(a) * Fraction(b)
                r = _round_f32(s)
                if s == 0:  # an exact zero sum: +0 unless both addends are -0 (round to nearest)
                    neg = np.signbit(acc) and (a * b == 0 and np.signbit(np.float32(a * b)))
                    r = np.float32(-0.0 if neg else 0.0)
                if flush and r != 0 and abs(Fraction(float(r))) < F32_TINY:
                    r = np.float32(-0.0 if r < 0 else 0.0)
                acc = r
            out[i, j] = acc
    return out


def _hostile_bf16(rng, shape):
    """bf16 values over the whole normal range, with subnormals, zeros of both signs and ties."""
    mag = rng.choice([1.0, 2.0**-60, 2.0**-126, 2.0**-130, 2.0**40, 2.0**-8], shape, p=[0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    v = (rng.standard_normal(shape) * mag).astype(BF)
    v[rng.random(shape) < 0.05] = BF(-0.0)
    v[rng.random(shape) < 0.05] = BF(1.0)
    return v


def _call(spec_name, A, Bm, C, acc, a_form=None):
    """One tile through ``gemm_tile`` on the named variant (``A`` in the form ``a_form``, by
    default the variant's preferred one)."""
    spec = N.SPECS[spec_name]
    a_form = spec.a_forms[0] if a_form is None else a_form
    if True:
        out = C.copy() if acc else np.full((A.shape[0], Bm.shape[1]), np.nan, np.float32)
        if spec.kind == "bf16":
            xp = B.pairs(A.astype(BF).view(np.uint16)) if a_form == "pairs" else A
            bp = B.interleave(Bm.view(np.uint16))
        else:
            xp = A
            bp = np.zeros((Bm.shape[0], B.npad(Bm.shape[1])), np.float32)
            bp[:, : Bm.shape[1]] = Bm
        B.gemm_tile(xp, bp, 0, Bm.shape[1], out, acc, spec=spec)
        return out


@pytest.mark.parametrize("name", sorted(N.SPECS))
def test_every_spec_gives_valid_ir(name):
    """The generator's IR parses and verifies for every spec (on any CPU: no code is run)."""
    import llvmlite.binding as llvm

    text = N.build_ir(N.SPECS[name])
    mod = llvm.parse_assembly(text)
    mod.verify()
    spec = N.SPECS[name]
    for mr in range(1, spec.mr + 1):
        assert mod.get_function(N.function_name(spec, mr, True)) is not None
    assert ("dpbf16ps" in text) == (spec.product == "dpbf16")
    assert ("ldmxcsr" in text) == spec.flush_subnormals


def test_spec_validation():
    with pytest.raises(ValueError, match="dpbf16"):
        N.KernelSpec("x", "avx512", "f32", 16, 6, 4, "dpbf16", (), "")
    with pytest.raises(ValueError, match="kind"):
        N.KernelSpec("x", "avx512", "f16", 16, 6, 4, "fma", (), "")
    with pytest.raises(ValueError, match="product"):
        N.KernelSpec("x", "avx512", "f32", 16, 6, 4, "mul", (), "")
    for s in N.SPECS.values():
        assert B._COLS % s.cols == 0, s.name  # the packed B's column granule fits every tile


_FORMS = [(n, f) for n in _runnable("bf16") + _runnable("f32") for f in N.SPECS[n].a_forms]


@pytest.mark.parametrize("name,a_form", _FORMS, ids=[f"{n}-{f}" for n, f in _FORMS])
@pytest.mark.parametrize("M,K,Nn", [(1, 1, 1), (7, 5, 3), (6, 4, 16), (13, 9, 70), (2, 6, 64)])
@pytest.mark.parametrize("acc", [False, True])
def test_each_variant_is_the_documented_sequential_sum(name, a_form, M, K, Nn, acc):
    """Each variant and form of ``A`` (odd ``K``: the last pair padded), fresh and onto ``C``."""
    spec = N.SPECS[name]
    rng = np.random.default_rng(M * 100 + K * 10 + Nn + acc)
    if spec.kind == "bf16":
        A = _hostile_bf16(rng, (M, K)).astype(np.float32)
        Bm = _hostile_bf16(rng, (K, Nn))
        Bf = Bm.astype(np.float32)
    else:
        A = (rng.standard_normal((M, K)) * rng.choice([1.0, 2.0**-20, 2.0**10], (M, K))).astype(np.float16)
        A = A.astype(np.float32)
        Bm = Bf = rng.standard_normal((K, Nn)).astype(np.float16).astype(np.float32)
    C = (rng.standard_normal((M, Nn)) * rng.choice([1.0, 2.0**-130, 0.0], (M, Nn))).astype(np.float32)
    got = _call(name, A, Bm, C, acc, a_form)
    if a_form == "f32" and spec.kind == "bf16":  # also A transposed in place (gᵀ), a strided A
        At = np.ascontiguousarray(A.T).T
        assert np.array_equal(got.view(np.uint32), _call(name, At, Bm, C, acc, a_form).view(np.uint32))
    want = _sequential(A, Bf, C if acc else None, spec.kind == "bf16", spec.kind == "bf16")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", ["bf16", "f32"])
def test_variants_agree_bitwise(kind):
    """Every variant of an operand kind that runs here: the same bits, on hostile values, odd K,
    several k passes, both row tails."""
    names = _runnable(kind)
    if sum(len(N.SPECS[n].a_forms) for n in names) < 2:
        pytest.skip(f"one {kind} variant and form runs on this CPU: nothing to compare")
    rng = np.random.default_rng(7)
    M, K, Nn = 19, 601, 150
    if kind == "bf16":
        A = _hostile_bf16(rng, (M, K)).astype(np.float32)
        Bm = _hostile_bf16(rng, (K, Nn))
    else:
        A = rng.standard_normal((M, K)).astype(np.float16).astype(np.float32)
        Bm = rng.standard_normal((K, Nn)).astype(np.float16).astype(np.float32)
    C = rng.standard_normal((M, Nn)).astype(np.float32)
    forms = [(n, f) for n in names for f in N.SPECS[n].a_forms]
    for acc in (False, True):
        res = [_call(n, A, Bm, C, acc, f) for n, f in forms]
        for nf, r in zip(forms[1:], res[1:]):
            assert np.array_equal(res[0].view(np.uint32), r.view(np.uint32)), (forms[0], nf)


def test_mxcsr_is_restored_after_the_flushing_variants():
    """The FMA bf16 variants set DAZ/FTZ for the call only: subnormal arithmetic afterwards (this
    thread and the pool's) is IEEE again."""
    names = [n for n in _runnable("bf16") if N.SPECS[n].flush_subnormals]
    if not names:
        pytest.skip("no flushing variant runs here")
    rng = np.random.default_rng(3)
    A = _hostile_bf16(rng, (300, 40)).astype(np.float32)
    Bm = _hostile_bf16(rng, (40, 700))
    tiny = np.array([2.0**-140], np.float32)
    for n in names:
        _call(n, A, Bm, np.zeros((300, 700), np.float32), False)
        assert (tiny * np.float32(1.0))[0] != 0  # FTZ off again
        assert (tiny + np.float32(0.0))[0] == tiny[0]  # DAZ off again


@pytest.mark.skipif(not _cpu.has("avx2", "fma"), reason="the AVX2 variant needs AVX2 + FMA")
def test_the_avx2_variants_are_avx2_code():
    """Built with the AVX-512 features off (the code an AVX2-only CPU runs): ymm registers 0-15
    only, no zmm, no mask registers; the FMA loop's accumulators never spill."""
    for name in ("avx2_bf16", "avx2_f32"):
        asm = N.assembly(N.SPECS[name])
        assert "zmm" not in asm and not re.search(r"%k[0-7]\b", asm), name
        regs = {int(r) for r in re.findall(r"%[xy]mm(\d+)", asm)}
        assert max(regs) <= 15, name
        assert "vfmadd" in asm
        # the full register tile's functions (every row tile but the last of a block) store no
        # ymm register to the stack: 12 accumulators, the B vectors (bf16: each half widened from
        # its own load, 2 at a time) and a broadcast fit the 16 ymm registers.  Before the
        # second B load the bf16 variant spilled a raw pair once per k step (~85 GF/s, ~100+
        # after, Zen 4 running the AVX2 code)
        spec = N.SPECS[name]
        for fn in {N.function_name(spec, spec.mr, acc, f) for acc in (False, True) for f in spec.a_forms}:
            body = asm.split(f"\n{fn}:", 1)[1].split(".cfi_endproc", 1)[0]
            spills = re.findall(r"vmov(?:dq[ua]|[ua]ps)\s+%ymm\d+, -?\d*\(%rsp\)", body)
            assert not spills, (fn, spills[:3])


@pytest.mark.skipif(not _cpu.has("avx512_bf16"), reason="needs AVX-512 BF16 (vdpbf16ps)")
def test_vdpbf16ps_adds_the_odd_product_first():
    """The SDM's VDPBF16PS order (odd pair element, then the even one, each rounded) holds on this
    CPU; an even-first order or one rounding per pair would differ on these sums."""
    A = np.array([[2.0**-24, 1.0]], np.float32)  # pair (even 2^-24, odd 1)
    Bm = np.array([[1.0], [2.0**-24]], BF)  # even·even = 2^-24, odd·odd = 2^-24
    C = np.array([[1.0]], np.float32)
    got = _call("avx512_bf16dp", A, Bm, C, True)[0, 0]
    # odd first: 1 + 2^-24 -> 1 (tie to even), then + 2^-24 -> 1; one rounding: 1 + 2^-23
    assert got == np.float32(1.0)
    assert np.float32(float(Fraction(1) + 2 * Fraction(2) ** -24)) != got


def test_detector_parses_x86_and_arm_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\nbugs\t: x\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes fphp asimdhp bf16 sve\nCPU part\t: 0xd0c\n"
    assert _cpu._parse_cpuinfo(x86) == {"fpu", "avx2", "fma", "avx512f", "avx512_bf16"}
    assert {"asimd", "bf16", "sve"} <= _cpu._parse_cpuinfo(arm)
    assert _cpu._parse_cpuinfo("processor: 0\n") == frozenset()
    # the vendor ("auto" takes the AVX-512 variants on AMD only: _bf16dot.AUTO_AVX512_VENDORS)
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n" + x86
    assert _cpu._parse_vendor(intel) == "GenuineIntel"
    assert _cpu._parse_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\n") == "AuthenticAMD"
    assert _cpu._parse_vendor(arm) == ""
    # LLVM's names mapped to the kernel's
    fl = _cpu._from_llvm()
    if _cpu.arch() == "x86_64" and fl:
        assert "avx512bf16" not in fl and ("avx512_bf16" in fl) == _cpu.has("avx512_bf16")
        assert ("avx2" in fl) == _cpu.has("avx2")


def test_one_detector():
    """Nothing else in the package reads /proc/cpuinfo or asks LLVM for the host's features."""
    import pathlib

    import fastgrad

    root = pathlib.Path(fastgrad.__file__).parent
    # the bench's machine description (model name, and a flags list for the report) still reads
    # its own lines; moving its flags to fastgrad._cpu is asked of its owner (issue 26)
    pending = {"benchmarks/machine.py"}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel == "_cpu.py" or rel in pending:
            continue
        src = path.read_text()
        assert "/proc/cpuinfo" not in src.replace("``/proc/cpuinfo``", ""), rel
        assert "get_host_cpu_features" not in src or rel == "kernels/_native.py", rel


def test_a_build_failure_warns_once_and_falls_back(monkeypatch):
    spec = N.KernelSpec("broken_test", "avx2", "f32", 8, 6, 2, "fma", (), "+avx2,+fma")

    def boom(s):
        raise RuntimeError("no LLVM today")

    monkeypatch.setattr(N, "_compile", boom)
    monkeypatch.setattr(N, "_built", {})
    monkeypatch.setattr(N, "_warned", set())
    with pytest.warns(RuntimeWarning, match="broken_test"):
        assert N.compiled(spec) is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert N.compiled(spec) is None  # cached, no second warning
    # a variant that does not build is not chosen: the ops run on BLAS
    monkeypatch.setattr(N, "_built", {n: None for n in N.SPECS})
    assert B.variant("bf16") is None and not B.available("bf16") and not B.available("f32")


def test_gemm_tile_preconditions_raise_internal_error():
    """Every precondition of the raw-pointer call is an ``InternalError`` (an invariant, not a
    user's ``ValueError``; raised, so ``python -O`` keeps it)."""
    from fastgrad.errors import InternalError

    if not B.available("f32"):
        pytest.skip("no native kernel here")
    spec = B.variant("f32")
    A = np.ones((4, 8), np.float32)
    bp = np.ones((8, 64), np.float32)
    out = np.zeros((4, 64), np.float32)
    B.gemm_tile(A, bp, 0, 64, out, spec=spec)
    assert np.all(out == 8)
    bad = [
        (A, bp[:7], 0, 64, out),  # B too short in k
        (A, bp[:, :32], 0, 64, out),  # B too narrow
        (A, bp, 0, 64, out[:, :32]),  # out the wrong shape
        (A, bp, 32, 64, out[:, :32]),  # c0 not a multiple of 64
        (A, bp, 0, 64, out.astype(np.float64)),  # out not fp32
        (A.astype(np.uint32), bp, 0, 64, out),  # dtypes differ: pairs A, fp32 B (fp32 A with bf16
        # pairs B is valid on the FMA variants: not a precondition failure under every ISA)
        (A.astype(np.uint32)[:, ::2], bp.astype(np.uint32), 0, 64, out),  # pairs not unit stride
        (A, bp, 0, 64, np.zeros((4, 64), np.float32)[:, ::-1]),  # negative column stride
        (A[None], bp, 0, 64, out),  # not 2-D
    ]
    ro = np.zeros((4, 64), np.float32)
    ro.flags.writeable = False
    bad.append((A, bp, 0, 64, ro))
    for args in bad:
        with pytest.raises(InternalError):
            B.gemm_tile(*args, spec=spec)
    with pytest.raises(InternalError, match="variant given"):  # no variant: never a silent choice
        B.gemm_tile(A, bp, 0, 64, out, spec=None)
    with pytest.raises(InternalError, match="operands"):  # a bf16 variant on fp32 operands
        B.gemm_tile(A, bp, 0, 64, out, spec=B.variant("bf16") or N.SPECS["avx2_bf16"])
    with pytest.raises(InternalError, match="C-contiguous"):
        B.pairs_in_place(np.ones((4, 8), np.float32)[:, ::2], "pairs")
    with pytest.raises(InternalError, match="form"):  # the plan's A form, named (GemmChoice.a_form)
        B.pairs_in_place(np.ones((4, 8), np.float32), None)
    with pytest.raises(ValueError, match="ISA"):
        B.variant("f32", "sse2")


def test_isa_setting(monkeypatch):
    from fastgrad import _config

    monkeypatch.setenv("FASTGRAD_NATIVE_ISA", "avx-2")
    with pytest.raises(ValueError, match="FASTGRAD_NATIVE_ISA"):
        _config.native_isa()
    monkeypatch.setenv("FASTGRAD_NATIVE_ISA", "AVX2")
    try:
        assert _config.native_isa() == "avx2"
        # the op layer resolves the variant from the setting into the call's GEMM choice
        from fastgrad.ops import _engines

        c = _engines.gemm_choice(np.float16)
        assert c.isa == "avx2" and c.variant in (None, "avx2_f32")
        if B.available():
            assert B.variant("bf16", "avx2").isa == "avx2" and B.variant("f32", "avx2").isa == "avx2"
        _config.set_native_isa("auto")  # the setter beats the environment
        assert _config.native_isa() == "auto" and _engines.gemm_choice(np.float16).isa == "auto"
        with pytest.raises(ValueError, match="isa"):
            _config.set_native_isa("neon2")
    finally:
        _config.set_native_isa(None)
        monkeypatch.delenv("FASTGRAD_NATIVE_ISA")
    assert not hasattr(B, "select_isa") and not hasattr(B, "_isa")  # the kernel module keeps no setting


@pytest.mark.parametrize("name,a_form", _FORMS, ids=[f"{n}-{f}" for n, f in _FORMS])
@pytest.mark.parametrize("acc", [False, True])
def test_passes_and_column_blocks_keep_the_sequential_sum(name, a_form, acc):
    """A tile past one pass over ``k`` (``_KC`` pairs) and one call's column block (``_NS``), with a
    column edge: every output is still the one sequence of additions.  Normal-range values (no
    flush), so the oracle is NumPy's fp32 ``c + a·b`` in the documented order (the products of
    bf16 or fp16 values are exact in fp32: one rounding per addition, as the fused multiply-add)."""
    spec = N.SPECS[name]
    ns = max(B._NS, 4 * spec.cols)
    M, K, Nn = 13, 2 * B._KC + 89, 2 * ns + 101  # 3 passes (pairs) / 2 (fp32 values); 2 blocks, 64 columns, 37
    rng = np.random.default_rng(7)
    dt = BF if spec.kind == "bf16" else np.float16
    A = (rng.standard_normal((M, K)) * 0.5).astype(dt).astype(np.float32)
    Bm = (rng.standard_normal((K, Nn)) * 0.5).astype(dt)
    Bf = Bm.astype(np.float32)
    C = rng.standard_normal((M, Nn)).astype(np.float32)
    got = _call(name, A, Bm if spec.kind == "bf16" else Bf, C, acc, a_form)
    want = C.copy() if acc else np.zeros((M, Nn), np.float32)
    pairs = spec.kind == "bf16"
    order = [k for p in range((K + 1) // 2) for k in (2 * p + 1, 2 * p)] if pairs else range(K)
    for k in order:
        if k < K:
            want = want + A[:, k : k + 1] * Bf[k : k + 1, :]
        else:  # the padded half of the last pair: + (+0)·0
            want = want + np.float32(0.0)
    assert want.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
