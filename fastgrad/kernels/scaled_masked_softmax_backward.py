"""PLACEHOLDER — to be written (scaled_masked_softmax_backward, kernels)."""
