"""pytest-benchmark rows for every benchmark case (see bench/conftest.py)."""

import numpy as np
import pytest

from fastgrad.benchmarks import machine, runner
from fastgrad.benchmarks.timing import torch_module


def test_case(benchmark, fg_row, fg_inputs, fg_rounds):
    case, ri, backend = fg_row
    benchmark.group = case.id
    info = {"op": case.op, "case": case.id, "dtype": case.dtype, "shape": case.shape_str,
            "mode": case.mode, "backend": backend, "flops": case.flops, "bytes": case.bytes,
            "bound": case.bound}
    if ri < 0:  # copy bound: a parallel copy moving the case's bytes (read + write)
        n = max(1, int(case.bytes // 8))
        src = np.ones(n, np.float32)
        dst = np.empty_like(src)
        fn = lambda: machine._copy(src, dst)  # noqa: E731
    else:
        r = case.runners[ri]
        info["mode"] = case.mode + (f"+{r.mode}" if r.mode else "")
        if (r.needs_torch or case.needs_torch) and torch_module() is None:
            pytest.skip("torch not installed")
        from fastgrad.backends import available_backends

        if r.kind == "fastgrad" and backend not in available_backends():
            pytest.skip(f"backend {backend} unavailable")
        fn = runner._callable(case, r, backend, fg_inputs(case))
    try:
        fn()  # warm-up outside the measurement: compilation, first-touch page faults
    except NotImplementedError as e:
        pytest.skip(f"not implemented: {e}")
    benchmark.extra_info.update(info)
    benchmark.pedantic(fn, rounds=fg_rounds, iterations=1, warmup_rounds=0)
    metrics = getattr(fn, "metrics", None)
    if metrics is not None:  # the runner's own figures: the train step's loss and its error vs float64
        benchmark.extra_info.update(metrics())
    med = benchmark.stats.stats.median
    if med:
        if case.flops:
            benchmark.extra_info["gflops"] = case.flops / med / 1e9
        if case.bytes:
            benchmark.extra_info["gbps"] = case.bytes / med / 1e9
