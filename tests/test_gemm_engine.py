"""The GEMM engines of the fused linear kernels (fastgrad/_onednn.py, kernels/_gemm.py).

The ``"onednn"`` engine (PyTorch's fp32 matmul in oneDNN's bf16 math mode) must give fp32
accuracy against a float64 oracle written here, the same bits at every thread count, leave
PyTorch's settings as it found them, and never be used where its accuracy probe fails; the
NumPy-level ops stay on the BLAS unless asked.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common import lm_head_problem, mean_ce_oracle64, native_isas, set_isa  # noqa: E402

import fastgrad as fg  # noqa: E402
import fastgrad.torch as ft  # noqa: E402
from fastgrad import _config, _cpu, _onednn  # noqa: E402
from fastgrad.ops import _engines  # noqa: E402

IGN = -100


def _data(BT, H, V, seed, dtype=np.float32):
    x, w, _, _, t = lm_head_problem(BT, H, V, seed, dtype)
    return x, w, t


def test_settings_resolve_and_bad_names_raise(monkeypatch):
    monkeypatch.delenv("FASTGRAD_GEMM", raising=False)
    assert _config.gemm_setting() == "auto"
    assert fg.gemm_engine() == "blas"  # the NumPy-level ops: the BLAS unless asked
    with fg.gemm("blas"):
        assert fg.gemm_engine() == "blas"
    with fg.gemm("onednn"):
        assert fg.gemm_engine() == ("onednn" if _onednn.usable() else "blas")
    monkeypatch.setenv("FASTGRAD_GEMM", "onednn")
    assert _config.gemm_setting() == "onednn"
    fg.set_gemm_engine("blas")
    try:
        assert fg.gemm_engine() == "blas"
    finally:
        fg.set_gemm_engine(None)
    for bad in ("mkl", "", "BLAS2"):
        with pytest.raises(ValueError, match="gemm engine"):
            fg.set_gemm_engine(bad)
        with pytest.raises(ValueError, match="gemm engine"):
            with fg.gemm(bad):
                pass


@pytest.mark.parametrize("capable", [True, False])
def test_auto_prefers_onednn_only_in_the_torch_loss_on_capable_cpus(monkeypatch, capable):
    monkeypatch.delenv("FASTGRAD_GEMM", raising=False)
    monkeypatch.setattr(_onednn, "cpu_has_bf16_dot", lambda: capable)
    calls = []
    real = _onednn.mm
    monkeypatch.setattr(_onednn, "mm", lambda *a: (calls.append(1), real(*a)))
    # an AMX CPU's bf16 math mode down-converts fp32 (bf32): the probe refuses the engine there
    # (seen on an Emerald Rapids Xeon), so even a capable CPU keeps the BLAS
    used = capable and _onednn.usable()
    with _config.prefer_onednn():
        assert fg.gemm_engine() == ("onednn" if used else "blas")
    x, w, t = _data(40, 16, 300, 1, np.float32)
    fg.linear_cross_entropy(x, w, t, return_grad=True)
    assert not calls  # the NumPy-level op: always the BLAS under "auto"
    hh = torch.from_numpy(x).requires_grad_()
    ww = torch.from_numpy(w).requires_grad_()
    ft.linear_cross_entropy(hh, ww, torch.from_numpy(t)).backward()
    assert bool(calls) == used


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 19, 1001), (613, 24, 1100)])
@pytest.mark.parametrize("recompute", [False, True])
def test_both_engines_match_float64(shape, dtype, recompute):
    import ml_dtypes

    BT, H, V = shape
    x, w, t = _data(BT, H, V, sum(shape), np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
    loss, gi, gw, agi, agw = mean_ce_oracle64(x, w, t, IGN)
    for eng in ("blas", "onednn"):
        with fg.gemm(eng):
            r = fg.linear_cross_entropy(x, w, t, return_grad=True)
            if recompute:
                r = fg.linear_cross_entropy(x, w, t, return_grad=True, lse=r.lse)
            else:
                np.testing.assert_allclose(r.loss, loss, rtol=2e-6, atol=1e-7)
        # fp32 accuracy, relative to |G|·|W| (the scale of each sum)
        assert np.all(np.abs(r.grad_input - gi) <= 1e-5 * agi + 1e-12)
        assert np.all(np.abs(r.grad_weight - gw) <= 1e-5 * agw + 1e-12)


def test_onednn_gives_the_same_bits_at_every_thread_count():
    x, w, t = _data(700, 40, 3000, 7, np.float32)  # several 512-row / 512-column tiles
    out = []
    for n in (1, 2):
        with fg.num_threads(n), fg.gemm("onednn"):
            r = fg.linear_cross_entropy(x, w, t, return_grad=True)
            r2 = fg.linear_cross_entropy(x, w, t, return_grad=True, lse=r.lse)
        out.append((r.loss, r.grad_input, r.grad_weight, r2.grad_input, r2.grad_weight))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_onednn_leaves_torch_settings_as_it_found_them():
    m = torch.backends.mkldnn.matmul
    before = (m.fp32_precision, torch.get_num_threads())
    x, w, t = _data(50, 16, 700, 2, np.float32)
    with fg.gemm("onednn"):
        fg.linear_cross_entropy(x, w, t, return_grad=True)
        with fg.num_threads(1):
            fg.linear_cross_entropy(x, w, t, return_grad=True)
        with pytest.raises(fg.AclnnError):
            fg.linear_cross_entropy(x, w[:, :3], t, return_grad=True)
    assert (m.fp32_precision, torch.get_num_threads()) == before


def test_the_probe_rejects_a_plain_bf16_down_conversion(monkeypatch):
    """Where the mode rounds fp32 operands to bf16 (as oneDNN's documentation allows), the
    probe fails and ``"onednn"`` resolves to the BLAS."""
    real = torch.mm

    def down_converting_mm(a, b, out=None):
        return real(a.bfloat16().float(), b.bfloat16().float(), out=out)

    # the real mode keeps fp32 except on AMX CPUs, where it down-converts (oneDNN's bf32; seen on
    # an Emerald Rapids Xeon): there the probe already refuses it
    assert _onednn._probe() == (not _cpu.has("amx_bf16"))
    monkeypatch.setattr(torch, "mm", down_converting_mm)
    assert not _onednn._probe()
    monkeypatch.setattr(_onednn, "_ok", False)
    assert _onednn.resolve_engine("onednn") == "blas"
    assert _onednn.resolve_engine("auto", prefer=True) == "blas"


def test_a_torch_without_the_mode_is_not_used(monkeypatch):
    """An older PyTorch (no ``torch.backends.mkldnn.matmul``): the probe fails, the BLAS runs."""
    monkeypatch.setattr(_onednn, "_ok", None)
    monkeypatch.setattr(torch.backends.mkldnn, "matmul", None)  # no fp32_precision attribute
    assert not _onednn.usable()
    assert _onednn.resolve_engine("onednn") == "blas"
    x, w, t = _data(20, 8, 50, 3)
    with fg.gemm("onednn"):
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
    assert np.isfinite(r.loss)


# ----------------------------------------------------------------------------------------------
# the engine interface (fastgrad/kernels/_engine.py)
# ----------------------------------------------------------------------------------------------


def _engine_run(name, X, W, G_blocks, vc, rows, together=False):
    """The three products over chunks of ``vc`` and the row blocks ``rows`` (equal tiles of the
    plan) on engine ``name`` through the loop's engine (``_lm_head.Operands``): (logits per tile,
    grad_weight per chunk, grad_input), accumulated as the FLCE grad does; ``together``: the two
    gradient products through ``grad_products`` (one task list on the fp32 engines)."""
    import dataclasses

    from fastgrad import tiling
    from fastgrad.kernels import _gemm
    from fastgrad.lm_head import loop as _lm_head

    BT, H = X.shape
    V = W.shape[0]
    kind = {"bfloat16": "bf16", "float16": "f32"}.get(np.dtype(X.dtype).name)
    if name == "native":
        from fastgrad.kernels import _bf16dot

        spec = _bf16dot.variant(kind, _config.native_isa())
        gemm = tiling.GemmChoice(exact=kind, variant=spec.name, a_form=spec.a_forms[0])
    else:
        gemm = tiling.GemmChoice(engine=name)
    bt = rows[0][1]
    assert [tuple(r) for r in rows] == [(b0, min(BT, b0 + bt)) for b0 in range(0, BT, bt)]
    dt = np.dtype(X.dtype).name
    plan = tiling.plan_linear_cross_entropy(BT, V, H, dtype=dt, gemm=gemm)
    bufs = tiling.lm_head_buffers("memory_saving", BT, H, bt, vc, dtype=dt, gemm=gemm)
    plan = dataclasses.replace(plan, bt_tile=bt, v_tile=vc, buffers=bufs)
    with _gemm.single_threaded_blas(gemm.engine):
        e = _lm_head.Operands(X, W, plan, weight_tiles="all")
        logits, gw = [], np.empty((V, H), np.float32)
        gi = np.zeros((BT, H), np.float32)
        for v0, v1 in plan.v_ranges():
            e.chunk(v0, v1)
            for k, (b0, b1) in enumerate(plan.bt_ranges()):
                L = np.full((b1 - b0, v1 - v0), np.nan, np.float32)
                e.logits(b0, b1, L)
                logits.append(L)
                G = np.ascontiguousarray(G_blocks[b0:b1, v0:v1])
                if together:
                    e.grad_products(G, b0, b1, gw[v0:v1], k > 0, gi[b0:b1])
                else:
                    e.grad_weight(G, b0, b1, gw[v0:v1], acc=k > 0)
                    e.grad_input(G, b0, b1, gi[b0:b1])  # may overwrite G: last
    return logits, gw, gi


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_engine_interface_matches_float64_and_is_isa_independent(dtype):
    """Each engine that runs the dtype here, against float64 (products summed in fp32: the fp32
    GEMM's bound); the native engine once per native ISA of this machine, the same bits."""
    import ml_dtypes

    from fastgrad.lm_head import engine as _engine

    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    rng = np.random.default_rng(5)
    BT, H, V, vc = 70, 33, 301, 128
    X = rng.standard_normal((BT, H)).astype(dt)
    W = (rng.standard_normal((V, H)) * 0.3).astype(dt)
    G = (rng.standard_normal((BT, V)) * 0.01).astype(dt).astype(np.float32)  # values of the dtype
    rows = [(0, 35), (35, BT)]  # the plan's equal row tiles
    x, w, g = X.astype(np.float64), W.astype(np.float64), G.astype(np.float64)
    ref = (x @ w.T, g.T @ x, g @ w)
    den = (np.abs(x) @ np.abs(w).T, np.abs(g).T @ np.abs(x), np.abs(g) @ np.abs(w))
    names = [n for n in _engine.engines(dt) if n != "onednn" or _onednn.usable()]
    assert names[0] == ("native" if dtype != "float32" else "blas")  # an x86-64 with AVX2 + FMA
    # "auto" takes the native kernel except on an AVX2-only CPU under the ISA setting "auto"
    from fastgrad.kernels import _bf16dot

    kind = {"bfloat16": "bf16", "float16": "f32"}.get(dtype)
    auto_native = kind is not None and _bf16dot.auto_variant(kind) is not None
    assert _engine.choose(dt) == ("native" if auto_native else "blas") and _engine.choose(dt, "blas") == "blas"
    runs = [(n, None) for n in names if n != "native"] + [("native", i) for i in native_isas() if "native" in names]
    native_bits = []
    for name, isa in runs:
        if isa is not None:
            set_isa(isa)
        try:
            logits, gw, gi = _engine_run(name, X, W, G, vc, rows)
        finally:
            set_isa(None)
        full = np.vstack([np.hstack(logits[i :: len(rows)]) for i in range(len(rows))])
        for got, r, d, k in zip((full, gw, gi), ref, den, (H, BT, V)):
            assert np.all(np.abs(got - r) <= (k + 1) * 2.0**-24 * d + 1e-30), (name, isa)
        if name == "native":
            native_bits.append([a.view(np.uint32) for a in (full, gw, gi)])
        # grad_products (the FLCE grad's call): the same bits as the two products in turn
        if isa is not None:
            set_isa(isa)
        try:
            _, gw2, gi2 = _engine_run(name, X, W, G, vc, rows, together=True)
        finally:
            set_isa(None)
        assert np.array_equal(gw2.view(np.uint32), gw.view(np.uint32)), (name, isa)
        assert np.array_equal(gi2.view(np.uint32), gi.view(np.uint32)), (name, isa)
    for other in native_bits[1:]:  # the same bits on every ISA
        assert all(np.array_equal(a, b) for a, b in zip(native_bits[0], other))


def test_engine_choice_and_errors():
    import ml_dtypes

    from fastgrad import tiling
    from fastgrad.lm_head import engine as _engine
    from fastgrad.lm_head import loop as _lm_head

    with pytest.raises(ValueError, match="setting"):
        _engine.choose(np.float32, "mkl")
    plan = tiling.plan_linear_cross_entropy(2, 4, 3, mode="forward", dtype="float32")
    with pytest.raises(ValueError, match="share H"):
        _lm_head.Operands(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32), plan)
    with pytest.raises(ValueError, match="dtype"):
        _lm_head.Operands(np.zeros((2, 3), np.float32), np.zeros((4, 3), ml_dtypes.bfloat16), plan)
    assert _engine.engines(np.float32) == ["blas", "onednn"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_auto_keeps_blas_where_only_the_avx2_variant_runs(monkeypatch, dtype):
    """The "auto" rule (``_bf16dot.AUTO_AVX2``): where the best variant the CPU runs is an AVX2
    one and the ISA setting is "auto" (an AVX2-only machine), "auto" keeps BLAS — measured
    faster there; an explicit ISA setting "avx2" runs the AVX2 kernel; an AVX-512 variant runs
    on "auto" on an AMD CPU, not on an Intel one (``_bf16dot.AUTO_AVX512_VENDORS``: BLAS measured
    faster there) unless the ISA setting is "avx512"."""
    import ml_dtypes

    from fastgrad.kernels import _bf16dot as B
    from fastgrad.kernels import _native as N
    from fastgrad.lm_head import engine as _engine

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    kind = "bf16" if dtype == "bfloat16" else "f32"
    in_use = _engines.bf16_kernel_in_use if kind == "bf16" else _engines.fp16_kernel_in_use
    avx2 = N.SPECS["avx2_bf16" if kind == "bf16" else "avx2_f32"]
    avx512 = N.SPECS["avx512_bf16dp" if kind == "bf16" else "avx512_f32"]
    try:
        set_isa("auto")
        # an AVX2-only CPU, simulated: the best variant is the AVX2 one
        monkeypatch.setattr(B, "variant", lambda k="bf16", isa=None: avx2 if k == kind else None)
        assert B.auto_variant(kind, "auto") is None
        assert _engine.choose(dt, "auto", "auto") == "blas" and "native" in _engine.engines(dt, "auto")
        assert not in_use()
        # an explicit "avx2" setting runs the AVX2 kernel
        set_isa("avx2")
        assert B.auto_variant(kind, "avx2") is avx2
        assert _engine.choose(dt, "auto", "avx2") == "native" and in_use()
        with fg.gemm("blas"):
            assert not in_use()
        # an AMD AVX-512 CPU on "auto": the native kernel (_bf16dot.AUTO_AVX512_VENDORS)
        set_isa("auto")
        monkeypatch.setattr(B, "variant", lambda k="bf16", isa=None: avx512 if k == kind else None)
        monkeypatch.setattr(B._cpu, "vendor", lambda: "AuthenticAMD")
        assert B.auto_variant(kind, "auto") is avx512
        assert _engine.choose(dt, "auto", "auto") == "native" and in_use()
        # an Intel AVX-512 CPU on "auto": BLAS (measured faster on an Emerald Rapids Xeon); an
        # explicit "avx512" setting runs the kernel there
        monkeypatch.setattr(B._cpu, "vendor", lambda: "GenuineIntel")
        assert B.auto_variant(kind, "auto") is None
        assert _engine.choose(dt, "auto", "auto") == "blas" and not in_use()
        set_isa("avx512")
        assert B.auto_variant(kind, "avx512") is avx512
        assert _engine.choose(dt, "auto", "avx512") == "native" and in_use()
    finally:
        set_isa(None)


def test_the_choice_describes_itself_once_for_the_command_and_the_bench():
    from fastgrad.tiling import GemmChoice

    assert GemmChoice().describe() == "BLAS sgemm"
    assert GemmChoice(engine="onednn").describe() == "oneDNN matmul"
    assert GemmChoice(exact="bf16", variant="avx2_bf16").describe() == "bf16 exact-product kernel (avx2_bf16)"
    assert GemmChoice(exact="f32", variant="avx512_f32").describe() == "fp32 kernel (avx512_f32, fp16 operands)"
    # the command reports what the op's own choice is, whatever it is on this CPU
    from fastgrad.cli.run import gemm_kernel
    from fastgrad.dtypes import BFLOAT16

    assert gemm_kernel(np.dtype(BFLOAT16)) == _engines.gemm_choice(BFLOAT16).describe()


def test_task_grids_take_a_tile_size_and_refuse_an_empty_one():
    from fastgrad.kernels import _gemm

    rng = np.random.default_rng(5)
    A = rng.standard_normal((70, 9)).astype(np.float32)
    B = rng.standard_normal((50, 9)).astype(np.float32)
    out = np.zeros((70, 50), np.float32)
    tasks = _gemm.nt_tasks(A, B, out, rows=32, cols=20)
    assert len(tasks) == 3 * 3  # ceil(70/32) x ceil(50/20) equal parts
    _gemm.run_tasks(tasks)
    np.testing.assert_allclose(out, A.astype(np.float64) @ B.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    gw = np.zeros((50, 9), np.float32)
    G = np.ascontiguousarray(out)
    assert len(_gemm.tn_tasks(G, A, gw, rows=16)) == 4
    for bad in (dict(rows=0), dict(cols=0)):
        with pytest.raises(ValueError, match="tile sizes"):
            _gemm.nt_tasks(A, B, out, **bad)
    with pytest.raises(ValueError, match="block size"):
        _gemm.tn_tasks(G, A, gw, rows=0)
