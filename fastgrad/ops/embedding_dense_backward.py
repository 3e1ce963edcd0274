"""PLACEHOLDER — to be written (embedding_dense_backward, op_api layer)."""

def embedding_dense_backward(*args, **kwargs):
    raise NotImplementedError('embedding_dense_backward')

