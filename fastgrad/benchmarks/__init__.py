"""fastgrad's benchmark harness: the one definition of cases, baselines, bounds, timing, the
JSON report schema, its table and its plots (``fastgrad bench``, ``pytest bench/``).

Modules: :mod:`.cases` (what is measured), :mod:`.machine` (machine description, copy
bandwidth and GEMM bounds), :mod:`.timing` (warm-up + repeated timing, threads, peak RSS),
:mod:`.runner` (cases -> JSON rows, memory cases in a spawned subprocess), :mod:`.report`
(JSON I/O, text/Markdown tables, side-by-side comparison, PNG plots).  Schema and usage:
``docs/benchmarks.md``.
"""

import importlib
from typing import Any

#: the package's names and the module each comes from, imported on first use: ``fastgrad -h``
#: and the command's other paths import ``benchmarks.report`` / ``.timing`` without the cases
#: and the runner (which pull in Numba)
_EXPORTS = {
    "ALIASES": "cases",
    "Case": "cases",
    "Runner": "cases",
    "all_cases": "cases",
    "find_case": "cases",
    "select": "cases",
    "format_compare": "report",
    "format_markdown": "report",
    "format_table": "report",
    "load": "report",
    "plot": "report",
    "save": "report",
    "SCHEMA": "report",
    "run": "runner",
    "run_one": "runner",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
