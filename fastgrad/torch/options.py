"""fastgrad's own modes of the training loss as one options object with named presets.

PyTorch 2.13 groups the modes of ``torch.nn.functional.linear_cross_entropy`` in
``torch.nn.LinearCrossEntropyOptions`` (``batch_chunk_size``, ``chunking_method``, ``acc_policy``,
``acc_dtype``, ...); Cut Cross-Entropy names its implementations (``impl="cce"``,
``"cce_kahan_full_c"``, ...).  fastgrad's modes — precision, schedule (fused or recompute),
gradient filtering, gradient accumulation dtype, GEMM engine — live in
:class:`LinearCrossEntropyOptions` here, with presets (:data:`PRESETS`) passed by name:
``options="fast"``.

The schedule rule (``schedule="auto"``) is :func:`choose_schedule`: the three-GEMM fused step
whenever the gradients it holds from the forward to the backward fit ``fused_memory_fraction``
of the available memory (``psutil.virtual_memory().available``), else the bounded recompute.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from ..errors import invalid

__all__ = [
    "LinearCrossEntropyOptions",
    "PRESETS",
    "FUSED_MEMORY_FRACTION",
    "resolve_options",
    "fused_held_bytes",
    "choose_schedule",
    "available_memory",
]

#: the default fraction of the available memory the fused step's held gradients may take
FUSED_MEMORY_FRACTION = 0.25
_PRECISIONS = (None, "accurate", "device", "fast")
_SCHEDULES = ("auto", "fused", "recompute")
_ENGINES = (None, "auto", "blas", "onednn")
_OP = "LinearCrossEntropyOptions"


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyOptions:
    """How fastgrad computes the fused linear cross-entropy (never *what*: the loss's
    arguments are PyTorch's).

    Attributes
    ----------
    precision : None | "accurate" | "device" | "fast"
        None: ``"device"`` in strict mode, else ``"accurate"`` (statistics and gradient from the
        same fp32 logits, each gradient rounded once).  ``"device"``: the NPU's aclnn pipeline
        (plain loss only).  ``"fast"``: bf16 ``dloss/dlogits`` with its mean error restored, every
        GEMM of the step (three fused, four recomputed) on the exact-product bf16 kernel (CPUs
        with AVX-512 BF16; elsewhere ``"accurate"`` bitwise, with a ``FallbackWarning``).  See
        ``docs/torch.md``, "Precision".
    schedule : "auto" | "fused" | "recompute"
        ``"fused"``: the gradient is computed in the forward (three GEMMs per step) and only
        scaled in the backward; it holds fp32 ``[V, H]`` + ``[BT, H]`` gradients (16-bit
        ``[V, H]`` with ``accum_dtype``) between the two — never ``[BT, V]``.  ``"recompute"``:
        the backward recomputes the logits vocabulary chunk by chunk (four GEMMs; a 16-bit
        weight's gradient written in its own dtype, no fp32 ``[V, H]``).  ``"auto"``:
        :func:`choose_schedule`.  A per-token loss (``reduction="none"``) or an entropy output
        always recomputes (its upstream gradient is unknown in the forward).
    filter_eps : None | "auto" | float in (0, 1]
        Cut Cross-Entropy's gradient filtering (``docs/torch.md``, "Gradient filtering").
    accum_dtype : None | a floating-point torch.dtype
        Liger's ``accum_dtype``: the fused step's ``grad_weight`` accumulated in the 16-bit
        gradient itself (no fp32 ``[V, H]``).
    engine : None | "auto" | "blas" | "onednn"
        The GEMM engine of this loss (:func:`fastgrad.gemm`); None: the process setting.
    fused_memory_fraction : float in (0, 1]
        ``schedule="auto"`` fuses when the held gradients are at most this fraction of the
        available memory (default :data:`FUSED_MEMORY_FRACTION` = 0.25).
    fused_memory_limit : int, optional
        Bytes the fused step may hold, instead of the fraction of the available memory.

    Raises
    ------
    fastgrad.AclnnError
        161002 (a ``ValueError``) naming the field for a value outside the above.
    """

    precision: str | None = None
    schedule: str = "auto"
    filter_eps: float | str | None = None
    accum_dtype: torch.dtype | None = None
    engine: str | None = None
    fused_memory_fraction: float = FUSED_MEMORY_FRACTION
    fused_memory_limit: int | None = None

    def __post_init__(self) -> None:
        # the named fields are strings (or None): a NumPy array equal to "fast" is not "fast"
        for name in ("precision", "schedule", "engine"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                allowed = {"precision": _PRECISIONS, "schedule": _SCHEDULES, "engine": _ENGINES}[name]
                raise invalid(name, " or ".join(map(repr, allowed)), repr(v), _OP)
        if self.precision not in _PRECISIONS:
            raise invalid("precision", "None, 'accurate', 'device' or 'fast'", repr(self.precision), _OP)
        if self.schedule not in _SCHEDULES:
            raise invalid("schedule", "'auto', 'fused' or 'recompute'", repr(self.schedule), _OP)
        if self.engine not in _ENGINES:
            raise invalid("engine", "None, 'auto', 'blas' or 'onednn'", repr(self.engine), _OP)
        f = self.fused_memory_fraction
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0.0 < float(f) <= 1.0:
            raise invalid("fused_memory_fraction", "a float in (0, 1]", repr(f), _OP)
        lim = self.fused_memory_limit
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, numbers.Integral) or lim < 0):
            raise invalid("fused_memory_limit", "None or an int >= 0 (bytes)", repr(lim), _OP)
        fe = self.filter_eps
        if fe is not None and not (isinstance(fe, str) and fe == "auto"):
            if isinstance(fe, bool) or not isinstance(fe, numbers.Real) or not 0.0 < float(fe) <= 1.0:
                raise invalid("filter_eps", "None, 'auto' or a float in (0, 1]", repr(fe), _OP)
        ad = self.accum_dtype
        if ad is not None and not (isinstance(ad, torch.dtype) and ad.is_floating_point):
            raise invalid("accum_dtype", "None or a floating-point torch.dtype", repr(ad), _OP)

    @property
    def fused(self) -> bool | None:
        """The ``fused=`` keyword of :func:`fastgrad.torch.linear_cross_entropy` this schedule is."""
        return {"auto": None, "fused": True, "recompute": False}[self.schedule]

    def replace(self, **changes: Any) -> LinearCrossEntropyOptions:
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> LinearCrossEntropyOptions:
        """The named preset (:data:`PRESETS`); 161002 for another name."""
        if not isinstance(name, str) or name not in PRESETS:
            raise invalid("options", f"a preset name ({', '.join(sorted(PRESETS))})", repr(name), _OP)
        return PRESETS[name]


#: named presets: ``options="fast"`` is ``LinearCrossEntropyOptions.preset("fast")``
PRESETS: dict[str, LinearCrossEntropyOptions] = {
    # accurate, schedule by the memory rule, the process's GEMM engine
    "default": LinearCrossEntropyOptions(),
    # three GEMMs whenever the loss is scalar (holds fp32 [V, H] + [BT, H])
    "fused": LinearCrossEntropyOptions(schedule="fused"),
    # four GEMMs, no fp32 [V, H]: the least memory
    "low_memory": LinearCrossEntropyOptions(schedule="recompute"),
    # bf16 dloss/dlogits with the mean error restored, all GEMMs on the bf16 kernel (AVX-512 BF16)
    "fast": LinearCrossEntropyOptions(precision="fast"),
    # Cut Cross-Entropy's gradient filtering at the dtype's eps / 32
    "filtered": LinearCrossEntropyOptions(filter_eps="auto"),
    # the NPU's aclnn pipeline (plain loss only)
    "device": LinearCrossEntropyOptions(precision="device"),
    # NumPy's BLAS for every GEMM (the NumPy-level ops' engine)
    "blas": LinearCrossEntropyOptions(engine="blas"),
}


def resolve_options(options: Any, param: str = "options", op: str | None = None) -> LinearCrossEntropyOptions:
    """``None`` / a preset name / a :class:`LinearCrossEntropyOptions` / PyTorch's
    ``torch.nn.LinearCrossEntropyOptions`` → fastgrad's options.

    PyTorch's options choose its batch chunking and accumulation policy, which fastgrad has no
    use for (it never holds ``[BT, V]`` and accumulates in fp32): they map to the default preset,
    except ``acc_dtype`` of 16 bits, which is fastgrad's ``accum_dtype``.
    """
    if options is None:
        return PRESETS["default"]
    if isinstance(options, LinearCrossEntropyOptions):
        return options
    if isinstance(options, str):
        if options not in PRESETS:
            raise invalid(param, f"a preset name ({', '.join(sorted(PRESETS))})", repr(options), op)
        return PRESETS[options]
    torch_opts = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if torch_opts is not None and isinstance(options, torch_opts):
        acc = options.acc_dtype
        return LinearCrossEntropyOptions(accum_dtype=acc if acc in (torch.bfloat16, torch.float16) else None)
    raise invalid(
        param,
        "None, a preset name, fastgrad.torch.LinearCrossEntropyOptions or torch.nn.LinearCrossEntropyOptions",
        type(options).__name__,
        op,
    )


def fused_held_bytes(
    rows: int, hidden: int, vocab: int, *, grad_input: bool, grad_weight: bool, grad_bias: bool, weight_bytes: int
) -> int:
    """Bytes the fused step holds from the forward to the backward: fp32 ``[BT, H]`` for
    ``grad_input``, ``[V, H]`` of ``weight_bytes`` per element for ``grad_weight`` (4: fp32;
    2 with a 16-bit ``accum_dtype``), fp32 ``[V]`` for ``grad_bias``."""
    return (
        (rows * hidden * 4 if grad_input else 0)
        + (vocab * hidden * weight_bytes if grad_weight else 0)
        + (vocab * 4 if grad_bias else 0)
    )


def available_memory() -> int:
    """Bytes of memory available to this process now (``psutil.virtual_memory().available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def choose_schedule(
    held_bytes: int,
    *,
    available_bytes: int | None = None,
    fraction: float = FUSED_MEMORY_FRACTION,
    limit: int | None = None,
) -> str:
    """The rule of ``schedule="auto"``: ``"fused"`` when ``held_bytes`` (:func:`fused_held_bytes`)
    is at most ``limit``, or — without a limit — at most ``fraction`` × ``available_bytes``
    (default: :func:`available_memory` now); otherwise ``"recompute"``.

    The promise of the loss is never ``[BT, V]``, not never ``[V, H]``: an optimizer holds
    several ``[V, H]`` copies anyway (Adam: two fp32 moments), so a ``[V, H]`` gradient held for
    one step is the three-GEMM schedule's price while memory allows it; the bounded recompute
    (four GEMMs, the 16-bit gradient written directly) is kept for tight memory.
    """
    if limit is not None:
        return "fused" if held_bytes <= limit else "recompute"
    avail = available_memory() if available_bytes is None else int(available_bytes)
    return "fused" if held_bytes <= fraction * avail else "recompute"
