"""Compile fastgrad's Numba kernels once, into the on-disk cache the test workers then load.

``.ci/run`` starts this in the background while ruff and mypy run (mypy uses one core; the second
one idles then) and waits for it before pytest: without it both pytest-xdist workers compile
every kernel cold, each on its own (~80 s of one core here: the scaled masked softmax backward's
kernel alone takes ~16 s per signature, and the tests reach four).  It runs every op once on tiny
inputs of each dtype (fp32, fp16, bf16), under each native-GEMM ISA setting the tests use
(``tests/common.py: native_isas``) and each GEMM setting, with the options whose kernels differ
(weights, reductions, the FLCE grad's two modes and filter, the training loss's accumulation
dtypes, precision and entropy, the deterministic embedding, strided inputs), in two processes
(:data:`PARTS`: the softmax backward, the rest).  The results are not checked here (the tests do
that); a kernel that fails to compile fails CI here, early.

The cache is the one ``fastgrad/_jit.py`` chooses from the environment (``NUMBA_CACHE_DIR``, else
the package's ``__pycache__``): the same as the test workers', since they run from the same
checkout in the same environment.  Numba keys each entry by the kernel's signature and the CPU,
and checks the source file's time stamp, so an entry this script writes is reused, never wrong.
A signature the script does not reach is compiled by the worker that needs it, as before.

Usage: ``python .ci/warm_numba.py [--part sms|rest]`` (prints one line: the seconds it took and
the cache dir).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings

os.environ.setdefault("FASTGRAD_BACKEND", "cpu")  # as tests/conftest.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from common import native_isas, sharp_problem  # noqa: E402  (the ISA settings the kernel tests run)


def _try(fg, fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)``; a combination the op refuses (``AclnnError``) is skipped, any
    other error (a kernel that does not compile) propagates."""
    try:
        fn(*args, **kwargs)
    except fg.AclnnError:
        pass


def _aclnn_lm_head(fg, np, dt, rng, opts) -> None:
    """The three fused linear aclnn ops (both FLCE grad modes, filtering, label smoothing) on
    contiguous, transposed and column-sliced weights."""
    BT, H, V = 12, 32, 80
    x = rng.standard_normal((BT, H), dtype=np.float32).astype(dt)
    w = (rng.standard_normal((V, H), dtype=np.float32) / 8).astype(dt)
    t = rng.integers(0, V, BT).astype(np.int64)
    for wt in (w, np.asfortranarray(w), w[:, : H // 2]):
        xx = x if wt.shape[1] == H else np.ascontiguousarray(x[:, : H // 2])
        f = fg.fused_linear_online_max_sum(xx, wt, t, 0, V // 2, False, options=opts)
        f = fg.fused_linear_online_max_sum(xx, wt, t, 0, V, True, options=opts)
        g = np.full(BT, 1.0 / BT, np.float32)
        args = (g, xx, wt, f.target_mask, f.masked_target)
        stats = {"logits_max": f.logits_max_local, "sum_exp_logits": f.sum_exp_logits_local}
        _try(fg, fg.fused_linear_cross_entropy_loss_grad, *args, **stats, options=opts)
        _try(fg, fg.fused_linear_cross_entropy_loss_grad, *args, 0.1, **stats, filter_eps="auto", options=opts)
        _try(fg, fg.fused_linear_cross_entropy_loss_grad, *args, **stats, filter_eps=1e-3, options=opts)
        fce = (f.logits_max_local, f.sum_exp_logits_local, f.predicted_logits_local)
        _, sm = fg.fused_cross_entropy_loss_with_max_sum(*fce, 0.0, f.vocab_parallel_logits)
        _try(fg, fg.fused_cross_entropy_loss_with_max_sum, *fce, 0.1, f.vocab_parallel_logits)
        _try(fg, fg.fused_linear_cross_entropy_loss_grad, *args, softmax=sm, options=opts)
    # gradient filtering that keeps some column blocks and drops others (tests/common.py's problem)
    x, w, t = sharp_problem(rng, 300, 64, 1337, dt, 8.0, 200)  # two row blocks, 21 column blocks
    f = fg.fused_linear_online_max_sum(x, w, t, 0, 1337, options=opts)
    stats = {"logits_max": f.logits_max_local, "sum_exp_logits": f.sum_exp_logits_local}
    g = np.full(300, 1.0 / 300, np.float32)
    _try(
        fg,
        fg.fused_linear_cross_entropy_loss_grad,
        g,
        x,
        w,
        f.target_mask,
        f.masked_target,
        **stats,
        filter_eps=2.0**-12,
        options=opts,
    )
    for kw in ({}, {"accum_dtype": dt}):
        _try(fg, fg.linear_cross_entropy, x, w, t, return_grad=True, filter_eps=2.0**-12, options=opts, **kw)


def _training_loss(fg, np, dt, rng, opts) -> None:
    """``linear_cross_entropy``: the forward, the fused step, the recompute from a saved lse,
    filtering, a 16-bit ``grad_weight``, ``precision="fast"``, the entropy, weights, bias and
    softcap; even and odd H; one row block and several (tests/test_training_buffers.py's modes)."""
    from fastgrad import _config

    BT, V = 24, 300
    for H in (16, 17):
        x = (rng.standard_normal((BT, H)) * 0.5).astype(dt)
        w = (rng.standard_normal((V, H)) * 0.5).astype(dt)
        t = rng.integers(0, V, BT).astype(np.int64)
        t[::7] = -100
        for budget in (None, 8_000):
            with contextlib.ExitStack() as st:
                if budget is not None:
                    _config.set_workspace_budget(budget)
                    st.callback(_config.set_workspace_budget, None)
                lse = fg.linear_cross_entropy(x, w, t, options=opts).lse
                for kw in (
                    {},
                    {"lse": lse},
                    {"lse": lse, "precision": "fast"},
                    {"filter_eps": 1e-3},
                    {"accum_dtype": dt},
                    {"reduction": "sum", "label_smoothing": 0.1, "ce_weight": np.ones(V, np.float32)},
                    {"return_entropy": True, "lse_square_scale": 1e-4, "softcap": 30.0},
                    {"bias": np.zeros(V, dt)},
                ):
                    _try(fg, fg.linear_cross_entropy, x, w, t, return_grad=True, options=opts, **kw)


def _sms(fg, np, dt, rng) -> None:
    """The scaled masked softmax backward: short and long rows, a broadcast mask (its row offsets
    a fresh array) and a full one (a read-only view: a second signature), the triangular mask."""
    for s2 in (16, 1100):
        y = rng.random((2, 2, 4, s2)).astype(dt)
        go = rng.standard_normal((2, 2, 4, s2)).astype(dt)
        m = rng.random((2, 1, 4, s2)) < 0.2
        fg.scaled_masked_softmax_backward(go, y, m, 0.5)
        fg.scaled_masked_softmax_backward(go, y, np.broadcast_to(m, go.shape), 1.0, True)


def _small_ops(fg, np, dt, rng) -> None:
    """The cross-entropy grad, smooth-L1 and embedding backwards, each dtype path (contiguous,
    broadcast and strided inputs, each attribute whose kernel differs), on both SoC families."""
    f32 = np.float32
    for soc in ("Ascend910B", "Ascend950"):
        with fg.soc_version(soc):
            # cross-entropy grad: with and without weight, each reduction, label smoothing
            lp = np.log(rng.dirichlet(np.ones(40), 6)).astype(dt)
            tg = rng.integers(0, 40, 6).astype(np.int64)
            w = rng.random(40).astype(f32)
            for red in ("mean", "sum", "none"):
                gl = np.array(1.0, dt) if red != "none" else np.ones(6, dt)
                fg.cross_entropy_loss_grad(gl, lp, tg, None, red)
                fg.cross_entropy_loss_grad(gl, lp, tg, w, red, 3, 0.1)
            # smooth L1 backward: contiguous, broadcast and strided
            a = rng.standard_normal((6, 10)).astype(dt)
            b = rng.standard_normal((6, 10)).astype(dt)
            for red in ("none", "mean", "sum"):
                g = np.ones((6, 10), dt) if red == "none" else np.array(1.0, dt)
                fg.smooth_l1_loss_backward(g, a, b, red, 1.0)
                if red != "none":
                    fg.smooth_l1_loss_backward(g, a[:, ::2], b[:, ::2], red, 0.5)
            fg.smooth_l1_loss_backward(np.ones((6, 1), dt), a, b[:1], "none", 1.0)
            fg.smooth_l1_loss_backward(np.array(1.0, dt), a.T, b.T, "mean", 1.0)
            # embedding dense backward: plain, padding, scale by frequency, deterministic
            gr = rng.standard_normal((9, 8)).astype(dt)
            idx = rng.integers(0, 5, 9).astype(np.int64)
            fg.embedding_dense_backward(gr, idx, 5)
            fg.embedding_dense_backward(gr, idx, 5, 2, True)
            with fg.deterministic():
                fg.embedding_dense_backward(gr, idx, 5)
                fg.embedding_dense_backward(gr, idx, 5, 2, True)


#: the two halves, run in two processes: the scaled masked softmax backward's kernel (~16 s to
#: compile per signature, four signatures) and the rest, about as long
PARTS = ("sms", "rest")


def warm(part: str) -> None:
    import numpy as np

    import fastgrad as fg
    from fastgrad import Options, _config, dtypes

    rng = np.random.default_rng(0)
    dts = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(dtypes.BFLOAT16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if part == "sms":
            for dt in dts:
                _sms(fg, np, dt, rng)
            return
        for dt in dts:
            _small_ops(fg, np, dt, rng)
        for dt in dts + (np.dtype(np.float64),):
            for isa in native_isas():
                for gemm in ("auto", "blas"):
                    opts = Options(gemm=gemm, native_isa=isa)
                    if dt != np.float64:  # the aclnn ops take 16-bit and fp32 operands
                        _aclnn_lm_head(fg, np, dt, rng, opts)
                    _training_loss(fg, np, dt, rng, opts)
                    with _config.prefer_onednn():  # fastgrad.torch's setting: the bf16 logits native
                        _training_loss(fg, np, dt, rng, opts)


def main(argv: list[str]) -> int:
    """No argument: both parts, the first in a child process; ``--part NAME``: that part only."""
    t0 = time.perf_counter()
    from fastgrad import _jit

    if not _jit.CACHE:
        print("warm_numba: Numba's cache is off here (FASTGRAD_NUMBA_CACHE=0 or no writable dir): nothing to warm")
        return 0
    if argv[:1] == ["--part"] and len(argv) == 2 and argv[1] in PARTS:
        warm(argv[1])
        return 0
    if argv:
        print(f"usage: {sys.argv[0]} [--part {'|'.join(PARTS)}]", file=sys.stderr)
        return 2
    child = subprocess.Popen([sys.executable, __file__, "--part", PARTS[0]])
    # stopped (.ci/run's trap when ruff or mypy fails): the child part stops too
    signal.signal(signal.SIGTERM, lambda *_: (child.terminate(), sys.exit(143)))
    try:
        warm(PARTS[1])
    finally:
        rc = child.wait()
    if rc:
        print(f"warm_numba: --part {PARTS[0]} failed (exit status {rc})", file=sys.stderr)
        return 1
    cache = _jit._nconfig.CACHE_DIR or "the package's __pycache__"
    print(f"warm_numba: the kernels compiled in {time.perf_counter() - t0:.1f} s (cache: {cache})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
