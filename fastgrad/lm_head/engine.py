"""The GEMM choice of the LM-head kernels: which engine can run which operands on this CPU, and
the one choice of a call.

The engine itself — ``X`` prepared once, a weight tile packed once, the three products into fp32
accumulators (``logits``, ``grad_weight``, ``grad_input``) on BLAS, oneDNN or the native
exact-product kernel — is ``lm_head/loop.Operands``, the loop's operands object; its buffers
are the plan's (``tiling.lm_head_buffers``).  This module decides which of them a call runs:

* :func:`engines` lists the engines that can run a dtype here (capability by dtype and CPU: the
  native kernel's variants for bf16 on AVX-512 BF16, AVX-512F or AVX2 + FMA, fp16 on the fp32
  variants);
* :func:`choose` picks one from a GEMM setting (``"auto"``: native where it runs and wins, else
  BLAS);
* :func:`resolve` makes the whole choice of one LM-head call (``tiling.GemmChoice``: the fp32
  engine, the native kernel, its variant and ``A`` form) from the settings the op layer passes
  (``fastgrad/ops/_engines.py``); the choice is recorded in the call's plan and no kernel reads a
  setting, the environment or a context variable.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .. import _onednn
from ..kernels import _bf16dot, _gemm
from .plan_types import GemmChoice, native_kind

__all__ = ["engines", "choose", "resolve"]


def engines(dtype: npt.DTypeLike, isa: str = "auto") -> list[str]:
    """The engines that can run operands of ``dtype`` on this CPU (the native kernel under the
    ISA setting ``isa``): ``"native"`` first where it runs, then ``"blas"``,
    ``"onednn"`` (the latter needs PyTorch; only listed, not probed)."""
    kind = native_kind(dtype)
    return (["native"] if kind is not None and _bf16dot.available(kind, isa) else []) + ["blas", "onednn"]


def choose(dtype: npt.DTypeLike, setting: str = "auto", isa: str = "auto") -> str:
    """The engine for ``dtype`` under a GEMM setting: ``"auto"`` → ``"native"`` where it runs
    and ``_bf16dot.auto_variant`` takes it (not on an AVX2-only CPU under the ISA setting
    ``"auto"``: BLAS is faster there), else ``"blas"``; ``"blas"`` / ``"onednn"`` as given.
    Raises ``ValueError`` for another setting."""
    if setting in ("blas", "onednn"):
        return setting
    if setting != "auto":
        raise ValueError(f"setting must be 'auto', 'blas' or 'onednn', got {setting!r}")
    # no variant, or an AVX2 one where BLAS is faster (_bf16dot.AUTO_AVX2): BLAS
    return "blas" if _auto_spec(dtype, isa)[1] is None else "native"


def _auto_spec(dtype, isa: str):
    """``(kind, spec)``: the native kernel's operand kind for ``dtype`` (``"bf16"``, ``"f32"`` for
    fp16, None) and the variant the GEMM setting ``"auto"`` runs it on (None: BLAS) — the one rule
    :func:`choose` and :func:`resolve` share."""
    kind = native_kind(dtype)
    return kind, (None if kind is None else _bf16dot.auto_variant(kind, isa))


def resolve(dtype: npt.DTypeLike, setting: str = "auto", isa: str = "auto", prefer_onednn: bool = False) -> GemmChoice:
    """The GEMMs of one LM-head call of operands ``dtype`` under the settings ``setting`` (the
    GEMM setting), ``isa`` (the native ISA setting) and
    ``prefer_onednn`` (inside ``fastgrad.torch``'s training loss).

    * ``engine``: ``"onednn"`` for the setting ``"onednn"`` (where usable), or ``"auto"`` with
      ``prefer_onednn`` on a CPU with a bf16 dot product (``fastgrad._onednn.resolve_engine``);
      else ``"blas"``.
    * ``exact``: on ``"auto"``, bf16 operands on the bf16 kernel and fp16 operands on the fp32
      kernel wherever :func:`_bf16dot.auto_variant` takes them (not an AVX2-only CPU under the
      ISA setting ``"auto"``: BLAS was faster there); None otherwise.
    * ``logits16``: ``exact == "bf16"`` inside the training loss (``prefer_onednn``).
    * ``beta1``: the ``"blas"`` engine where NumPy's BLAS adds a product onto its output in the
      call (``_gemm.blas_accumulates``: OpenBLAS's ``cblas_sgemm``, ``beta = 1``).

    Pure: the same arguments give the same choice on this CPU; nothing is set process-wide (the
    kernels run the variant the choice names: ``_bf16dot.spec_named(choice.variant)``).
    """
    engine = _onednn.resolve_engine(setting, prefer_onednn)
    fallback = None
    if setting == "onednn" and engine != "onednn":
        fallback = (
            "GEMM setting 'onednn': oneDNN's bf16-mode fp32 matmul is not usable on this machine "
            "(its accuracy probe failed: an AMX CPU rounds the operands to bf16); BLAS runs instead"
        )
    kind, spec = _auto_spec(dtype, isa) if setting == "auto" else (None, None)
    exact = kind if spec is not None else None
    return GemmChoice(
        engine=engine,
        exact=exact,
        variant=None if spec is None else spec.name,
        logits16=exact == "bf16" and prefer_onednn,
        isa=isa,
        a_form=None if spec is None else spec.a_forms[0],
        beta1=engine == "blas" and _gemm.blas_accumulates(np.float32),
        fallback=fallback,
    )
