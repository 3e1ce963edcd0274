"""Timing, thread control and peak-memory measurement for the benchmark harness.

* :func:`time_fn` — one untimed warm-up call (it absorbs Numba compilation, first-touch page
  faults and allocator growth), then up to ``repeat`` timed calls, stopping early once
  ``budget_s`` seconds of timed calls have run (at least one); returns median/p20/p80.
* :func:`threads` — run NumPy's BLAS, the Numba kernels and PyTorch on ``n`` threads.
* :func:`reset_peak_rss` / :func:`peak_rss` — Linux ``VmHWM`` (reset by writing ``5`` to
  ``/proc/self/clear_refs``); elsewhere ``ru_maxrss`` (not resettable: only a fresh process
  gives a per-case peak, which is why memory-measured cases run in a spawned subprocess).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

MIB = 1024.0 * 1024.0


@dataclass
class Timing:
    median_s: float
    p20_s: float
    p80_s: float
    reps: int
    warmup_s: float
    samples: list

    def as_dict(self) -> dict:
        return {
            "time_median_s": self.median_s,
            "time_p20_s": self.p20_s,
            "time_p80_s": self.p80_s,
            "reps": self.reps,
            "warmup_s": self.warmup_s,
        }


def time_fn(fn: Callable[[], object], repeat: int = 5, budget_s: float = 30.0, warmup: int = 1) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then up to ``repeat`` timed calls (>= 1)."""
    t0 = time.perf_counter()
    for _ in range(max(0, warmup)):
        fn()
    warm = time.perf_counter() - t0
    samples = []
    spent = 0.0
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        samples.append(dt)
        spent += dt
        if spent >= budget_s:
            break
    s = np.asarray(samples)
    return Timing(
        float(np.median(s)),
        float(np.percentile(s, 20)),
        float(np.percentile(s, 80)),
        len(samples),
        warm,
        [float(x) for x in samples],
    )


def torch_module() -> types.ModuleType | None:
    """``torch`` when installed, else None (imported lazily: fastgrad does not need it)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - any import failure means "no torch"
        return None
    return torch


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run the Numba kernels, NumPy's BLAS and PyTorch (when imported) on ``n`` threads."""
    if n is None:
        yield
        return
    from .._config import num_threads

    t = sys.modules.get("torch")
    old = t.get_num_threads() if t is not None else None
    if t is not None:
        t.set_num_threads(int(n))
    try:
        with num_threads(int(n)):
            yield
    finally:
        if t is not None and old is not None:
            t.set_num_threads(old)


def default_threads() -> int:
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------ peak memory ----


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vmhwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux); True when it worked.  First every free block
    of fastgrad's output cache and glibc's free heap go back to the system, so a row's peak
    counts its own buffers, not those an earlier row left cached."""
    gc.collect()
    from .. import _outcache

    _outcache.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm = _vmhwm()
    return hwm is not None and hwm <= current_rss() * 1.05 + 4 * MIB


def peak_rss() -> int:
    """Peak resident set size in bytes since the last successful reset (or process start):
    Linux's ``VmHWM``, the high-water mark of this process image (what ``/usr/bin/time -v``
    reports for a job it starts).  Not ``ru_maxrss`` where ``VmHWM`` exists: Linux carries that
    across ``execve``, so a job started from a large process (a test runner, a notebook) would
    report its parent's size.  Elsewhere ``ru_maxrss``."""
    hwm = _vmhwm()
    if hwm is not None:
        return hwm
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) * (1 if sys.platform == "darwin" else 1024)
