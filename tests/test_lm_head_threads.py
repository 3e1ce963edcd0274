"""The LM-head calls are thread-safe: the plan decides which GEMM variant runs, and no
process-wide setting is changed for the duration of a call (issue 47).

* A plan made under one ISA setting runs its own variant (``GemmChoice.variant``) after the
  setting changed — no kernel-level global is read mid-call.
* Python threads running LM-head ops under different settings at once (``use_native_isa``,
  ``gemm``: context variables, one per thread) give bitwise the results each setting gives alone.
* The BLAS thread limit and oneDNN's math mode are counted, so overlapping calls never undo each
  other (``kernels/_gemm.single_threaded_blas``, ``_onednn.fp32_precision_bf16``).

What is thread-safe is listed in docs/architecture.md ("Threads")."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from common import two_threads_overlapping

import fastgrad as fg
from fastgrad import _config
from fastgrad.kernels import _bf16dot, _native

BF = ml_dtypes.bfloat16


def _inputs(BT=192, H=96, V=3000, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BT, H)).astype(BF)
    w = (rng.standard_normal((V, H)) * 0.3).astype(BF)
    t = rng.integers(0, V, BT).astype(np.int64)
    mask = np.zeros((BT + 7) // 8, np.uint8)
    g = rng.uniform(0.5, 1.5, BT).astype(np.float32)
    return x, w, t, mask, g


def _flce(x, w, t, mask, g):
    """The online max-sum, then the FLCE grad (memory-saving: the logits recomputed)."""
    s = fg.fused_linear_online_max_sum(x, w, t, 0, w.shape[0])
    m, e = np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)
    gi, gw = fg.fused_linear_cross_entropy_loss_grad(g, x, w, mask, t, logits_max=m, sum_exp_logits=e)
    loss = fg.linear_cross_entropy(x, w, t, return_grad=True)
    return [np.asarray(a).view(np.uint16).copy() for a in (gi, gw)] + [
        np.asarray(a, np.float32).view(np.uint32).copy() for a in (m, e, loss.loss, loss.grad_input, loss.grad_weight)
    ]


def _settings():
    """(ISA setting, GEMM setting) pairs this CPU runs differently: every native ISA it has, and BLAS."""
    out = [("auto", "auto")]
    if _bf16dot.variant("bf16", "avx2") is not None:
        out.append(("avx2", "auto"))
    if _bf16dot.variant("bf16", "avx512") is not None:
        out.append(("avx512", "auto"))
    out.append(("auto", "blas"))
    return out


def _under(isa, gemm, fn, *args):
    with _config.use_native_isa(isa), fg.gemm(gemm):
        return fn(*args)


def test_a_plan_runs_its_own_variant_after_the_setting_changed(monkeypatch):
    from fastgrad.kernels import fused_linear_cross_entropy_loss_grad as K
    from fastgrad.ops import _engines

    avx2 = _bf16dot.variant("bf16", "avx2")
    if avx2 is None:
        pytest.skip("no AVX2 + FMA variant on this CPU")
    x, w, t, mask, g = _inputs()
    BT, H = x.shape
    V = w.shape[0]
    s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
    m, e = np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)
    with _config.use_native_isa("avx2"):
        plan = _engines.lm_head_plan(BT, V, H, "memory_saving", x.dtype, _config.settings())
        want = _flce(x, w, t, mask, g)[:2]
    assert plan.gemm.variant == "avx2_bf16" and plan.gemm.a_form == "f32"
    seen = []
    real = _bf16dot.gemm_tile
    monkeypatch.setattr(_bf16dot, "gemm_tile", lambda *a, **k: (seen.append(k["spec"].name), real(*a, **k))[1])
    # the setting changes (another call's, the process's): the plan made before still runs its variant
    _config.set_native_isa("avx512" if _bf16dot.variant("bf16", "avx512") is not None else "auto")
    try:
        gi = np.empty((BT, H), BF)
        gw = np.empty((V, H), BF)
        K.fused_linear_cross_entropy_loss_grad(
            grad=g,
            input=x,
            weight=w,
            target_mask=mask,
            masked_target=t,
            label_smoothing=0.0,
            logits_max=m,
            sum_exp_logits=e,
            softmax=None,
            out=(gi, gw),
            plan=plan,
        )
    finally:
        _config.set_native_isa(None)
    assert seen and set(seen) == {"avx2_bf16"}
    assert np.array_equal(gi.view(np.uint16), want[0]) and np.array_equal(gw.view(np.uint16), want[1])


def test_threads_with_different_settings_give_their_single_threaded_bits():
    x, w, t, mask, g = _inputs(seed=3)
    settings = _settings()
    want = {st: _under(*st, _flce, x, w, t, mask, g) for st in settings}
    # every native variant gives the same bits (kernels/_native.py); BLAS its own
    natives = [want[st] for st in settings if st[1] == "auto"]
    for other in natives[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(natives[0][:5], other[:5]))
    errors: list[BaseException] = []
    got: dict = {}
    start = threading.Barrier(len(settings))

    def worker(st):
        try:
            start.wait()
            for _ in range(3):
                got.setdefault(st, []).append(_under(*st, _flce, x, w, t, mask, g))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(st,)) for st in settings]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for st in settings:
        for res in got[st]:
            assert all(np.array_equal(a, b) for a, b in zip(res, want[st])), st


def test_overlapping_calls_keep_the_blas_limit_until_the_last_ends():
    from threadpoolctl import threadpool_info

    from fastgrad.kernels import _gemm

    def blas_threads():  # NumPy's BLAS (the one the kernels call; torch may bring others)
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]]

    before = blas_threads()
    if not before:
        pytest.skip("NumPy's BLAS is not one threadpoolctl sees")
    a = _gemm.single_threaded_blas("blas")
    b = _gemm.single_threaded_blas("blas")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first call ends while the second still runs
    assert all(n == 1 for n in blas_threads())
    b.__exit__(None, None, None)
    assert blas_threads() == before


def test_set_num_threads_never_lifts_the_blas_limit_of_a_call_in_flight():
    """Found by fuzzing: ``set_num_threads`` (and ``num_threads``) in one Python thread set the
    process-wide BLAS count under another thread's call, whose OpenBLAS sums then changed (50 of
    50 calls of a 77 x 513 x 1999 fp32 grad).  Now the count applies when the last call ends."""
    from threadpoolctl import threadpool_info

    from fastgrad.kernels import _gemm

    def numpy_blas():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]]

    if not numpy_blas():
        pytest.skip("NumPy's BLAS is not one threadpoolctl sees")
    n0 = fg.get_num_threads()
    call = _gemm.single_threaded_blas("blas")
    call.__enter__()
    try:
        fg.set_num_threads(min(2, _config.max_threads()))
        assert all(n == 1 for n in numpy_blas())  # the call in flight keeps its limit
    finally:
        call.__exit__(None, None, None)
        assert numpy_blas() == [min(2, _config.max_threads())] * len(numpy_blas())  # applied at its end
        fg.set_num_threads(n0)
    # end to end: another thread setting the count while fp32 BLAS grads run
    rng = np.random.default_rng(0)
    x = rng.standard_normal((77, 513), dtype=np.float32)
    w = (0.2 * rng.standard_normal((1999, 513))).astype(np.float32)
    t = rng.integers(0, 1999, 77)

    def run():
        return np.asarray(fg.linear_cross_entropy(x, w, t, return_grad=True).grad_weight).tobytes()

    ref = run()
    stop = threading.Event()

    def other():
        while not stop.is_set():
            fg.set_num_threads(fg.get_num_threads())

    th = threading.Thread(target=other)
    th.start()
    try:
        same = [run() == ref for _ in range(12)]
    finally:
        stop.set()
        th.join()
    assert all(same)


def test_onednn_mode_is_counted():
    torch = pytest.importorskip("torch")
    from fastgrad import _onednn

    m = torch.backends.mkldnn.matmul
    old = m.fp32_precision
    a = _onednn.fp32_precision_bf16()
    b = _onednn.fp32_precision_bf16()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert m.fp32_precision == "bf16"
    b.__exit__(None, None, None)
    assert m.fp32_precision == old


def test_specs_are_named_by_the_plan():
    """``GemmChoice.variant`` names a spec of ``_native.SPECS``; the kernels resolve it there."""
    for name, spec in _native.SPECS.items():
        assert _bf16dot.spec_named(name) is spec
    assert _bf16dot.spec_named(None) is None


def test_options_are_the_calls_own_settings():
    """``options=fastgrad.Options(...)``: the call's settings over those in force, resolved by the
    op (the plan records them), nothing process-wide; the same bits as the context managers."""
    import ml_dtypes as _md

    x, w, t, mask, g = _inputs(BT=64, H=32, V=700)
    s = fg.fused_linear_online_max_sum(x, w, t, 0, w.shape[0])
    m, e = np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)
    before = fg.settings()
    with fg.gemm("blas"):
        want = fg.fused_linear_cross_entropy_loss_grad(g, x, w, mask, t, logits_max=m, sum_exp_logits=e)
    *got, plan = fg.fused_linear_cross_entropy_loss_grad(
        g, x, w, mask, t, logits_max=m, sum_exp_logits=e, options=fg.Options(gemm="blas"), return_plan=True
    )
    assert plan.gemm.exact is None and plan.gemm.engine == "blas"
    assert all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)) for a, b in zip(got, want))
    assert fg.settings() == before
    if _bf16dot.variant("bf16", "avx2") is not None:
        *_, p2 = fg.fused_linear_cross_entropy_loss_grad(
            g, x, w, mask, t, logits_max=m, sum_exp_logits=e, options=fg.Options(native_isa="avx2"), return_plan=True
        )
        assert p2.gemm.variant == "avx2_bf16"
    r = fg.linear_cross_entropy(x, w, t, return_grad=True, options=fg.Options(workspace_bytes=64 * 700 * 4 // 3))
    assert r.plan.budget_bytes == 64 * 700 * 4 // 3 and r.plan.n_blocks > 1
    assert x.dtype == _md.bfloat16
    for bad, param in (
        ({"gemm": "mkl"}, "options.gemm"),
        ({"native_isa": "neon"}, "options.native_isa"),
        ({"workspace_bytes": 0}, "options.workspace_bytes"),
    ):
        with pytest.raises(fg.AclnnError) as ei:
            fg.fused_linear_online_max_sum(x, w, t, 0, w.shape[0], options=fg.Options(**bad))
        assert ei.value.status == 161002 and param in str(ei.value)
    with pytest.raises(fg.AclnnError, match="options"):
        fg.linear_cross_entropy(x, w, t, options={"gemm": "blas"})


def test_overlapping_num_threads_blocks_in_two_threads_restore_the_process_count():
    """Found by fuzzing: each ``num_threads()`` block restored the BLAS count it saw on entry, so
    while B (entered inside A's block) still ran, A's exit lifted B's BLAS back to the process's
    count, and B's exit then left the BLAS at A's count for good.  Numba's count is each thread's
    own and goes back to it."""
    from threadpoolctl import threadpool_info

    def numpy_blas():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas" and "numpy" in i["filepath"]]

    if not numpy_blas() or _config.max_threads() < 2:
        pytest.skip("needs NumPy's BLAS seen by threadpoolctl and two CPUs")
    n0 = fg.get_num_threads()
    fg.set_num_threads(2)
    try:
        numba_after = []

        class Block:  # num_threads(1), and Numba's count of the thread after it
            def __init__(self):
                self.cm = fg.num_threads(1)

            def __enter__(self):
                self.cm.__enter__()

            def __exit__(self, *exc):
                self.cm.__exit__(*exc)
                numba_after.append(fg.get_num_threads())

        seen = two_threads_overlapping(Block(), Block(), numpy_blas)
        k = len(numpy_blas())
        assert seen == {"B inside, A left": [1] * k, "both left": [2] * k}
        assert numba_after == [_numba_default(), _numba_default()]
    finally:
        fg.set_num_threads(n0)


def _numba_default() -> int:
    """A new Python thread's Numba count (Numba's is per thread; a new thread starts at the
    process's default, NUMBA_NUM_THREADS)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fg.get_num_threads()))
    t.start()
    t.join()
    return out[0]
