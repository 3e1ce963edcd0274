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
that followed (the train step at the Qwen2.5-0.5B head was slower with the passes on OpenMP than
on the pool; figures in bench/results/README.md, "Measurements behind the source's choices").

Two engines compute the fp32 tiles (``fastgrad.gemm_engine``): NumPy's BLAS, or PyTorch's fp32
matmul routed to oneDNN's AVX-512 brgemm (``fastgrad._onednn``: exact fp32; faster than
OpenBLAS's sgemm where OpenBLAS lacks a kernel for the CPU, Zen 5, the same rate on Zen 4).
Either way each tile is one single-threaded call
(the pool's threads run PyTorch's OpenMP with one thread), so the reproducibility above holds
for both.

Accumulating tiles (``out += A · B``, a sum over vocabulary chunks or row blocks) take a scratch
``tmp`` (the product, then a separate addition), or :data:`IN_BLAS`: one call of the BLAS's own
``cblas_sgemm``/``cblas_dgemm`` with ``beta = 1`` (:func:`blas_accumulates`: NumPy's OpenBLAS,
found through threadpoolctl), which adds the product's ``K``-panels onto ``out`` as it computes
them — no scratch, no second pass over ``out``, different last bits (still from the shapes only).

Fork-safe: a forked child (a DataLoader worker, ``multiprocessing``'s ``"fork"`` context) has
none of the parent's pool threads; ``os.register_at_fork`` makes it forget the pools (and take a
fresh lock), so its first GEMM starts its own pool instead of waiting forever on a dead worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import threadpoolctl

from .. import _onednn
from ..errors import InternalError
from ..lm_head.plan_types import ACLNN_GEMM_TILE

#: The most output rows (resp. columns) per BLAS call.  A dimension is cut into equal parts of
#: at most this size (``_spans``), so the tasks are balanced over the pool; never derived from
#: the thread count.
ROW_BLOCK, COL_BLOCK = ACLNN_GEMM_TILE

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
_controller = None


def mm(A: np.ndarray, B: np.ndarray, out: np.ndarray, engine: str = "blas") -> None:
    """``out = A · B`` (2-D, fp32 or fp64) on ``engine``; one single-threaded call."""
    if engine == "onednn" and out.dtype == np.float32:
        _onednn.mm(A, B, out)
    else:
        np.matmul(A, B, out=out)


class _InBlas:
    """The type of :data:`IN_BLAS`."""

    def __repr__(self) -> str:
        return "IN_BLAS"


#: ``tmp`` of an accumulating tile (``out += A · B``) summed inside the BLAS call (``beta = 1``;
#: :func:`accumulate`) instead of through a scratch product — where the plan found
#: :func:`blas_accumulates`.
IN_BLAS = _InBlas()

#: What an accumulating tile takes as ``tmp``: None (``out = A · B``), a scratch of ``out``'s
#: shape, or :data:`IN_BLAS` (:func:`_mm_into`).
Scratch = np.ndarray | _InBlas | None

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@functools.cache
def _cblas_gemm(dtype_name: str):
    """NumPy's OpenBLAS's ``cblas_sgemm`` (``"float32"``) / ``cblas_dgemm`` (``"float64"``) as a
    ctypes function, or None: the library NumPy loaded (threadpoolctl's OpenBLAS controller
    under NumPy's directory, or the only OpenBLAS loaded), its symbols under the names
    OpenBLAS builds take (``scipy_`` prefix, ``64_`` suffix), the integer width from
    ``openblas_get_config`` (``USE64BITINT``), and one small product checked against
    ``np.matmul`` before it is used.  Any other BLAS (MKL, Accelerate, BLIS): None."""
    t = {"float32": ("s", ctypes.c_float), "float64": ("d", ctypes.c_double)}.get(dtype_name)
    if t is None:
        return None
    try:
        from threadpoolctl import ThreadpoolController

        libs = [c for c in ThreadpoolController().lib_controllers if c.internal_api == "openblas"]
    except Exception:  # noqa: BLE001 - no controller: no in-place accumulation, never an error
        return None
    home = os.path.dirname(os.path.dirname(os.path.realpath(np.__file__)))
    mine = [c for c in libs if os.path.realpath(c.filepath).startswith(os.path.join(home, "numpy"))]
    if len(mine) != 1 and len(libs) != 1:
        return None
    lib = ctypes.CDLL((mine or libs)[0].filepath)
    for prefix in ("scipy_", ""):
        for suffix in ("64_", ""):
            fn = getattr(lib, f"{prefix}cblas_{t[0]}gemm{suffix}", None)
            cfg = getattr(lib, f"{prefix}openblas_get_config{suffix}", None)
            if fn is None or cfg is None:
                continue
            cfg.restype = ctypes.c_char_p
            cfg.argtypes = []
            ilp64 = b"USE64BITINT" in (cfg() or b"")
            it, ft = (ctypes.c_int64 if ilp64 else ctypes.c_int), t[1]
            fn.restype = None
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, it, it, it, ft, ctypes.c_void_p, it]
            fn.argtypes += [ctypes.c_void_p, it, ft, ctypes.c_void_p, it]
            return fn if _cblas_checks(fn, np.dtype(dtype_name)) else None
    return None


def _cblas_checks(fn, dt: np.dtype) -> bool:
    """One small ``C += A·Bᵀ`` through ``fn`` equals ``C + A @ B.T`` (exact: small integers)."""
    a = np.arange(6, dtype=dt).reshape(2, 3)
    b = np.arange(12, dtype=dt).reshape(4, 3) - 5
    c = np.ones((2, 4), dt)
    want = c + a @ b.T
    if not _cblas_call(fn, a, b.T, c):
        return False
    return bool(np.array_equal(c, want))


def _layout(a: np.ndarray) -> tuple[int, int] | None:
    """``(trans, ld)`` of a 2-D operand for a row-major cblas call, or None (another layout)."""
    r, c = a.shape
    item = a.itemsize
    s0, s1 = a.strides
    if s0 % item or s1 % item:
        return None
    s0, s1 = s0 // item, s1 // item
    if (c <= 1 or s1 == 1) and (r <= 1 or s0 >= max(c, 1)):
        return _NO_TRANS, (s0 if r > 1 else max(c, 1))
    if (r <= 1 or s0 == 1) and (c <= 1 or s1 >= max(r, 1)):
        return _TRANS, (s1 if c > 1 else max(r, 1))
    return None


def _cblas_call(fn, A: np.ndarray, B: np.ndarray, out: np.ndarray) -> bool:
    """``out += A · B`` through ``fn`` (beta = 1); False (nothing done) for a layout it cannot take."""
    la, lb, lc = _layout(A), _layout(B), _layout(out)
    if la is None or lb is None or lc is None or lc[0] != _NO_TRANS or not out.flags.writeable:
        return False
    M, N = out.shape
    K = A.shape[1]
    if M and N and K:
        a, b, c = A.ctypes.data, B.ctypes.data, out.ctypes.data
        fn(_ROW_MAJOR, la[0], lb[0], M, N, K, 1.0, a, la[1], b, lb[1], 1.0, c, lc[1])
    return True


def blas_accumulates(dtype) -> bool:
    """NumPy's BLAS can add a product onto its output in one call for operands of ``dtype``
    (``cblas_?gemm`` with ``beta = 1``: :data:`IN_BLAS`); the op layer's plans ask this once."""
    return _cblas_gemm(np.dtype(dtype).name) is not None


def accumulate(A: np.ndarray, B: np.ndarray, out: np.ndarray, engine: str = "blas") -> None:
    """``out += A · B`` (2-D, one dtype): one call of the BLAS's gemm with ``beta = 1`` for the
    ``"blas"`` engine where :func:`blas_accumulates`; else (another engine, a layout the call
    cannot take) the product into fresh scratch, then the sum."""
    fn = _cblas_gemm(out.dtype.name) if engine == "blas" else None
    if A.shape[0] != out.shape[0] or B.shape[1] != out.shape[1] or A.shape[1] != B.shape[0]:
        raise ValueError(f"accumulate: shapes {A.shape} · {B.shape} do not give {out.shape}")
    if fn is not None and A.dtype == B.dtype == out.dtype and _cblas_call(fn, A, B, out):
        return
    _add_product(A, B, out, np.empty_like(out), engine)


def _add_product(A: np.ndarray, B: np.ndarray, out: np.ndarray, tmp: np.ndarray, engine: str) -> None:
    """``tmp = A · B; out += tmp``: the product into scratch, then a separate addition."""
    mm(A, B, tmp, engine)
    np.add(out, tmp, out=out)


def _mm_into(A: np.ndarray, B: np.ndarray, out: np.ndarray, tmp: Scratch, engine: str) -> None:
    """``out = A · B``; with ``tmp`` (scratch of ``out``'s shape) ``tmp = A · B; out += tmp`` —
    one tile on one thread, the sum taken while the product is still in cache (bitwise the
    product followed by a separate addition); with :data:`IN_BLAS` ``out += A · B`` in the
    BLAS call (:func:`accumulate`)."""
    if tmp is None:
        mm(A, B, out, engine)
    elif isinstance(tmp, _InBlas):
        accumulate(A, B, out, engine)
    else:
        _add_product(A, B, out, tmp, engine)


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: the parent's pool threads (and a lock one of
    them may have held) do not exist there.  Forget the pools (the child makes its own on first
    use) and take a fresh lock; without this the child's first GEMM waits forever on a worker
    that is not there (a DataLoader worker, ``multiprocessing``'s ``fork`` context)."""
    global _lock, _pools, _blas_lock
    _lock = threading.Lock()
    _blas_lock = threading.Lock()
    _pools = {}


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(n: int) -> ThreadPoolExecutor:
    with _lock:
        p = _pools.get(n)
        if p is None:
            p = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fastgrad-gemm")
        return p


_blas_lock = threading.Lock()
_blas_users = 0  # kernel calls inside single_threaded_blas now, in every thread
_blas_limit = None  # threadpoolctl's limiter of the first of them (restores the BLAS's threads)
_blas_pending: int | None = None  # a BLAS thread count asked for while they run (set_blas_threads)


def _release_blas_control() -> None:
    """threadpoolctl (≥ 3.8) lets only the thread that last set OpenBLAS's (process-wide) thread
    count set it again until that thread lets go, and silently ignores the others: let go at once,
    so the call that ends last — in any thread — restores the count."""
    ctl = getattr(threadpoolctl, "OpenBLASController", None)
    clear = getattr(ctl, "clear_controlling_thread", None)
    if clear is not None:
        clear()


def _apply_blas_threads(n: int) -> None:
    threadpoolctl.threadpool_limits(limits=n, user_api="blas")
    _release_blas_control()


def set_blas_threads(n: int) -> None:
    """NumPy's BLAS on ``n`` threads for the code outside fastgrad's calls (``set_num_threads``):
    at once, or — while kernel calls run in any thread, holding it at one thread — when the last
    of them ends (it would change their OpenBLAS sums under them: bits that depend on timing)."""
    global _blas_pending
    with _blas_lock:
        if _blas_users:
            _blas_pending = int(n)
        else:
            _apply_blas_threads(int(n))


def blas_threads() -> int | None:
    """The BLAS thread count in force for the code outside fastgrad's calls: the one asked for
    while calls run, else what the first of them found, else the library's now (None: no BLAS
    threadpoolctl can see)."""
    with _blas_lock:
        if _blas_pending is not None:
            return _blas_pending
        if _blas_users and _blas_limit is not None:
            n = _blas_limit.get_original_num_threads()
            return n.get("blas") if isinstance(n, dict) else n
    info = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
    return info[0] if info else None


@contextlib.contextmanager
def single_threaded_blas(engine: str = "blas"):
    """For the duration: the BLAS on one thread (each tile is one single-threaded call on the
    GEMM pool).  The BLAS's thread count is process-wide: concurrent kernel calls are counted —
    the first limits it, the last restores what the first found — so two calls in two Python
    threads never undo each other's limit (an undone limit changes OpenBLAS's sums: bits that
    depend on timing).  ``engine`` is the call's choice (``tiling.GemmChoice.engine``, made by
    the op layer); nothing here reads a setting; the ``"onednn"`` engine's math mode is set
    around each of its own ``torch.mm`` calls (``_onednn.mm``), not here."""
    global _controller, _blas_users, _blas_limit, _blas_pending
    if engine not in ("blas", "onednn"):
        raise InternalError(f"engine must be 'blas' or 'onednn', got {engine!r}")
    with _blas_lock:
        if _controller is None:
            _controller = threadpoolctl.ThreadpoolController()
        if _blas_users == 0:
            _blas_limit = _controller.limit(limits=1, user_api="blas")
            _release_blas_control()
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0 and _blas_limit is not None:
                _blas_limit.restore_original_limits()
                _release_blas_control()
                _blas_limit = None
                if _blas_pending is not None:  # set_blas_threads while the calls ran
                    _apply_blas_threads(_blas_pending)
                    _blas_pending = None


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
    n = pool_threads()
    if n <= 1 or len(tasks) <= 1:
        # the calling thread's OpenMP (PyTorch's): one thread, as on the pool
        with _onednn.one_omp_thread() if engine == "onednn" else contextlib.nullcontext():
            for t in tasks:
                t()
        return
    futs = [_pool(n).submit(t) for t in tasks]
    for f in futs:
        f.result()


def run_graph(groups: list[list], preds: list[set[int]], engine: str = "blas") -> None:
    """Run groups of tasks (callables of no argument) on the pool as a dependency graph: group
    ``g``'s tasks may start once every group in ``preds[g]`` (indices below ``g``) has finished;
    a free thread takes the next task of the lowest-numbered ready group (the list's order is the
    priority, and a topological order: one thread runs the groups in it, inline).  No barrier
    but the last: a pipelined loop's next GEMM tiles start while the tail of the previous stage
    still runs.  Each task is the same call on the same operands whatever the schedule, so the
    bits depend only on the graph.  The first exception a task raises is raised here once every
    started task has returned; no task starts after it.  ``ValueError`` for a predecessor that
    is not an earlier group."""
    G = len(groups)
    for g, p in enumerate(preds):
        if any(not 0 <= q < g for q in p):
            raise ValueError(f"run_graph: group {g}'s predecessors must be earlier groups, got {sorted(p)}")
    n = pool_threads()
    if n <= 1 or sum(len(t) for t in groups) <= 1:  # _run's inline path, the groups in order
        _run([t for tasks in groups for t in tasks], engine)
        return
    succ: list[list[int]] = [[] for _ in range(G)]
    npred = [len(p) for p in preds]
    for g, p in enumerate(preds):
        for q in p:
            succ[q].append(g)
    left = [len(t) for t in groups]  # tasks not yet finished
    nxt = [0] * G  # the next task to hand out
    ready: list[int] = []
    cv = threading.Condition()
    remaining = [G]  # groups not finished
    error: list[BaseException] = []  # the first task's exception

    def complete(g: int) -> None:  # under cv: g finished; its successors may become ready
        stack = [g]
        while stack:
            h = stack.pop()
            remaining[0] -= 1
            for s2 in succ[h]:
                npred[s2] -= 1
                if npred[s2] == 0:
                    if groups[s2]:
                        heapq.heappush(ready, s2)
                    else:
                        stack.append(s2)
        cv.notify_all()

    with cv:
        # the groups without predecessors; an empty one finishes at once, releasing its successors
        for g in [g for g in range(G) if npred[g] == 0]:
            if groups[g]:
                heapq.heappush(ready, g)
            else:
                complete(g)

    def worker() -> None:
        while True:
            with cv:
                while not ready and remaining[0] and not error:
                    cv.wait()
                if not remaining[0] or error:
                    return
                g = ready[0]
                i = nxt[g]
                nxt[g] += 1
                if nxt[g] == len(groups[g]):
                    heapq.heappop(ready)
            try:
                groups[g][i]()
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                with cv:
                    if not error:
                        error.append(e)
                    cv.notify_all()
                return
            with cv:
                left[g] -= 1
                if left[g] == 0:
                    complete(g)

    futs = [_pool(n).submit(worker) for _ in range(n)]
    for f in futs:
        f.result()
    if error:
        raise error[0]


def _spans(M: int, step: int) -> list[tuple[int, int]]:
    """``[0, M)`` cut into ``ceil(M / step)`` parts of equal size (±1): from the shape only."""
    return parts(M, -(-M // step))


def pool_threads() -> int:
    """The pool's width: the calling thread's Numba thread count (``fastgrad.set_num_threads``)."""
    return numba.get_num_threads()


#: the fewest rows (and columns) a native GEMM task is cut to where the pool has more threads than tiles
POOL_MIN_SIDE = 64
#: the least share of the pool's thread-time that :func:`pool_grid` keeps busy in the last round
POOL_BALANCE = 0.9


def pool_grid(rows: int, cols: int, r_max: int, c_max: int) -> tuple[int, int]:
    """(row parts, column parts) of a GEMM's tasks: the shapes' ``rows × cols`` — or, where their
    count leaves less than :data:`POOL_BALANCE` of ``T · rounds`` busy (``T``: :func:`pool_threads`;
    e.g. 4 tiles on 16 threads), the first count that reaches it (or the best balance there is),
    more column parts first (up to ``c_max``), then more row parts (up to ``r_max``): a row part
    re-reads all of ``B`` and reuses each of its blocks over fewer rows (bench/results/README.md).
    Only for kernels whose bits do not depend on the split (the native GEMMs: each output one fixed
    sequence of additions); one thread, or a pool the tiles fill, runs the shapes' grid."""
    T = pool_threads()

    def balance(n: int) -> float:
        return n / (T * -(-n // T))

    if T <= 1 or rows * cols == 0 or balance(rows * cols) >= POOL_BALANCE:
        return rows, cols
    best = (balance(rows * cols), rows, cols)
    for r in range(rows, max(rows, r_max) + 1):
        for c in range(cols, max(cols, c_max) + 1):
            b = balance(r * c)
            if b >= POOL_BALANCE:
                return r, c
            if b > best[0] + 1e-12:
                best = (b, r, c)
    return best[1], best[2]


def parts(M: int, k: int) -> list[tuple[int, int]]:
    """``[0, M)`` cut into ``k`` parts of equal size (±1)."""
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


def _part(t: Scratch, a: int, b: int, c: int | None = None, d: int | None = None):
    """``t[a:b, c:d]`` (``t[a:b]`` without columns), or None / :data:`IN_BLAS` as given."""
    if t is None or isinstance(t, _InBlas):
        return t
    return t[a:b] if c is None else t[a:b, c:d]


def _grid_tasks(A: np.ndarray, n: int, b_of, out: np.ndarray, tmp: Scratch, engine: str, rows: int, cols: int) -> list:
    """``out[a:b, c:d] (+)= A[a:b] · b_of(c, d)`` over tiles of ≤ ``rows`` × ≤ ``cols`` of
    ``out`` (``n`` its columns), as tasks (``tmp``: None, a scratch of ``out``'s shape, or
    :data:`IN_BLAS`, as :func:`_mm_into`'s)."""
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
    tmp: Scratch = None,
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
    tmp: Scratch = None,
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
    tmp: Scratch = None,
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
