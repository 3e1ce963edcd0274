"""Validation helpers shared by the op modules (the op_api layer)."""

from __future__ import annotations

import numbers

import numpy as np

from ..errors import invalid

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def parse_reduction(reduction, op: str | None = None, name: str = "reduction") -> str:
    """'none' | 'mean' | 'sum', or the aclnn integers 0 | 1 | 2 -> the string form."""
    if isinstance(reduction, str):
        r = reduction.strip().lower()
        if r in ("none", "mean", "sum"):
            return r
    elif isinstance(reduction, numbers.Integral) and not isinstance(reduction, bool):
        if int(reduction) in REDUCTIONS:
            return REDUCTIONS[int(reduction)]
    raise invalid(name, "'none'|'mean'|'sum' or 0|1|2", repr(reduction), op)


def parse_float(value, name: str, op: str | None = None) -> float:
    """A real scalar attribute (Python/NumPy number, 0-d array) -> float; else 161002."""
    if isinstance(value, bool) or value is None:
        raise invalid(name, "a real number", repr(value), op)
    try:
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if isinstance(value, numbers.Real):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise invalid(name, "a real number", repr(value), op)


def parse_int(value, name: str, op: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise invalid(name, "an integer", repr(value), op)
    return int(value)


def parse_bool(value, name: str, op: str | None = None) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise invalid(name, "a bool", repr(value), op)


INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
