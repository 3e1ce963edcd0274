"""bf16/fp16 <-> fp32 conversions in njit: bit-exact with ml_dtypes / NumPy astype."""

import warnings

import ml_dtypes
import numpy as np
import pytest

from fastgrad import dtypes as D

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("dt", [BF16, F16], ids=str)
def test_widen_all_65536_patterns(dt):
    a = ALL16.view(dt)
    ref = a.astype(np.float32).view(np.uint32)
    got = D.to_float32(a).view(np.uint32)
    np.testing.assert_array_equal(got, ref)


def _fp32_cases():
    rng = np.random.default_rng(0)
    r16 = ALL16.astype(np.uint32)
    f16_as32 = ALL16.view(np.float16).astype(np.float32).view(np.uint32)
    parts = [
        rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32),   # anything
        (r16 << 16) | 0x8000, (r16 << 16) | 0x7FFF, (r16 << 16) | 0x8001,       # bf16 ties / neighbours
        f16_as32 + (1 << 12), f16_as32 + (1 << 12) - 1, f16_as32 + (1 << 12) + 1,  # fp16 ties
        np.arange(0x33000000 - 4096, 0x38800000 + 4096, 3, dtype=np.uint32),    # fp16 subnormal range
        np.arange(0, 1 << 17, dtype=np.uint32),                                  # fp32 subnormals
        np.arange(0x7F800000, 0x7F800000 + (1 << 16), dtype=np.uint32),          # +Inf, NaN payloads
        np.arange(0xFF800000, 0xFF800000 + (1 << 16), dtype=np.uint32),          # -Inf, NaN payloads
        np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000], np.uint32),  # overflow edges
    ]
    return np.concatenate(parts)


@pytest.mark.parametrize("dt", [BF16, F16], ids=str)
def test_narrow_is_bit_exact(dt):
    u = _fp32_cases()
    f = u.view(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = f.astype(dt).view(np.uint16)
    got = D.from_float32(f, dt).view(np.uint16)
    bad = np.nonzero(got != ref)[0]
    assert bad.size == 0, [(hex(u[i]), hex(ref[i]), hex(got[i])) for i in bad[:5]]


def test_bf16_nan_is_canonical_and_keeps_sign():
    nan_bits = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF], np.uint32)
    got = D.from_float32(nan_bits.view(np.float32), BF16).view(np.uint16)
    np.testing.assert_array_equal(got, [0x7FC0, 0xFFC0, 0x7FC0, 0xFFC0])


def test_round_f32_is_the_composition():
    from fastgrad._jit import njit

    @njit
    def rnd(x, code):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = D.round_f32(x[i], code)
        return out

    x = _fp32_cases()[:200000].view(np.float32)
    for dt in (BF16, F16):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = x.astype(dt).astype(np.float32)
        np.testing.assert_array_equal(rnd(x, D.code_of(dt)).view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(rnd(x, D.F32).view(np.uint32), x.view(np.uint32))


def test_non_contiguous_and_empty():
    a = np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::3].astype(BF16)
    np.testing.assert_array_equal(D.to_float32(a), a.astype(np.float32))
    assert D.to_float32(np.zeros((0, 3), F16)).shape == (0, 3)
    out = np.zeros((8, 5), F16).T
    D.from_float32(np.ones((5, 8), np.float32), F16, out=out)
    assert np.all(out == 1)


@pytest.mark.parametrize("dt", [BF16, F16], ids=str)
def test_round_trip_of_every_16_bit_pattern(dt):
    """widen then narrow gives every pattern back (bf16 NaNs become the canonical quiet NaN)."""
    a = ALL16.view(dt)
    back = D.from_float32(D.to_float32(a), dt).view(np.uint16)
    if dt == BF16:
        nan = (ALL16 & 0x7FFF) > 0x7F80
        expect = np.where(nan, (ALL16 & 0x8000) | 0x7FC0, ALL16).astype(np.uint16)
    else:
        expect = ALL16
    np.testing.assert_array_equal(back, expect)
