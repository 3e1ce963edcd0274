"""fastgrad's benchmark harness: the one definition of cases, baselines, bounds, timing, the
JSON report schema, its table and its plots (``fastgrad bench``, ``pytest bench/``).

Modules: :mod:`.cases` (what is measured), :mod:`.machine` (machine description, copy
bandwidth and GEMM bounds), :mod:`.timing` (warm-up + repeated timing, threads, peak RSS),
:mod:`.runner` (cases -> JSON rows, memory cases in a spawned subprocess), :mod:`.report`
(JSON I/O, text/Markdown tables, side-by-side comparison, PNG plots).  Schema and usage:
``docs/benchmarks.md``.
"""

from .cases import ALIASES, Case, Runner, all_cases, find_case, select
from .report import format_compare, format_markdown, format_table, load, plot, save
from .runner import SCHEMA, run, run_one

__all__ = [
    "ALIASES",
    "Case",
    "Runner",
    "all_cases",
    "find_case",
    "select",
    "SCHEMA",
    "run",
    "run_one",
    "format_compare",
    "format_markdown",
    "format_table",
    "load",
    "plot",
    "save",
]
