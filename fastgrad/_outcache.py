"""Recycled memory for the ops' large fresh outputs: a caching allocator for the CPU.

Why: an op called without ``out=`` writes a new array.  Above glibc's mmap threshold (at most
32 MiB) ``np.empty`` maps fresh pages from the kernel, and the first write to each page costs a
fault and the kernel's clearing of the page — one extra pass of writes over the output, which
for the bandwidth-bound ops costs as much as the op itself (the clearing, not the number of
faults, is the cost: fresh pages advised ``MADV_HUGEPAGE`` cost about as much as small ones;
figures in bench/results/README.md, "Measurements behind the source's choices").  No way of
touching the pages makes it cheaper; not asking the kernel for new pages does, as PyTorch's
CUDA caching allocator, jemalloc and tcmalloc do.

The kernels take their large scratch buffers (logits tiles, widened weight chunks, fp32
accumulators) from here too: dropped at the end of a call, they serve the next call of the
same shapes — a training loop's steps — without fresh pages.

How: every output of at least ``MIN_BYTES`` lives on a block (a ``uint8`` array that owns
its memory) kept in a list, and is owned by a lease (:class:`_Lease`): the output array's
``base`` is the lease, so every array, view or tensor (``torch.from_numpy``) derived from the
output keeps the lease alive, and the lease keeps its block's memory alive.  Ownership is
explicit: a ``weakref.finalize`` on the lease marks the block free when the lease is collected
— when the last array that refers to the output is gone — and a block is handed out again only
when it is marked free (no reference count is read: the contract holds on any Python, free-
threaded builds included).  A free block serves a request of at least half its size (best fit:
the smallest such free block; so the forward's logits tile serves the backward's smaller tile
instead of both being held).  The blocks' total (in use or
free) is capped by ``FASTGRAD_OUTPUT_CACHE_MB`` (default 2048; 0 turns the cache off): past
the cap, free blocks are released (least recently used first) and, if that is not enough, the
output is a plain ``np.empty``.  :func:`empty_cache` releases every free block.  A block the
cache forgets while it is in use (``empty_cache`` never does; interpreter exit does) stays
valid: its lease holds the memory until the last user is gone.

The outputs are not zeroed (neither is ``np.empty``'s memory): every op writes all of its
output.  Thread-safe (one lock; the finalizer only sets a flag, so a collection inside the
lock cannot deadlock).  Fork-safe: the child takes a fresh lock (``os.register_at_fork``).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
import threading
import weakref

import numpy as np

from ._config import ScopeStack, output_cache_env_limit

__all__ = ["empty", "empty_cache", "output_cache_info", "output_cache_limit", "set_output_cache_limit", "output_cache"]

MIN_BYTES = 16 * 2**20  #: smaller outputs come from malloc's own free lists, no fresh pages
GRANULE = 2 * 2**20  #: block sizes are rounded up to this (nearby sizes share blocks)

_lock = threading.Lock()


class _Block:
    """One cached block: its memory and whether an output owns it now."""

    __slots__ = ("buf", "in_use")

    def __init__(self, nbytes: int):
        self.buf = np.empty(nbytes, np.uint8)
        self.in_use = False

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def hand_back(self) -> None:
        """The lease's finalizer: the output and everything derived from it are gone."""
        self.in_use = False


class _Lease:
    """The owner of one output on a block: the output array's ``base`` (NumPy keeps the object
    that supplied ``__array_interface__`` as the base), holding the block's memory alive."""

    __slots__ = ("__array_interface__", "block", "__weakref__")

    def __init__(self, block: _Block, shape: tuple, dt: np.dtype):
        self.block = block
        self.__array_interface__ = {
            "data": (block.buf.ctypes.data, False),
            "shape": shape,
            "typestr": dt.str,
            "version": 3,
        }


def _lease(block: _Block, shape: tuple, dt: np.dtype) -> np.ndarray:
    """An output of ``shape``/``dt`` on ``block``, owned by a new lease (the block in use until
    the lease is collected)."""
    block.in_use = True
    lease = _Lease(block, shape, dt)
    out = np.asarray(lease)
    if out.dtype != dt:  # e.g. ml_dtypes' bfloat16, whose typestr NumPy reads as raw bytes
        out = out.view(dt)
    fin = weakref.finalize(lease, block.hand_back)
    fin.atexit = False
    return out


def _after_fork_in_child() -> None:
    """A lock held by another thread of the parent at the fork is never released in the child."""
    global _lock, _scopes_lock
    _lock = threading.Lock()
    _scopes_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_blocks: list[_Block] = []  # most recently used last
_limit_override: int | None = None
_hits = 0
_misses = 0


@atexit.register
def _drop_at_exit() -> None:
    """Forget every block while the interpreter is whole: at exit the memory belongs to its
    users alone again, as without the cache (no block outlives the arrays and tensors that
    refer to it into the interpreter's teardown)."""
    with _lock:
        _blocks.clear()


def output_cache_limit() -> int:
    """The cap on the cached blocks' total, in bytes (0: the cache is off)."""
    if _limit_override is not None:
        return _limit_override
    return output_cache_env_limit()


def _cap_bytes(mb: object, op: str) -> int | None:
    import numbers

    from .errors import invalid

    if mb is None:
        return None
    if isinstance(mb, bool) or not isinstance(mb, numbers.Real) or not math.isfinite(float(mb)) or float(mb) < 0:
        raise invalid("mb", "a finite number of MiB >= 0 (0: the cache off) or None", repr(mb), op)
    return int(float(mb) * 2**20)


def set_output_cache_limit(mb: float | None) -> None:
    """Set the cap in MiB for the process (0: off; None: back to ``FASTGRAD_OUTPUT_CACHE_MB``).
    Free blocks above the new cap are released at once.

    Raises ``AclnnParamError`` (161002, a ``ValueError``) naming ``mb`` unless it is a finite
    number >= 0 or None."""
    global _limit_override
    _limit_override = _cap_bytes(mb, "set_output_cache_limit")
    with _lock:
        _release_free(_total() - output_cache_limit())


#: the open ``output_cache()`` blocks of every Python thread (under ``_scopes_lock``)
_scopes = ScopeStack()
_scopes_lock = threading.Lock()


@contextlib.contextmanager
def output_cache(mb: float | None):
    """Context manager: the cap set to ``mb`` MiB inside (0: fresh pages for every output).

    The cap is the process's: while blocks of several Python threads overlap, the newest open
    block's cap is in force, and when the last one ends the cap before the first is restored —
    whatever order they end in (:class:`fastgrad._config.ScopeStack`)."""
    global _limit_override
    _cap_bytes(mb, "output_cache")  # a bad mb is refused before anything changes
    with _scopes_lock:
        before = _limit_override
        set_output_cache_limit(mb)
        scope = _scopes.enter(_limit_override, lambda: before)
    try:
        yield
    finally:
        with _scopes_lock:
            _, _limit_override = _scopes.leave(scope)


def _free(i: int) -> bool:
    return not _blocks[i].in_use


def _total() -> int:
    return sum(b.nbytes for b in _blocks)


def _release_free(excess: int) -> int:
    """Drop free blocks, least recently used first, until ``excess`` bytes are gone (under the lock)."""
    released = 0
    i = 0
    while i < len(_blocks) and released < excess:
        if _free(i):
            released += _blocks.pop(i).nbytes
        else:
            i += 1
    return released


def empty(shape, dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``, C-contiguous, on a recycled block when it is large."""
    global _hits, _misses
    dt = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = math.prod(shape) * dt.itemsize
    cap = output_cache_limit()
    if nbytes < MIN_BYTES or cap == 0:
        return np.empty(shape, dt)
    size = -(-nbytes // GRANULE) * GRANULE
    with _lock:
        # best fit among the free blocks of at most twice the size (exact sizes first)
        blk, best = None, -1
        for i in range(len(_blocks) - 1, -1, -1):
            n = _blocks[i].nbytes
            if size <= n <= 2 * size and (best < 0 or n < _blocks[best].nbytes) and _free(i):
                best = i
                if n == size:
                    break
        if best >= 0:
            blk = _blocks.pop(best)
            _hits += 1
        if blk is None:
            _misses += 1
            over = _total() + size - cap
            if over > 0 and _release_free(over) < over:
                return np.empty(shape, dt)
            blk = _Block(size)
        _blocks.append(blk)
        # owned by a lease: the block comes back when the last array derived from it is gone
        return _lease(blk, shape, dt)


def empty_cache() -> int:
    """Release every cached block nothing refers to; returns the bytes released."""
    with _lock:
        return _release_free(sys.maxsize)


def output_cache_info() -> dict:
    """``{"blocks", "bytes", "free_blocks", "free_bytes", "hits", "misses", "limit"}``."""
    with _lock:
        free = [_blocks[i].nbytes for i in range(len(_blocks)) if _free(i)]
        return {
            "blocks": len(_blocks),
            "bytes": _total(),
            "free_blocks": len(free),
            "free_bytes": sum(free),
            "hits": _hits,
            "misses": _misses,
            "limit": output_cache_limit(),
        }
