"""fastgrad keeps PyTorch's intra-op thread count: starting Numba's OpenMP threading layer sets the
OpenMP runtime that PyTorch's CPU wheels share (libgomp) to all cores, so fastgrad's first call
undid a ``torch.set_num_threads(1)`` made before it (``fastgrad/_config._numba``).  Each case in
a fresh interpreter: the layer starts once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs: 1 thread must differ from all")

CASES = {
    # the training loss through fastgrad.torch (its first call starts Numba's threads)
    "torch_loss": """
        import fastgrad.torch as ft
        x = torch.randn(64, 32, requires_grad=True); w = torch.randn(96, 32)
        ft.linear_cross_entropy(x, w, torch.randint(0, 96, (64,))).backward()
    """,
    # a NumPy-level op
    "op": """
        import numpy as np, fastgrad as fg
        fg.smooth_l1_loss_backward(np.ones(8, np.float32), np.zeros(8, np.float32), np.ones(8, np.float32))
    """,
    # the thread setting itself
    "set_num_threads": """
        import fastgrad as fg
        fg.set_num_threads(1)
        with fg.num_threads(2):
            pass
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_fastgrad_call_keeps_torch_threads(case):
    # PyTorch used first (its OpenMP state initialized, as in a training script), then fastgrad
    head = "import torch\ntorch.set_num_threads(1)\ntorch.randn(64, 64) @ torch.randn(64, 64)\nassert torch.get_num_threads() == 1\n"
    code = head + textwrap.dedent(CASES[case]) + "\nprint(torch.get_num_threads())\n"
    env = dict(os.environ, NUMBA_NUM_THREADS=str(min(4, os.cpu_count() or 2)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-1] == "1", p.stdout
