"""``lm_head/passes.col_means16``: the column means of a 16-bit matrix (``precision="fast"``'s weight
and input means, the rounding error's mean part), bitwise against an independent NumPy transcription
of its contract — fp32 sums over the rows in order, then one fp32 division — for bf16 and fp16,
awkward widths (the task split at 256-column spans and its edges), hostile values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fastgrad import dtypes as D
from fastgrad.lm_head import passes


def _oracle(u16: np.ndarray, dtype) -> np.ndarray:
    x = u16.view(dtype).astype(np.float32)
    acc = np.zeros(x.shape[1], np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are the contract's too
        for row in x:  # one fp32 addition per row and column, rows in order
            acc += row
    n = x.shape[0]
    return acc / np.float32(n) if n else acc


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("H", [1, 5, 255, 256, 257, 896, 1000])
def test_col_means16_bitwise(dtype, rows, H):
    rng = np.random.default_rng(rows * 1000 + H)
    x = (rng.standard_normal((rows, H)) * rng.choice([1e-3, 1.0, 300.0], size=(rows, H))).astype(dtype)
    u = x.view(np.uint16)
    before = u.copy()
    out = np.full(H, np.nan, np.float32)
    passes.col_means16(H, u, D.code_of(dtype), out)
    np.testing.assert_array_equal(out.view(np.uint32), _oracle(u, dtype).view(np.uint32))
    np.testing.assert_array_equal(u, before)  # the input is not modified


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
def test_col_means16_hostile_values_and_a_strided_chunk(dtype):
    rng = np.random.default_rng(3)
    big = rng.standard_normal((64, 600)).astype(dtype)
    big[10, 110], big[12, 111], big[13, 112], big[14, 112] = np.inf, np.nan, np.inf, -np.inf
    fi = ml_dtypes.finfo(dtype)
    big[:, 113] = fi.max  # the fp32 sum overflows to inf for bf16, not for fp16
    big[:, 114] = fi.smallest_subnormal
    u = big.view(np.uint16)[8:40, 100:]  # a row and column slice of a wider matrix
    out = np.zeros(u.shape[1], np.float32)
    passes.col_means16(u.shape[1], u, D.code_of(dtype), out)
    want = _oracle(np.ascontiguousarray(u), dtype)
    assert np.isinf(want[10]) and np.isnan(want[11]) and np.isnan(want[12])
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
