"""PLACEHOLDER — to be written (embedding_dense_backward, kernels)."""
