"""Process-wide settings: strict device-parity mode and thread count.

Strict mode (``fg.strict()`` or ``FASTGRAD_STRICT=1``) makes every public op reject exactly
what the CANN device rejects, with the device's status code; outside it, those inputs are
computed as documented extensions.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fastgrad_strict", default=None)
_strict_global: bool | None = None


def is_strict() -> bool:
    """True when strict device-parity mode is on (context > set_strict > FASTGRAD_STRICT)."""
    v = _STRICT.get()
    if v is not None:
        return v
    if _strict_global is not None:
        return _strict_global
    return os.environ.get("FASTGRAD_STRICT", "0").strip().lower() in ("1", "true", "yes", "on")


def set_strict(enabled: bool | None) -> None:
    """Turn strict mode on/off for the process (None: back to ``FASTGRAD_STRICT``)."""
    global _strict_global
    _strict_global = None if enabled is None else bool(enabled)


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Context manager: reject exactly what the device rejects, with its status codes.

    >>> with fg.strict():
    ...     fg.cross_entropy_loss_grad(..., label_smoothing=0.1)   # AclnnError 161002
    """
    token = _STRICT.set(bool(enabled))
    try:
        yield
    finally:
        _STRICT.reset(token)


def env_bytes(name: str, default_mib: float, minimum: int) -> int:
    """A size from the environment variable ``name`` in MiB (bytes, at least ``minimum``);
    ``default_mib`` when unset or not a number."""
    mb = os.environ.get(name)
    if mb:
        try:
            return max(minimum, int(float(mb) * 2**20))
        except ValueError:
            pass
    return int(default_mib * 2**20)


def set_num_threads(n: int) -> None:
    """Set the threads used by the Numba kernels and by NumPy's BLAS (threadpoolctl)."""
    import numba
    from threadpoolctl import threadpool_limits

    n = int(n)
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    threadpool_limits(limits=n, user_api="blas")


def get_num_threads() -> int:
    import numba

    return numba.get_num_threads()


@contextlib.contextmanager
def num_threads(n: int):
    """Context manager running the kernels and BLAS on ``n`` threads, restoring afterwards."""
    import numba
    from threadpoolctl import threadpool_limits

    old = numba.get_num_threads()
    numba.set_num_threads(min(int(n), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    try:
        with threadpool_limits(limits=int(n), user_api="blas"):
            yield
    finally:
        numba.set_num_threads(old)


# ----------------------------------------------------------------------------------------------
# progress hook (the CLI's progress bar; any caller's)
# ----------------------------------------------------------------------------------------------

_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("fastgrad_progress", default=None)


@contextlib.contextmanager
def progress(callback):
    """Context manager: ops that run over a tile plan call ``callback(done, total)`` per tile.

    ``fused_linear_cross_entropy_loss_grad`` and ``fused_linear_online_max_sum`` report tiles
    of their plan (``fastgrad.tiling.plan_linear_cross_entropy``) on the cpu backend; other
    ops and backends do not call it.

    >>> with fg.progress(lambda done, total: print(done, "/", total)):
    ...     fg.fused_linear_cross_entropy_loss_grad(...)
    """
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def progress_callback():
    """The callback installed by :func:`progress`, or None."""
    return _PROGRESS.get()
