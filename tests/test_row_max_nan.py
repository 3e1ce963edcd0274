"""The statistics' one-pass row max (``kernels/_vmath.row_max_nan``): against a NumPy oracle
(the largest non-NaN value, ``ninf`` without one, the NaN count) for hostile rows (hypothesis) and
at the vector lanes' edges, on the fp32 vector path and the scalar loop (strided rows, fp64); and
that the fp32 path is packed vector code.
"""

import platform

import numpy as np
import pytest

from fastgrad._jit import njit
from fastgrad.kernels._vmath import row_max_nan

# -- row_max_nan


@njit
def _jit_max(r, ninf):
    return row_max_nan(r, ninf)


def _oracle(r):
    ok = r[~np.isnan(r)]
    return (ok.max() if ok.size else -np.inf), int(np.isnan(r).sum())


def _check(r):
    for a in (r, r.astype(np.float64)):
        m, c = _jit_max(a, a.dtype.type(-np.inf))
        want_m, want_c = _oracle(a)
        assert c == want_c and (m == want_m), (a, m, c)
    if r.size > 1:  # a strided fp32 row: the scalar loop
        s = np.repeat(r, 2)[::2]
        assert _jit_max(s, np.float32(-np.inf)) == _oracle(s)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

_hostile = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([np.nan, -np.inf, np.inf, 0.0, -0.0, 1e-45, -3.4e38]),
)


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 80), elements=_hostile))
def test_row_max_nan_is_the_largest_value_that_is_not_nan(r):
    _check(r)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 8192, 8195])
@pytest.mark.parametrize("where", ["none", "first", "last", "all", "tail"])
def test_row_max_nan_at_the_lane_edges(n, where):
    rng = np.random.default_rng(n)
    r = (rng.standard_normal(n) * 5).astype(np.float32)
    if n and where == "first":
        r[0] = np.nan
    elif n and where == "last":
        r[-1] = np.nan
        r[n // 2] = 1e30  # the max in a lane
    elif where == "all":
        r[:] = np.nan
    elif n and where == "tail":
        r[-(n % 8 or 1) :] = np.nan
        r[-1] = 99.0  # the max in the scalar tail
    _check(r)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 assembly")
def test_row_max_nan_is_vector_code_for_fp32_rows():
    @njit(cache=False)
    def f(r, ninf):
        return row_max_nan(r, ninf)

    f(np.ones(20, np.float32), np.float32(-np.inf))
    asm = next(iter(f.inspect_asm().values()))
    assert "maxps" in asm  # packed: the 8 lanes (vmaxps ymm on AVX2, or SSE's maxps)
