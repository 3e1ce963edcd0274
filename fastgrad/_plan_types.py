"""The GEMM choice and the native kernel's operand layouts — the types every LM-head plan carries
(``fastgrad.tiling`` re-exports them: the plans of the aclnn ops and of the training loss are
there).  Imports nothing of fastgrad's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

#: the native kernel's operand kind per 16-bit dtype name: bf16 pairs, or fp16 on the fp32 kernel
_NATIVE_KINDS = {"bfloat16": "bf16", "float16": "f32"}


def native_kind(dtype: npt.DTypeLike) -> str | None:
    """The native exact-product kernel's operand kind for ``dtype`` (a dtype or its name):
    ``"bf16"`` (bf16 pairs), ``"f32"`` (fp16 values on the fp32 kernel) or None (no kernel: BLAS)."""
    import numpy as np

    return _NATIVE_KINDS.get(dtype if isinstance(dtype, str) else np.dtype(dtype).name)


@dataclass(frozen=True)
class GemmChoice:
    """Which GEMMs one LM-head call runs, chosen once by the op layer from the settings
    (``fastgrad._config.settings()``: the GEMM setting, the native ISA, ``fastgrad.torch``'s
    preference) and recorded in its plan; no kernel reads a setting.

    Attributes
    ----------
    engine : {"blas", "onednn"}
        The fp32 tiles: NumPy's BLAS or PyTorch's oneDNN matmul (``fastgrad.gemm_engine``).
    exact : {"bf16", "f32"} or None
        16-bit operands on the native exact-product kernel (``kernels/_bf16dot.py``): ``"bf16"``
        (bf16 pairs) or ``"f32"`` (fp16 operands widened, the fp32 kernel); None: BLAS.
    variant : str or None
        The native kernel spec that runs them (``kernels/_native.py``: ``avx512_bf16dp``, …).
    logits16 : bool
        The training loss's logits GEMMs of bf16 operands on the native kernel (``"auto"`` inside
        ``fastgrad.torch``).
    isa : {"auto", "avx512", "avx2"}
        The native ISA setting the choice was made under.
    a_form : {"pairs", "f32"} or None
        The form of ``A`` the native variant takes (``KernelSpec.a_forms[0]``): bf16 pairs
        (``vdpbf16ps``) or fp32 values (the FMA variants); it decides which copies of ``X`` the
        loop holds (:func:`lm_head_buffers`).
    beta1 : bool
        The ``"blas"`` engine adds a tile's product onto its output in the same call (NumPy's
        OpenBLAS's ``cblas_sgemm`` with ``beta = 1``: ``kernels/_gemm.blas_accumulates``); the
        training loss's accumulating tiles then take no scratch product
        (:attr:`TrainingPlan.accumulate_in_gemm`).  The aclnn ops' kernels do not read it.
    fallback : str or None
        What the settings asked for and this machine could not run, and what runs instead (e.g.
        the GEMM setting ``"onednn"`` where its accuracy probe failed: BLAS); the op layer warns
        once per distinct fallback (``fastgrad.ops._engines.warn_fallback``).  None: as asked.
    """

    engine: str = "blas"
    exact: str | None = None
    variant: str | None = None
    logits16: bool = False
    isa: str = "auto"
    a_form: str | None = None
    beta1: bool = False
    fallback: str | None = None

    def exact_for(self, a: np.ndarray, b: np.ndarray) -> str | None:
        """The exact-product kernel for operands ``a`` and ``b`` (both 16-bit of one dtype), or None."""
        return self.exact_for_dtype(a.dtype) if a.dtype == b.dtype else None

    def exact_for_dtype(self, dtype: npt.DTypeLike) -> str | None:
        """The exact-product kernel this choice runs for operands of ``dtype`` (or its name), or None."""
        want = native_kind(dtype)
        return self.exact if (want is not None and self.exact == want) else None

    def describe(self) -> str:
        """What the GEMMs of 16-bit operands run on, in words (the command's and the bench's
        reports): ``"bf16 exact-product kernel (<variant>)"``, ``"fp32 kernel (<variant>, fp16
        operands)"``, else the fp32 engine's ``"BLAS sgemm"`` / ``"oneDNN matmul"``."""
        if self.exact == "bf16":
            return f"bf16 exact-product kernel ({self.variant})"
        if self.exact == "f32":
            return f"fp32 kernel ({self.variant}, fp16 operands)"
        return "oneDNN matmul" if self.engine == "onednn" else "BLAS sgemm"


#: BLAS for everything: what a plan made without the op layer's choice runs
BLAS = GemmChoice()


def _round_down(x: int, m: int) -> int:
    return (x // m) * m


@dataclass(frozen=True)
class Buffer:
    """One buffer the LM-head loop allocates (``lm_head/loop.Workspace`` hands it out by name).

    ``shape``: its largest extent (a tile at the edge of the matrix uses a prefix); ``dtype``: a
    NumPy dtype name; ``scope``: ``"call"`` (sized by the call: ``[BT, H]`` accumulators and
    copies of ``X``) or ``"tile"`` (sized by the tile plan, the part the budget bounds)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    scope: str

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        import numpy as np

        return self.size * np.dtype(self.dtype).itemsize


# The native kernel's packed ``B`` layout (``kernels/_bf16dot.py`` packs into it; the plan sizes it)
NATIVE_COLS = 64  #: the packed ``B``'s column granule: a multiple of every variant's register tile


def npad(n: int) -> int:
    """Columns of the native kernels' ``B`` for ``n`` output columns: ``64·⌈n/64⌉``."""
    return -(-n // NATIVE_COLS) * NATIVE_COLS


def b_cols(n: int) -> int:
    """The row length of the native kernel's packed ``B`` for ``n`` columns: :func:`npad` ``(n)``,
    plus 64 where that is a multiple of 256 — rows 1 KiB · 2ʲ apart share a few L1/L2 sets, and a
    column tile of ``B`` is read down its rows (AVX2 at a 32 KiB row stride: fp32 ``B`` 59 → 82
    GF/s per core on a Zen 4 EPYC).  Columns past ``n`` are zero and never read into an output."""
    w = npad(n)
    return w + NATIVE_COLS if w % 256 == 0 else w


def b_size(k: int, n: int) -> int:
    """uint32 elements of the native kernel's ``B`` for a ``[K, N]`` bf16 product: ``ceil(K/2)``
    rows of :func:`b_cols` ``(N)``."""
    return ((k + 1) // 2) * b_cols(n)


def fp32_operands(grad: bool, kind: str | None) -> bool:
    """The LM-head loop holds fp32 copies of ``X`` and of the weight tiles: where the logits run
    on BLAS (``kind`` None), and for the gradient GEMMs unless they run on the bf16 kernel (the
    fp32 kernel of fp16 operands takes them as its ``B``).  ``kind``: ``GemmChoice.exact_for``."""
    return (grad and kind != "bf16") or kind is None
