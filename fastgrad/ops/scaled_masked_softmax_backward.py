"""PLACEHOLDER — to be written (scaled_masked_softmax_backward, op_api layer)."""

def scaled_masked_softmax_backward(*args, **kwargs):
    raise NotImplementedError('scaled_masked_softmax_backward')

