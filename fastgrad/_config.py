"""The settings, in one place: every environment variable and context variable of fastgrad is
read here, and nowhere below the op layer (``tests/test_architecture.py`` checks it).

==========================  =======================  ==========================================
setting                     environment              API (process / context)
==========================  =======================  ==========================================
strict device parity        ``FASTGRAD_STRICT``      ``set_strict`` / ``strict()``
SoC profile                 ``FASTGRAD_SOC_VERSION`` ``set_soc_version`` / ``soc_version()``
deterministic mode          ``FASTGRAD_DETERMINISTIC`` ``set_deterministic`` / ``deterministic()``
backend                     ``FASTGRAD_BACKEND``     ``set_backend`` / ``use_backend()``
GEMM engine                 ``FASTGRAD_GEMM``        ``set_gemm_engine`` / ``gemm()``
native kernel ISA           ``FASTGRAD_NATIVE_ISA``  ``set_native_isa``
workspace budget            ``FASTGRAD_WORKSPACE_MB`` ``set_workspace_budget``
output cache cap            ``FASTGRAD_OUTPUT_CACHE_MB`` ``set_output_cache_limit`` / ``output_cache()``
threads                     ``NUMBA_NUM_THREADS``    ``set_num_threads`` / ``num_threads()``
Numba cache                 ``FASTGRAD_NUMBA_CACHE``, ``NUMBA_CACHE_DIR``  (read once, at import)
CANN runtime                ``FASTGRAD_ACL_LIB_DIR``, ``FASTGRAD_ACL_DEVICE``, ``ASCEND_HOME_PATH``
==========================  =======================  ==========================================

Precedence: context > process setting > environment > default.  An invalid environment value
is refused with ``AclnnParamError`` (161002, a ``ValueError``) naming the variable, never read as
the default.  :func:`settings` resolves them all into one frozen :class:`Settings`, which the op
layer reads once per call and resolves into the call's plan (the GEMM choice, the budget); the
kernels take plain parameters and the plan.

Strict mode (``fg.strict()`` or ``FASTGRAD_STRICT=1``) makes every public op reject exactly
what the CANN device rejects, with the device's status code; outside it, those inputs are
computed as documented extensions.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fastgrad_strict", default=None)
_strict_global: bool | None = None


def _check_flag(enabled: object, op: str | None, param: str = "enabled") -> bool:
    """``enabled`` as a bool (a Python or NumPy bool); else 161002 naming ``param``: a string
    such as ``"false"`` or a number is refused, never read by its truth value."""
    import numpy as np

    if not isinstance(enabled, (bool, np.bool_)):
        from .errors import invalid

        raise invalid(param, "a bool (True or False)", repr(enabled), op)
    return bool(enabled)


def is_strict() -> bool:
    """True when strict device-parity mode is on (context > set_strict > FASTGRAD_STRICT)."""
    v = _STRICT.get()
    if v is not None:
        return v
    if _strict_global is not None:
        return _strict_global
    return env_flag("FASTGRAD_STRICT")


def set_strict(enabled: bool | None) -> None:
    """Turn strict mode on/off for the process (None: back to ``FASTGRAD_STRICT``).  Raises
    ``AclnnParamError`` (161002) for anything but a bool or None."""
    global _strict_global
    _strict_global = None if enabled is None else _check_flag(enabled, "set_strict")


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Context manager: reject exactly what the device rejects, with its status codes.

    >>> with fg.strict():
    ...     fg.cross_entropy_loss_grad(..., label_smoothing=0.1)   # AclnnError 161002
    """
    token = _STRICT.set(_check_flag(enabled, "strict"))
    try:
        yield
    finally:
        _STRICT.reset(token)


# deterministic mode (the device's ``aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 1)``)
_DETERMINISTIC: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fastgrad_deterministic", default=None)
_deterministic_global: bool | None = None


def is_deterministic() -> bool:
    """True when the device's deterministic mode is emulated (context > set_deterministic >
    FASTGRAD_DETERMINISTIC; default off).  It changes which summation order an op follows where
    the device's deterministic kernel differs (``embedding_dense_backward``: the A2/A3
    ``EmbeddingDenseGradV2DeterministKernel``, docs/device_parity.md row 9b); fastgrad's
    results are bitwise reproducible either way."""
    v = _DETERMINISTIC.get()
    if v is not None:
        return v
    if _deterministic_global is not None:
        return _deterministic_global
    return env_flag("FASTGRAD_DETERMINISTIC")


def set_deterministic(enabled: bool | None) -> None:
    """Turn deterministic mode on/off for the process (None: back to ``FASTGRAD_DETERMINISTIC``).
    Raises ``AclnnParamError`` (161002) for anything but a bool or None."""
    global _deterministic_global
    _deterministic_global = None if enabled is None else _check_flag(enabled, "set_deterministic")


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Context manager: follow the device's deterministic-mode kernels (see :func:`is_deterministic`)."""
    token = _DETERMINISTIC.set(_check_flag(enabled, "deterministic"))
    try:
        yield
    finally:
        _DETERMINISTIC.reset(token)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
#: a decimal number as environment variables write it: ASCII digits, an optional sign, point and exponent
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def env_flag(name: str) -> bool:
    """A boolean environment variable (``1/true/yes/on`` or ``0/false/no/off``, unset = off).

    Raises ``AclnnParamError`` (161002, a ``ValueError``) naming the variable for any other
    value: a typo is refused, never read as "off"."""
    v = os.environ.get(name, "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    from .errors import invalid

    raise invalid(name, "one of 1, true, yes, on, 0, false, no, off (environment variable)", repr(os.environ[name]))


def env_bytes(name: str, default_mib: float, minimum: int) -> int:
    """A size from the environment variable ``name`` in MiB (returned in bytes); ``default_mib``
    when unset or empty.

    Raises ``AclnnParamError`` (161002, a ``ValueError``) naming the variable when the value is
    not a plain decimal number (ASCII digits, optional sign, point and exponent: no ``1_000``,
    hex, ``nan``/``inf`` or other scripts' digits), is below ``minimum`` bytes or is too large
    to be a number of bytes: an invalid setting is refused, never replaced by the default."""
    mb = os.environ.get(name, "").strip()
    if not mb:
        return int(default_mib * 2**20)
    from .errors import invalid

    lo = "> 0" if 0 < minimum <= 1 else f">= {minimum / 2**20:g}"
    # a plain decimal number in ASCII: float() would also take "1_000", "nan", "inf" and digits of
    # other scripts ("１２"), which no shell or C program reads as a number
    v = float(mb) if _DECIMAL.fullmatch(mb) else float("nan")
    if not (v == v and math.isfinite(v * 2**20) and v * 2**20 >= minimum):
        raise invalid(name, f"a number of MiB {lo} (environment variable)", repr(os.environ[name]))
    return int(v * 2**20)


_numba_started = False


def _numba():
    """``numba``, its threading layer started — with PyTorch's intra-op thread count kept.

    Starting Numba's OpenMP threading layer sets the OpenMP runtime's thread count to Numba's
    (``NUMBA_NUM_THREADS``: all cores); PyTorch's CPU wheels share that runtime (``libgomp``), so
    fastgrad's first call undid a ``torch.set_num_threads(k)`` made before it (seen: 1 → 2 on a
    2-core machine; ``tests/test_torch_threads.py``).  The layer is started here, before any
    kernel, and PyTorch's count put back when PyTorch is already imported (nothing is imported)."""
    global _numba_started
    import numba

    if not _numba_started:
        import sys

        t = sys.modules.get("torch")
        n = t.get_num_threads() if t is not None and hasattr(t, "get_num_threads") else None
        numba.get_num_threads()  # starts the threading layer
        if t is not None and n is not None and t.get_num_threads() != n:
            t.set_num_threads(n)
        _numba_started = True
    return numba


def max_threads() -> int:
    """The most threads the kernels can run: Numba's ``NUMBA_NUM_THREADS`` (by default the CPUs
    this process may use)."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


def _check_threads(n: object, name: str = "n", op: str = "set_num_threads") -> int:
    import numbers

    from .errors import invalid

    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise invalid(name, "an integer number of threads", repr(n), op)
    hi = max_threads()
    if not 1 <= int(n) <= hi:
        raise invalid(name, f"1..{hi} (the CPUs Numba may use, NUMBA_NUM_THREADS)", int(n), op)
    return int(n)


def set_num_threads(n: int) -> None:
    """Set the threads used by the Numba kernels and by NumPy's BLAS (threadpoolctl; process-wide:
    while fastgrad calls run in other threads, which hold the BLAS at one thread, it applies when
    the last of them ends — a call in flight keeps its bits).

    Raises ``AclnnParamError`` (161002, a ``ValueError``) unless ``1 <= n <= max_threads()``:
    more threads than the CPUs Numba may use are refused, never silently reduced."""
    from .kernels._gemm import set_blas_threads

    n = _check_threads(n)
    _numba().set_num_threads(n)
    set_blas_threads(n)


def get_num_threads() -> int:
    return _numba().get_num_threads()


class ScopeStack:
    """Open ``with`` blocks that each set one value (a count, a cap), oldest first, ending in any
    order: the newest open block's value is in force, and when the last ends the value before
    the first comes back — restoring each block's own "before" would leave the value of a block
    that already ended when blocks overlap (two threads, two asyncio tasks).  Not locked: a
    stack shared by threads is used under its owner's lock."""

    def __init__(self) -> None:
        self.open: list[list[Any]] = []  # one-item lists: each block's identity and value
        self.base: Any = None

    def enter(self, value: Any, current: Callable[[], Any]) -> list[Any]:
        """Open a block setting ``value``; ``current()`` is read when it is the first."""
        if not self.open:
            self.base = current()
        scope = [value]
        self.open.append(scope)
        return scope

    def leave(self, scope: list[Any]) -> tuple[bool, Any]:
        """Close ``scope``: (False, None) when it is not open here, else (True, the value now)."""
        at = next((i for i, s in enumerate(self.open) if s is scope), None)
        if at is None:
            return False, None
        del self.open[at]
        return True, (self.open[-1][0] if self.open else self.base)


#: the open ``num_threads()`` blocks: the BLAS count is the process's (every thread's blocks,
#: under the lock), Numba's each thread's own
_blas_scopes = ScopeStack()
_blas_scopes_lock = threading.Lock()
_numba_scopes = threading.local()


def _after_fork_in_child() -> None:
    """A lock held by another thread of the parent at the fork is never released in the child."""
    global _blas_scopes_lock
    _blas_scopes_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Context manager running the kernels and BLAS on ``n`` threads, restoring afterwards (the
    BLAS's count as :func:`set_num_threads` sets it: never under another thread's call in flight).

    Numba's count is the calling thread's own, kept the same way per thread: blocks of several
    asyncio tasks (or generators) of one thread that overlap — one entered, another entered, the
    first ended — leave the newest open block's count, and the count before the first once all
    have ended (restoring each block's "before" would leave the count of a block that ended).
    The BLAS's is the process's: while blocks of several Python threads overlap, the newest open
    block's count is in force, and when the last one ends the count before the first is restored —
    whatever order they end in."""
    from .kernels._gemm import blas_threads, set_blas_threads

    numba = _numba()
    n = _check_threads(n, op="num_threads")
    mine: ScopeStack | None = getattr(_numba_scopes, "stack", None)
    if mine is None:
        _numba_scopes.stack = mine = ScopeStack()
    numba_scope = mine.enter(n, numba.get_num_threads)
    with _blas_scopes_lock:
        blas_scope = _blas_scopes.enter(n, blas_threads)
        set_blas_threads(n)
    numba.set_num_threads(n)
    try:
        yield
    finally:
        here: ScopeStack | None = getattr(_numba_scopes, "stack", None)
        # (not found: ended on another thread than it began, whose count it never set)
        found, back = here.leave(numba_scope) if here is not None else (False, None)
        if found:
            numba.set_num_threads(back)
        with _blas_scopes_lock:
            _, back = _blas_scopes.leave(blas_scope)
            if back is not None:
                set_blas_threads(back)


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


def _check_engine(name: object, op: str) -> str:
    """``name`` as a GEMM engine (case and surrounding blanks ignored); else 161002 naming ``op``."""
    v = name.strip().lower() if isinstance(name, str) else None
    if v not in GEMM_ENGINES:
        from .errors import invalid

        raise invalid("name", "a gemm engine: " + ", ".join(GEMM_ENGINES), repr(name), op)
    return v


def gemm_setting() -> str:
    """The requested engine: context > ``set_gemm_engine`` > ``FASTGRAD_GEMM`` > ``"auto"``."""
    v = _GEMM.get()
    if v is not None:
        return v
    if _gemm_global is not None:
        return _gemm_global
    env = os.environ.get("FASTGRAD_GEMM", "").strip().lower()
    if not env:
        return "auto"
    if env not in GEMM_ENGINES:  # a typo (FASTGRAD_GEMM=mkl) is refused, never read as "auto"
        from .errors import invalid

        raise invalid("FASTGRAD_GEMM", "auto, blas or onednn (environment variable)", repr(os.environ["FASTGRAD_GEMM"]))
    return env


def set_gemm_engine(name: str | None) -> None:
    """Choose the GEMM engine of the fused linear kernels for the process (None: back to
    ``FASTGRAD_GEMM``, default ``"auto"``).  See :func:`gemm_engine`.  Raises ``AclnnParamError``
    (161002) for another name."""
    global _gemm_global
    _gemm_global = None if name is None else _check_engine(name, "set_gemm_engine")


@contextlib.contextmanager
def gemm(name: str) -> Iterator[None]:
    """Context manager: run the fused linear kernels' fp32 GEMMs on engine ``name`` (161002 for
    another name)."""
    token = _GEMM.set(_check_engine(name, "gemm"))
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
      kernel it is much faster (Zen 5 EPYC; bench/results/README.md); on a Zen 4 EPYC the
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
      CPU with AVX-512 (AVX2 + FMA only under the ISA setting ``"avx2"``: on ``"auto"`` an
      AVX2-only CPU keeps BLAS, :func:`fastgrad.ops._engines.bf16_kernel_in_use`), the logits GEMMs of bf16 ``hidden``
      and ``weight`` run on an exact-product bf16 kernel (``fastgrad/kernels/_bf16dot.py``: the
      products of bf16 values are exact in fp32, summed in fp32 in a fixed order, the same bits on every ISA
      (:func:`native_isa`); about twice sgemm's rate with AVX-512 BF16; bf16
      subnormals read as zero) — ``"blas"`` or ``"onednn"`` set explicitly turn it off.
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
def progress(callback: Callable[[int, int], object] | None) -> Iterator[None]:
    """Context manager: ops that run over a tile plan call ``callback(done, total)`` per tile
    (161002 for a ``callback`` that is not callable).

    ``fused_linear_cross_entropy_loss_grad`` and ``fused_linear_online_max_sum`` report tiles
    of their plan (``fastgrad.tiling.plan_linear_cross_entropy``) on the cpu backend;
    ``linear_cross_entropy`` (the training loss) its row blocks (``tiling.TrainingPlan``), or
    with ``lse`` the tiles of its recompute (``TrainingPlan.recompute_grid``), on the cpu and
    reference backends (the reference: row blocks); other ops and backends do not call it.

    >>> with fg.progress(lambda done, total: print(done, "/", total)):
    ...     fg.fused_linear_cross_entropy_loss_grad(...)
    """
    if callback is not None and not callable(callback):
        from .errors import invalid

        raise invalid("callback", "a callable (done, total) or None", repr(callback), "progress")
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def progress_callback() -> Callable[[int, int], object] | None:
    """The callback installed by :func:`progress`, or None."""
    return _PROGRESS.get()


#: the native kernel's ISA settings (``fastgrad/kernels/_native.py``): ``"auto"`` runs the best
#: variant the CPU has; ``"avx512"`` / ``"avx2"`` only that ISA's variants (e.g. ``"avx2"`` on an
#: AVX-512 machine: the code an AVX2-only CPU runs, for CI and tests)
NATIVE_ISAS = ("auto", "avx512", "avx2")
_native_isa_global: str | None = None
_NATIVE_ISA: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastgrad_native_isa", default=None)


def _check_isa(name: object, what: str = "isa", op: str | None = "set_native_isa") -> str:
    v = name.strip().lower() if isinstance(name, str) else None
    if v not in NATIVE_ISAS:
        from .errors import invalid

        raise invalid(what, "auto, avx512 or avx2", repr(name), op)
    return v


def native_isa() -> str:
    """The native GEMM kernel's ISA setting: :func:`use_native_isa` (this thread / task) >
    :func:`set_native_isa` (the process) > ``FASTGRAD_NATIVE_ISA`` > ``"auto"``.  Raises
    ``AclnnParamError`` (161002, a ``ValueError``) naming the variable when
    ``FASTGRAD_NATIVE_ISA`` holds another value.

    * ``"auto"``: the best variant this CPU runs — bf16 operands on ``vdpbf16ps`` (AVX-512 BF16),
      else AVX-512F FMAs, else AVX2 + FMA; fp16 operands on AVX-512F, else AVX2 + FMA.  Where
      that is an AVX2 variant, or an AVX-512 one on a non-AMD CPU, the GEMM setting ``"auto"``
      keeps BLAS (faster there: :func:`fastgrad.ops._engines.bf16_kernel_in_use`,
      ``kernels/_bf16dot.AUTO_AVX512_VENDORS``); the variant runs when called for explicitly.
    * ``"avx512"``: only the AVX-512 variants (none on an AVX2-only CPU: BLAS); on ``"auto"``
      also on Intel CPUs (this explicit setting overrides the vendor rule).
    * ``"avx2"``: only the AVX2 + FMA variants, compiled with the AVX-512 features off — on an
      AVX-512 machine, the code an AVX2-only CPU runs (``FASTGRAD_NATIVE_ISA=avx2`` in CI); the
      GEMM setting ``"auto"`` runs them (this explicit setting overrides the BLAS rule above).

    The variants give the same bits (``fastgrad/kernels/_native.py``); the setting changes the
    speed only.  The op layer resolves it into each LM-head call's GEMM choice
    (``fastgrad/ops/_engines.py``) and records it in the call's plan (``GemmChoice.variant``),
    which is what runs; no kernel reads it, so a call in flight keeps its variant whatever another
    thread sets meanwhile."""
    ctx = _NATIVE_ISA.get()
    if ctx is not None:
        return ctx
    if _native_isa_global is not None:
        return _native_isa_global
    env = os.environ.get("FASTGRAD_NATIVE_ISA", "").strip()
    return _check_isa(env, "FASTGRAD_NATIVE_ISA (environment variable)", None) if env else "auto"


def set_native_isa(name: str | None) -> None:
    """Run the native GEMM kernel's variants of ISA ``name`` (``"auto"``, ``"avx512"``,
    ``"avx2"``; None: back to ``FASTGRAD_NATIVE_ISA``, default ``"auto"``) for the process.
    See :func:`native_isa`.  Raises ``AclnnParamError`` (161002) for any other name."""
    global _native_isa_global
    _native_isa_global = None if name is None else _check_isa(name)


@contextlib.contextmanager
def use_native_isa(name: str) -> Iterator[None]:
    """Within the block (this thread or asyncio task only: a context variable), the LM-head calls
    run the native GEMM variants of ISA ``name`` (see :func:`native_isa`); restored afterwards.
    Raises ``ValueError`` (161002) for another name."""
    token = _NATIVE_ISA.set(_check_isa(name, op="use_native_isa"))
    try:
        yield
    finally:
        _NATIVE_ISA.reset(token)


# ----------------------------------------------------------------------------------------------
# SoC profile (which NPU's kernels the ops follow; fastgrad/soc.py holds the table)
# ----------------------------------------------------------------------------------------------

_SOC: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastgrad_soc_version", default=None)
_soc_global: str | None = None


def _check_soc(name: object, what: str = "name", op: str | None = "set_soc_version") -> str:
    """``name`` as a SoC fastgrad has a profile for (blanks around it dropped); else 161002 naming
    ``what``."""
    from .soc import SOC_VERSIONS, profile_name

    try:
        profile_name(name)  # type: ignore[arg-type]
    except ValueError:
        from .errors import invalid

        expected = (
            f"one of {', '.join(SOC_VERSIONS)} (or a finer CANN name of one of them, e.g. Ascend910B3, "
            "Ascend910_9391, Ascend950PR_9599)"
        )
        raise invalid(what, expected, repr(name), op) from None
    return str(name).strip()


def get_soc_version() -> str:
    """The SoC whose kernels the ops follow, as CANN writes it (``"Ascend910B"``, ``"Ascend910B3"``,
    ``"Ascend910_93"``, ``"Ascend950"``, …): context (:func:`soc_version`) > :func:`set_soc_version`
    > ``FASTGRAD_SOC_VERSION`` > ``"Ascend910B"`` (Atlas A2).

    On the ``"acl"`` backend the ops follow the device's own SoC (``aclrtGetSocName``) instead.
    Raises ``AclnnParamError`` (161002, a ``ValueError``) naming ``FASTGRAD_SOC_VERSION`` when it
    holds a name fastgrad has no profile for.
    """
    v = _SOC.get()
    if v is not None:
        return v
    if _soc_global is not None:
        return _soc_global
    env = os.environ.get("FASTGRAD_SOC_VERSION", "").strip()
    if env:
        return _check_soc(env, "FASTGRAD_SOC_VERSION (environment variable)", None)
    from .soc import DEFAULT_SOC_VERSION

    return DEFAULT_SOC_VERSION


def set_soc_version(name: str | None) -> None:
    """Follow the kernels of SoC ``name`` for the process (None: back to ``FASTGRAD_SOC_VERSION``,
    default ``"Ascend910B"``).  Names as CANN writes them: ``"Ascend910B"`` (Atlas A2),
    ``"Ascend910_93"`` (A3), ``"Ascend950"``, or a finer name of one of them (``"Ascend910B3"``,
    ``"Ascend910_9391"``).  Raises ``AclnnParamError`` (161002) for any other name.  See ``fastgrad/soc.py``."""
    global _soc_global
    _soc_global = None if name is None else _check_soc(name)


@contextlib.contextmanager
def soc_version(name: str) -> Iterator[None]:
    """Context manager: the ops follow the kernels of SoC ``name`` inside the block (161002 for a
    name fastgrad has no profile for).

    >>> with fg.soc_version("Ascend950"):
    ...     fg.smooth_l1_loss_backward(...)      # the arch35 DAG, not the 910B TBE kernel
    """
    token = _SOC.set(_check_soc(name, op="soc_version"))
    try:
        yield
    finally:
        _SOC.reset(token)


# ----------------------------------------------------------------------------------------------
# workspace budget (the tile plans), output cache cap (fastgrad._outcache)
# ----------------------------------------------------------------------------------------------

_budget_override: int | None = None
_WORKSPACE_FLOOR: contextvars.ContextVar[int] = contextvars.ContextVar("fastgrad_workspace_floor", default=0)


@contextlib.contextmanager
def workspace_floor(nbytes: int) -> Iterator[None]:
    """Context manager: the workspace budget is at least ``nbytes`` inside the block
    (``fastgrad.torch``'s fused training step: its row blocks' scratch is recycled as the 16-bit
    ``grad_weight`` afterwards, so a scratch as large as that gradient costs no peak memory).
    Raises 161002 for anything but an int >= 0."""
    n = _check_bytes(nbytes, 0, "workspace_floor")
    token = _WORKSPACE_FLOOR.set(n)
    try:
        yield
    finally:
        _WORKSPACE_FLOOR.reset(token)


def _check_bytes(nbytes: object, least: int, op: str | None, param: str = "nbytes") -> int:
    """``nbytes`` as an int >= ``least`` (a Python or NumPy integer, not a bool); else 161002: a
    float, a string or a negative size is refused, never truncated by ``int()``."""
    import numbers

    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or int(nbytes) < least:
        from .errors import invalid

        raise invalid(param, f"an int >= {least} (bytes)", repr(nbytes), op)
    return int(nbytes)


def set_workspace_budget(nbytes: int | None) -> None:
    """Set the scratch-memory budget (bytes) used by tile plans; None: back to
    ``FASTGRAD_WORKSPACE_MB`` (default 256 MiB).  Raises ``AclnnParamError`` (161002) for anything
    but an int >= 1 or None."""
    global _budget_override
    _budget_override = None if nbytes is None else _check_bytes(nbytes, 1, "set_workspace_budget")


def workspace_budget_override() -> int | None:
    """The process's :func:`set_workspace_budget` (None: the environment's or the default), to
    restore it after a temporary change."""
    return _budget_override


def workspace_budget() -> int:
    """The scratch-memory budget of the tile plans in bytes: :func:`set_workspace_budget` >
    ``FASTGRAD_WORKSPACE_MB`` > 256 MiB (161002 for an invalid variable), raised to the
    :func:`workspace_floor` in force."""
    base = _budget_override if _budget_override is not None else env_bytes("FASTGRAD_WORKSPACE_MB", 256, 1)
    return max(base, _WORKSPACE_FLOOR.get())


#: the output cache's cap without a setting, MiB
OUTPUT_CACHE_DEFAULT_MB = 2048


def output_cache_env_limit() -> int:
    """The output cache's cap from ``FASTGRAD_OUTPUT_CACHE_MB`` (default
    :data:`OUTPUT_CACHE_DEFAULT_MB`; 0: off) in bytes; ``fastgrad._outcache`` asks this when no
    cap was set in the process."""
    return env_bytes("FASTGRAD_OUTPUT_CACHE_MB", OUTPUT_CACHE_DEFAULT_MB, 0)


# ----------------------------------------------------------------------------------------------
# backend (the registry, fastgrad.backends, takes the name from here)
# ----------------------------------------------------------------------------------------------

_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastgrad_backend", default=None)
_backend_global: str | None = None


def backend_setting() -> str:
    """The backend the next op call runs on, as named: context (``use_backend``) >
    ``set_backend`` > ``FASTGRAD_BACKEND`` > ``"cpu"`` (validated by the registry), in lower case
    without surrounding blanks (a variable holding only blanks is unset, as every variable here)."""
    return _BACKEND.get() or _backend_global or os.environ.get("FASTGRAD_BACKEND", "").strip().lower() or "cpu"


def backend_from_environment() -> bool:
    """True when :func:`backend_setting` comes from ``FASTGRAD_BACKEND`` (no context, no process
    setting): an unknown name there is the variable's mistake (161002 naming it)."""
    return not (_BACKEND.get() or _backend_global) and bool(os.environ.get("FASTGRAD_BACKEND", "").strip())


def set_backend_setting(name: str | None) -> None:
    """The process-wide backend name (None: back to ``FASTGRAD_BACKEND``); validated by the caller."""
    global _backend_global
    _backend_global = None if name is None else name.strip().lower()


@contextlib.contextmanager
def backend_context(name: str) -> Iterator[None]:
    """The backend name for the block (validated by the caller, ``fastgrad.use_backend``)."""
    token = _BACKEND.set(name.strip().lower())
    try:
        yield
    finally:
        _BACKEND.reset(token)


# ----------------------------------------------------------------------------------------------
# the CANN runtime's environment (fastgrad/backends/acl_runtime.py takes it from here)
# ----------------------------------------------------------------------------------------------

#: the variables of the CANN runtime's location and device
ENV_ACL_LIB_DIR = "FASTGRAD_ACL_LIB_DIR"
ENV_ACL_DEVICE = "FASTGRAD_ACL_DEVICE"


def acl_library_dirs(defaults: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """Directories searched for the CANN libraries, and whether ``FASTGRAD_ACL_LIB_DIR`` (the
    override) is set: the override alone, else ``$ASCEND_HOME_PATH/lib64``,
    ``$ASCEND_TOOLKIT_HOME/lib64``, ``defaults`` and ``LD_LIBRARY_PATH``'s entries (no repeats)."""
    override = os.environ.get(ENV_ACL_LIB_DIR)
    if override:
        return [override], True
    dirs = []
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        v = os.environ.get(var)
        if v:
            dirs.append(os.path.join(v, "lib64"))
    dirs += list(defaults)
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out, False


def acl_device_id() -> int:
    """The NPU the acl backend runs on: ``FASTGRAD_ACL_DEVICE`` (default 0).  Raises
    ``AclnnParamError`` (161002) naming the variable for a value that is not an integer >= 0."""
    v = os.environ.get(ENV_ACL_DEVICE, "").strip()
    if not v:
        return 0
    if not (v.isascii() and v.isdigit()):  # ("²".isdigit(), "１２".isdigit() are true)
        from .errors import invalid

        raise invalid(ENV_ACL_DEVICE, "a device id >= 0 (environment variable)", repr(os.environ[ENV_ACL_DEVICE]))
    return int(v)


# ----------------------------------------------------------------------------------------------
# the Numba cache (fastgrad/_jit.py asks once, at import)
# ----------------------------------------------------------------------------------------------


def numba_cache_candidates() -> list[str] | None:
    """Where compiled kernels may be cached, in order of preference (``fastgrad/_jit.py`` takes
    the first writable one): ``NUMBA_CACHE_DIR``, ``""`` (the package's own ``__pycache__``,
    Numba's default), ``$XDG_CACHE_HOME/fastgrad/numba`` (``~/.cache``), the temp dir.  None:
    caching off (``FASTGRAD_NUMBA_CACHE`` ``0/false/no/off``; ``1/true/yes/on``, empty or unset:
    on).  Raises ``AclnnParamError`` (161002) naming the variable for any other value: a typo
    (``FASTGRAD_NUMBA_CACHE=of``) is refused, never read as "on"."""
    if os.environ.get("FASTGRAD_NUMBA_CACHE", "").strip() and not env_flag("FASTGRAD_NUMBA_CACHE"):
        return None  # (unset or empty: on; env_flag refuses a typo naming the variable)
    out = []
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        out.append(env)
    out.append("")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    out += [os.path.join(base, "fastgrad", "numba"), os.path.join(tempfile.gettempdir(), f"fastgrad-numba-{uid}")]
    return out


# ----------------------------------------------------------------------------------------------
# all of it at once: what the op layer reads per call
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Every setting in force now, resolved (context > process > environment > default).

    The op layer reads it once per call (:func:`settings`) and passes what the call needs down
    as plain parameters and the plan; nothing below the op layer reads a setting."""

    strict: bool
    soc_version: str
    backend: str
    gemm: str  #: the GEMM setting: "auto" | "blas" | "onednn"
    prefer_onednn: bool  #: inside fastgrad.torch's training loss ("auto" prefers oneDNN, bf16 logits native)
    native_isa: str  #: "auto" | "avx512" | "avx2"
    workspace_bytes: int
    #: the kernels' thread count (informational: no plan depends on it); reading it starts Numba's
    #: threading layer in the op layer, before any kernel, with PyTorch's count kept (:func:`_numba`)
    threads: int
    progress: Callable[[int, int], object] | None
    #: the device's deterministic mode (:func:`is_deterministic`)
    deterministic: bool = False


@dataclass(frozen=True)
class Options:
    """Per-call settings of the LM-head ops (``options=`` of :func:`fastgrad.fused_linear_online_max_sum`,
    :func:`fastgrad.fused_linear_cross_entropy_loss_grad`, :func:`fastgrad.linear_cross_entropy`):
    each field not None overrides the setting in force for that call only, resolved by the op
    (:meth:`resolve`, as PyTorch's ``LinearCrossEntropyOptions._adjust``) — no context manager,
    nothing process-wide, so calls in several threads each carry their own.

    Attributes
    ----------
    gemm : {"auto", "blas", "onednn"} or None
        The GEMM setting (:func:`set_gemm_engine`).
    native_isa : {"auto", "avx512", "avx2"} or None
        The native kernel's ISA setting (:func:`set_native_isa`).
    workspace_bytes : int or None
        The tile plans' scratch budget in bytes (:func:`set_workspace_budget`), ≥ 1.
    prefer_onednn : bool or None
        The training loss's GEMM preference inside ``fastgrad.torch`` (``"auto"`` prefers the bf16
        logits kernel and oneDNN's fp32 tiles; :func:`prefer_onednn`).

    Raises (from :meth:`resolve`): ``AclnnParamError`` 161002 naming ``options.<field>`` for a
    value out of range.
    """

    gemm: str | None = None
    native_isa: str | None = None
    workspace_bytes: int | None = None
    prefer_onednn: bool | None = None

    def resolve(self, s: Settings) -> Settings:
        """``s`` with this object's fields that are not None in place of its own."""
        from .errors import invalid

        changes: dict[str, Any] = {}
        if self.gemm is not None:
            if str(self.gemm).strip().lower() not in GEMM_ENGINES:
                raise invalid("options.gemm", "one of " + ", ".join(GEMM_ENGINES), repr(self.gemm))
            changes["gemm"] = str(self.gemm).strip().lower()
        if self.native_isa is not None:
            isa = str(self.native_isa).strip().lower()
            if isa not in NATIVE_ISAS:
                raise invalid("options.native_isa", "one of " + ", ".join(NATIVE_ISAS), repr(self.native_isa))
            changes["native_isa"] = isa
        if self.workspace_bytes is not None:
            changes["workspace_bytes"] = _check_bytes(self.workspace_bytes, 1, None, "options.workspace_bytes")
        if self.prefer_onednn is not None:
            changes["prefer_onednn"] = _check_flag(self.prefer_onednn, None, "options.prefer_onednn")
        return replace(s, **changes) if changes else s


def settings() -> Settings:
    """The settings in force now (see the module doc); raises ``AclnnParamError`` (161002)
    naming the environment variable when one holds an invalid value."""
    return Settings(
        strict=is_strict(),
        soc_version=get_soc_version(),
        backend=backend_setting(),
        gemm=gemm_setting(),
        prefer_onednn=_AUTO_ONEDNN.get(),
        native_isa=native_isa(),
        workspace_bytes=workspace_budget(),
        threads=get_num_threads(),
        progress=progress_callback(),
        deterministic=is_deterministic(),
    )
