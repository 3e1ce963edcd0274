"""pytest-benchmark suite over the shared case definitions (``fastgrad.benchmarks.cases``).

    pytest bench/ --benchmark-only                 # quick shapes
    pytest bench/ --benchmark-only --fg-full       # the LLM-sized shapes of the report
    pytest bench/ --benchmark-only --fg-backend cpu,reference --fg-ops ce,softmax

One test per (case, runner, backend): the fastgrad op on each backend, the PyTorch baselines
(skipped without torch) and the bound (the fp32 GEMMs, or a parallel copy of the case's
bytes).  Peak-memory measurements need a fresh process: use ``fastgrad bench`` for those.
"""

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("fastgrad bench")
    g.addoption("--fg-full", action="store_true", help="LLM-sized cases (default: the quick shapes)")
    g.addoption("--fg-backend", default="cpu", help="comma-separated fastgrad backends (default cpu)")
    g.addoption("--fg-ops", default="", help="comma-separated ops/aliases to run (default all)")
    g.addoption("--fg-rounds", type=int, default=0, help="timed rounds per test (default 5 quick, 3 full)")


def _rows(config):
    from fastgrad import benchmarks as B

    full = config.getoption("--fg-full")
    backends = [b.strip() for b in config.getoption("--fg-backend").split(",") if b.strip()]
    ops = [o for o in config.getoption("--fg-ops").split(",") if o.strip()]
    rows = []
    for case in B.select(B.all_cases(quick=not full), ops):
        for ri, r in enumerate(case.runners):
            for b in (backends if r.kind == "fastgrad" else [r.name]):
                label = f"{case.id}::{r.name}{('+' + r.mode) if r.mode else ''}" + (
                    f"@{b}" if r.kind == "fastgrad" else "")
                rows.append(pytest.param((case, ri, b), id=label))
        if case.bound == "copy":
            rows.append(pytest.param((case, -1, "bound"), id=f"{case.id}::bound(copy)"))
    return rows


def pytest_generate_tests(metafunc):
    if "fg_row" in metafunc.fixturenames:
        metafunc.parametrize("fg_row", _rows(metafunc.config))


_CACHE = {}


@pytest.fixture
def fg_inputs():
    """Inputs of a case, built once and kept while consecutive tests use the same case."""
    def get(case):
        if case.id not in _CACHE:
            _CACHE.clear()
            _CACHE[case.id] = case.build()
        return _CACHE[case.id]
    return get


@pytest.fixture
def fg_rounds(request):
    n = request.config.getoption("--fg-rounds")
    return n or (3 if request.config.getoption("--fg-full") else 5)
