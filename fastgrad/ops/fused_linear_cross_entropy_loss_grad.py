"""PLACEHOLDER — to be written (fused_linear_cross_entropy_loss_grad, op_api layer)."""

def fused_linear_cross_entropy_loss_grad(*args, **kwargs):
    raise NotImplementedError('fused_linear_cross_entropy_loss_grad')

