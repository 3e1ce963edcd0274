"""PLACEHOLDER — to be written (smooth_l1_loss_backward, op_api layer)."""

def smooth_l1_loss_backward(*args, **kwargs):
    raise NotImplementedError('smooth_l1_loss_backward')

