"""The dtype names the op test files share, their torch twins, and a small LM-head problem."""

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [F32, F16, BF16]


def torch_dt(dtype):
    """The torch dtype of a NumPy dtype (torch is optional: skips the test without it)."""
    torch = pytest.importorskip("torch")
    return {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[np.dtype(dtype)]


def lm_head_problem(BT, H, V, seed, dtype=np.float32, ignore_index=-100):
    """``(hidden [BT, H], weight [V, H], bias [V], class weights [V] (float64), target [BT])``:
    logits of a few units, every fourth target (from the second) ignored; 16-bit ``dtype``
    rounds hidden, weight and bias."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((BT, H)) * 1.5).astype(np.float32)
    w = (rng.standard_normal((V, H)) / np.sqrt(H) * 2).astype(np.float32)
    b = (rng.standard_normal(V) * 0.5).astype(np.float32)
    cw = rng.random(V) + 0.5
    t = rng.integers(0, V, BT)
    t[1::4] = ignore_index
    if np.dtype(dtype) != F32:
        x, w, b = x.astype(dtype), w.astype(dtype), b.astype(dtype)
    return x, w, b, cw, t
