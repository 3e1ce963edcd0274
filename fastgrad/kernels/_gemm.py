"""Deterministic parallel GEMMs on NumPy's BLAS.

A multi-threaded BLAS splits a GEMM differently for different thread counts, and an output
element computed by a different micro-kernel can differ in its last bit: OpenBLAS's sgemm is
*not* bitwise reproducible across thread counts.  fastgrad promises identical results for every
thread count, so the GEMMs of the fused kernels are cut here into a fixed partition of output rows
(chosen from the shapes only), each block computed by single-threaded BLAS, and the blocks spread
over a pool of ``fastgrad.get_num_threads()`` Python threads (NumPy releases the GIL in BLAS).
Every output element is then produced by the same call with the same operands whatever the
thread count.

The element-wise passes between those GEMMs run on the same pool (``run_rows``: serial
``nogil`` Numba kernels over fixed row spans), not on Numba's OpenMP threads: GNU OpenMP's
workers spin after each parallel region, and the spinning took the cores from the BLAS calls
that followed (the train step at the Qwen2.5-0.5B head, 2 cores: 17.1 s with the passes on
OpenMP, 14.4 s on the pool).

Two engines compute the fp32 tiles (``fastgrad.gemm_engine``): NumPy's BLAS, or PyTorch's fp32
matmul routed to oneDNN's AVX-512 brgemm (``fastgrad._onednn``: exact fp32; 1.85× OpenBLAS's
sgemm on a Zen 5 EPYC, the same rate on Zen 4).  Either way each tile is one single-threaded call
(the pool's threads run PyTorch's OpenMP with one thread), so the reproducibility above holds
for both.

Fork-safe: a forked child (a DataLoader worker, ``multiprocessing``'s ``"fork"`` context) has
none of the parent's pool threads; ``os.register_at_fork`` makes it forget the pools (and take a
fresh lock), so its first GEMM starts its own pool instead of waiting forever on a dead worker.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from .. import _onednn

#: The most output rows (resp. columns) per BLAS call.  A dimension is cut into equal parts of
#: at most this size (``_spans``), so the tasks are balanced over the pool; never derived from
#: the thread count.
ROW_BLOCK = 512
COL_BLOCK = 512

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
_controller = None


def mm(A: np.ndarray, B: np.ndarray, out: np.ndarray, engine: str = "blas") -> None:
    """``out = A · B`` (2-D, fp32 or fp64) on ``engine``; one single-threaded call."""
    if engine == "onednn" and out.dtype == np.float32:
        _onednn.mm(A, B, out)
    else:
        np.matmul(A, B, out=out)


def _mm_into(A: np.ndarray, B: np.ndarray, out: np.ndarray, tmp: np.ndarray | None, engine: str) -> None:
    """``out = A · B``, or with ``tmp`` (scratch of ``out``'s shape) ``tmp = A · B; out += tmp``:
    one tile on one thread, the sum taken while the product is still in cache (bitwise the
    product followed by a separate addition)."""
    if tmp is None:
        mm(A, B, out, engine)
    else:
        mm(A, B, tmp, engine)
        np.add(out, tmp, out=out)


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: the parent's pool threads (and a lock one of
    them may have held) do not exist there.  Forget the pools (the child makes its own on first
    use) and take a fresh lock; without this the child's first GEMM waits forever on a worker
    that is not there (a DataLoader worker, ``multiprocessing``'s ``fork`` context)."""
    global _lock, _pools
    _lock = threading.Lock()
    _pools = {}


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(n: int) -> ThreadPoolExecutor:
    with _lock:
        p = _pools.get(n)
        if p is None:
            p = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fastgrad-gemm")
        return p


@contextlib.contextmanager
def single_threaded_blas(engine: str = "blas"):
    """For the duration: the BLAS on one thread and, for ``engine == "onednn"``, PyTorch's bf16
    math mode for fp32 matmuls (all restored afterwards).  ``engine`` is the call's choice
    (``tiling.GemmChoice.engine``, made by the op layer); nothing here reads a setting."""
    global _controller
    if engine not in ("blas", "onednn"):
        raise ValueError(f"engine must be 'blas' or 'onednn', got {engine!r}")
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_controller.limit(limits=1, user_api="blas"))
        if engine == "onednn":
            stack.enter_context(_onednn.fp32_precision_bf16())
        yield


def blas_for(engine_of):
    """Decorator of a keyword-only kernel entry point: its body runs inside
    :func:`single_threaded_blas` of the engine ``engine_of(kwargs)`` names — taken from the
    call's own arguments (its plan), never from a setting."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(**kwargs):
            with single_threaded_blas(engine_of(kwargs)):
                return fn(**kwargs)

        return wrapper

    return deco


def _run(tasks, engine: str = "blas"):
    """Run ``tasks`` (callables of no argument) on the pool (inline for one thread or task)."""
    n = numba.get_num_threads()
    if n <= 1 or len(tasks) <= 1:
        # the calling thread's OpenMP (PyTorch's): one thread, as on the pool
        with _onednn.one_omp_thread() if engine == "onednn" else contextlib.nullcontext():
            for t in tasks:
                t()
        return
    futs = [_pool(n).submit(t) for t in tasks]
    for f in futs:
        f.result()


def _spans(M: int, step: int) -> list[tuple[int, int]]:
    """``[0, M)`` cut into ``ceil(M / step)`` parts of equal size (±1): from the shape only."""
    k = -(-M // step)
    return [((i * M) // k, ((i + 1) * M) // k) for i in range(k)]


def row_tasks(kernel, n: int, *args, parts: int = 16) -> list:
    """The tasks of :func:`run_rows` (``kernel(lo, hi, *args)`` over at most ``parts`` equal spans
    of ``[0, n)``), to run with other independent tasks in one :func:`run_tasks`."""
    return [functools.partial(kernel, a, b, *args) for a, b in _spans(n, -(-n // parts))] if n > 0 else []


def run_rows(kernel, n: int, *args, parts: int = 16) -> None:
    """``kernel(lo, hi, *args)`` over ``[0, n)`` cut into at most ``parts`` equal spans, on the
    pool: the element-wise passes of the fused loops run on the same threads as their GEMMs
    (no OpenMP workers spinning beside the BLAS calls).  The spans come from ``n`` only."""
    if n > 0:
        _run(row_tasks(kernel, n, *args, parts=parts))


def run_tasks(tasks: list, engine: str = "blas") -> None:
    """Run independent tasks (from :func:`row_tasks`, :func:`nt_tasks`, :func:`nn_tasks`,
    :func:`tn_tasks`) on the pool together, one barrier for all: a pipelined loop puts one
    stage's GEMM tiles beside the next stage's element-wise passes.  Each task is the same call
    on the same operands as when run alone, so the bits do not depend on the grouping."""
    _run(tasks, engine)


def _part(t: np.ndarray | None, a: int, b: int, c: int | None = None, d: int | None = None):
    """``t[a:b, c:d]`` (``t[a:b]`` without columns), or None."""
    if t is None:
        return None
    return t[a:b] if c is None else t[a:b, c:d]


def _grid_tasks(
    A: np.ndarray, n: int, b_of, out: np.ndarray, tmp: np.ndarray | None, engine: str, rows: int, cols: int
) -> list:
    """``out[a:b, c:d] (+)= A[a:b] · b_of(c, d)`` over tiles of ≤ ``rows`` × ≤ ``cols`` of
    ``out`` (``n`` its columns), as tasks."""
    if rows < 1 or cols < 1:
        raise ValueError(f"tile sizes must be >= 1, got rows={rows}, cols={cols}")
    return [
        (lambda a=a, b=b, c=c, d=d: _mm_into(A[a:b], b_of(c, d), out[a:b, c:d], _part(tmp, a, b, c, d), engine))
        for a, b in _spans(A.shape[0], rows)
        for c, d in _spans(n, cols)
    ]


def nt_tasks(
    A: np.ndarray,
    B: np.ndarray,
    out: np.ndarray,
    tmp: np.ndarray | None = None,
    engine: str = "blas",
    *,
    rows: int = ROW_BLOCK,
    cols: int = COL_BLOCK,
) -> list:
    """The tiles of :func:`matmul_nt` as tasks (``rows`` × ``cols``: the largest tile of ``out``;
    a plan's choice, from the shapes only)."""
    return _grid_tasks(A, B.shape[0], lambda c, d: B[c:d].T, out, tmp, engine, rows, cols)


def nn_tasks(
    A: np.ndarray,
    B: np.ndarray,
    out: np.ndarray,
    tmp: np.ndarray | None = None,
    engine: str = "blas",
    *,
    rows: int = ROW_BLOCK,
    cols: int = COL_BLOCK,
) -> list:
    """The tiles of :func:`matmul_nn` as tasks (``rows`` × ``cols`` as :func:`nt_tasks`)."""
    return _grid_tasks(A, B.shape[1], lambda c, d: B[:, c:d], out, tmp, engine, rows, cols)


def tn_tasks(
    A: np.ndarray,
    B: np.ndarray,
    out: np.ndarray,
    tmp: np.ndarray | None = None,
    engine: str = "blas",
    *,
    rows: int = COL_BLOCK,
) -> list:
    """The blocks of :func:`matmul_tn` as tasks: ≤ ``rows`` rows of ``out`` (columns of ``A``)
    each, every column of ``out`` in one call."""
    if rows < 1:
        raise ValueError(f"block size must be >= 1, got rows={rows}")
    return [
        (lambda a=a, b=b: _mm_into(A[:, a:b].T, B, out[a:b], _part(tmp, a, b), engine))
        for a, b in _spans(A.shape[1], rows)
    ]


def matmul_nt(
    A: np.ndarray, B: np.ndarray, out: np.ndarray, tmp: np.ndarray | None = None, engine: str = "blas"
) -> None:
    """out[M, N] = A[M, K] · B[N, K]ᵀ (with ``tmp``, scratch of out's shape: out += A · Bᵀ), tiles
    of ≤ ROW_BLOCK rows × ≤ COL_BLOCK columns of out."""
    _run(nt_tasks(A, B, out, tmp, engine), engine)


def matmul_nn(
    A: np.ndarray, B: np.ndarray, out: np.ndarray, tmp: np.ndarray | None = None, engine: str = "blas"
) -> None:
    """out[M, N] = A[M, K] · B[K, N] (with ``tmp``, scratch of out's shape: out += A · B), tiles
    of ≤ ROW_BLOCK rows × ≤ COL_BLOCK columns of out."""
    _run(nn_tasks(A, B, out, tmp, engine), engine)


def matmul_tn(
    A: np.ndarray, B: np.ndarray, out: np.ndarray, tmp: np.ndarray | None = None, engine: str = "blas"
) -> None:
    """out[M, N] = A[K, M]ᵀ · B[K, N] (with ``tmp``, scratch of out's shape: out += Aᵀ · B),
    blocks of ≤ COL_BLOCK rows of out (columns of A)."""
    _run(tn_tasks(A, B, out, tmp, engine), engine)
