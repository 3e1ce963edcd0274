"""PLACEHOLDER — to be written (cross_entropy_loss_grad, op_api layer)."""

def cross_entropy_loss_grad(*args, **kwargs):
    raise NotImplementedError('cross_entropy_loss_grad')

