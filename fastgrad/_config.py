"""Process-wide settings: strict device-parity mode and thread count.

Strict mode (``fg.strict()`` or ``FASTGRAD_STRICT=1``) makes every public op reject exactly
what the CANN device rejects, with the device's status code; outside it, those inputs are
computed as documented extensions.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator

_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fastgrad_strict", default=None)
_strict_global: bool | None = None


def is_strict() -> bool:
    """True when strict device-parity mode is on (context > set_strict > FASTGRAD_STRICT)."""
    v = _STRICT.get()
    if v is not None:
        return v
    if _strict_global is not None:
        return _strict_global
    return env_flag("FASTGRAD_STRICT")


def set_strict(enabled: bool | None) -> None:
    """Turn strict mode on/off for the process (None: back to ``FASTGRAD_STRICT``)."""
    global _strict_global
    _strict_global = None if enabled is None else bool(enabled)


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Context manager: reject exactly what the device rejects, with its status codes.

    >>> with fg.strict():
    ...     fg.cross_entropy_loss_grad(..., label_smoothing=0.1)   # AclnnError 161002
    """
    token = _STRICT.set(bool(enabled))
    try:
        yield
    finally:
        _STRICT.reset(token)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


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
    not a number or is below ``minimum`` bytes: an invalid setting is refused, never replaced
    by the default."""
    mb = os.environ.get(name, "").strip()
    if not mb:
        return int(default_mib * 2**20)
    from .errors import invalid

    lo = "> 0" if 0 < minimum <= 1 else f">= {minimum / 2**20:g}"
    try:
        v = float(mb)
    except ValueError:
        v = float("nan")
    if not (v == v and v * 2**20 >= minimum and v < float("inf")):
        raise invalid(name, f"a number of MiB {lo} (environment variable)", repr(os.environ[name]))
    return int(v * 2**20)


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
    """Set the threads used by the Numba kernels and by NumPy's BLAS (threadpoolctl).

    Raises ``AclnnParamError`` (161002, a ``ValueError``) unless ``1 <= n <= max_threads()``:
    more threads than the CPUs Numba may use are refused, never silently reduced."""
    import numba
    from threadpoolctl import threadpool_limits

    n = _check_threads(n)
    numba.set_num_threads(n)
    threadpool_limits(limits=n, user_api="blas")


def get_num_threads() -> int:
    import numba

    return numba.get_num_threads()


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Context manager running the kernels and BLAS on ``n`` threads, restoring afterwards."""
    import numba
    from threadpoolctl import threadpool_limits

    n = _check_threads(n, op="num_threads")
    old = numba.get_num_threads()
    numba.set_num_threads(n)
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
    if not env:
        return "auto"
    if env not in GEMM_ENGINES:  # a typo (FASTGRAD_GEMM=mkl) is refused, never read as "auto"
        from .errors import invalid

        raise invalid("FASTGRAD_GEMM", "auto, blas or onednn (environment variable)", repr(os.environ["FASTGRAD_GEMM"]))
    return env


def set_gemm_engine(name: str | None) -> None:
    """Choose the GEMM engine of the fused linear kernels for the process (None: back to
    ``FASTGRAD_GEMM``, default ``"auto"``).  See :func:`gemm_engine`."""
    global _gemm_global
    _gemm_global = None if name is None else _check_engine(name)


@contextlib.contextmanager
def gemm(name: str) -> Iterator[None]:
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
      CPU with AVX-512 (AVX2 + FMA only under the ISA setting ``"avx2"``: on ``"auto"`` an
      AVX2-only CPU keeps BLAS, :func:`bf16_kernel_in_use`), the logits GEMMs of bf16 ``hidden``
      and ``weight`` run on an exact-product bf16 kernel (``fastgrad/kernels/_bf16dot.py``: the
      products of bf16 values are exact in fp32, summed in fp32 in a fixed order, the same bits on every ISA
      (:func:`native_isa`); ~2.2× sgemm per core on a Zen 4 EPYC with AVX-512 BF16; bf16
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


def progress_callback() -> Callable[[int, int], object] | None:
    """The callback installed by :func:`progress`, or None."""
    return _PROGRESS.get()


#: the native kernel's ISA settings (``fastgrad/kernels/_native.py``): ``"auto"`` runs the best
#: variant the CPU has; ``"avx512"`` / ``"avx2"`` only that ISA's variants (e.g. ``"avx2"`` on an
#: AVX-512 machine: the code an AVX2-only CPU runs, for CI and tests)
NATIVE_ISAS = ("auto", "avx512", "avx2")
_native_isa_global: str | None = None


def _check_isa(name: object, what: str = "isa") -> str:
    v = str(name).strip().lower()
    if v not in NATIVE_ISAS:
        from .errors import invalid

        raise invalid(what, "auto, avx512 or avx2", repr(name), "set_native_isa")
    return v


def native_isa() -> str:
    """The native GEMM kernel's ISA setting: :func:`set_native_isa` > ``FASTGRAD_NATIVE_ISA`` >
    ``"auto"``.  Raises ``AclnnParamError`` (161002, a ``ValueError``) naming the variable when
    ``FASTGRAD_NATIVE_ISA`` holds another value.

    * ``"auto"``: the best variant this CPU runs — bf16 operands on ``vdpbf16ps`` (AVX-512 BF16),
      else AVX-512F FMAs, else AVX2 + FMA; fp16 operands on AVX-512F, else AVX2 + FMA.  Where
      that is an AVX2 variant, the GEMM setting ``"auto"`` keeps BLAS (measured faster there:
      :func:`bf16_kernel_in_use`); the variant runs when called for explicitly.
    * ``"avx512"``: only the AVX-512 variants (none on an AVX2-only CPU: BLAS).
    * ``"avx2"``: only the AVX2 + FMA variants, compiled with the AVX-512 features off — on an
      AVX-512 machine, the code an AVX2-only CPU runs (``FASTGRAD_NATIVE_ISA=avx2`` in CI); the
      GEMM setting ``"auto"`` runs them (this explicit setting overrides the BLAS rule above).

    The variants give the same bits (``fastgrad/kernels/_native.py``); the setting changes the
    speed only.  The kernels read it from ``_bf16dot`` (pushed there by this module)."""
    if _native_isa_global is not None:
        v = _native_isa_global
    else:
        env = os.environ.get("FASTGRAD_NATIVE_ISA", "").strip()
        v = _check_isa(env, "FASTGRAD_NATIVE_ISA (environment variable)") if env else "auto"
    from .kernels import _bf16dot

    if _bf16dot.selected_isa() != v:
        _bf16dot.select_isa(v)
    return v


def set_native_isa(name: str | None) -> None:
    """Run the native GEMM kernel's variants of ISA ``name`` (``"auto"``, ``"avx512"``,
    ``"avx2"``; None: back to ``FASTGRAD_NATIVE_ISA``, default ``"auto"``) for the process.
    See :func:`native_isa`.  Raises ``ValueError`` for any other name."""
    global _native_isa_global
    _native_isa_global = None if name is None else _check_isa(name)
    native_isa()


def bf16_kernel_available() -> bool:
    """The exact-product bf16 GEMM kernel (``fastgrad/kernels/_bf16dot.py``) runs on this CPU
    under the ISA setting (:func:`native_isa`): AVX-512 BF16, AVX-512F or AVX2 + FMA; compiled
    once per process (a build failure warns once and leaves the GEMMs on BLAS)."""
    from .kernels import _bf16dot

    native_isa()
    return _bf16dot.available()


def bf16_kernel_in_use() -> bool:
    """GEMMs of bf16 values go to the exact-product bf16 kernel: the GEMM setting ``"auto"`` on a
    CPU where the kernel runs (:func:`bf16_kernel_available`) — except an AVX2-only CPU under
    the ISA setting ``"auto"``: there ``"auto"`` keeps BLAS, which was faster (the AVX2 code
    on a Zen 4 EPYC, one thread, against OpenBLAS's Haswell sgemm path: FLCE grad 1.18x, online
    max-sum 1.12x, training loss 0.97x its CPU time; ``_bf16dot.AUTO_AVX2``).  An explicit
    ``set_native_isa("avx2")`` / ``FASTGRAD_NATIVE_ISA=avx2`` runs the AVX2 kernel anyway."""
    from .kernels import _bf16dot

    native_isa()
    return gemm_setting() == "auto" and _bf16dot.auto_variant("bf16") is not None


def fp16_kernel_in_use() -> bool:
    """GEMMs of fp16 values in the NumPy-level fused linear ops go to the fp32 kernel
    (``fastgrad/kernels/_bf16dot.py``, kind ``"f32"``: the products of fp16 values are exact in
    fp32, summed in fp32 in a fixed order): the GEMM setting ``"auto"`` on a CPU with AVX-512F,
    or with AVX2 + FMA only under an explicit ISA setting ``"avx2"`` (:func:`native_isa`; on
    ``"auto"`` an AVX2-only CPU keeps BLAS: the AVX2 code took 1.37x / 1.46x the BLAS path's
    time for the fp16 FLCE grad / online max-sum, ``_bf16dot.AUTO_AVX2``)."""
    from .kernels import _bf16dot

    native_isa()
    return gemm_setting() == "auto" and _bf16dot.auto_variant("f32") is not None


# ----------------------------------------------------------------------------------------------
# SoC profile (which NPU's kernels the ops follow; fastgrad/soc.py holds the table)
# ----------------------------------------------------------------------------------------------

_SOC: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastgrad_soc_version", default=None)
_soc_global: str | None = None


def _check_soc(name: str, what: str = "soc_version") -> str:
    from .soc import profile_name

    try:
        profile_name(name)
    except ValueError as e:
        raise ValueError(str(e).replace("soc_version", what, 1)) from None
    return name.strip()


def get_soc_version() -> str:
    """The SoC whose kernels the ops follow, as CANN writes it (``"Ascend910B"``, ``"Ascend910B3"``,
    ``"Ascend910_93"``, ``"Ascend950"``, …): context (:func:`soc_version`) > :func:`set_soc_version`
    > ``FASTGRAD_SOC_VERSION`` > ``"Ascend910B"`` (Atlas A2).

    On the ``"acl"`` backend the ops follow the device's own SoC (``aclrtGetSocName``) instead.
    Raises ``ValueError`` when ``FASTGRAD_SOC_VERSION`` holds a name fastgrad has no profile for.
    """
    v = _SOC.get()
    if v is not None:
        return v
    if _soc_global is not None:
        return _soc_global
    env = os.environ.get("FASTGRAD_SOC_VERSION", "").strip()
    if env:
        return _check_soc(env, "FASTGRAD_SOC_VERSION (environment variable)")
    from .soc import DEFAULT_SOC_VERSION

    return DEFAULT_SOC_VERSION


def set_soc_version(name: str | None) -> None:
    """Follow the kernels of SoC ``name`` for the process (None: back to ``FASTGRAD_SOC_VERSION``,
    default ``"Ascend910B"``).  Names as CANN writes them: ``"Ascend910B"`` (Atlas A2),
    ``"Ascend910_93"`` (A3), ``"Ascend950"``, or a finer name of one of them (``"Ascend910B3"``,
    ``"Ascend910_9391"``).  Raises ``ValueError`` for any other name.  See ``fastgrad/soc.py``."""
    global _soc_global
    _soc_global = None if name is None else _check_soc(name)


@contextlib.contextmanager
def soc_version(name: str):
    """Context manager: the ops follow the kernels of SoC ``name`` inside the block.

    >>> with fg.soc_version("Ascend950"):
    ...     fg.smooth_l1_loss_backward(...)      # the arch35 DAG, not the 910B TBE kernel
    """
    token = _SOC.set(_check_soc(name))
    try:
        yield
    finally:
        _SOC.reset(token)
