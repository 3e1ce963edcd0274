"""PLACEHOLDER — to be written (fused_linear_online_max_sum, kernels)."""
