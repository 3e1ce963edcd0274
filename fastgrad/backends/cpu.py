"""The ``"cpu"`` backend: the Numba kernels (:mod:`fastgrad.kernels`).

``IMPLS`` maps each op to its kernel entry point (imported on first use).  The kernels of ops
with an op_host plan (the fused linear cross-entropy family) take ``plan=`` and ``progress=``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the return types only (the kernels are imported on first use)
    import numpy.typing as npt

    from ..kernels._native import KernelSpec
    from ..tiling import GemmChoice

TAKES_PLAN = True

_K = "fastgrad.kernels."

IMPLS = {
    "fused_linear_online_max_sum": _K + "fused_linear_online_max_sum:fused_linear_online_max_sum",
    "fused_cross_entropy_loss_with_max_sum": _K
    + "fused_cross_entropy_loss_with_max_sum:fused_cross_entropy_loss_with_max_sum",
    "fused_linear_cross_entropy_loss_grad": _K
    + "fused_linear_cross_entropy_loss_grad:fused_linear_cross_entropy_loss_grad",
    "cross_entropy_loss_grad": _K + "cross_entropy_loss_grad:cross_entropy_loss_grad_cpu",
    "scaled_masked_softmax_backward": _K + "scaled_masked_softmax_backward:scaled_masked_softmax_backward_cpu",
    "smooth_l1_loss_backward": _K + "smooth_l1_loss_backward:smooth_l1_loss_backward",
    "embedding_dense_backward": _K + "embedding_dense_backward:embedding_dense_backward",
    "linear_cross_entropy": _K + "linear_cross_entropy:linear_cross_entropy_cpu",
}


def resolve_gemm(dtype: npt.DTypeLike, setting: str, isa: str, prefer_onednn: bool) -> GemmChoice:
    """The GEMM choice (``tiling.GemmChoice``) of an LM-head call on this backend: the kernels'
    capability (``fastgrad/lm_head/engine.py``: ``resolve``) under the settings the op layer
    passes (``fastgrad/ops/_engines.py``)."""
    from ..lm_head.engine import resolve

    return resolve(dtype, setting, isa, prefer_onednn)


def native_variant(kind: str, isa: str) -> KernelSpec | None:
    """The native kernel spec that runs operands of ``kind`` (``"bf16"`` / ``"f32"``) under the ISA
    setting ``isa`` on this CPU, or None (``kernels/_bf16dot.variant``)."""
    from ..kernels import _bf16dot

    return _bf16dot.variant(kind, isa)
