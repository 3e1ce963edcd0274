"""The GEMM engine interface of the LM-head kernels: one object per call that prepares ``X``
once, packs a weight chunk once, and multiplies into fp32 accumulators.

The three products of the LM-head loop (``X`` ``[BT, H]``, a vocabulary chunk ``Wc`` ``[nv, H]``
of the weight, ``G`` ``[nb, nv]`` fp32 the logits gradient of a row block):

* :meth:`GemmEngine.logits`:      ``out[nb, nv]  = X[b0:b1] · Wcᵀ``
* :meth:`GemmEngine.grad_weight`: ``out[nv, H] (+)= Gᵀ · X[b0:b1]``
* :meth:`GemmEngine.grad_input`:  ``out[nb, H] (+)= G · Wc``  (may consume ``G``: call it last)

Implementations (:func:`engines`):

* ``"blas"`` / ``"onednn"`` (:class:`BlasEngine`): fp32 operands (16-bit inputs widened once per
  call, the chunk once per chunk) on NumPy's BLAS or PyTorch's oneDNN matmul, through
  ``_gemm``'s fixed tile grid (``engine`` passed down, not read from the thread's state).
* ``"native"`` (:class:`NativeEngine`): the exact-product kernel (``_bf16dot`` / ``_native``) for
  bf16 or fp16 operands whose ``G`` holds values of the input dtype (the FLCE grad's rounded
  ``g``): bf16 on any variant (AVX-512 BF16, AVX-512F, AVX2 + FMA), fp16 on the fp32 variants.

Capability by dtype and CPU: :func:`engines` lists the engines that can run a dtype here;
:func:`choose` picks one from a GEMM setting (``"auto"``: native where it runs, else BLAS), and
:func:`resolve` makes the whole choice of one LM-head call (``tiling.GemmChoice``: the fp32
engine, the native kernel and its variant) from the settings the op layer passes
(``fastgrad/ops/_engines.py``); the choice is recorded in the call's plan and no kernel or
engine reads a setting, the environment or a context variable.  Call the products inside
``_gemm.single_threaded_blas(engine)`` (BLAS single-threaded per tile, oneDNN's math mode).

The bits: an engine computes exactly the calls the LM-head kernels make today for the same
operands (``tests/test_gemm_engine.py`` pins each against those calls and float64).
"""

from __future__ import annotations

import numpy as np

from .. import _onednn
from .. import dtypes as D
from ..tiling import GemmChoice
from . import _bf16dot, _gemm
from ._linear import fp32_block

__all__ = ["GemmEngine", "BlasEngine", "NativeEngine", "engines", "choose", "make", "resolve"]


class GemmEngine:
    """The interface (see the module doc).  ``prepare(X)`` once per call, ``pack(v0, v1)`` once
    per vocabulary chunk, then the three products for any row block ``b0:b1`` of ``X``."""

    name = "base"

    def __init__(self, X: np.ndarray, W: np.ndarray):
        if X.ndim != 2 or W.ndim != 2 or X.shape[1] != W.shape[1]:
            raise ValueError(f"X [BT, H] and W [V, H] must share H, got {X.shape} and {W.shape}")
        if X.dtype != W.dtype:
            raise ValueError(f"X and W must share a dtype, got {X.dtype} and {W.dtype}")
        self.X, self.W, self.H = X, W, X.shape[1]
        self.n = 0

    def pack(self, v0: int, v1: int) -> None:  # pragma: no cover - the interface
        raise NotImplementedError

    def logits(self, b0: int, b1: int, out: np.ndarray) -> None:  # pragma: no cover
        raise NotImplementedError

    def grad_weight(self, G: np.ndarray, b0: int, b1: int, out: np.ndarray, acc: bool) -> None:  # pragma: no cover
        raise NotImplementedError

    def grad_input(self, G: np.ndarray, out: np.ndarray, acc: bool = True) -> None:  # pragma: no cover
        raise NotImplementedError


class BlasEngine(GemmEngine):
    """fp32 operands on ``mm`` (``"blas"``: NumPy's BLAS; ``"onednn"``: PyTorch's oneDNN)."""

    def __init__(self, X: np.ndarray, W: np.ndarray, mm: str = "blas"):
        super().__init__(X, W)
        if mm not in ("blas", "onednn"):
            raise ValueError(f"mm must be 'blas' or 'onednn', got {mm!r}")
        self.name = self.mm = mm
        self.X32 = fp32_block(X, 0, X.shape[0])  # exact; a view for fp32
        self.W32 = np.empty((0, self.H), np.float32)

    def pack(self, v0: int, v1: int) -> None:
        self.W32 = fp32_block(self.W, v0, v1)
        self.n = v1 - v0

    def logits(self, b0: int, b1: int, out: np.ndarray) -> None:
        _gemm.matmul_nt(self.X32[b0:b1], self.W32, out, engine=self.mm)

    def grad_weight(self, G: np.ndarray, b0: int, b1: int, out: np.ndarray, acc: bool) -> None:
        tmp = np.empty_like(out) if acc else None
        _gemm.matmul_tn(G, self.X32[b0:b1], out, tmp=tmp, engine=self.mm)

    def grad_input(self, G: np.ndarray, out: np.ndarray, acc: bool = True) -> None:
        tmp = np.empty_like(out) if acc else None
        _gemm.matmul_nn(G, self.W32, out, tmp=tmp, engine=self.mm)


class NativeEngine(GemmEngine):
    """The exact-product kernel: bf16 (pairs; ``X`` in the variant's ``A`` form, its row blocks
    interleaved as ``gᵀ·X``'s ``B`` once each) or fp16 (the fp32 variants over widened operands
    padded to the kernel's ``B`` width).  ``G`` must hold values of the input dtype."""

    name = "native"

    def __init__(self, X: np.ndarray, W: np.ndarray, vc: int):
        super().__init__(X, W)
        if X.dtype not in (D.BFLOAT16, D.FLOAT16):
            raise ValueError(f"the native engine takes bf16 or fp16 operands, got {X.dtype}")
        self.bf16 = X.dtype == D.BFLOAT16
        if not _bf16dot.available("bf16" if self.bf16 else "f32"):
            raise ValueError("no native kernel variant runs on this CPU (engines() lists what does)")
        H = self.H
        self.Xp = None if self.bf16 else fp32_block(X, 0, X.shape[0], width=_bf16dot.npad(H))
        self.lg = _bf16dot.Logits(X, W, vc, self.Xp)
        self._xint: dict[tuple[int, int], np.ndarray] = {}
        self.Wb = np.empty((0, 0), np.uint32)

    def pack(self, v0: int, v1: int) -> None:
        self.lg.chunk(v0, v1)
        if self.bf16:
            self.Wb = _bf16dot.interleave(self.W[v0:v1])  # grad_input's B
        else:
            self.Wb = fp32_block(self.W, v0, v1, width=_bf16dot.npad(self.H))
        self.n = v1 - v0

    def logits(self, b0: int, b1: int, out: np.ndarray) -> None:
        self.lg.logits(b0, b1, out)

    def grad_weight(self, G: np.ndarray, b0: int, b1: int, out: np.ndarray, acc: bool) -> None:
        if self.bf16:
            if (b0, b1) not in self._xint:
                self._xint[b0, b1] = _bf16dot.interleave(self.X[b0:b1])
            _bf16dot.matmul_tn(G, self._xint[b0, b1], self.H, out, acc=acc)
        elif self.Xp is not None:  # fp16: X widened (set in __init__)
            _bf16dot.matmul(G.T, self.Xp[b0:b1], self.H, out, acc=acc)

    def grad_input(self, G: np.ndarray, out: np.ndarray, acc: bool = True) -> None:
        if self.bf16:
            _bf16dot.matmul(_bf16dot.pairs_in_place(G), self.Wb, self.H, out, acc=acc)
        else:
            _bf16dot.matmul(G, self.Wb, self.H, out, acc=acc)


def engines(dtype) -> list[str]:
    """The engines that can run operands of ``dtype`` on this CPU (the native kernel under the
    ISA setting of ``_bf16dot``): ``"native"`` first where it runs, then ``"blas"``,
    ``"onednn"`` (the latter needs PyTorch; only listed, not probed)."""
    dt = np.dtype(dtype)
    out = []
    if (dt == D.BFLOAT16 and _bf16dot.available("bf16")) or (dt == D.FLOAT16 and _bf16dot.available("f32")):
        out.append("native")
    return out + ["blas", "onednn"]


def choose(dtype, setting: str = "auto") -> str:
    """The engine for ``dtype`` under a GEMM setting: ``"auto"`` → ``"native"`` where it runs
    and ``_bf16dot.auto_variant`` takes it (not on an AVX2-only CPU under the ISA setting
    ``"auto"``: BLAS is faster there), else ``"blas"``; ``"blas"`` / ``"onednn"`` as given.
    Raises ``ValueError`` for another setting."""
    if setting in ("blas", "onednn"):
        return setting
    if setting != "auto":
        raise ValueError(f"setting must be 'auto', 'blas' or 'onednn', got {setting!r}")
    # no variant, or an AVX2 one where BLAS is faster (_bf16dot.AUTO_AVX2): BLAS
    return "blas" if _auto_spec(dtype)[1] is None else "native"


def _auto_spec(dtype):
    """``(kind, spec)``: the native kernel's operand kind for ``dtype`` (``"bf16"``, ``"f32"`` for
    fp16, None) and the variant the GEMM setting ``"auto"`` runs it on (None: BLAS) — the one rule
    :func:`choose` and :func:`resolve` share."""
    dt = np.dtype(dtype)
    kind = "bf16" if dt == D.BFLOAT16 else "f32" if dt == D.FLOAT16 else None
    return kind, (None if kind is None else _bf16dot.auto_variant(kind))


def make(name: str, X: np.ndarray, W: np.ndarray, vc: int) -> GemmEngine:
    """The engine ``name`` (:func:`choose`) for this call's ``X`` and ``W``, chunks of ≤ ``vc``."""
    if name == "native":
        return NativeEngine(X, W, vc)
    return BlasEngine(X, W, name)


def resolve(dtype, setting: str = "auto", isa: str = "auto", prefer_onednn: bool = False) -> GemmChoice:
    """The GEMMs of one LM-head call of operands ``dtype`` under the settings ``setting`` (the
    GEMM setting), ``isa`` (the native ISA setting; made the kernel module's from now on) and
    ``prefer_onednn`` (inside ``fastgrad.torch``'s training loss).

    * ``engine``: ``"onednn"`` for the setting ``"onednn"`` (where usable), or ``"auto"`` with
      ``prefer_onednn`` on a CPU with a bf16 dot product (``fastgrad._onednn.resolve_engine``);
      else ``"blas"``.
    * ``exact``: on ``"auto"``, bf16 operands on the bf16 kernel and fp16 operands on the fp32
      kernel wherever :func:`_bf16dot.auto_variant` takes them (not an AVX2-only CPU under the
      ISA setting ``"auto"``: BLAS was faster there); None otherwise.
    * ``logits16``: ``exact == "bf16"`` inside the training loss (``prefer_onednn``).
    """
    _bf16dot.select_isa(isa)
    engine = _onednn.resolve_engine(setting, prefer_onednn)
    kind, spec = _auto_spec(dtype) if setting == "auto" else (None, None)
    exact = kind if spec is not None else None
    return GemmChoice(
        engine=engine,
        exact=exact,
        variant=None if spec is None else spec.name,
        logits16=exact == "bf16" and prefer_onednn,
        isa=isa,
        a_form=None if spec is None else spec.a_forms[0],
    )
