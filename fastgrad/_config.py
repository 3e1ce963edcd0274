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
# GEMM engine of the fused linear kernels
# ----------------------------------------------------------------------------------------------

#: the engines (``fastgrad.kernels._gemm``): NumPy's BLAS, or PyTorch's oneDNN fp32 matmul
#: with ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
GEMM_ENGINES = ("auto", "blas", "onednn")
_gemm_global: str | None = None
_GEMM: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastgrad_gemm", default=None)
#: set by ``fastgrad.torch``'s training loss: there ``"auto"`` prefers the oneDNN engine
_AUTO_ONEDNN: contextvars.ContextVar[bool] = contextvars.ContextVar("fastgrad_auto_onednn", default=False)


def _check_engine(name: str) -> str:
    name = str(name).strip().lower()
    if name not in GEMM_ENGINES:
        raise ValueError(f"gemm engine must be one of {', '.join(GEMM_ENGINES)}; got {name!r}")
    return name


def gemm_setting() -> str:
    """The requested engine: context > ``set_gemm_engine`` > ``FASTGRAD_GEMM`` > ``"auto"``."""
    v = _GEMM.get()
    if v is not None:
        return v
    if _gemm_global is not None:
        return _gemm_global
    env = os.environ.get("FASTGRAD_GEMM", "").strip().lower()
    return env if env in GEMM_ENGINES else "auto"


def set_gemm_engine(name: str | None) -> None:
    """Choose the GEMM engine of the fused linear kernels for the process (None: back to
    ``FASTGRAD_GEMM``, default ``"auto"``).  See :func:`gemm_engine`."""
    global _gemm_global
    _gemm_global = None if name is None else _check_engine(name)


@contextlib.contextmanager
def gemm(name: str):
    """Context manager: run the fused linear kernels' fp32 GEMMs on engine ``name``."""
    token = _GEMM.set(_check_engine(name))
    try:
        yield
    finally:
        _GEMM.reset(token)


@contextlib.contextmanager
def prefer_onednn():
    """Context manager (``fastgrad.torch``'s training loss): ``"auto"`` resolves to the oneDNN
    engine where the CPU has a bf16 dot product (``gemm_engine``)."""
    token = _AUTO_ONEDNN.set(True)
    try:
        yield
    finally:
        _AUTO_ONEDNN.reset(token)


def gemm_engine() -> str:
    """The engine the fused linear kernels' fp32 GEMMs run on now: ``"blas"`` or ``"onednn"``.

    * ``"blas"``: NumPy's BLAS (sgemm), single-threaded per output tile.
    * ``"onednn"``: PyTorch's fp32 matmul with ``torch.backends.mkldnn.matmul.fp32_precision =
      "bf16"`` (set only for the duration of the call), which routes it to oneDNN's AVX-512
      brgemm rather than MKL's sgemm; without AMX the arithmetic stays exact fp32 (oneDNN's
      bf16 down-conversion, "bf32", exists only for AMX).  Where OpenBLAS lacks the CPU's best
      kernel it is much faster (Zen 5 EPYC, 2 threads: 450 vs 245 GF/s); on a Zen 4 EPYC the
      two run at the same rate.  Its accuracy is checked once per process by a probe (an
      operand needing 24 significant bits must survive, and a random product must be within
      1e-5 of float64 relative to ``Σ|a||b|``; fp32 gives ~1e-7, a plain bf16 down-conversion
      ~4e-3): where the probe fails (as it should on an AMX CPU, where oneDNN down-converts) the engine
      is not used.
    * ``"auto"`` (the default): ``"onednn"`` inside ``fastgrad.torch``'s training loss
      (``fastgrad.torch.linear_cross_entropy``, the module, the Hugging Face patch) when the CPU
      has AVX-512 BF16 or AMX-BF16 (Zen 4/5 EPYC: oneDNN at least as fast as OpenBLAS) and the
      probe passes; ``"blas"`` everywhere else — the NumPy-level ops (golden data) give the same
      bits whatever else the process imported.  Also on ``"auto"`` inside the training loss, on a
      CPU with AVX-512 BF16, the logits GEMMs of bf16 ``hidden`` and ``weight`` run on an
      exact-product bf16 kernel (``fastgrad/kernels/_bf16dot.py``: the products of bf16 values are
      exact in fp32, summed in fp32 in a fixed order; ~2.2× sgemm per core on a Zen 4 EPYC;
      bf16 subnormals read as zero) — ``"blas"`` or ``"onednn"`` set explicitly turn it off.
      On ``"auto"`` the NumPy-level ``fused_linear_online_max_sum`` and
      ``fused_linear_cross_entropy_loss_grad`` of bf16 operands run their GEMMs on that kernel
      too: every operand there is a bf16 value (the grad's ``g`` is rounded to bf16 by the op's
      contract, as on the device), so the result is the same fp32 GEMM summed in another fixed
      order (the bits depend on the CPU, as they do with BLAS's kernels).

    Both engines keep fastgrad's reproducibility: a fixed partition of the output into tiles,
    each tile computed single-threaded, so results are identical for every thread count (but
    differ between the engines in the last bits of fp32).  float64 GEMMs always use the BLAS.
    Raises ``ValueError`` when ``"onednn"`` is requested and PyTorch is not installed.
    """
    from ._onednn import resolve_engine

    return resolve_engine(gemm_setting(), _AUTO_ONEDNN.get())


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


def bf16_kernel_available() -> bool:
    """The exact-product bf16 GEMM kernel (``fastgrad/kernels/_bf16dot.py``) runs on this CPU
    (AVX-512 BF16; compiled once per process)."""
    from .kernels import _bf16dot

    return _bf16dot.available()


def bf16_kernel_in_use() -> bool:
    """GEMMs of bf16 values go to the exact-product bf16 kernel: the GEMM setting ``"auto"`` on a
    CPU where the kernel runs (:func:`bf16_kernel_available`)."""
    return gemm_setting() == "auto" and bf16_kernel_available()


def fp16_kernel_in_use() -> bool:
    """GEMMs of fp16 values in the NumPy-level fused linear ops go to the fp32 AVX-512 kernel
    (``fastgrad/kernels/_bf16dot.py``, kind ``"f32"``: the products of fp16 values are exact in
    fp32, summed in fp32 in a fixed order): the GEMM setting ``"auto"`` on a CPU with AVX-512F."""
    from .kernels import _bf16dot

    return gemm_setting() == "auto" and _bf16dot.available("f32")
