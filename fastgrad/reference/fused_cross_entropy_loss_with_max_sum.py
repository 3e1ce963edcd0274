"""PLACEHOLDER — to be written (fused_cross_entropy_loss_with_max_sum, reference)."""
