"""A forked child runs the LM-head ops after its parent did (issue 26: the GEMM pool of the
parent survived ``fork`` and the child's first op waited forever on workers that do not exist).

Each case runs in a subprocess with a timeout, so a hang fails the test instead of hanging the
suite: the script runs the ops in the parent (the GEMM pool and the output cache populated),
forks — ``os.fork()`` and ``multiprocessing``'s ``"fork"`` context (DataLoader workers) — and
runs them again in the child, which must finish and give the parent's results bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp
    import os
    import sys

    import ml_dtypes
    import numpy as np

    import fastgrad as fg
    from fastgrad import _config, _outcache

    _outcache.MIN_BYTES = 1 << 16  # the scratch and outputs on recycled blocks, as at scale
    _config.set_native_isa(sys.argv[2])
    fg.set_num_threads(2)
    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[sys.argv[1]]
    rng = np.random.default_rng(0)
    BT, H, V = 256, 64, 4096
    x = rng.standard_normal((BT, H)).astype(dt)
    w = (rng.standard_normal((V, H)) * 0.2).astype(dt)
    t = rng.integers(0, V, BT)
    grad = np.full(BT, 1.0 / BT, np.float32)
    mask = np.packbits(np.zeros(BT, bool), bitorder="little")

    def ops():
        s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
        m = np.asarray(s[0], np.float32)
        e = np.asarray(s[1], np.float32)
        g = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, t, logits_max=m, sum_exp_logits=e)
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
        outs = [np.asarray(a) for a in (*s, *g, r.loss, r.grad_input, r.grad_weight) if a is not None]
        return [np.ascontiguousarray(a).tobytes() for a in outs]

    want = ops()
    pid = os.fork()
    if pid == 0:
        try:
            ok = ops() == want
        except BaseException as e:  # noqa: BLE001
            print("child failed:", repr(e), flush=True)
            ok = False
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"os.fork child: {status}"

    def child(_):
        return ops() == want

    with mp.get_context("fork").Pool(2) as pool:
        assert all(pool.map(child, range(2))), "multiprocessing fork child differs"
    assert ops() == want  # the parent's pool still works
    print("OK")
    """
)


def _isas():
    from common import native_isas

    return native_isas()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("isa", _isas())
def test_lm_head_ops_run_in_a_forked_child(dtype, isa, tmp_path):
    script = tmp_path / "fork_case.py"
    script.write_text(SCRIPT)
    try:
        r = subprocess.run(
            [sys.executable, str(script), dtype, isa], capture_output=True, text=True, timeout=240, cwd=tmp_path
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the forked child hung (killed after {e.timeout} s): {e.stdout}{e.stderr}")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_the_pool_is_forgotten_in_the_child():
    """The at-fork handler itself: the child's pool table is empty, the parent's is kept."""
    code = textwrap.dedent(
        """
        import os
        import numpy as np
        import fastgrad as fg
        from fastgrad.kernels import _gemm

        fg.set_num_threads(2)
        _gemm._run([lambda: None, lambda: None])
        assert _gemm._pools
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not _gemm._pools and not _gemm._lock.locked() else 3)
        _, st = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(st) == 0 and _gemm._pools
        print("OK")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
