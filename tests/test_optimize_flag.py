"""The native-kernel paths under ``python -O`` (asserts removed): the same results bit for bit as
a normal run, and the raw-pointer calls still refuse bad operands (``ValueError``, not
``assert``).  Each run is a subprocess (the flag is per interpreter), once per native ISA.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from common import native_isas

SCRIPT = textwrap.dedent(
    """
    import hashlib
    import sys

    import ml_dtypes
    import numpy as np

    import fastgrad as fg
    from fastgrad import _config
    from fastgrad.errors import InternalError
    from fastgrad.kernels import _bf16dot as B

    _config.set_native_isa(sys.argv[1])
    h = hashlib.sha256()
    rng = np.random.default_rng(0)
    BT, H, V = 97, 66, 1100
    for dt in (np.float32, ml_dtypes.bfloat16, np.float16):
        x = rng.standard_normal((BT, H)).astype(dt)
        w = (rng.standard_normal((V, H)) * 0.2).astype(dt)
        t = rng.integers(0, V, BT)
        grad = rng.uniform(0.1, 1, BT).astype(np.float32)
        mask = np.packbits(rng.random(BT) < 0.2, bitorder="little")
        s = fg.fused_linear_online_max_sum(x, w, t, 0, V)
        m, e = np.asarray(s[0], np.float32), np.asarray(s[1], np.float32)
        g = fg.fused_linear_cross_entropy_loss_grad(grad, x, w, mask, t, logits_max=m, sum_exp_logits=e)
        r = fg.linear_cross_entropy(x, w, t, return_grad=True)
        for a in (*s, *g, r.loss, r.grad_input, r.grad_weight):
            if a is not None:  # (the online max-sum's logits: not asked for)
                h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    refused = 0
    if B.available("f32"):
        A = np.ones((4, 8), np.float32)
        out = np.zeros((4, 64), np.float32)
        for bp in (np.ones((7, 64), np.float32), np.ones((8, 32), np.float32)):  # too short, too narrow
            try:
                B.gemm_tile(A, bp, 0, 64, out, spec=B.variant("f32", sys.argv[1]))
            except InternalError:
                refused += 1
    print(sys.flags.optimize, B.available(), refused, h.hexdigest())
    """
)


def _run(flags, isa, tmp_path):
    script = tmp_path / "optimize_case.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, *flags, str(script), isa], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("isa", native_isas())
def test_lm_head_ops_under_python_O_equal_the_normal_run(isa, tmp_path):
    normal = _run([], isa, tmp_path)
    optimized = _run(["-O"], isa, tmp_path)
    assert normal[0] == "0" and optimized[0] == "1"  # the flag took effect
    if normal[1] == "True":  # a native kernel runs here: both bad operands refused, also with -O
        assert normal[2] == optimized[2] == "2"
    assert normal[3] == optimized[3]  # every output, bit for bit
