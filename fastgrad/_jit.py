"""Numba decorators with safe on-disk caching.

``cache=True`` raises at decoration time when Numba finds no writable cache directory (a
read-only install).  We pick a writable directory ourselves, in this order:
``NUMBA_CACHE_DIR`` (if writable), the package's own ``__pycache__`` (numba's default),
``$XDG_CACHE_HOME/fastgrad/numba`` (``~/.cache``), then the system temp dir; if none is
writable, caching is off (compilation still works).  ``FASTGRAD_NUMBA_CACHE=0`` turns caching
off explicitly.
"""

from __future__ import annotations

import os
import tempfile

import numba
import numba.core.config as _nconfig

from . import _config

#: fastmath flags that keep NaN/Inf semantics and true division (no nnan/ninf/arcp).
FASTMATH_SAFE = {"nsz", "contract", "afn", "reassoc"}  # a set: numba rejects frozenset


def _writable(d: str) -> bool:
    try:
        os.makedirs(d, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=d, prefix=".fg-probe-", delete=True)
        probe.close()
        return True
    except OSError:
        return False


def _choose_cache() -> bool:
    """Point Numba at the first writable cache directory (``fastgrad._config.numba_cache_candidates``:
    the environment is read there); False: caching off."""
    cands = _config.numba_cache_candidates()
    if cands is None:
        return False
    pkg_cache = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    for d in cands:
        if _writable(d or pkg_cache):
            _nconfig.CACHE_DIR = d  # type: ignore[attr-defined]  # "": numba's default in-tree locator
            return True
    return False


CACHE = _choose_cache()


def njit(*args, **kwargs):
    """``numba.njit`` with fastgrad's cache choice (``cache=`` defaults to the safe choice)."""
    kwargs.setdefault("cache", CACHE)
    if args and callable(args[0]) and len(args) == 1:
        return numba.njit(**kwargs)(args[0])
    return numba.njit(*args, **kwargs)


def pjit(*args, **kwargs):
    """``njit(parallel=True)`` with the safe cache choice."""
    kwargs.setdefault("parallel", True)
    return njit(*args, **kwargs)


def tjit(fn):
    """A serial kernel over a range of rows, ``fn(lo, hi, ...)``, that releases the GIL: run on
    fastgrad's pool of Python threads beside the BLAS calls (``kernels._gemm.run_rows``), so the
    fused loops never switch between two thread pools."""
    return njit(nogil=True)(fn)


def tjit_ieee(fn):
    """:func:`tjit` with NumPy's error model: a float division by zero gives IEEE's inf/NaN, as
    the device's vector unit does (``exp(x - max) / sum_exp`` with a zero ``sum_exp``), not a
    ``ZeroDivisionError``.  The same arithmetic otherwise (only the check is gone)."""
    return njit(nogil=True, error_model="numpy")(fn)


prange = numba.prange
