"""The ``"reference"`` backend: float64 NumPy goldens (:mod:`fastgrad.reference`).

``IMPLS`` maps each op to its golden (imported on first use).  Goldens take no plan.
"""

TAKES_PLAN = False

_R = "fastgrad.reference."

IMPLS = {
    "fused_linear_online_max_sum": _R + "fused_linear_online_max_sum:fused_linear_online_max_sum",
    "fused_cross_entropy_loss_with_max_sum": _R
    + "fused_cross_entropy_loss_with_max_sum:fused_cross_entropy_loss_with_max_sum",
    "fused_linear_cross_entropy_loss_grad": _R
    + "fused_linear_cross_entropy_loss_grad:fused_linear_cross_entropy_loss_grad",
    "cross_entropy_loss_grad": _R + "cross_entropy_loss_grad:cross_entropy_loss_grad_reference",
    "scaled_masked_softmax_backward": _R + "scaled_masked_softmax_backward:scaled_masked_softmax_backward_reference",
    "smooth_l1_loss_backward": _R + "smooth_l1_loss_backward:smooth_l1_loss_backward",
    "embedding_dense_backward": _R + "embedding_dense_backward:embedding_dense_backward",
    "linear_cross_entropy": _R + "linear_cross_entropy:linear_cross_entropy",
}
