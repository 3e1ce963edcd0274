"""The dtype names the op test files share, and their torch twins."""

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
